"""Message states, fenced writes, and what happens when a write is fenced out.

Every write that settles or extends a delivery names the delivery's token;
the database applies it only while the row is ``running`` under that token.  A write that finds the row elsewhere is *stale*: it is logged,
counted (in this process and in the ``counter`` table) and otherwise
ignored, never raised.  A write that finds its message cancelled is dropped
quietly: cancellation is what the operator asked for.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import psycopg

from ..db.statements import Statements


class State(str, Enum):
    """The state of a message row (``message.state``); see the transition table in :mod:`.sql`."""

    QUEUED = "queued"  #: waiting to be claimed (maybe delayed, or waiting for a retry's backoff)
    RUNNING = "running"  #: leased to one delivery (prefetched or running); attempt is its fence
    #: its delivery's fenced transaction committed (exactly_once.py): done, until its outcome writer
    #: (or, if the worker died, maintenance) finishes the row as an ack does
    COMMITTED = "committed"
    DEAD = "dead"  #: dead-lettered; kept for ``dead_message_ttl``
    CANCELLED = "cancelled"  #: cancelled by an operator; kept for ``dead_message_ttl``


class Write(str, Enum):
    """The kinds of fenced write, as they are named in logs."""

    ACK = "ack"
    NACK = "nack"
    RETRY = "retry"
    REQUEUE = "requeue"
    EXTEND = "extend"
    RESULT = "result"


#: A fenced write that did not apply: (kind, message id, attempt, delivery token).
Miss = tuple[Write, str, int, str | None]
#: A row as it is now: (state, attempt, delivery token), or ``None`` when it is gone.
Row = tuple[str, int, str | None] | None
#: Told of a delivery's outcome once it is written or fenced out: ``(outcome, verdict)``, the verdict
#: ``"applied"``, ``"stale"`` or ``"cancelled"`` (see :meth:`StaleWrites.settled`).
OutcomeObserver = Callable[[Any, str], None]
#: The writes whose verdict an observer is told: a delivery's outcome.
OUTCOME_WRITES = frozenset({Write.ACK, Write.NACK, Write.RETRY})
#: The writes that end a delivery: one the fence refused is recorded in the attempt log.
ENDING_WRITES = OUTCOME_WRITES | {Write.REQUEUE}


@dataclass(frozen=True)
class Ended:
    """What the attempt log (migration 023) records of the deliveries whose ending writes the fence
    refused, given to :meth:`StaleWrites.report` while history is kept (``keep_finished`` > 0): a stale
    delivery's write as ``fenced out``, with the reason and its own error, under *process* (its row no
    longer names its consumer); the end of a delivery whose message was cancelled while it ran as
    ``cancelled`` (its row still does)."""

    process: str  #: the writing process (the outcome writer's name in the tallies)
    errors: Mapping[tuple[str, str], str | None] = field(default_factory=dict)  #: (id, delivery) -> its error


def left_by(kind: Write, delivery: str | None, now: Row) -> bool:
    """Does the row look as the *kind* write of *delivery* would have left it?"""
    if kind is Write.ACK:
        return now is None
    if now is None or delivery is None or now[2] != delivery:
        return False
    if kind is Write.NACK:
        return now[0] == State.DEAD.value
    if kind is Write.RETRY:
        return now[0] == State.QUEUED.value
    return False


def stale_message(kind: Write, message_id: str, attempt: int, now: Row, delivery: str | None = None) -> str:
    """The warning a stale write logs: why it was refused, told by the row as it is now (its state,
    attempt and token against the writer's *attempt* and *delivery*)."""
    where = stale_reason(attempt, now, delivery)
    return f"Stale {kind.value} of message {message_id} by attempt {attempt} ignored: {where}."


def stale_reason(attempt: int, now: Row, delivery: str | None = None) -> str:
    """Why a stale write of *attempt* (*delivery*) was refused, told by the row as it is now."""
    if now is None:
        # An ack deletes the row: this delivery's own (its outcome written before this write, as a
        # requeue at shutdown of a message whose ack just committed), or a later delivery's; or the
        # dead letter was purged, the queue flushed.  The row cannot tell which.
        where = "the row is gone: the message is finished (acked, by this delivery or a later one, or purged)"
    else:
        state, at, token = now
        if delivery is not None and token == delivery:
            where = f"this delivery's own outcome was written already (state {state!r} at attempt {at})"
        elif at > attempt and state in (State.RUNNING.value, State.COMMITTED.value):
            where = f"the message was redelivered: attempt {at} holds it now ({state!r})"
        elif state == State.QUEUED.value:
            where = (
                f"the message is back in its queue at attempt {at} (its lease expired and it was rescued, "
                "or it was released or retried) for another delivery"
            )
        else:
            where = f"the row is at attempt {at} in state {state!r}, under another delivery"
    return where


def stale_counts(queues: Sequence[str | None]) -> list[list]:
    """Parameters of ``count_stale`` for stale writes of these queues (``None``: unknown):
    the total, and one counter per known queue."""
    per_queue = Counter(f"stale_writes:{q}" for q in queues if q)
    names = ["stale_writes", *per_queue]
    return [names, [len(queues), *per_queue.values()]]


def _refused(kind: Write, attempt: int, now: Row, delivery: str | None = None) -> str:
    """The attempt log's note of a refused write: what it was, and why it was refused."""
    return f"its {kind.value} was refused: {stale_reason(attempt, now, delivery)}"


def _attempt_rows(
    log: list[tuple[Write, str, int, str, str, str | None]], ended: Ended, queues: Mapping[str, str]
) -> dict[str, Any]:
    """The parameters of ``attempt_ended``: each refused write's delivery, its outcome in the log, and its
    error (the reason it was refused, then the delivery's own error)."""
    errors = []
    for _, message_id, _, delivery, _, reason in log:
        own = ended.errors.get((message_id, delivery))
        errors.append("\n".join(text for text in (reason, own) if text) or None)
    return {
        "ids": [row[1] for row in log],
        "deliveries": [row[3] for row in log],
        "attempts": [row[2] for row in log],
        "queues": [queues.get(row[1], "") for row in log],
        "outcomes": [row[4] for row in log],
        "errors": errors,
        "process": ended.process,
    }


class StaleWrites:
    """Classifies, logs and counts fenced-out writes; one per broker or backend."""

    def __init__(
        self, statements: Statements, logger: logging.Logger, observers: list[OutcomeObserver] | None = None
    ) -> None:
        self.statements = statements
        self.logger = logger
        self._lock = threading.Lock()
        #: Told of every delivery outcome written or fenced out (the broker's ``outcome_observers``,
        #: shared, so that they outlive this process's parts); none by default, and then nothing is kept.
        self.observers: list[OutcomeObserver] = observers if observers is not None else []
        self._verdicts: dict[tuple[str, str], str] = {}  # (message id, delivery) -> "stale" or "cancelled"
        self.stale = 0  #: stale writes seen by this process
        self.cancelled = 0  #: writes dropped because their message was cancelled
        self.dropped_effects = 0  #: results, follow-ups and countdowns of outcomes that did not apply

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {
                "stale_writes": self.stale,
                "cancelled_writes": self.cancelled,
                "dropped_effects": self.dropped_effects,
            }

    def drop_effects(self, outcomes: Sequence[Any]) -> None:
        """Count (and log) what fenced-out outcomes would have caused: it is not written."""
        n = 0
        for outcome in outcomes:
            if outcome.effects:
                n += outcome.effects
                self.logger.info(
                    "The %s of message %s by attempt %d did not apply: its result, follow-up messages and group "
                    "countdown (%d in all) are dropped with it.",
                    outcome.kind.value,
                    outcome.message_id,
                    outcome.attempt,
                    outcome.effects,
                )
        if n:
            with self._lock:
                self.dropped_effects += n

    def drop_unacked(self, kind: Write, message_id: str, attempt: int, n: int) -> None:
        """Count (and log) the *n* effects of a delivery that ended in a *kind* (a retry or a dead letter)
        they cannot ride: the messages it sent inside ``with_ack()``, and, after a retry the actor made
        itself, whatever the middleware sent after it.  They are not sent."""
        self.logger.info(
            "Attempt %d of message %s ended with a %s: %d message(s) or countdown(s) that wait for an ack are dropped.",
            attempt,
            message_id,
            kind.value,
            n,
        )
        with self._lock:
            self.dropped_effects += n

    def report(
        self,
        conn: psycopg.Connection,
        misses: Sequence[Miss],
        retried: Collection[tuple[str, str]] = (),
        queues: Mapping[str, str] | None = None,
        ended: Ended | None = None,
    ) -> set[tuple[str, str]]:
        """Log and count *misses*; called inside the writing transaction (after it, for a batch of acks alone).

        *retried* holds the (message id, delivery token) pairs whose previous try
        failed with a broken connection: it may have committed, so a row that
        looks as that write left it is not counted as stale.  *queues* (message
        id -> queue, when the caller knows) adds per-queue counts to the total.
        Returns the (message id, delivery token) pairs of *misses* that such a
        try probably wrote: their effects were written with them, not dropped.
        *ended* (history kept): record the deliveries these writes ended in the
        attempt log, in the same transaction (never one such a try wrote).
        """
        if not misses:
            return set()
        rows = conn.execute(self.statements.current, [[m[1] for m in misses]]).fetchall()
        current: dict[str, Row] = {str(r[0]): (r[1], r[2], None if r[3] is None else str(r[3])) for r in rows}
        n_stale = n_cancelled = 0
        written_before: set[tuple[str, str]] = set()
        stale_queues: list[str | None] = []
        cancelled_ended: list[tuple[str, str]] = []  # cancelled deliveries that ended with this write
        log: list[tuple[Write, str, int, str, str, str | None]] = []  # the attempt log's rows
        for kind, message_id, attempt, delivery in misses:
            now = current.get(message_id)
            if now is not None and now[0] == State.CANCELLED.value:
                n_cancelled += 1
                self._verdict(kind, message_id, delivery, "cancelled")
                if delivery is not None and now[2] == delivery and kind is not Write.RESULT:
                    cancelled_ended.append((message_id, delivery))
                    log.append((kind, message_id, attempt, delivery, "cancelled", None))
                elif delivery is not None:  # a stale delivery's write, its message cancelled since
                    log.append((kind, message_id, attempt, delivery, "fenced out", _refused(kind, attempt, now)))
                self.logger.info(
                    "Message %s was cancelled; the %s of attempt %d is dropped.", message_id, kind.value, attempt
                )
            elif delivery is not None and (message_id, delivery) in retried and left_by(kind, delivery, now):
                written_before.add((message_id, delivery))
                self.logger.info(
                    "The %s of message %s by attempt %d was probably written by a try whose connection broke "
                    "at commit; not counted as stale.",
                    kind.value,
                    message_id,
                    attempt,
                )
            else:
                n_stale += 1
                self._verdict(kind, message_id, delivery, "stale")
                stale_queues.append((queues or {}).get(message_id))
                self.logger.warning(stale_message(kind, message_id, attempt, now, delivery))
                if delivery is not None:
                    refused = _refused(kind, attempt, now, delivery)
                    log.append((kind, message_id, attempt, delivery, "fenced out", refused))
        with self._lock:
            self.stale += n_stale
            self.cancelled += n_cancelled
        if ended is not None and (log := [row for row in log if row[0] in ENDING_WRITES]):
            conn.execute(self.statements.attempt_ended, _attempt_rows(log, ended, queues or {}))
        if cancelled_ended:  # the row no longer says its actor still runs (see leases.py)
            conn.execute(
                self.statements.cancel_ended, [[m for m, _ in cancelled_ended], [d for _, d in cancelled_ended]]
            )
        if n_stale:
            conn.execute(self.statements.count_stale, stale_counts(stale_queues))
        return written_before

    def _verdict(self, kind: Write, message_id: str, delivery: str | None, verdict: str) -> None:
        """Remember why a delivery's outcome did not apply, for :meth:`settled` (only while observed)."""
        if self.observers and delivery is not None and kind in OUTCOME_WRITES:
            with self._lock:
                self._verdicts[(message_id, delivery)] = verdict

    def settled(self, outcomes: Sequence[Any]) -> None:
        """*outcomes* are written or fenced out (the outcome writer's ``_done``): tell the observers each
        delivery's verdict: ``"stale"`` or ``"cancelled"`` as :meth:`report` found it, else ``"applied"``.
        On the outcome writer's thread; an observer that raises is logged, never stops the writer."""
        if not self.observers:
            return
        for outcome in outcomes:
            if outcome.kind not in OUTCOME_WRITES:
                continue
            with self._lock:
                verdict = self._verdicts.pop((outcome.message_id, outcome.delivery), "applied")
            for observe in list(self.observers):
                try:
                    observe(outcome, verdict)
                except Exception:
                    self.logger.exception("An outcome observer (%r) failed.", observe)
