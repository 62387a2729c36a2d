"""Settling deliveries: fenced ack, nack, retry and requeue writes.

Worker threads hand over an :class:`Outcome` and go back to work (the
delivery is then *settled*).  One writer thread per process flushes
everything pending in one transaction, every statement fenced on
``(message_id, delivery token, state = 'running')``, with what the delivery
causes (its result, follow-up messages, group countdown).  When the database is away the
same outcomes are written again with bounded backoff: the actor is never
re-run for it, and if the lease lapses meanwhile the late write is fenced out
and the message is redelivered (at-least-once).  Requeue, the release of
unstarted deliveries at shutdown, is written at once by the caller.

Nothing is dropped.  Error texts are made storable before they are written
(:func:`storable_text`).  When the database refuses a batch for what is in
it (not for a lost connection or a busy server), the writer writes its
outcomes one at a time; an outcome refused alone has its message
dead-lettered with the reason instead (:meth:`OutcomeWriter._dead_letter`);
and a dead letter refused too is *parked*: tried again alone every
``MAX_BACKOFF`` seconds, its lease kept, while the other outcomes flow.  A
result refused alone is replaced by a stored failure that gives the reason
(:meth:`OutcomeWriter._store_alone`); the ack it rode with stands.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg

from ..config import Settings
from ..db.database import Database
from ..db.doorbell import look_back
from ..db.reconnect import RETRY_INTERVAL
from ..db.statements import Statements
from ..errors import SchemaError, key_taken_meanwhile, lost_connection, refusal, worth_retrying
from .delivery import MAX_ERROR_BYTES, Outcome, PostgresMessageProxy, retry_outcome, storable_text
from .effects import EffectWrites, retry_wakes
from .fencing import Ended, Miss, StaleWrites, Write
from .leases import Held, Leases

__all__ = ["MAX_ERROR_BYTES", "Outcome", "OutcomeWriter", "retry_outcome", "storable_text"]


class OutcomeWriter(EffectWrites):
    #: Longest pause between two tries while the database is away; also the
    #: pause between two tries of a parked dead letter.
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
        self.writer = writer  #: this process, in the outcome tallies (see db/queries/)
        self._pending: list[Outcome] = []
        self._cond = threading.Condition()
        self._busy = False
        self._stopped = False
        # (message_id, attempt) whose last try failed: it may have committed
        # before the connection broke, so finding it applied is no stale write.
        self._retried: set[tuple[str, str]] = set()
        self._away = False  # the last try lost its connection: said once, not per try
        # Dead letters the database refused as well: tried again alone, not
        # with every batch, from _parked_until on (their leases are kept).
        self._parked: list[Outcome] = []
        self._parked_until = 0.0
        self._parked_reminded = 0.0  # when "still refused" was last logged (at most once a minute)
        self._thread = threading.Thread(target=self._run, name="dramatiq-pg-outcomes", daemon=True)
        self._thread.start()

    def submit(self, outcome: Outcome) -> None:
        self.leases.settle(outcome.message_id)
        with self._cond:
            if self._stopped:  # an actor that finished after close(): its lease lapses, it runs again
                self.logger.error(
                    "The %s of message %s came after the broker closed: not written; its lease will lapse and "
                    "the message be delivered again.",
                    outcome.kind.value,
                    outcome.message_id,
                )
                return
            self._pending.append(outcome)
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every submitted outcome is written or fenced out; ``False`` on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy or self._parked:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def stop(self, timeout: float = 10.0) -> None:
        """Wait (at most *timeout* seconds) for what was submitted to be written, then stop: what is still
        unwritten is given up (said), never tried after the broker closed its pool (a try would open a
        new one).  Its leases lapse and its messages are delivered again."""
        self.flush(timeout)
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        backoff = 0.05
        batch: list[Outcome] = []
        while True:
            with self._cond:
                while not self._pending and not batch and not self._parked_due() and not self._stopped:
                    self._cond.wait(self._parked_wait())
                if self._stopped:
                    self._give_up(len(self._pending) + len(batch))
                    self._pending.clear()
                    self._busy = False
                    self._cond.notify_all()
                    return
                batch.extend(self._pending)
                self._pending.clear()
                parked: list[Outcome] = []
                if self._parked_due():
                    parked, self._parked = self._parked, []
                self._busy = True
            if parked:
                self._write_parked(parked)
            again = self._write_all(batch, backoff) if batch else []
            if again:
                # After a lost connection the next try waits in the pool, which reconnects at a steady
                # pace and hands the connection over at once (reconnect.py logs the outage itself).
                with self._cond:  # stop() ends the pause: nothing is tried once it gave up waiting
                    self._cond.wait_for(lambda: self._stopped, min(backoff, RETRY_INTERVAL) if self._away else backoff)
                backoff = min(backoff * 2, self.MAX_BACKOFF)
                batch = again
                continue
            backoff = 0.05
            batch = []
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _give_up(self, unwritten: int) -> None:
        """Stopped: say what is left unwritten (called with the lock held; nothing is tried any more)."""
        if unwritten:
            self.logger.error(
                "Stopping with %d outcome(s) that could not be written before the broker closed (the database "
                "is away or slow); their leases will lapse and the messages be delivered again.",
                unwritten,
            )
        if self._parked:
            self.logger.error(
                "Stopping with %d outcome(s) the database refused even as dead letters; their leases "
                "will lapse and the messages be delivered again (max_deliveries bounds how often).",
                len(self._parked),
            )

    def _write_all(self, batch: list[Outcome], backoff: float) -> list[Outcome]:
        """Write *batch*; returns what to write again after a pause (the database is away or busy)."""
        try:
            self.write(batch)
        except Exception as e:
            if worth_retrying(e):
                if isinstance(e, SchemaError):
                    pass  # the database layer says so, once (then once a minute)
                elif key_taken_meanwhile(e):
                    self.logger.info(
                        "A send took the unique key of a message going back to the queue while the outcomes "
                        "were written (%s); writing them again.",
                        refusal(e),
                    )
                elif not lost_connection(e):
                    self.logger.warning(
                        "Could not write %d outcome(s) (%s); trying again in %.2fs. "
                        "The actors will not run again for them.",
                        len(batch),
                        e,
                        backoff,
                    )
                elif not self._away:
                    self.logger.info(
                        "Could not write %d outcome(s) (%s); they are written as soon as the database is back. "
                        "The actors will not run again for them.",
                        len(batch),
                        e,
                    )
                self._away = lost_connection(e)
                self._failed_at_commit(batch, e)
                return batch
            self.logger.warning(
                "The database refused a batch of %d outcome(s) (%s); writing them one at a time.",
                len(batch),
                refusal(e),
            )
            return self._isolate(batch)
        self._done(batch)
        return []

    def _isolate(self, batch: list[Outcome]) -> list[Outcome]:
        """Write each outcome alone; one refused alone has its message dead-lettered with the reason.

        Returns what to write again after a pause: from the first outcome
        whose write failed for a reason other than a refusal (the database
        went away meanwhile), the rest of the batch.
        """
        for i, outcome in enumerate(batch):
            try:
                self.write([outcome])
            except Exception as e:
                if worth_retrying(e):
                    self._failed_at_commit([outcome], e)
                    return batch[i:]
                dead_letter = self._dead_letter(outcome, e)
                if dead_letter is not None:  # the dead letter met a lost connection: its turn comes again
                    return [dead_letter, *batch[i + 1 :]]
            else:
                self._done([outcome])
        return []

    def _dead_letter(self, outcome: Outcome, error: BaseException) -> Outcome | None:
        """Dead-letter the message of *outcome*, which the database refused (*error*), saying why.

        Tries a reason with the refusal and the actor's error (escaped to
        ASCII, first 2000 characters), then one without the actor's error,
        then a bare one; a dead letter refused in every form is parked.
        Returns the dead letter when a try failed for a reason other than a
        refusal, for the caller to write again after a pause.
        """
        what = f"the {outcome.kind.value} of attempt {outcome.attempt} could not be stored"
        reasons = [f"{what} ({refusal(error)})", what]
        if outcome.error:
            escaped = outcome.error[:2000].encode("ascii", "backslashreplace").decode("ascii")
            reasons.insert(0, f"{reasons[0]}; the actor's error was: {escaped}")
        nack = outcome
        for reason in reasons:
            nack = Outcome(
                Write.NACK,
                outcome.message_id,
                outcome.attempt,
                outcome.delivery,
                error=reason,
                queue_name=outcome.queue_name,
                exception=outcome.exception,
                result=outcome.result if outcome.kind is Write.NACK else None,  # a stored exception
            )
            try:
                self.write([nack])
            except Exception as e:
                if worth_retrying(e):
                    self._failed_at_commit([nack], e)
                    return nack
                continue
            self.logger.error("Message %s is dead-lettered: %s.", outcome.message_id, reason)
            self._done([nack])
            return None
        self.logger.error(
            "Message %s: %s, and the database refuses its dead letter too; trying again every %.0fs "
            "(its lease is kept meanwhile).",
            outcome.message_id,
            what,
            self.MAX_BACKOFF,
        )
        with self._cond:
            if not self._parked:
                self._parked_until = time.monotonic() + self.MAX_BACKOFF
            self._parked.append(nack)
        return None

    def _parked_due(self) -> bool:
        return bool(self._parked) and time.monotonic() >= self._parked_until

    def _parked_wait(self) -> float | None:
        """How long the writer may sleep when idle: until the parked dead letters are due, if any."""
        return max(self._parked_until - time.monotonic(), 0.0) if self._parked else None

    def _write_parked(self, parked: list[Outcome]) -> None:
        """Try the parked dead letters again, each alone; park again those still not written."""
        still: list[Outcome] = []
        for nack in parked:
            try:
                self.write([nack])
            except Exception as e:
                still.append(nack)
                if not worth_retrying(e) and time.monotonic() - self._parked_reminded >= 60:
                    self._parked_reminded = time.monotonic()
                    self.logger.warning(
                        "%d dead letter(s) still refused, e.g. of message %s: %s",
                        len(parked),
                        nack.message_id,
                        refusal(e),
                    )
                continue
            self.logger.error("Message %s is dead-lettered at last: %s.", nack.message_id, nack.error)
            self._done([nack])
        if still:
            with self._cond:
                self._parked_until = time.monotonic() + self.MAX_BACKOFF
                self._parked = still + self._parked

    def _failed_at_commit(self, outcomes: list[Outcome], error: BaseException) -> None:
        """After *error*: if it cost the connection, the writes may have committed (see StaleWrites.report)."""
        if lost_connection(error):
            self._retried.update((o.message_id, o.delivery) for o in outcomes)

    def _done(self, outcomes: list[Outcome]) -> None:
        """Written (or fenced out): forget the deliveries, freeing their slots."""
        self._away = False
        for outcome in outcomes:
            self._retried.discard((outcome.message_id, outcome.delivery))
            self.leases.release(outcome.message_id, outcome.delivery)
        self.stale.settled(outcomes)  # the observers (broker.outcome_observers), if any

    def write(self, batch: list[Outcome]) -> None:
        if all(o.kind is Write.ACK and not o.effects and not o.committed for o in batch):
            self._write_acks(batch)
            return
        if all(o.committed and not o.effects for o in batch):
            self._write_committed(batch)
            return
        # A delivery whose fenced transaction committed never runs again: a crash must not undo the
        # ack of its row, nor what rides with it (its result, its next step), as it may undo others.
        durable = any(o.committed for o in batch)
        stmts = self.statements
        by_kind: dict[Write, list[Outcome]] = {Write.ACK: [], Write.NACK: [], Write.RETRY: [], Write.RESULT: []}
        for outcome in batch:
            by_kind[outcome.kind].append(outcome)
        # The same message may appear twice only through a bug upstream; the
        # fence makes the second write a counted no-op.
        with self.database.connection(raw=True) as conn, self._transaction(conn, durable=durable):
            applied: set[tuple[str, str]] = set()  # (message id, delivery) of the writes that applied
            if committed := [o for o in by_kind[Write.ACK] if o.committed]:
                # Committed by their fenced transaction: their effects apply if their row is still here.
                done = {"ids": [o.message_id for o in committed], "deliveries": [o.delivery for o in committed]}
                rows = conn.execute(
                    self._committed_statement(relaxed=False), {**done, "writer": self.writer}
                ).fetchall()
                applied.update((r[0], r[1]) for r in rows)
            if acks := [o for o in by_kind[Write.ACK] if not o.committed]:
                ack = self._ack_statement(relaxed=False)  # the transaction is relaxed already, if at all
                params: dict[str, Any] = {"ids": [o.message_id for o in acks], "deliveries": [o.delivery for o in acks]}
                rows = conn.execute(ack, {**params, "writer": self.writer}).fetchall()
                applied.update((r[0], r[1]) for r in rows)
            if nacks := by_kind[Write.NACK]:
                params = {
                    "ids": [o.message_id for o in nacks],
                    "deliveries": [o.delivery for o in nacks],
                    "errors": [o.error for o in nacks],
                }
                nack = stmts.nack_logged if self._logged else stmts.nack  # (the attempt log: migration 023)
                rows = conn.execute(nack, {**params, "writer": self.writer}).fetchall()
                applied.update((r[0], r[1]) for r in rows)
            if retries := by_kind[Write.RETRY]:
                rows = conn.execute(
                    stmts.retry_logged if self._logged else stmts.retry,
                    {
                        "ids": [o.message_id for o in retries],
                        "deliveries": [o.delivery for o in retries],
                        "payloads": [o.payload for o in retries],
                        "delays": [o.delay_ms for o in retries],
                        "errors": [o.error for o in retries],
                        "writer": self.writer,
                    },
                ).fetchall()
                applied.update((r[0], r[1]) for r in rows)
                wakes = retry_wakes([o for o in retries if (o.message_id, o.delivery) in applied])
                if wakes and self.settings.listen:
                    conn.execute(stmts.notify, [self.settings.channel, wakes])
            done_after_all: set[int] = set()  # (ids of the outcomes of deliveries that committed after all)
            if failed := [
                o for o in by_kind[Write.NACK] + by_kind[Write.RETRY] if (o.message_id, o.delivery) not in applied
            ]:
                done_after_all = {id(o) for o in self._committed_after_all(conn, failed)}
            misses: list[Miss] = [
                (o.kind, o.message_id, o.attempt, o.delivery)
                for o in batch
                if o.kind is not Write.RESULT
                and (o.message_id, o.delivery) not in applied
                and id(o) not in done_after_all
            ]
            if any(o.result is not None for o in batch):
                misses += self._write_results(conn, by_kind, applied)
            self._write_effects(conn, [o for o in batch if (o.message_id, o.delivery) in applied])
            queues = {o.message_id: o.queue_name for o in batch if o.queue_name}
            written_before = self.stale.report(
                conn, misses, retried=self._retried, queues=queues, ended=self._ended(batch) if misses else None
            )
            dropped = [
                o
                for o in batch
                if o.kind is not Write.RESULT
                and (o.message_id, o.delivery) not in applied | written_before
                and id(o) not in done_after_all
            ]
            self.stale.drop_effects(dropped)
        for outcome in batch:
            if outcome.kind is Write.NACK and (outcome.message_id, outcome.delivery) in applied:
                self.on_dead(outcome.message_id, outcome.exception)

    def _committed_after_all(self, conn: psycopg.Connection, failed: list[Outcome]) -> list[Outcome]:
        """Of the nacks and retries that did not apply, those of deliveries whose fenced transaction
        committed although the delivery could not tell (the connection broke at its ``COMMIT``; see
        :mod:`.exactly_once`): their rows are finished as acks now (nothing of the failure is
        written: the message is done) and they are not stale writes.  Returns them."""
        params = {"ids": [o.message_id for o in failed], "deliveries": [o.delivery for o in failed]}
        rows = conn.execute(self._committed_statement(relaxed=False), {**params, "writer": self.writer}).fetchall()
        done = {(r[0], r[1]) for r in rows}
        found = [o for o in failed if (o.message_id, o.delivery) in done]
        for o in found:
            self.logger.info(
                "Message %s (attempt %d): its fenced transaction had committed (the reply was lost); it is done, "
                "and its failure afterwards is neither retried nor dead-lettered.",
                o.message_id,
                o.attempt,
            )
        return found

    def _write_acks(self, acks: list[Outcome]) -> None:
        """Acks and nothing else (no result, follow-up or countdown): the ack statement alone is their
        transaction, one round trip instead of three (begin, ack, commit).  Unless ``durable_outcomes``,
        the statement turns ``synchronous_commit`` off for itself.  Acks fenced out are counted after it,
        in the database if it can (the acks stay written either way)."""
        ack = self._ack_statement(relaxed=not self.settings.durable_outcomes)
        params = {"ids": [o.message_id for o in acks], "deliveries": [o.delivery for o in acks], "writer": self.writer}
        with self.database.connection(raw=True) as conn:
            applied = {(r[0], r[1]) for r in conn.execute(ack, params).fetchall()}
            misses: list[Miss] = [
                (o.kind, o.message_id, o.attempt, o.delivery) for o in acks if (o.message_id, o.delivery) not in applied
            ]
            if not misses:
                return
            queues = {o.message_id: o.queue_name for o in acks if o.queue_name}
            try:
                self.stale.report(conn, misses, retried=self._retried, queues=queues, ended=self._ended(acks))
            except psycopg.Error as e:  # the acks are written: nothing to write again
                self.logger.warning(
                    "Could not finish counting %d fenced-out ack(s) (%s); the acks that applied are written.",
                    len(misses),
                    e,
                )

    def _write_committed(self, outcomes: list[Outcome]) -> None:
        """Deliveries whose fenced transaction committed and that caused nothing since: their rows are
        finished as acks are, in one statement (see migration 016).  One already gone was written
        before a lost connection, or finished by maintenance: nothing to write either way.

        Durable whatever ``durable_outcomes`` says: such a delivery never runs again, so a finish a
        crash undid would leave its row committed until the rescue's grace ran out
        (:data:`~.maintenance.COMMITTED_GRACE_LEASES`), and its commit already waited for a flush."""
        statement = self._committed_statement(relaxed=False)
        params = {"ids": [o.message_id for o in outcomes], "deliveries": [o.delivery for o in outcomes]}
        with self.database.connection(raw=True) as conn:
            conn.execute(statement, {**params, "writer": self.writer})

    @property
    def _logged(self) -> bool:
        """Are the deliveries that end without an ack recorded in the attempt log (history is kept)?"""
        return self.settings.keep_finished > 0

    def _ended(self, outcomes: list[Outcome]) -> Ended | None:
        """What the stale-write report records of the deliveries whose writes missed (history kept)."""
        return Ended(self.writer, {(o.message_id, o.delivery): o.error for o in outcomes}) if self._logged else None

    def _committed_statement(self, *, relaxed: bool) -> bytes:
        """The ack of rows their fenced transaction committed (``committed_done``), as :meth:`_ack_statement`."""
        stmts = self.statements
        if self.settings.keep_finished > 0:
            return stmts.committed_done_keep_relaxed if relaxed else stmts.committed_done_keep
        return stmts.committed_done_relaxed if relaxed else stmts.committed_done

    def _ack_statement(self, *, relaxed: bool) -> bytes:
        """The ack, moving rows to the history table when it is kept; *relaxed*: without waiting for the flush."""
        stmts = self.statements
        if self.settings.keep_finished > 0:
            return stmts.ack_keep_relaxed if relaxed else stmts.ack_keep
        return stmts.ack_relaxed if relaxed else stmts.ack

    @contextmanager
    def _transaction(self, conn: psycopg.Connection, *, durable: bool = False) -> Iterator[None]:
        """The writer's (or a release's) transaction on *conn* (autocommit).

        Unless ``durable_outcomes`` (or *durable*), its commit does not wait for the WAL flush: it
        begins with ``BEGIN; SET LOCAL synchronous_commit = off``, one round trip as a plain BEGIN.
        One lost in a crash makes its messages run again, with what they cause (results, follow-up
        messages, countdowns: all in this transaction, lost together).  Not so a delivery whose
        fenced transaction committed: it never runs again, so a batch with one is *durable*.
        ``conn.transaction()`` blocks inside are savepoints, as in psycopg's own transaction.
        """
        if self.settings.durable_outcomes or durable:
            with conn.transaction():
                yield
            return
        conn.execute(self.statements.begin_relaxed, prepare=False)
        try:
            yield
        except BaseException:
            with suppress(psycopg.Error):  # a broken connection: the pool discards it
                conn.rollback()
            raise
        conn.commit()

    def requeue(self, proxies: list[PostgresMessageProxy]) -> set[str]:
        """Release unstarted deliveries now, fenced; the attempt number and the place in line stay.

        Returns the ids released.  Raises Dramatiq's ``ConnectionClosed`` when
        the database cannot be reached (their leases then lapse).
        """
        for p in proxies:
            p.settled = True
        return self.release([(p.message_id, Held(p.queue_name, p.attempt, p.delivery)) for p in proxies])

    def release(self, held: list[tuple[str, Held]]) -> set[str]:
        """Put *held* deliveries back in their queues now (fenced), and forget them; see :meth:`requeue`."""
        ids = [mid for mid, _ in held]
        deliveries = [h.delivery for _, h in held]

        def release(conn: psycopg.Connection) -> set[str]:
            with self._transaction(conn):
                requeue = self.statements.requeue_logged if self._logged else self.statements.requeue
                rows = conn.execute(requeue, [ids, deliveries]).fetchall()
                released = {str(r[0]) for r in rows}
                misses: list[Miss] = [
                    (Write.REQUEUE, mid, h.attempt, h.delivery) for mid, h in held if mid not in released
                ]
                queues = {mid: h.queue_name for mid, h in held}
                self.stale.report(conn, misses, queues=queues, ended=self._ended([]))
                if released and self.settings.listen:
                    conn.execute(
                        self.statements.notify,
                        [self.settings.channel, look_back(sorted({h.queue_name for _, h in held}))],
                    )
            return released

        try:
            return self.database.run(release)
        finally:
            for mid, h in held:
                self.leases.release(mid, h.delivery)
