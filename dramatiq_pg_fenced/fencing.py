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
from collections.abc import Collection, Mapping, Sequence
from enum import Enum
from typing import Any

import psycopg

from .sql import Statements


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


def stale_message(kind: Write, message_id: str, attempt: int, now: Row) -> str:
    """The warning a stale write logs."""
    if now is None:
        where = "the row is gone (finished by another attempt)"
    else:
        where = f"the row is at attempt {now[1]} in state {now[0]!r}"
    return f"Stale {kind.value} of message {message_id} by attempt {attempt} ignored: {where}."


def stale_counts(queues: Sequence[str | None]) -> list[list]:
    """Parameters of ``count_stale`` for stale writes of these queues (``None``: unknown):
    the total, and one counter per known queue."""
    per_queue = Counter(f"stale_writes:{q}" for q in queues if q)
    names = ["stale_writes", *per_queue]
    return [names, [len(queues), *per_queue.values()]]


class StaleWrites:
    """Classifies, logs and counts fenced-out writes; one per broker or backend."""

    def __init__(self, statements: Statements, logger: logging.Logger) -> None:
        self.statements = statements
        self.logger = logger
        self._lock = threading.Lock()
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
            "Attempt %d of message %s ended with a %s: %d message(s) or countdown(s) that wait for an ack "
            "are dropped.",
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
    ) -> set[tuple[str, str]]:
        """Log and count *misses*; called inside the writing transaction (after it, for a batch of acks alone).

        *retried* holds the (message id, delivery token) pairs whose previous try
        failed with a broken connection: it may have committed, so a row that
        looks as that write left it is not counted as stale.  *queues* (message
        id -> queue, when the caller knows) adds per-queue counts to the total.
        Returns the (message id, delivery token) pairs of *misses* that such a
        try probably wrote: their effects were written with them, not dropped.
        """
        if not misses:
            return set()
        rows = conn.execute(self.statements.current, [[m[1] for m in misses]]).fetchall()
        current: dict[str, Row] = {str(r[0]): (r[1], r[2], None if r[3] is None else str(r[3])) for r in rows}
        n_stale = n_cancelled = 0
        written_before: set[tuple[str, str]] = set()
        stale_queues: list[str | None] = []
        ended: list[tuple[str, str]] = []  # cancelled deliveries that ended with this write
        for kind, message_id, attempt, delivery in misses:
            now = current.get(message_id)
            if now is not None and now[0] == State.CANCELLED.value:
                n_cancelled += 1
                if delivery is not None and now[2] == delivery and kind is not Write.RESULT:
                    ended.append((message_id, delivery))
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
                stale_queues.append((queues or {}).get(message_id))
                self.logger.warning(stale_message(kind, message_id, attempt, now))
        with self._lock:
            self.stale += n_stale
            self.cancelled += n_cancelled
        if ended:  # the row no longer says its actor still runs (see leases.py)
            conn.execute(self.statements.cancel_ended, [[m for m, _ in ended], [d for _, d in ended]])
        if n_stale:
            conn.execute(self.statements.count_stale, stale_counts(stale_queues))
        return written_before
