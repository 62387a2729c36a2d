"""The parts a broker runs in each process, wired together.

Built by :class:`~.broker.PostgresBroker` on first use in a process, and again
after ``fork`` (the parent's threads are not the child's).  Each part gets the
database, the bound statements and the settings, never the broker.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.results import Results

from .config import Settings
from .core import delivery
from .core.consumer import LookBack, LostClaims, ServerClock
from .core.delivery import Countdown, Outcome, PostgresMessageProxy, ResultWrite, Row
from .core.fencing import OutcomeObserver, StaleWrites, Write
from .core.interrupt import Interrupter
from .core.leases import CancelWatch, LeaseKeeper, Leases, StartGate
from .core.maintenance import Maintenance
from .core.outcomes import OutcomeWriter
from .core.processes import Heartbeat
from .core.turns import Answered, Turns
from .db.database import Database
from .db.statements import Statements

if TYPE_CHECKING:
    from .features.scheduler import Scheduler
    from .features.schedules import Schedules


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
        schedules: Callable[[], Schedules],
        row: Callable[[Message, int | None], Row],
        observers: list[OutcomeObserver] | None = None,
    ) -> None:
        self.pid = os.getpid()
        self.stale = StaleWrites(statements, logger, observers)
        self.leases = Leases()
        self.lost_claims = LostClaims()
        self.look_back = LookBack()
        self.clock = ServerClock()  # the database's clock, for the floors of claims that found nothing
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
        self._scheduler_parts = (schedules, database, statements, settings, logger, row)
        self._scheduler: Scheduler | None = None
        self._scheduler_lock = threading.Lock()
        self.consumers = 0  #: consumers made in this process (each gets an id of its own)

    @property
    def scheduler(self) -> Scheduler:
        """This process's scheduler, made (and its module imported) when first asked for: by a worker
        with schedules to run (:meth:`~.broker.PostgresBroker.start_scheduler`)."""
        with self._scheduler_lock:
            if self._scheduler is None:
                from .features.scheduler import Scheduler

                schedules, database, statements, settings, logger, row = self._scheduler_parts
                self._scheduler = Scheduler(schedules(), database, statements, settings, logger, row=row)
            return self._scheduler

    @property
    def scheduled_ticks(self) -> int:
        """Ticks this process's scheduler enqueued (0 if it was never made)."""
        scheduler = self._scheduler
        return 0 if scheduler is None else scheduler.enqueued

    def close(self, timeout: float = 10.0) -> None:
        """Write the pending outcomes (the keeper still extends their leases meanwhile), then end the
        chores, waiting at most *timeout* seconds for the ticks under way (all at once, not in turn)."""
        scheduler = self._scheduler  # none if never asked for
        if scheduler is not None:
            scheduler.halt()
        self.writer.stop(timeout)
        chores = [c for c in (scheduler, self.keeper, self.cancel_watch, self.maintenance) if c is not None]
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
