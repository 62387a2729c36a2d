"""What a delivery causes, written with its outcome in the outcome writer's transaction: results,
follow-up messages, group countdowns (:class:`EffectWrites`, a part of
:class:`~.outcomes.OutcomeWriter`), and the parameters of those statements.

Written only for outcomes that applied: a fenced-out delivery causes nothing
(``StaleWrites.drop_effects``)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import psycopg

from ..config import Settings
from ..db.database import Database
from ..db.statements import BIGINT_MAX, Statements, rate_limits_channel, results_channel
from ..errors import refusal, worth_retrying
from .delivery import Countdown, Outcome, ResultWrite, Row, fair, keyed
from .fencing import Miss, StaleWrites, State, Write


class EffectWrites:
    """The writes of a delivery's effects (a part of :class:`~.outcomes.OutcomeWriter`)."""

    database: Database
    statements: Statements
    settings: Settings
    stale: StaleWrites
    logger: logging.Logger

    def _write_effects(self, conn: psycopg.Connection, applied: list[Outcome]) -> None:
        """Follow-up messages and group countdowns of outcomes that applied, in their transaction."""
        rows: list[Row] = [row for o in applied for row in o.follow_ups]
        self.write_countdowns(conn, [c for o in applied for c in o.countdowns], rows)

    def write_countdowns(
        self, conn: psycopg.Connection, countdowns: list[Countdown], rows: list[Row] | None = None
    ) -> None:
        """Count *countdowns* down, in order, and send the completions of the groups they clear (with
        *rows*), in the caller's transaction on *conn*: an ack's here, or the transaction in which a
        relay applies countdowns moved from other databases (groups.py)."""
        rows = [] if rows is None else rows
        for countdown in countdowns:
            if self._count_down(conn, countdown):
                rows.extend(countdown.completions)
        if rows:
            # With a unique key (unique.py), a follow-up whose key another message holds is not
            # inserted; nobody waits for its id here.
            # A follow-up to a fair queue carries its fairness key (fairness.py): the fair enqueue.
            columns = [list(column) for column in zip(*rows, strict=True)]
            if fair(rows):
                statement, columns = self.statements.enqueue_fair, columns
            elif any(map(keyed, rows)):
                statement, columns = self.statements.enqueue_unique, columns[:8]
            else:
                statement, columns = self.statements.enqueue, columns[:6]
            conn.execute(statement, [*columns, self.settings.channel, self.settings.listen])

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
        """Results of applied acks and nacks, and fenced stored exceptions; returns the fenced-out ones.

        A result the database refuses does not undo its ack (or nack): it is
        written again alone, and if refused alone, a failure that gives the
        reason is stored in its place (:meth:`_store_alone`).
        """
        # One row per key and statement (ON CONFLICT cannot touch a row twice).
        with_ack = {  # results of acks, stored exceptions of nacks (PostgresBroker.stored_exception)
            o.result.key: o.result
            for o in (*by_kind[Write.ACK], *by_kind[Write.NACK])
            if o.result is not None and (o.message_id, o.delivery) in applied
        }
        fenced = {o.result.key: o.result for o in by_kind[Write.RESULT] if o.result is not None}
        try:
            with conn.transaction():  # a savepoint: a result that cannot be written must not undo the acks
                self._store(conn, list(with_ack.values()), fenced=False)
                written = self._store(conn, list(fenced.values()), fenced=True)
        except Exception as e:
            if worth_retrying(e):
                raise
            self.logger.warning(
                "The database refused %d result(s) written together (%s); writing them one at a time.",
                len(with_ack) + len(fenced),
                refusal(e),
            )
            for write in with_ack.values():
                self._store_alone(conn, write, fenced=False)
            written = {key for key, write in fenced.items() if self._store_alone(conn, write, fenced=True)}
        return [
            (Write.RESULT, w.message_id, w.attempt or 0, w.delivery) for key, w in fenced.items() if key not in written
        ]

    def _store(self, conn: psycopg.Connection, writes: list[ResultWrite], *, fenced: bool) -> set[str]:
        """Write *writes*; returns the keys written (fenced: those whose delivery still held the row)."""
        if not writes:
            return set()
        params = {**result_params(writes), "channel": results_channel(self.settings.schema)}
        if not fenced:
            conn.execute(self.statements.result_store, params)
            return {w.key for w in writes}
        params["states"] = [State.RUNNING.value, State.DEAD.value]
        return {r[0] for r in conn.execute(self.statements.result_store_fenced, params).fetchall()}

    def _store_alone(self, conn: psycopg.Connection, write: ResultWrite, *, fenced: bool) -> bool:
        """Write one result in a savepoint; if refused, a failure that says so in its place.

        Returns ``False`` only when the write was fenced out.  If even the
        failure is refused, the error is logged and the outcome stands
        without a result.
        """
        try:
            with conn.transaction():
                return write.key in self._store(conn, [write], fenced=fenced)
        except Exception as e:
            if worth_retrying(e):
                raise
            reason = f"the result of attempt {write.attempt} of message {write.message_id} could not be stored"
            reason = f"{reason} ({refusal(e)})"
        try:
            if write.failure is None:
                raise ValueError("no failure encoder for this result")
            with conn.transaction():
                failure = dataclasses.replace(write, data=write.failure(reason))
                written = write.key in self._store(conn, [failure], fenced=fenced)
        except Exception as e:
            if worth_retrying(e):
                raise
            self.logger.error(
                "%s, nor a failure in its place (%s); its ack or nack stands without a result.", reason, refusal(e)
            )
            return True
        self.logger.error("%s; a failure saying so is stored in its place.", reason)
        return written


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
