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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from .broker import PostgresBroker


@dataclass
class Outcome:
    kind: str  # "ack" | "nack" | "retry"
    message_id: str
    attempt: int
    error: str | None = None
    payload: bytes | None = None
    delay_ms: int = 0
    queue_name: str = ""
    exception: BaseException | None = field(default=None, repr=False)


class OutcomeWriter:
    #: Longest pause between two tries while the database is away.
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
                self.broker._leases.release(outcome.message_id, outcome.attempt)
            batch = []
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def write(self, batch: list[Outcome]) -> None:
        broker = self.broker
        stmts = broker._sql
        by_kind: dict[str, list[Outcome]] = {"ack": [], "nack": [], "retry": []}
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
            stale = [(o.kind, o.message_id, o.attempt) for o in batch if o.message_id not in applied]
            if stale:
                broker._report_stale(conn, stale, retried=self._retried)
        for outcome in batch:
            if outcome.kind == "nack" and outcome.message_id in applied:
                broker._remember_dead(outcome.message_id, outcome.exception)


def describe(outcome_kind: str, message_id: str, attempt: int, current: Any) -> str:
    if current is None:
        now = "the row is gone (finished by another attempt)"
    else:
        now = f"the row is at attempt {current[1]} in state {current[0]!r}"
    return f"Stale {outcome_kind} of message {message_id} by attempt {attempt} ignored: {now}."
