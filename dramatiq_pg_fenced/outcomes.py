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
from typing import Any

import psycopg
from dramatiq.message import Message

from .config import Settings
from .database import Database
from .delivery import Countdown, Outcome, PostgresMessageProxy, ResultWrite, Row
from .errors import PayloadTooLarge, lost_connection
from .fencing import Miss, StaleWrites, Write
from .leases import Leases
from .reconnect import RETRY_INTERVAL
from .sql import BIGINT_MAX, Statements, rate_limits_channel, results_channel


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
                message.delivery,
                error=f"retry refused: {e}\n{error}",
                queue_name=message.queue_name,
                exception=message.exception,
            )
    return Outcome(
        Write.RETRY,
        message.message_id,
        message.attempt,
        message.delivery,
        payload=payload,
        delay_ms=max(int(delay or 0), 0),
        error=error,
        queue_name=message.queue_name,
    )


class OutcomeWriter:
    #: Longest pause between two tries after a failed statement (a lost connection: RETRY_INTERVAL).
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
    ) -> None:
        self.database = database
        self.statements = statements
        self.settings = settings
        self.leases = leases
        self.stale = stale
        self.logger = logger
        self.on_dead = on_dead
        self._pending: list[Outcome] = []
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        # (message_id, delivery) whose last try failed: it may have committed
        # before the connection broke, so finding it applied is no stale write.
        self._retried: set[tuple[str, str]] = set()
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
                self._retried.update((o.message_id, o.delivery) for o in batch)
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
                self._retried.discard((outcome.message_id, outcome.delivery))
                self.leases.release(outcome.message_id, outcome.delivery)
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
            applied: set[tuple[str, str]] = set()  # (message id, delivery) of the writes that applied
            if acks := by_kind[Write.ACK]:
                rows = conn.execute(stmts.ack, [[o.message_id for o in acks], [o.delivery for o in acks]]).fetchall()
                applied.update((str(r[0]), str(r[1])) for r in rows)
            if nacks := by_kind[Write.NACK]:
                rows = conn.execute(
                    stmts.nack,
                    [[o.message_id for o in nacks], [o.delivery for o in nacks], [o.error for o in nacks]],
                ).fetchall()
                applied.update((str(r[0]), str(r[1])) for r in rows)
            if retries := by_kind[Write.RETRY]:
                rows = conn.execute(
                    stmts.retry,
                    [
                        [o.message_id for o in retries],
                        [o.delivery for o in retries],
                        [o.payload for o in retries],
                        [o.delay_ms for o in retries],
                        [o.error for o in retries],
                    ],
                ).fetchall()
                applied.update((str(r[0]), str(r[1])) for r in rows)
                wakes = retry_wakes([o for o in retries if (o.message_id, o.delivery) in applied])
                if wakes and self.settings.listen:
                    conn.execute(stmts.notify, [self.settings.channel, wakes])
            misses: list[Miss] = [
                (o.kind, o.message_id, o.attempt, o.delivery)
                for o in batch
                if o.kind is not Write.RESULT and (o.message_id, o.delivery) not in applied
            ]
            if any(o.result is not None for o in batch):
                misses += self._write_results(conn, by_kind, applied)
            self._write_effects(conn, [o for o in batch if (o.message_id, o.delivery) in applied])
            self.stale.report(conn, misses, retried=self._retried)
            dropped = [o for o in batch if o.kind is not Write.RESULT and (o.message_id, o.delivery) not in applied]
            self.stale.drop_effects(dropped)
        for outcome in batch:
            if outcome.kind is Write.NACK and (outcome.message_id, outcome.delivery) in applied:
                self.on_dead(outcome.message_id, outcome.exception)

    def _write_effects(self, conn: psycopg.Connection, applied: list[Outcome]) -> None:
        """Follow-up messages and group countdowns of outcomes that applied, in their transaction."""
        rows: list[Row] = [row for o in applied for row in o.follow_ups]
        for countdown in (c for o in applied for c in o.countdowns):
            if self._count_down(conn, countdown):
                rows.extend(countdown.completions)
        if rows:
            columns = [list(column) for column in zip(*rows, strict=True)]
            conn.execute(self.statements.enqueue, [*columns, self.settings.channel, self.settings.listen])

    def _count_down(self, conn: psycopg.Connection, countdown: Countdown) -> bool:
        """Dramatiq's ``Barrier.wait(block=False)``: down by one unless at the last party; ``True`` when cleared."""
        params = {"key": countdown.key, "delta": -1, "low": 1, "high": BIGINT_MAX, "ttl": countdown.ttl_ms}
        if conn.execute(self.statements.rate_limit_update, params).fetchone() is not None:
            return False
        events = {"key": countdown.key + "@events", "ttl": countdown.ttl_ms}
        conn.execute(
            self.statements.rate_limit_notify, {**events, "channel": rate_limits_channel(self.settings.schema)}
        )
        return True

    def _write_results(
        self, conn: psycopg.Connection, by_kind: dict[Write, list[Outcome]], applied: set[tuple[str, str]]
    ) -> list[Miss]:
        """Results of applied acks, and fenced stored exceptions; returns the fenced-out ones."""
        stmts = self.statements
        channel = results_channel(self.settings.schema)
        # One row per key and statement (ON CONFLICT cannot touch a row twice).
        with_ack = {
            o.result.key: o.result
            for o in by_kind[Write.ACK]
            if o.result is not None and (o.message_id, o.delivery) in applied
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
                        (Write.RESULT, w.message_id, w.attempt or 0, w.delivery)
                        for key, w in fenced.items()
                        if key not in written
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
        deliveries = [p.delivery for p in proxies]

        def release(conn: psycopg.Connection) -> set[str]:
            rows = conn.execute(self.statements.requeue, [ids, deliveries]).fetchall()
            released = {str(r[0]) for r in rows}
            misses: list[Miss] = [
                (Write.REQUEUE, p.message_id, p.attempt, p.delivery) for p in proxies if p.message_id not in released
            ]
            self.stale.report(conn, misses)
            if released and self.settings.listen:
                conn.execute(self.statements.notify, [self.settings.channel, sorted({p.queue_name for p in proxies})])
            return released

        try:
            return self.database.run(release, transaction=True)
        finally:
            for p in proxies:
                p.settled = True
                self.leases.release(p.message_id, p.delivery)


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
        "deliveries": [w.delivery for w in writes],
        "data": [w.data for w in writes],
        "ttls": [w.ttl_ms for w in writes],
    }
