"""Settling deliveries: fenced ack, nack, retry and requeue writes.

Worker threads hand over an :class:`Outcome` and go back to work (the
delivery is then *settled*).  One writer thread per process flushes
everything pending in one transaction, every statement fenced on
``(message_id, attempt, state = 'running')``.  When the database is away the
same outcomes are written again with bounded backoff: the actor is never
re-run for it, and if the lease lapses meanwhile the late write is fenced out
and the message is redelivered (at-least-once).  Requeue, the release of
unstarted deliveries at shutdown, is written at once by the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from dramatiq.message import Message

from .config import Settings
from .database import Database
from .delivery import PostgresMessageProxy, ResultWrite
from .errors import PayloadTooLarge
from .fencing import Miss, StaleWrites, Write
from .leases import Leases
from .sql import Statements, results_channel


@dataclass
class Outcome:
    """One delivery's outcome, on its way to the database."""

    kind: Write  # ACK, NACK, RETRY or RESULT
    message_id: str
    attempt: int
    error: str | None = None
    payload: bytes | None = None  # RETRY: the message as it goes back to the queue
    delay_ms: int = 0  # RETRY: its backoff
    queue_name: str = ""
    exception: BaseException | None = field(default=None, repr=False)  # NACK: for join(fail_fast=True)
    result: ResultWrite | None = field(default=None, repr=False)


def retry_outcome(
    message: PostgresMessageProxy, delay: int | None, encode: Callable[[Message], bytes], logger: logging.Logger
) -> Outcome:
    """The outcome of Dramatiq's Retries re-enqueueing *message*: back to the
    queue with its new options, or dead-lettered if it can no longer be stored."""
    error = message.error_text()
    try:
        payload = encode(message.message)
    except PayloadTooLarge:
        # Dramatiq's traceback option made it grow; last_error keeps the traceback anyway.
        slim = {k: v for k, v in message.options.items() if k != "traceback"}
        try:
            payload = encode(dataclasses.replace(message.message, options=slim))
        except PayloadTooLarge as e:
            # Raising here would let the ack that follows drop the message: dead-letter it instead.
            logger.error("Message %s cannot be retried: %s", message.message_id, e)
            return Outcome(
                Write.NACK,
                message.message_id,
                message.attempt,
                error=f"retry refused: {e}\n{error}",
                queue_name=message.queue_name,
                exception=message.exception,
            )
    return Outcome(
        Write.RETRY,
        message.message_id,
        message.attempt,
        payload=payload,
        delay_ms=max(int(delay or 0), 0),
        error=error,
        queue_name=message.queue_name,
    )


class OutcomeWriter:
    #: Longest pause between two tries while the database is away.
    MAX_BACKOFF = 5.0

    def __init__(
        self,
        database: Database,
        statements: Statements,
        settings: Settings,
        leases: Leases,
        stale: StaleWrites,
        logger: logging.Logger,
        on_dead: Callable[[str, BaseException | None], None],
        writer: str = "",
    ) -> None:
        self.database = database
        self.statements = statements
        self.settings = settings
        self.leases = leases
        self.stale = stale
        self.logger = logger
        self.on_dead = on_dead
        self.writer = writer  #: this process, in the outcome tallies (see sql.py)
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
        self.leases.settle(outcome.message_id)
        with self._cond:
            self._pending.append(outcome)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted outcome is written or fenced out; ``False`` on timeout."""
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
                self.logger.warning(
                    "Could not write %d outcome(s) (%s); trying again in %.2fs. The actors will not run again for them.",
                    len(batch),
                    e,
                    backoff,
                )
                self._retried.update((o.message_id, o.attempt) for o in batch)
                time.sleep(backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)
                continue
            except Exception:
                self.logger.exception(
                    "Unexpected error writing %d outcome(s); they are dropped, leases will lapse.", len(batch)
                )
            backoff = 0.05
            for outcome in batch:
                self._retried.discard((outcome.message_id, outcome.attempt))
                self.leases.release(outcome.message_id, outcome.attempt)
            batch = []
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def write(self, batch: list[Outcome]) -> None:
        stmts = self.statements
        by_kind: dict[Write, list[Outcome]] = {Write.ACK: [], Write.NACK: [], Write.RETRY: [], Write.RESULT: []}
        for outcome in batch:
            by_kind[outcome.kind].append(outcome)
        # The same message may appear twice only through a bug upstream; the
        # fence makes the second write a counted no-op.
        with self.database.connection(raw=True) as conn, conn.transaction():
            applied: set[str] = set()
            if acks := by_kind[Write.ACK]:
                ack = stmts.ack_keep if self.settings.keep_finished > 0 else stmts.ack
                params = {"ids": [o.message_id for o in acks], "attempts": [o.attempt for o in acks]}
                rows = conn.execute(ack, {**params, "writer": self.writer}).fetchall()
                applied.update(str(r[0]) for r in rows)
            if nacks := by_kind[Write.NACK]:
                params = {
                    "ids": [o.message_id for o in nacks],
                    "attempts": [o.attempt for o in nacks],
                    "errors": [o.error for o in nacks],
                }
                rows = conn.execute(stmts.nack, {**params, "writer": self.writer}).fetchall()
                applied.update(str(r[0]) for r in rows)
            if retries := by_kind[Write.RETRY]:
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
                if wakes and self.settings.listen:
                    conn.execute(stmts.notify, [self.settings.channel, wakes])
            misses: list[Miss] = [
                (o.kind, o.message_id, o.attempt)
                for o in batch
                if o.kind is not Write.RESULT and o.message_id not in applied
            ]
            if any(o.result is not None for o in batch):
                misses += self._write_results(conn, by_kind, applied)
            queues = {o.message_id: o.queue_name for o in batch if o.queue_name}
            self.stale.report(conn, misses, retried=self._retried, queues=queues)
        for outcome in batch:
            if outcome.kind is Write.NACK and outcome.message_id in applied:
                self.on_dead(outcome.message_id, outcome.exception)

    def _write_results(
        self, conn: psycopg.Connection, by_kind: dict[Write, list[Outcome]], applied: set[str]
    ) -> list[Miss]:
        """Results of applied acks, and fenced stored exceptions; returns the fenced-out ones."""
        stmts = self.statements
        channel = results_channel(self.settings.schema)
        # One row per key and statement (ON CONFLICT cannot touch a row twice).
        with_ack = {
            o.result.key: o.result for o in by_kind[Write.ACK] if o.result is not None and o.message_id in applied
        }
        fenced = {o.result.key: o.result for o in by_kind[Write.RESULT] if o.result is not None}
        misses: list[Miss] = []
        try:
            with conn.transaction():  # a savepoint: a result that cannot be written must not undo the acks
                if with_ack:
                    conn.execute(stmts.result_store, {**result_params(with_ack.values()), "channel": channel})
                if fenced:
                    params = {**result_params(fenced.values()), "channel": channel, "states": ["running", "dead"]}
                    written = {r[0] for r in conn.execute(stmts.result_store_fenced, params).fetchall()}
                    misses = [
                        (Write.RESULT, w.message_id, w.attempt or 0) for key, w in fenced.items() if key not in written
                    ]
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise
        except psycopg.Error:
            self.logger.exception(
                "Could not write %d result(s); they are dropped, the acks stand.", len(with_ack) + len(fenced)
            )
        return misses

    def requeue(self, proxies: list[PostgresMessageProxy]) -> set[str]:
        """Release unstarted deliveries now, fenced; the attempt number and the place in line stay.

        Returns the ids released.  Raises Dramatiq's ``ConnectionClosed`` when
        the database cannot be reached (their leases then lapse).
        """
        ids = [p.message_id for p in proxies]
        attempts = [p.attempt for p in proxies]

        def release(conn: psycopg.Connection) -> set[str]:
            rows = conn.execute(self.statements.requeue, [ids, attempts]).fetchall()
            released = {str(r[0]) for r in rows}
            self.stale.report(
                conn,
                [(Write.REQUEUE, p.message_id, p.attempt) for p in proxies if p.message_id not in released],
                queues={p.message_id: p.queue_name for p in proxies},
            )
            if released and self.settings.listen:
                conn.execute(self.statements.notify, [self.settings.channel, sorted({p.queue_name for p in proxies})])
            return released

        try:
            return self.database.run(release, transaction=True)
        finally:
            for p in proxies:
                p.settled = True
                self.leases.release(p.message_id, p.attempt)


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


def result_params(writes: Iterable[ResultWrite]) -> dict[str, list[Any]]:
    writes = list(writes)
    return {
        "keys": [w.key for w in writes],
        "ids": [w.message_id for w in writes],
        "attempts": [w.attempt for w in writes],
        "data": [w.data for w in writes],
        "ttls": [w.ttl_ms for w in writes],
    }
