"""Fenced outcome writes (ack, nack, retry), batched off the worker threads.

Worker threads hand over an outcome and go back to work.  One writer thread
per process flushes everything pending in one transaction, every statement
fenced on ``(message_id, attempt, state = 'running')``.  When the database is
away the same outcomes are written again with bounded backoff: the actor is
never re-run for it, and if the lease lapses meanwhile the late write is
fenced out and the message is redelivered (at-least-once).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

from .errors import lost_connection
from .reconnect import RETRY_INTERVAL
from .sql import results_channel

if TYPE_CHECKING:
    from .broker import PostgresBroker


@dataclass
class ResultWrite:
    """An actor's result for the results table (see results.py), written here.

    Attached to an ack, it is written in the ack's transaction and only if the
    ack applies.  As a ``"result"`` outcome (a stored exception, submitted
    right after its nack) it is fenced on the row being at that attempt,
    running or dead, so it lands only if its attempt's nack did.
    """

    key: str
    message_id: str
    attempt: int | None  # None: stored outside a delivery, not fenced
    data: bytes
    ttl_ms: int


@dataclass
class Outcome:
    kind: str  # "ack" | "nack" | "retry" | "result"
    message_id: str
    attempt: int
    error: str | None = None
    payload: bytes | None = None
    delay_ms: int = 0
    queue_name: str = ""
    exception: BaseException | None = field(default=None, repr=False)
    result: ResultWrite | None = field(default=None, repr=False)


class OutcomeWriter:
    #: Longest pause between two tries after a failed statement (a lost connection: RETRY_INTERVAL).
    MAX_BACKOFF = 5.0

    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.logger = broker.logger
        self._pending: list[Outcome] = []
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        # (message_id, attempt) whose last try failed: it may have committed
        # before the connection broke, so finding it applied is no stale write.
        self._retried: set[tuple[str, int]] = set()
        self._thread = threading.Thread(target=self._run, name="dramatiq-pg-outcomes", daemon=True)
        self._thread.start()

    def submit(self, outcome: Outcome) -> None:
        self.broker._leases.finishing(outcome.message_id)
        with self._cond:
            self._pending.append(outcome)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted outcome is written or fenced out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.05
        away = False  # the last try lost its connection, or found none: said once, not per try
        batch: list[Outcome] = []
        while True:
            with self._cond:
                while not self._pending and not batch and not self._stopped:
                    self._cond.wait()
                if self._stopped and not self._pending and not batch:
                    return
                batch.extend(self._pending)
                self._pending.clear()
                self._busy = True
            try:
                self.write(batch)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                self._retried.update((o.message_id, o.attempt) for o in batch)
                if lost_connection(e):
                    # The next try waits in the pool, which reconnects at a steady pace and hands
                    # the connection over at once (reconnect.py logs the outage itself).
                    if not away:
                        self.logger.info(
                            "Could not write %d outcome(s) (%s); they are written as soon as the database is back. "
                            "The actors will not run again for them.",
                            len(batch),
                            e,
                        )
                    away = True
                    time.sleep(min(backoff, RETRY_INTERVAL))
                    backoff = min(backoff * 2, RETRY_INTERVAL)
                    continue
                self.logger.warning(
                    "Could not write %d outcome(s) (%s); trying again in %.2fs. The actors will not run again for them.",
                    len(batch),
                    e,
                    backoff,
                )
                time.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)
                continue
            except Exception:
                self.logger.exception(
                    "Unexpected error writing %d outcome(s); they are dropped, leases will lapse.", len(batch)
                )
            backoff = 0.05
            away = False
            for outcome in batch:
                self._retried.discard((outcome.message_id, outcome.attempt))
                self.broker._leases.release(outcome.message_id, outcome.attempt)
            batch = []
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def write(self, batch: list[Outcome]) -> None:
        broker = self.broker
        stmts = broker._sql
        by_kind: dict[str, list[Outcome]] = {"ack": [], "nack": [], "retry": [], "result": []}
        for outcome in batch:
            by_kind[outcome.kind].append(outcome)
        # The same message may appear twice only through a bug upstream; the
        # fence makes the second write a counted no-op.
        with broker._pool_connection(raw=True) as conn, conn.transaction():
            applied: set[str] = set()
            if by_kind["ack"]:
                acks = by_kind["ack"]
                rows = conn.execute(stmts.ack, [[o.message_id for o in acks], [o.attempt for o in acks]]).fetchall()
                applied.update(str(r[0]) for r in rows)
            if by_kind["nack"]:
                nacks = by_kind["nack"]
                rows = conn.execute(
                    stmts.nack,
                    [[o.message_id for o in nacks], [o.attempt for o in nacks], [o.error for o in nacks]],
                ).fetchall()
                applied.update(str(r[0]) for r in rows)
            if by_kind["retry"]:
                retries = by_kind["retry"]
                rows = conn.execute(
                    stmts.retry,
                    [
                        [o.message_id for o in retries],
                        [o.attempt for o in retries],
                        [o.payload for o in retries],
                        [o.delay_ms for o in retries],
                        [o.error for o in retries],
                    ],
                ).fetchall()
                applied.update(str(r[0]) for r in rows)
                wakes = retry_wakes([o for o in retries if o.message_id in applied])
                if wakes and broker.listen:
                    conn.execute(stmts.notify, [broker.channel, wakes])
            stale = [
                (o.kind, o.message_id, o.attempt) for o in batch if o.kind != "result" and o.message_id not in applied
            ]
            if any(o.result is not None for o in batch):
                stale += self._write_results(conn, by_kind, applied)
            if stale:
                broker._report_stale(conn, stale, retried=self._retried)
        for outcome in batch:
            if outcome.kind == "nack" and outcome.message_id in applied:
                broker._remember_dead(outcome.message_id, outcome.exception)

    def _write_results(
        self, conn: psycopg.Connection, by_kind: dict[str, list[Outcome]], applied: set[str]
    ) -> list[tuple[str, str, int]]:
        """Results of applied acks, and fenced stored exceptions; returns the fenced-out ones."""
        stmts = self.broker._sql
        channel = results_channel(self.broker.schema)
        # One row per key and statement (ON CONFLICT cannot touch a row twice).
        with_ack = {o.result.key: o.result for o in by_kind["ack"] if o.result is not None and o.message_id in applied}
        fenced = {o.result.key: o.result for o in by_kind["result"] if o.result is not None}
        stale: list[tuple[str, str, int]] = []
        try:
            with conn.transaction():  # a savepoint: a result that cannot be written must not undo the acks
                if with_ack:
                    conn.execute(stmts.result_store, {**_result_params(with_ack.values()), "channel": channel})
                if fenced:
                    params = {**_result_params(fenced.values()), "channel": channel, "states": ["running", "dead"]}
                    written = {r[0] for r in conn.execute(stmts.result_store_fenced, params).fetchall()}
                    stale = [
                        ("result", w.message_id, w.attempt or 0) for key, w in fenced.items() if key not in written
                    ]
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise
        except psycopg.Error:
            self.logger.exception(
                "Could not write %d result(s); they are dropped, the acks stand.", len(with_ack) + len(fenced)
            )
        return stale


def retry_wakes(retries: list[Outcome]) -> list[str]:
    """Doorbell payloads for re-queued messages: per queue, one for "due now" and one for the earliest backoff."""
    now: set[str] = set()
    later: dict[str, int] = {}
    for o in retries:
        if not o.queue_name:
            continue
        if o.delay_ms <= 0:
            now.add(o.queue_name)
        else:
            later[o.queue_name] = min(o.delay_ms, later.get(o.queue_name, o.delay_ms))
    return sorted(now) + [f"{queue}\t{ms}" for queue, ms in sorted(later.items())]


def _result_params(writes: Iterable[ResultWrite]) -> dict[str, list[Any]]:
    writes = list(writes)
    return {
        "keys": [w.key for w in writes],
        "ids": [w.message_id for w in writes],
        "attempts": [w.attempt for w in writes],
        "data": [w.data for w in writes],
        "ttls": [w.ttl_ms for w in writes],
    }


def describe(outcome_kind: str, message_id: str, attempt: int, current: Any) -> str:
    if current is None:
        now = "the row is gone (finished by another attempt)"
    else:
        now = f"the row is at attempt {current[1]} in state {current[0]!r}"
    return f"Stale {outcome_kind} of message {message_id} by attempt {attempt} ignored: {now}."
