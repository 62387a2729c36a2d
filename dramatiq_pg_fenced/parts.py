"""The parts a broker runs in each process, wired together.

Built by :class:`~.broker.PostgresBroker` on first use in a process, and again
after ``fork`` (the parent's threads are not the child's).  Each part gets the
database, the bound statements and the settings, never the broker.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any, cast

from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.results import Results

from . import delivery
from .config import Settings
from .consumer import LookBack, LostClaims
from .database import Database
from .delivery import Countdown, Outcome, PostgresMessageProxy, ResultWrite, Row
from .fencing import StaleWrites, Write
from .interrupt import Interrupter
from .leases import CancelWatch, LeaseKeeper, Leases, StartGate
from .maintenance import Maintenance
from .outcomes import OutcomeWriter
from .processes import Heartbeat
from .schedules import Scheduler, Schedules
from .sql import Statements
from .turns import Answered, Turns


class ProcessParts:
    """The lease registry and keeper, the start gate, the interrupter and its cancel watch, the maintenance
    loop and its heartbeat, the outcome writer, the scheduler and the turns (who does the idle chores)
    of one process."""

    def __init__(
        self,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        on_dead: Callable[[str, BaseException | None], None],
        writer: str,
        schedules: Schedules,
        row: Callable[[Message, int | None], Row],
    ) -> None:
        self.pid = os.getpid()
        self.stale = StaleWrites(statements, logger)
        self.leases = Leases()
        self.lost_claims = LostClaims()
        self.look_back = LookBack()
        # "" joined as it consumes; each time it begins to listen, its consumers look back (a "!back" went unheard)
        self.turns = Turns(statements, settings.schema, groups=(), heard=self.look_back.request_all)
        self.answered = Answered()
        self.interrupter = Interrupter(logger)
        self.keeper = LeaseKeeper(
            self.leases, database, statements, settings, logger, on_cancelled=self.interrupter.cancelled
        )
        self.cancel_watch = CancelWatch(
            self.interrupter,
            database,
            statements,
            settings,
            logger,
            hears=self.turns.hearing if settings.listen else None,
        )
        self.gate = StartGate(self.leases, database, statements)
        #: This process's row in ``process`` (written only while a worker runs here).
        self.heartbeat = Heartbeat(self.leases, database, statements, writer, tick=settings.rescue_interval)
        self.maintenance = Maintenance(
            self.leases, database, statements, settings, logger, heartbeat=self.heartbeat, turns=self.turns
        )
        self.writer = OutcomeWriter(
            database, statements, settings, self.leases, self.stale, logger, on_dead=on_dead, writer=writer
        )
        self.scheduler = Scheduler(schedules, database, statements, settings, logger, row=row)
        self.consumers = 0  #: consumers made in this process (each gets an id of its own)

    def close(self, timeout: float = 10.0) -> None:
        """Write the pending outcomes (the keeper still extends their leases meanwhile), then end the
        chores, waiting at most *timeout* seconds for the ticks under way (all at once, not in turn)."""
        self.scheduler.halt()
        self.writer.stop(timeout)
        chores = (self.scheduler, self.keeper, self.cancel_watch, self.maintenance)
        for chore in chores:
            chore.halt()
        deadline = time.monotonic() + timeout
        for chore in chores:
            chore.stop(max(deadline - time.monotonic(), 0.0))


class DeliveryMethods:
    """What the middleware and the backends ask the broker about a delivery (a mixin of
    :class:`~.broker.PostgresBroker`: it needs the broker's per-process ``parts`` and ``row``)."""

    logger: logging.Logger
    _parts: ProcessParts | None

    @property
    def parts(self) -> ProcessParts:
        raise NotImplementedError

    def row(self, message: Message, delay: int | None) -> Row:
        raise NotImplementedError

    def holds(self, message: Any) -> bool:
        """Is *message* a delivery of ours, held by this process at its attempt and not settled yet?"""
        parts = self._parts
        if not isinstance(message, PostgresMessageProxy) or message.settled:
            return False
        if parts is None or parts.pid != os.getpid():
            return False
        held = parts.leases.held(message.message_id)
        return held is not None and held.delivery == message.delivery

    def submit_result(self, message: PostgresMessageProxy, write: ResultWrite) -> None:
        """Write *write* with (or right after) the outcome of this delivery, only if that outcome applied."""
        outcome = Outcome(
            Write.RESULT, message.message_id, message.attempt, message.delivery, queue_name=message.queue_name
        )
        outcome.result = write
        self.parts.writer.submit(outcome)

    def stored_exception(self, message: PostgresMessageProxy) -> ResultWrite | None:
        """The exception Dramatiq's Results middleware stores for a failed message, built as its nack is
        handed over so that it rides that nack: written in its transaction, only if it applies.

        Results stores it in ``after_nack``, after the nack: written apart, it could land although the
        nack was fenced out (a stale worker's error stored as the result of a message the rescuer
        dead-lettered).  Only for our own results backend, on this broker; ``store_exception`` then
        skips the message.
        """
        if not message.failed:
            return None
        for m in self.middleware:  # type: ignore[attr-defined]
            backend = getattr(m, "backend", None)
            build = getattr(backend, "exception_write", None)
            # Ours, on this broker's schema: with a pool of its own too (its fence reads our message rows,
            # so it is on our database).
            if not isinstance(m, Results) or build is None or getattr(backend, "schema", None) != self.schema:  # type: ignore[attr-defined]
                continue
            store, ttl = m._lookup_options(self, message)
            if not store:
                return None
            message.exception_stored = True
            return cast(ResultWrite, build(message, message.exception or Exception("unknown"), ttl))
        return None

    @property
    def interrupter(self) -> Interrupter:
        """Which interruptible actor runs on which thread, in this process (see :mod:`.interrupt`)."""
        return self.parts.interrupter

    def why_not_start(self, message: PostgresMessageProxy) -> str | None:
        """Why a delivery held in the prefetch must not start (``None``: it may); see :class:`.leases.StartGate`."""
        return self.parts.gate.why_not(message)

    def release_unstarted(self) -> int:
        """Put every prefetched delivery that has not started back in its queue, now (fenced).

        Called as a worker begins to shut down (``FencedDelivery``), so other
        workers take them at once instead of after this one's running actors
        finish.  A worker thread that picks one of them up afterwards skips it.
        """
        parts = self._parts
        if parts is None or parts.pid != os.getpid():
            return 0
        unstarted = parts.leases.drain()
        if not unstarted:
            return 0
        try:
            released = parts.writer.release(unstarted)
        except ConnectionClosed:
            self.logger.warning("Could not release %d prefetched message(s); their leases will lapse.", len(unstarted))
            return 0
        self.logger.info("Released %d prefetched message(s) that had not started.", len(released))
        return len(released)

    def countdown(self, message: PostgresMessageProxy, key: str, ttl: int, completions: list[Message]) -> bool:
        """Tie a group member's barrier countdown (and the completion messages) to its outcome.

        Returns ``False`` when *message* is not a delivery whose effects wait
        for its outcome (the caller then counts down at once).
        """
        if delivery.deferring() is not message:
            return False
        message.countdowns.append(Countdown(key, ttl, [self.row(m, None) for m in completions]))
        return True
