"""PostgresBroker: Dramatiq messages as rows in PostgreSQL, fenced per attempt.

This module is Dramatiq's ``Broker`` API and the wiring of the parts: per
process it builds the lease registry and keeper, the maintenance loop and the
outcome writer, hands each what it needs (the database, the bound
statements, the settings), and gives every consumer the same.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import uuid
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, cast

from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.logging import get_logger
from dramatiq.message import Message
from psycopg_pool import ConnectionPool

from .config import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_DEAD_MESSAGE_TTL,
    DEFAULT_DURABLE_OUTCOMES,
    DEFAULT_INTERRUPT_ON_CANCEL,
    DEFAULT_KEEP_FINISHED,
    DEFAULT_LEASE_SECONDS,
    DEFAULT_MAX_DELIVERIES,
    DEFAULT_MAX_PAYLOAD_BYTES,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_POOL_MAX_SIZE,
    DEFAULT_RESCUE_INTERVAL,
    DEFAULT_SCHEMA,
    Settings,
)
from .core import delivery
from .core.consumer import PostgresConsumer
from .core.delivery import PostgresMessageProxy, Row
from .core.fencing import OutcomeObserver, Write
from .core.outcomes import retry_outcome
from .db import startup
from .db.database import Database, this_process
from .db.statements import check_queue, check_schema, statements
from .errors import DeadLetterError, DeliveryLost
from .features.exactly_once import FencedTransactionHook, FencedTransactions
from .hooks import SkipNoopHooks
from .middleware import FencedDelivery
from .ops import admin
from .ops.admin import OperatorMethods
from .ops.console import ConsoleMethods
from .parts import DeliveryMethods, ProcessParts
from .sending.enqueue import Enqueuer
from .sending.fairness import FairShares
from .sending.sends import SendMethods, SendsOfThisThread
from .sending.unique import UniqueMessages

if TYPE_CHECKING:
    from .features.schedules import Schedules


class PostgresBroker(
    SkipNoopHooks, OperatorMethods, ConsoleMethods, DeliveryMethods, FencedTransactions, SendMethods, Broker
):
    """A Dramatiq broker that keeps messages in PostgreSQL.

    Parameters:
      url: libpq connection string or URL.  ``None`` uses libpq's defaults
        (``PGHOST`` and friends).
      pool: a ``psycopg_pool.ConnectionPool`` you own (autocommit
        connections); used instead of ``url`` for queries.
      schema: where the tables live (``broker.migrate()`` creates it).
      lease_seconds: how long a claimed message is held without extension.
      poll_interval: seconds between claims when no doorbell rings.
      rescue_interval: seconds between two returns of expired leases to their queues.
      listen: ``False`` turns LISTEN/NOTIFY off, and server-side prepared
        statements in the pool made from ``url`` (PgBouncer transaction pooling).
      max_payload_bytes: larger encoded messages are refused at enqueue.
      dead_message_ttl: seconds dead letters and cancellations are kept.
      max_deliveries: deliveries of one message that may end without any
        outcome (its worker crashed or lost its lease) before it is
        dead-lettered instead of queued again; ``None``: no limit.
      keep_finished: seconds acked messages are kept in the history table,
        for ``inspect`` and the dashboard (0: none kept).
      synchronous_commit: ``False`` enqueues with ``synchronous_commit = off``
        (faster; a database crash may lose the last few enqueued messages).
      durable_outcomes: ``True`` makes claims, acks, nacks, retries, lease
        extensions and shutdown releases wait for the WAL flush too.  By
        default they do not: one lost in a database crash makes its message
        run again (at-least-once), never lost; the enqueue stays durable.
      run_schedules: ``False``: this process's workers do not run the
        scheduler of ``broker.schedules`` (``dramatiq-pg-fenced scheduler
        MODULE`` can run it alone).
      read_url: where operators' reads go (:meth:`stats`, :meth:`queue_overview`,
        :meth:`list_messages`, :meth:`inspect`, the dashboard's pages and the
        metrics): a streaming replica (a hot standby), so they never load the
        primary.  Claims, leases, sends, outcomes and operators' actions
        (cancel, re-drive, pause, purge) always go to ``url``.  ``None``
        (default): everything goes to ``url``.
      interrupt_on_cancel: ``True`` makes every actor without its own
        ``interrupt_on_cancel`` option stop when its running message is
        cancelled (``MessageCancelled`` raised in its thread; see
        :mod:`.interrupt`).  By default only actors declared with
        ``interrupt_on_cancel=True`` are.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        pool: ConnectionPool | None = None,
        schema: str = DEFAULT_SCHEMA,
        middleware: list[Any] | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        rescue_interval: float = DEFAULT_RESCUE_INTERVAL,
        listen: bool = True,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        dead_message_ttl: int = DEFAULT_DEAD_MESSAGE_TTL,
        keep_finished: int = DEFAULT_KEEP_FINISHED,
        pool_max_size: int = DEFAULT_POOL_MAX_SIZE,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        synchronous_commit: bool = True,
        max_deliveries: int | None = DEFAULT_MAX_DELIVERIES,
        durable_outcomes: bool = DEFAULT_DURABLE_OUTCOMES,
        run_schedules: bool = True,
        interrupt_on_cancel: bool = DEFAULT_INTERRUPT_ON_CANCEL,
        read_url: str | None = None,
    ) -> None:
        check_schema(schema)
        if lease_seconds <= 0 or poll_interval <= 0 or rescue_interval <= 0:
            raise ValueError("lease_seconds, poll_interval and rescue_interval must be positive")
        if max_deliveries is not None and (
            not isinstance(max_deliveries, int) or isinstance(max_deliveries, bool) or max_deliveries < 1
        ):
            raise ValueError(f"max_deliveries must be a positive integer or None, not {max_deliveries!r}")
        if keep_finished < 0 or dead_message_ttl < 0:
            raise ValueError("keep_finished and dead_message_ttl must not be negative")
        super().__init__(middleware=middleware)
        self.logger = get_logger(__name__, type(self))
        self.settings = Settings(
            schema=schema,
            lease_seconds=float(lease_seconds),
            poll_interval=float(poll_interval),
            rescue_interval=float(rescue_interval),
            listen=listen,
            dead_message_ttl=dead_message_ttl,
            max_deliveries=max_deliveries,
            keep_finished=int(keep_finished),
            durable_outcomes=bool(durable_outcomes),
            interrupt_on_cancel=bool(interrupt_on_cancel),
        )
        self.database = Database(
            url,
            pool=pool,
            schema=schema,
            connect_timeout=connect_timeout,
            pool_max_size=pool_max_size,
            prepare=listen,  # listen=False: maybe behind a transaction pooler
        )
        #: Where operators' reads go: a replica's own pool with ``read_url``, else :attr:`database`.
        self.reader = self.database
        if read_url:
            self.reader = Database(
                read_url,
                schema=schema,
                connect_timeout=connect_timeout,
                pool_max_size=min(pool_max_size, 4),
                prepare=listen,
                name="reader",
                reads=True,
            )
        self.statements = statements(schema)
        #: Declares fairness_key and fairness_weight, and knows the fair queues (fairness.py).
        self.fair_shares = FairShares()
        self.enqueuer = Enqueuer(
            self.statements,
            self.settings,
            actor_of=self.actors.get,
            fair_queues=self.fair_shares.queues,
            max_payload_bytes=max_payload_bytes,
            synchronous_commit=synchronous_commit,
            logger=self.logger,
        )
        self._schedules: Schedules | None = None  # made when first asked for (see schedules)
        self._schedules_lock = threading.Lock()
        self.run_schedules = bool(run_schedules)
        self.consumer_id = _new_consumer_id()
        self.queues: set[str] = set()
        self._parts_lock = threading.Lock()
        self._parts: ProcessParts | None = None
        self._dead: OrderedDict[str, BaseException | None] = OrderedDict()
        self._local = SendsOfThisThread()  # per thread: an open batch() or transaction()
        self._checked_in: int | None = None  # the process whose start-up check passed
        #: Told of each delivery's outcome once written or fenced out, ``(outcome, verdict)`` on the
        #: outcome writer's thread (:meth:`.fencing.StaleWrites.settled`); the OpenTelemetry middleware's.
        self.outcome_observers: list[OutcomeObserver] = []
        #: Each called with the delivery as a ``fenced_transaction()`` begins: a context manager
        #: around the block (the OpenTelemetry middleware's span).
        self.fenced_transaction_hooks: list[FencedTransactionHook] = []
        self.add_middleware(UniqueMessages())  # declares the unique_key and unique_until actor options
        self.add_middleware(self.fair_shares)
        self.add_middleware(FencedDelivery())

    def add_middleware(self, middleware: Any, **where: Any) -> None:
        """Dramatiq's ``add_middleware``, keeping :class:`FencedDelivery` last (see its docstring)."""
        super().add_middleware(middleware, **where)
        fenced = [m for m in self.middleware if isinstance(m, FencedDelivery)]
        if fenced and self.middleware[-1] is not fenced[-1]:
            self.middleware.remove(fenced[-1])
            self.middleware.append(fenced[-1])

    # Read-only views of the settings, as before.
    schema = property(lambda self: self.settings.schema)
    url = property(lambda self: self.database.url)
    channel = property(lambda self: self.settings.channel)
    listen = property(lambda self: self.settings.listen)
    lease_seconds = property(lambda self: self.settings.lease_seconds)
    poll_interval = property(lambda self: self.settings.poll_interval)
    rescue_interval = property(lambda self: self.settings.rescue_interval)
    dead_message_ttl = property(lambda self: self.settings.dead_message_ttl)
    max_deliveries = property(lambda self: self.settings.max_deliveries)
    durable_outcomes = property(lambda self: self.settings.durable_outcomes)
    interrupt_on_cancel = property(lambda self: self.settings.interrupt_on_cancel)
    keep_finished = property(lambda self: self.settings.keep_finished)

    @property
    def max_payload_bytes(self) -> int:
        """Larger encoded messages are refused at enqueue (settable)."""
        return self.enqueuer.max_payload_bytes

    @max_payload_bytes.setter
    def max_payload_bytes(self, value: int) -> None:
        self.enqueuer.max_payload_bytes = value

    @property
    def synchronous_commit(self) -> bool:
        """``False``: enqueues commit without waiting for the WAL flush (settable)."""
        return self.enqueuer.synchronous_commit

    @synchronous_commit.setter
    def synchronous_commit(self, value: bool) -> None:
        self.enqueuer.synchronous_commit = value

    @property
    def schedules(self) -> Schedules:
        """Periodic messages declared in this process (``@schedule`` or ``broker.schedules.add``).

        The registry, and the schedules' code, are made when first asked for: a worker of an application
        that declares no schedule never loads them.
        """
        with self._schedules_lock:
            if self._schedules is None:
                from .features.schedules import Schedules

                self._schedules = Schedules(lookup=self.actors.get, where=lambda _: (self.database, self.statements))
            return self._schedules

    # -- the parts of this process ----------------------------------------------
    @property
    def parts(self) -> ProcessParts:
        """This process's lease registry, keeper, maintenance loop and outcome writer."""
        parts = self._parts
        if parts is None or parts.pid != this_process():
            with self._parts_lock:
                parts = self._parts
                if parts is None or parts.pid != os.getpid():
                    # After fork the parent's threads are not ours: start afresh.
                    self.consumer_id = _new_consumer_id()
                    parts = self._parts = ProcessParts(
                        self.database,
                        self.statements,
                        self.settings,
                        self.logger,
                        on_dead=self._remember_dead,
                        writer=self.consumer_id,
                        schedules=lambda: self.schedules,
                        row=self.enqueuer.row,
                        observers=self.outcome_observers,
                    )
        return parts

    @property
    def started(self) -> bool:
        """Has this process connected or started a thread for this broker?"""
        parts = self._parts
        return self.database.started or (parts is not None and parts.pid == os.getpid())

    def flush_outcomes(self, timeout: float | None = None) -> bool:
        """Wait until every outcome settled in this process is written (or fenced out); ``False`` on timeout."""
        parts = self._parts
        if parts is None or parts.pid != os.getpid():
            return True
        return parts.writer.flush(timeout)

    def _remember_dead(self, message_id: str, exception: BaseException | None) -> None:
        """For ``join(fail_fast=True)``: the actor's own exception, when it failed here."""
        with self._parts_lock:
            self._dead[message_id] = exception
            while len(self._dead) > 1000:
                self._dead.popitem(last=False)

    # -- Dramatiq's Broker API ----------------------------------------------------
    def migrate(self) -> list[int]:
        """Create or upgrade the schema; returns the versions applied."""
        return self.database.migrate()

    def check_startup(self) -> None:
        """Raise :class:`~.startup.StartupError` if the database can never work as configured (role,
        password, database, schema); pass if it works, or cannot be reached now (waited for).  Once per
        process, as a worker starts (``FencedDelivery``)."""
        if self._checked_in != this_process():
            startup.check(self.database, ready=self.database.found_ready)  # its connection: the pool's first
            self._checked_in = this_process()

    def close(self) -> None:
        """Write pending outcomes, stop the background threads and listeners, close the pool (if ours)."""
        with self._parts_lock:
            parts, self._parts = self._parts, None
        if parts is not None and parts.pid == os.getpid():
            parts.close()
        self.database.close()
        if self.reader is not self.database:
            self.reader.close()

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> PostgresConsumer:
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)
        parts = self.parts
        parts.consumers += 1
        parts.leases.undrain()  # a worker of this process that shut down before stopped claiming
        parts.turns.join("", queue_name, room=lambda: parts.leases.capacity(queue_name, prefetch) > 0)  # turns.py
        # The keeper extends what consumers hold; maintenance also rescues other
        # processes' expired leases, so a consuming process runs it from the start.
        parts.keeper.start()
        parts.maintenance.start()
        if self.run_schedules:
            self.start_scheduler()
        parts.cancel_watch.start()  # reads the rows while one runs and no "!interrupt" can come (turns.py)
        return PostgresConsumer(
            queue_name,
            prefetch,
            timeout,
            consumer_id=f"{self.consumer_id}/{queue_name}/{parts.consumers}",
            database=self.database,
            statements=self.statements,
            settings=self.settings,
            leases=parts.leases,
            lost_claims=parts.lost_claims,
            writer=parts.writer,
            doorbell=self._doorbell(parts),
            logger=self.logger,
            priority=min((a.priority for a in self.actors.values() if a.queue_name == queue_name), default=0),
            look_back=parts.look_back,
            clock=parts.clock,
            stored_exception=self.stored_exception,
            turns=parts.turns if self.listen else None,
            answered=parts.answered if self.listen else None,
            fair=queue_name in self.fair_shares.queues,
        )

    def start_scheduler(self) -> bool:
        """Run this process's scheduler thread (once), if any schedule is declared; returns whether it runs.

        Workers call it as they start consuming (unless ``run_schedules=False``).
        """
        if self._schedules is None or not len(self._schedules):
            return False
        self.parts.scheduler.start()
        return True

    def _doorbell(self, parts: ProcessParts) -> Any:
        """This process's wake-up channel; it also hears of cancelled messages that must not start, or must stop."""
        if not self.listen:
            return None
        doorbell = self.database.doorbell(self.channel, timed=True)
        doorbell.on("cancel", parts.leases.mark_cancelled)
        doorbell.on("back", parts.look_back.request)
        doorbell.on("interrupt", parts.interrupter.command)
        doorbell.on("took", parts.answered.took)  # rings another process's claim answered (turns.py)
        doorbell.on_ring(parts.answered.rang)
        doorbell.attend(parts.turns)  # its seat among the listening processes, for the idle chores' turns
        return doorbell

    def declare_queue(self, queue_name: str) -> None:
        """Remember the queue; no I/O (called at import time by ``@actor``)."""
        if queue_name not in self.queues:
            check_queue(queue_name)
            self.emit_before("declare_queue", queue_name)
            self.queues.add(queue_name)
            self.emit_after("declare_queue", queue_name)

    def get_declared_queues(self) -> set[str]:
        return self.queues.copy()

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Store a message; with ``delay`` (ms) it becomes due at ``now() + delay`` (database clock).

        A message this broker delivered (Dramatiq's Retries middleware sends
        the same proxy back) is not inserted again: its row goes back to the
        queue, fenced on the delivering attempt.

        A message with a unique key (``unique_key``, see unique.py) that
        another message of its actor holds is not inserted: the message
        returned is then a copy carrying the holder's ``message_id`` (so
        ``actor.send(...).get_result()`` waits for the holder's result).
        Inside :meth:`batch` or a delivery's follow-ups the message is
        returned as sent, since nothing is written yet.
        """
        self.emit_before("enqueue", message, delay)
        if isinstance(message, PostgresMessageProxy):
            if not self._retry(message, delay):
                return cast(Message, message)  # not re-queued: no after_enqueue
        elif (tied := delivery.tied_sends()) is not None:
            tied.append(self.row(message, delay))  # written with its outcome (with_ack: its ack), if that applies
        elif (batch := self._local.batch) is not None:
            batch.append((message, delay))  # written, and emit_after sent, when the block ends
            return message
        else:
            ids = self._insert([(message, delay)])
            if ids is not None and ids[0] != message.message_id:
                self.emit_after("enqueue", message, delay)
                return dataclasses.replace(message, message_id=ids[0])  # deduplicated: the holder's id
        self.emit_after("enqueue", message, delay)
        return cast(Message, message)

    def _retry(self, message: PostgresMessageProxy, delay: int | None) -> bool:
        """Decide this delivery's retry; returns whether it goes back to the queue.

        In the middleware's ``after_process_message`` (Dramatiq's Retries) the
        retry waits on the delivery for Dramatiq's ack, which hands it over
        with the delivery's other effects; otherwise it is handed over now.
        The delivery is settled only once its outcome is handed over: if the
        retry cannot be built (the encoder raises), the message is
        dead-lettered with the reason instead, never left held.
        """
        if message.settled or message.decided is not None:
            self.logger.warning(
                "Message %s was already settled by attempt %d; retry ignored.", message.message_id, message.attempt
            )
            return False
        if message.committed:  # its fenced transaction acked it: done (Dramatiq's ack that follows writes its effects)
            delivery.failed_after_its_commit(self.logger, message, "retried")
            return False
        if isinstance(message.exception, DeliveryLost):
            return False  # stale: a retry would be fenced out too; its ack is, and is counted
        outcome = retry_outcome(message, delay, self.enqueuer.encode, self.logger)
        if delivery.deferring() is message:
            message.decided = outcome  # handed over by Dramatiq's ack, with the other effects
        else:
            self.parts.writer.submit(outcome)
            message.settled = message.retried_at_once = True
        return outcome.kind is Write.RETRY

    def row(self, message: Message, delay: int | None) -> Row:
        """*message* as the enqueue statement takes it (see :meth:`.enqueue.Enqueuer.row`)."""
        return self.enqueuer.row(message, delay)

    def flush(self, queue_name: str) -> None:
        """Drop every message of the queue, dead letters included."""
        self.flush_queues([queue_name])

    def flush_all(self) -> None:
        self.flush_queues(sorted(self.queues))

    def flush_queues(self, queue_names: list[str]) -> None:
        self.database.run(lambda conn: conn.execute(self.statements.flush, [queue_names]))

    def join(self, queue_name: str, *, timeout: int | None = None, fail_fast: bool = True, interval: int = 20) -> None:
        """Wait until the queue has nothing queued, delayed or running (an actor after its fenced
        transaction committed included).

        Raises:
          QueueJoinTimeout: after ``timeout`` milliseconds.
          Exception: the actor's exception (or :class:`DeadLetterError` when it
            failed in another process) once a message of the queue was
            dead-lettered since the last flush; ``fail_fast=False`` waits
            regardless.  True by default, as Dramatiq 2's ``StubBroker.join``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        stmts = self.statements
        while True:
            self.flush_outcomes(timeout=1.0)
            # Pending first, dead letters second: a message dead-lettered between the two reads
            # is seen by the second (the other order returned on an empty queue, missing it).
            row = self.database.run(lambda conn: conn.execute(stmts.pending, [queue_name]).fetchone())
            if fail_fast:
                dead = self.database.run(lambda conn: conn.execute(stmts.dead_letters, [queue_name]).fetchone())
                if dead is not None:
                    exc = self._dead.get(str(dead[0]))
                    if exc is not None:
                        raise exc
                    raise DeadLetterError(str(dead[0]), dead[1])
            if row is not None and row[0] == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    def stats(self) -> dict[str, Any]:
        """Counters of this process, totals from the database, queue sizes, every stored schedule
        (next and last tick, the last tick's message; see :func:`.schedules.overview`) and, per queue
        with keyed messages due, its top fairness keys (``fair_keys``: see :func:`.admin.fair_keys`);
        the database's figures from the :attr:`reader` (a replica, with ``read_url``)."""
        parts = self._parts if self._parts is not None and self._parts.pid == os.getpid() else None
        local = parts.stale.counts() if parts is not None else {}
        local["duplicate_sends"] = self.enqueuer.duplicates
        local["interrupts"] = parts.interrupter.interrupts if parts is not None else 0
        held = len(parts.leases.snapshot()) if parts is not None else 0
        local["scheduled_ticks"] = parts.scheduled_ticks if parts is not None else 0
        totals, queues = admin.queue_counts(self.reader, self.statements)
        from .features.schedules import overview as schedule_overview

        schedules = schedule_overview(self.reader, self.statements)
        fair = admin.fair_keys(self.reader, self.statements)
        return {"process": {**local, "held": held}, "totals": totals, "queues": queues, "schedules": schedules,
                "fair_keys": fair}  # fmt: skip


def _new_consumer_id() -> str:
    """Who holds a lease, for operators: host, process and a random suffix (pids repeat)."""
    return f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def __getattr__(name: str) -> Any:
    """``CancelOutcome``, as before, from the operators' code that defines it, imported on first use."""
    if name == "CancelOutcome":
        return admin.CancelOutcome
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PostgresBroker", "CancelOutcome", "MessageProxy"]  # noqa: F822 (CancelOutcome: __getattr__)
