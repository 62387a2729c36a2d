"""Queues over several PostgreSQL databases, each fenced on its own: :class:`RoutedBroker`.

::

    broker = RoutedBroker(
        {"main": "postgresql://db1/app", "reports": "postgresql://db2/app"},
        routes={"reports": "reports", "exports": "reports"},  # queue -> database
        default="main",  # every other queue
    )
    dramatiq.set_broker(broker)

Each database is a :class:`~.broker.PostgresBroker` of its own (a *shard*: its pool, doorbell,
lease keeper, outcome writer, maintenance and scheduler), and a queue lives in exactly one of
them: its sends, claims, acks, leases, retries and unique keys go to that database only, so every
guarantee of one database holds for the queue, there.  The router is the Dramatiq broker the
worker sees: it holds the middleware (every hook is emitted on it, also from the shards), the
actors, and sends each call to the queue's shard.  A queue without a route goes to ``default``;
without a default it is an error when it is declared (as ``@actor`` runs, at start-up), and a
route to a database that is not named is an error at once: never a silent default.

**What a delivery causes in another database** (a pipeline's next step, a callback, a message sent
inside ``with_ack()``) is written where its outcome is: in the ack's transaction, in the
delivery's own database, as a queued row of a queue that no worker consumes there.  That table is
the outbox.  A :class:`Relay` per database and consuming process moves such rows to their queue's
database: it takes them (``FOR UPDATE SKIP LOCKED``), inserts them there, where a row of the
``relayed`` table (migration 017) keyed by message id makes the insert happen once, commits, and
only then deletes them where they were.  A relay that dies in between leaves them to be moved
again, which inserts nothing twice (a move is keyed by the message id, the source database's name
and the row's ``seq`` there: a message sent to and fro by two configurations that disagree during
a deploy is a new row each time it comes back, moved again, never lost); a delivery that was
fenced out wrote nothing to relay.  A moved message its database refuses (its id is there
already, or another message holds its unique key) is logged at warning with its id and counted
(``relay_conflicts`` in :meth:`RoutedBroker.stats`, ``dramatiq_pg_relay_conflicts_total``).  The
doorbell wakes the relay of the process that listens for its set of queues as such a row commits
(one per set: turns.py, "wake one"); the idle look, every ``relay_poll`` seconds, is a safety net
taken in turns (turns.py): one process per database.

**Groups**: a group's barrier lives in one home, the database of the rate-limiter backend given
to :class:`~.rate_limits.FencedGroupCallbacks`; a member counts down with its ack there, or, from
another database, through a countdown row in its outbox that the relay applies at the home once
(see :mod:`.groups`).  Results live with each message, in its queue's database
(:class:`RoutedResultBackend`), so ``group.get_results()`` reads each member's where it is.

Limits, said plainly: messages keep their order within a database, not across two (a relayed
message is enqueued when it is moved); a cross-database follow-up or countdown costs a second
insert and commit, and the relay's delay.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import psycopg
from dramatiq.broker import Broker
from dramatiq.errors import ConnectionClosed, QueueJoinTimeout, QueueNotFound
from dramatiq.logging import get_logger
from dramatiq.message import Message
from dramatiq.results import Results
from dramatiq.results.backend import Missing, ResultBackend

from . import delivery, groups, turns
from .broker import PostgresBroker
from .consumer import PostgresConsumer
from .delivery import PostgresMessageProxy
from .exactly_once import Fence
from .hooks import SkipNoopHooks
from .interrupt import Interrupter
from .middleware import FencedDelivery
from .rate_limits import FencedGroupCallbacks
from .rate_limits import PostgresBackend as RateLimiterBackend
from .reconnect import RETRY_INTERVAL
from .schedules import Schedule, Schedules
from .unique import UniqueMessages

#: Seconds between a relay's looks when no doorbell rang (a safety net: a ring wakes it at once).
RELAY_POLL = 5.0
#: The turns group of the relays (turns.py): no queue is named so (Dramatiq's names cannot hold spaces).
RELAY_GROUP = "relay of the outbox"
#: Rows a relay moves per transaction.
RELAY_BATCH = 500
#: Seconds a ``relayed`` row is kept: a message whose source database comes back later than this
#: with it still in its outbox (a relay died between the two commits) would be moved twice.
RELAYED_KEEP = 7 * 24 * 3600
#: Seconds between a relay's purges of its database's old ``relayed`` rows.
RELAYED_PURGE_EVERY = 3600.0


class RouteError(ValueError):
    """A route names a database the broker does not have, or a queue has no route and no default."""


class RoutedBroker(SkipNoopHooks, Broker):
    """A Dramatiq broker over several databases: each queue in one of them (see the module's docstring).

    Parameters:
      urls: database name -> URL; a :class:`PostgresBroker` is made for each, with ``options``.
      routes: queue name -> database name.
      default: the database of every queue without a route (``None``: such a queue is an error).
      brokers: database name -> a :class:`PostgresBroker` of yours, instead of ``urls``.
      middleware: as Dramatiq's (``None``: its default middleware).
      options: for every :class:`PostgresBroker` made from ``urls`` (schema, lease_seconds, ...).
    """

    def __init__(
        self,
        urls: Mapping[str, str] | None = None,
        *,
        routes: Mapping[str, str] | None = None,
        default: str | None = None,
        brokers: Mapping[str, PostgresBroker] | None = None,
        middleware: list[Any] | None = None,
        relay_poll: float = RELAY_POLL,
        **options: Any,
    ) -> None:
        if (urls is None) == (brokers is None):
            raise TypeError("RoutedBroker takes urls= or brokers=, one of them")
        if urls is not None:
            brokers = {name: PostgresBroker(url, middleware=[], **options) for name, url in urls.items()}
        assert brokers is not None
        if not brokers:
            raise RouteError("RoutedBroker needs at least one database")
        self.shards: dict[str, PostgresBroker] = dict(brokers)
        self.routes: dict[str, str] = dict(routes or {})
        self.default = default
        for queue, name in sorted(self.routes.items()):
            if name not in self.shards:
                raise RouteError(
                    f"queue {queue!r} is routed to database {name!r}, which is not one of {sorted(self.shards)}"
                )
        if default is not None and default not in self.shards:
            raise RouteError(f"the default database {default!r} is not one of {sorted(self.shards)}")
        super().__init__(middleware=middleware)
        self.logger = get_logger(__name__, type(self))
        self.queues: set[str] = set()
        self.relay_poll = relay_poll
        #: The database of the groups' barriers (groups.py): that of FencedGroupCallbacks' backend.
        self.group_home: str | None = None
        self.relay_conflicts = 0  #: messages this process's relays moved and their database refused
        self._relays: dict[str, Relay] = {}
        self._relays_lock = threading.Lock()
        #: Schedules (``@schedule`` or ``broker.schedules.add``), each kept with its queue's database.
        self.schedules: Schedules = RoutedSchedules(self)
        for shard in self.shards.values():
            # Every hook goes to the middleware the worker sees (the router's), with the router.
            shard.emit_before = self.emit_before  # type: ignore[method-assign]
            shard.emit_after = self.emit_after  # type: ignore[method-assign]
            shard.emit_for_each = self.emit_for_each  # type: ignore[method-assign]
            # The Results middleware is the router's: the exception that rides a nack is found there.
            shard.stored_exception = self.stored_exception  # type: ignore[method-assign]
        self.add_middleware(UniqueMessages())
        self.add_middleware(FencedDelivery())

    def add_middleware(self, middleware: Any, **where: Any) -> None:
        """Dramatiq's, keeping :class:`FencedDelivery` last (as :meth:`PostgresBroker.add_middleware`)."""
        super().add_middleware(middleware, **where)
        if isinstance(middleware, FencedGroupCallbacks):
            self.group_home = self.home_of(middleware.rate_limiter_backend)
        fenced = [m for m in self.middleware if isinstance(m, FencedDelivery)]
        if fenced and self.middleware[-1] is not fenced[-1]:
            self.middleware.remove(fenced[-1])
            self.middleware.append(fenced[-1])

    # -- routing ----------------------------------------------------------------
    def database_of(self, queue_name: str) -> str:
        """The name of the database *queue_name* lives in; :class:`RouteError` if none."""
        if queue_name == groups.COUNTDOWN_QUEUE and self.group_home is not None:
            return self.group_home
        name = self.routes.get(queue_name, self.default)
        if name is None:
            raise RouteError(
                f"queue {queue_name!r} has no route and the broker has no default database: add it to routes= "
                f"(one of {sorted(self.shards)}) or give default="
            )
        return name

    def home_of(self, backend: Any) -> str | None:
        """The database a rate-limiter backend keeps its keys in, if it is one of ours (with its schema)."""
        if isinstance(backend, RateLimiterBackend):
            for name, shard in self.shards.items():
                if backend.database is shard.database and backend.schema == shard.schema:
                    return name
        return None

    def shard(self, queue_name: str) -> PostgresBroker:
        """The broker of the database *queue_name* lives in."""
        return self.shards[self.database_of(queue_name)]

    def _of(self, message: Any) -> PostgresBroker:
        return self.shard(message.queue_name)

    def _running(self) -> PostgresBroker:
        """The shard of the delivery running on this thread (the default's, or the first, outside one)."""
        message = delivery.running()
        if message is not None:
            return self._of(message)
        return self.shards[self.default] if self.default is not None else next(iter(self.shards.values()))

    @property
    def settings(self) -> Any:
        """The settings of the default (or first) database (``interrupt_on_cancel`` for the middleware)."""
        return (self.shards[self.default] if self.default is not None else next(iter(self.shards.values()))).settings

    # -- Dramatiq's Broker API --------------------------------------------------
    def declare_actor(self, actor: Any) -> None:
        super().declare_actor(actor)
        for shard in self.shards.values():
            shard.actors[actor.actor_name] = actor  # unique keys, retries and priorities look actors up

    def declare_queue(self, queue_name: str) -> None:
        """Route the queue (a :class:`RouteError` now, at import, if it has no database); no I/O."""
        if queue_name not in self.queues:
            self.shard(queue_name).declare_queue(queue_name)  # its hooks are the router's
            self.queues.add(queue_name)

    def get_declared_queues(self) -> set[str]:
        return self.queues.copy()

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Into the queue's database (a delivery's follow-up: into the delivery's, with its outcome,
        then relayed)."""
        return self._of(message).enqueue(message, delay=delay)

    def enqueue_many(self, messages: Any, *, delay: int | None = None) -> list[Message]:
        """Each database's messages in one statement there (see :meth:`PostgresBroker.enqueue_many`)."""
        messages = list(messages)
        by_shard: dict[str, list[int]] = {}
        for i, m in enumerate(messages):
            by_shard.setdefault(self.database_of(m.queue_name), []).append(i)
        out: list[Message] = list(messages)
        for name, indexes in by_shard.items():
            sent = self.shards[name].enqueue_many([messages[i] for i in indexes], delay=delay)
            for i, m in zip(indexes, sent, strict=True):
                out[i] = m
        return out

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> PostgresConsumer:
        """The queue's consumer, on its database; starts this process's relays."""
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)
        consumer = self.shard(queue_name).consume(queue_name, prefetch, timeout)
        self.start_relays()
        return consumer

    def start_scheduler(self) -> bool:
        """Run the scheduler of every database with schedules (see :meth:`PostgresBroker.start_scheduler`)."""
        return any([shard.start_scheduler() for shard in self.shards.values() if shard.run_schedules])

    def flush(self, queue_name: str) -> None:
        self.shard(queue_name).flush(queue_name)

    def flush_all(self) -> None:
        for name, shard in self.shards.items():
            mine = sorted(q for q in self.queues if self.database_of(q) == name)
            if mine:
                shard.flush_queues(mine)

    def join(self, queue_name: str, *, timeout: int | None = None, fail_fast: bool = True, interval: int = 20) -> None:
        """As :meth:`PostgresBroker.join`, on the queue's database, once its outbox rows elsewhere moved,
        and the groups' countdown rows too (a completion for this queue may wait behind one)."""
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        target = self.database_of(queue_name)
        home = self.group_home
        while True:
            for shard in self.shards.values():
                shard.flush_outcomes(timeout=1.0)
            waiting = any(self._outbox(name, [queue_name]) for name in self.shards if name != target)
            if not waiting and home is not None:
                waiting = any(self._outbox(name, [groups.COUNTDOWN_QUEUE]) for name in self.shards if name != home)
            if not waiting:
                break
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)
        left = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        self.shards[target].join(queue_name, timeout=left, fail_fast=fail_fast, interval=interval)

    def _outbox(self, name: str, queues: list[str], *, running: bool = False) -> int:
        """How many rows of *queues* wait in database *name*'s outbox (*running*: or run there still)."""
        shard = self.shards[name]
        statement = shard.statements.relay_left if running else shard.statements.relay_waiting
        row = shard.database.run(lambda c: c.execute(statement, [queues]).fetchone())
        return int(row[0]) if row else 0

    def close(self) -> None:
        with self._relays_lock:
            relays, self._relays = list(self._relays.values()), {}
        for relay in relays:
            relay.halt()
        deadline = time.monotonic() + 10.0
        for relay in relays:
            relay.stop(max(deadline - time.monotonic(), 0.0))
        for shard in self.shards.values():
            shard.close()

    # -- what the middleware, the backends and actors ask ------------------------
    def check_startup(self) -> None:
        for shard in self.shards.values():
            shard.check_startup()

    def migrate(self) -> dict[str, list[int]]:
        """Migrate every database; the versions applied, per database."""
        return {name: shard.migrate() for name, shard in self.shards.items()}

    def why_not_start(self, message: PostgresMessageProxy) -> str | None:
        return self._of(message).why_not_start(message)

    def release_unstarted(self) -> int:
        return sum(shard.release_unstarted() for shard in self.shards.values() if shard._parts is not None)

    @property
    def interrupter(self) -> Interrupter:
        return self._running().interrupter

    def holds(self, message: Any) -> bool:
        return self._of(message).holds(message)

    def submit_result(self, message: PostgresMessageProxy, write: Any) -> None:
        self._of(message).submit_result(message, write)

    def stored_exception(self, message: PostgresMessageProxy) -> Any:
        """As :meth:`PostgresBroker.stored_exception`, for a :class:`RoutedResultBackend` on this router."""
        if not message.failed:
            return None
        for m in self.middleware:
            backend = getattr(m, "backend", None)
            if isinstance(m, Results) and isinstance(backend, RoutedResultBackend):
                store, ttl = m._lookup_options(self, message)
                if not store:
                    return None
                message.exception_stored = True
                return backend.of(message).exception_write(message, message.exception or Exception("unknown"), ttl)
        return None

    def countdown(self, message: PostgresMessageProxy, key: str, ttl: int, completions: list[Message]) -> bool:
        """Tie a group member's countdown to its ack (see :mod:`.groups`): in the home, as with one
        database; elsewhere, a countdown row in its ack's transaction, relayed to the home."""
        if self.group_home is None:
            return False
        member = self._of(message)
        if member is self.shards[self.group_home]:
            return member.countdown(message, key, ttl, completions)
        if delivery.deferring() is not message:
            return False
        message.ack_sends.append(member.row(groups.countdown_message(message, key, ttl, completions), None))
        return True

    def flush_outcomes(self, timeout: float | None = None) -> bool:
        return all(shard.flush_outcomes(timeout) for shard in self.shards.values())

    def fence(self) -> Fence:
        return self._running().fence()

    @contextmanager
    def fenced_transaction(self, conn: psycopg.Connection | None = None) -> Iterator[psycopg.Connection]:
        """The running delivery's (see :meth:`PostgresBroker.fenced_transaction`): on its database."""
        with self._running().fenced_transaction(conn) as c:
            yield c

    @contextmanager
    def with_ack(self) -> Iterator[None]:
        with self._running().with_ack():
            yield

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Sends wait until the block ends, then go in one statement per database."""
        with ExitStack() as stack:
            for shard in self.shards.values():
                stack.enter_context(shard.batch())
            yield

    @contextmanager
    def transaction(self, conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
        """Sends inside are written on *conn*, in your transaction (the outbox pattern), whatever their
        queue: one of another database is relayed there once your transaction commits, provided
        *conn* is a connection to one of this broker's databases (with its schema)."""
        with ExitStack() as stack:
            for shard in self.shards.values():
                stack.enter_context(shard.transaction(conn))
            yield conn

    def stats(self) -> dict[str, Any]:
        """Per database: :meth:`PostgresBroker.stats`, its routes and the relayed messages it refused
        (``relay_conflicts``, ever); and this process's relays' refusals (``process``)."""
        out: dict[str, Any] = {}
        for name, shard in self.shards.items():
            figures = shard.stats()
            figures["routes"] = sorted(q for q in self.queues | set(self.routes) if self.database_of(q) == name)
            # Moved here from other databases and refused (their id or unique key taken), ever.
            figures["relay_conflicts"] = int(figures["totals"].get("relay_conflicts", 0))
            out[name] = figures
        return {"databases": out, "process": {"relay_conflicts": self.relay_conflicts}}

    def cancel(self, message_id: str, *, seen: str | None = None) -> Any:
        """Cancel a message, wherever it lives (each database is asked in turn until one has it)."""
        outcome = None
        for shard in self.shards.values():
            outcome = shard.cancel(message_id, seen=seen)
            if outcome.value != "not_found":
                return outcome
        return outcome

    def inspect(self, message_id: str) -> dict[str, Any] | None:
        """The message as its database has it, with a ``database`` key; ``None`` if none has it."""
        for name, shard in self.shards.items():
            found = shard.inspect(message_id)
            if found is not None:
                return {**found, "database": name}
        return None

    def move_queue(
        self, queue_name: str, *, timeout: float = 600.0, interval: float = 0.2, keep_paused: bool = True
    ) -> int:
        """Finish moving *queue_name* to the database its route now names; returns the rows moved here.

        After a route changed (deploy the new ``routes=`` to producers and workers; processes of the
        old configuration may still run meanwhile), the queue's rows in its old databases are an
        outbox, which relays move anyway.  This makes it complete: it pauses the queue in every
        other database (workers of the old configuration stop claiming it there, the ones they run
        finish there, fenced as always, and a retry comes back as a queued row there, to be moved;
        their relays move nothing into a paused queue, so rows stop going back), moves the queued
        and delayed rows (each inserted once, see :meth:`relay`), and waits until no row of the
        queue is queued or running anywhere else.  The pauses stay (*keep_paused*) while processes
        of the old configuration may run: resume the queue there once they are gone (or never: it
        no longer lives there).  Dead letters and cancelled messages stay where they are (a
        re-drive there queues them, to be moved).  :class:`~dramatiq.errors.QueueJoinTimeout` after
        *timeout* seconds (run it again).
        """
        target = self.database_of(queue_name)
        others = [name for name in self.shards if name != target]
        for name in others:
            self.shards[name].pause(queue_name, create=True)
        deadline = time.monotonic() + timeout
        moved = 0
        while True:
            for name in others:
                moved += self.relay(name, queues=[queue_name])
            if not any(self._outbox(name, [queue_name], running=True) for name in others):
                break
            if time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval)
        if not keep_paused:
            for name in others:
                self.shards[name].resume(queue_name)
        return moved

    def metrics_registry(self) -> Any:
        """A Prometheus registry with every database's queue figures (:mod:`.metrics`), each sample
        labelled with its ``database``; serve it with ``metrics.exposition(registry)``."""
        from .metrics import databases_registry

        return databases_registry(self)

    # -- the relays ---------------------------------------------------------------
    def foreign_queues(self, name: str) -> list[str]:
        """The queues whose rows do not belong in database *name* (routed elsewhere; with the countdown
        rows of group members, outside the groups' home)."""
        queues = self.queues | set(self.routes)
        if self.group_home is not None:
            queues.add(groups.COUNTDOWN_QUEUE)
        return sorted(q for q in queues if self.database_of(q) != name)

    def _paused_in_their_databases(self, queues: list[str]) -> set[str]:
        """Of *queues*, those paused in the database they are routed to: nothing is moved into a paused
        queue (what :meth:`move_queue` relies on while processes of an older configuration, which route
        the queue back, still run)."""
        by_target: dict[str, list[str]] = {}
        for q in queues:
            by_target.setdefault(self.database_of(q), []).append(q)
        paused: set[str] = set()
        for target, mine in by_target.items():
            shard = self.shards[target]
            with shard.database.connection() as conn:
                paused.update(str(r[0]) for r in conn.execute(shard.statements.paused_among, [mine]))
        return paused

    def start_relays(self) -> None:
        """This process's relay of each database (once; after a fork, afresh)."""
        with self._relays_lock:
            for name in self.shards:
                relay = self._relays.get(name)
                if relay is None or not relay.alive():
                    relay = self._relays[name] = Relay(self, name)
                    relay.start()

    def relay(self, name: str, limit: int = RELAY_BATCH, *, queues: list[str] | None = None) -> int:
        """Move one batch of database *name*'s outbox (of *queues* only, if given) to the queues'
        databases; returns how many moved."""
        source = self.shards[name]
        foreign = self.foreign_queues(name) if queues is None else [q for q in queues if self.database_of(q) != name]
        foreign = [q for q in foreign if q not in self._paused_in_their_databases(foreign)]
        if not foreign:
            return 0
        stmts = source.statements
        with source.database.connection() as conn, conn.transaction():
            rows = conn.execute(stmts.relay_take, {"queues": foreign, "limit": limit}).fetchall()
            if not rows:
                return 0
            by_target: dict[str, list[tuple[Any, ...]]] = {}
            for row in rows:
                by_target.setdefault(self.database_of(row[1]), []).append(row)
            for target_name, moved in by_target.items():
                target = self.shards[target_name]
                countdowns = [r for r in moved if r[1] == groups.COUNTDOWN_QUEUE]
                if countdowns:  # applied at the groups' home, not inserted
                    _, bad = groups.count_down_at_home(target, name, countdowns)
                    for row, why in bad:
                        self._refuse(conn, source, name, row, why)
                messages = [r for r in moved if r[1] != groups.COUNTDOWN_QUEUE]
                if not messages:
                    continue
                columns = [list(c) for c in zip(*messages, strict=True)]
                with target.database.connection() as there:  # autocommit: the statement is its transaction
                    put = there.execute(target.statements.relay_put, [*columns, name, target.channel, target.listen])
                    refused = (put.fetchone() or (0, 0, []))[2]
                for message_id in refused:
                    self.relay_conflicts += 1
                    self.logger.warning(
                        "Message %s, relayed from database %r, was not inserted in %r: a message with its id is "
                        "there already, or another holds its unique key (counted in relay_conflicts).",
                        message_id,
                        name,
                        target_name,
                    )
            # Only now do the rows leave here: a failure before this commit moves them again, and the
            # relayed table there makes that insert nothing.
        return len(rows)

    def _refuse(
        self, conn: psycopg.Connection, source: PostgresBroker, name: str, row: tuple[Any, ...], why: str
    ) -> None:
        """Dead-letter in *source* (in the relay's transaction there, *conn*) an outbox row its target
        cannot take, and count it with the conflicts: a relay that failed on it would fail again at
        every turn and hold up every row behind it."""
        conn.execute(
            source.statements.relay_dead,
            {"id": row[0], "queue": row[1], "actor": row[2], "priority": row[3], "payload": row[5], "error": why},
        )
        self.relay_conflicts += 1
        self.logger.error(
            "Message %s of database %r was dead-lettered there: %s (counted in relay_conflicts).", row[0], name, why
        )


class RoutedResultBackend(ResultBackend):
    """Dramatiq's results over a :class:`RoutedBroker`: a message's result is kept in the database of
    its queue, fenced and written with its ack there as with one database (a
    :class:`~.results.PostgresBackend` per database, on its shard); ``get_result`` reads it there.

    ::

        backend = RoutedResultBackend(broker)
        broker.add_middleware(Results(backend=backend))
    """

    def __init__(self, router: RoutedBroker, **options: Any) -> None:
        from .results import PostgresBackend, WritePendingResults

        super().__init__()
        self.router = router
        self.backends = {name: PostgresBackend(broker=shard, **options) for name, shard in router.shards.items()}
        # Writes a delivery's pending result before it sends a follow-up (per thread: one is enough).
        router.add_middleware(WritePendingResults(next(iter(self.backends.values()))))

    def of(self, message: Any) -> Any:
        """The backend of *message*'s queue's database."""
        return self.backends[self.router.database_of(message.queue_name)]

    def get_result(self, message: Any, *, block: bool = False, timeout: int | None = None) -> Any:
        return self.of(message).get_result(message, block=block, timeout=timeout)

    def store_result(self, message: Any, result: Any, ttl: int) -> None:
        self.of(message).store_result(message, result, ttl)

    def store_exception(self, message: Any, exception: Exception, ttl: int) -> None:
        self.of(message).store_exception(message, exception, ttl)

    def _get(self, message_key: str) -> Any:
        for backend in self.backends.values():
            data = backend._get(message_key)
            if data is not Missing:
                return data
        return Missing

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()


class RoutedSchedules(Schedules):
    """``router.schedules``: each schedule goes to the registry of its queue's database, whose
    scheduler ticks it there, exactly once (see :mod:`.schedules`); names are unique across all."""

    def __init__(self, router: RoutedBroker) -> None:
        super().__init__(lookup=router.actors.get)
        self.router = router

    def add(self, actor: Any, cron: str | None = None, **options: Any) -> Schedule:
        actor_name, queue_name = self._actor(actor)
        name = options.get("name") or actor_name
        if self.get(name) is not None:
            raise ValueError(f"schedule {name!r} is declared twice; give the second one a name of its own (name=...)")
        scheduled = self.router.shard(queue_name).schedules.add(actor, cron, **options)
        self._by_name[scheduled.name] = scheduled
        return scheduled

    def remove(self, name: str) -> None:
        scheduled = self._by_name.pop(name)
        self.router.shard(scheduled.queue_name).schedules.remove(name)


class Relay:
    """One process's relay of one database's outbox (see :meth:`RoutedBroker.relay`): a daemon thread
    woken by the doorbell as a row of a foreign queue commits there, at once, in the process that
    listens for its set of queues (turns.py: one at a time; the relays share the rows with ``SKIP LOCKED``).

    Its idle look (every ``relay_poll`` seconds: the paused queues, then the outbox) is a safety net
    for a lost ring, and is taken in turns (turns.py): the listening processes take seats in the
    :data:`RELAY_GROUP` of the database, and only the one on duty looks, so the idle cost of the
    relays no longer grows with processes.  While its turns are unknown (not listening yet, LISTEN
    lost, ``listen=False``) a relay looks every ``relay_poll`` seconds, as each did before turns.
    """

    def __init__(self, router: RoutedBroker, name: str) -> None:
        self.router = router
        self.name = name
        self.shard = router.shards[name]
        self.pid = os.getpid()
        self.moved = 0  #: rows this relay moved
        self.looks = 0  #: idle looks (a pass no ring asked for)
        #: When (wall clock) its last idle looks were decided: for operators and tests.
        self.looked_at: deque[float] = deque(maxlen=256)
        self._turns: turns.Turns | None = None
        self._purged = -RELAYED_PURGE_EVERY
        self._event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"dramatiq-pg-relay-{name}", daemon=True)

    def start(self) -> None:
        if self.shard.listen:
            parts = self.shard.parts
            parts.turns.join(RELAY_GROUP)
            self._turns = parts.turns
            doorbell = self.shard.database.doorbell(self.shard.channel, timed=True)
            doorbell.attend(parts.turns)  # its seats are taken on the LISTEN connection (once per process)
            for queue in self.router.foreign_queues(self.name):
                doorbell.subscribe(queue, event=self._event)
        self._thread.start()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def halt(self) -> None:
        """Ask the thread to end after its current pass, without waiting for it."""
        self._stopped = True
        self._event.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread and wait (at most *timeout* seconds) for a pass under way, which would
        otherwise go on on a closed database and open a pool of its own again."""
        self.halt()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _purge(self) -> None:
        """Old ``relayed`` rows of this relay's database go (every :data:`RELAYED_PURGE_EVERY` seconds)."""
        now = time.monotonic()
        if now - self._purged < RELAYED_PURGE_EVERY:
            return
        self._purged = now
        keep = max(RELAYED_KEEP, self.shard.dead_message_ttl)
        with self.shard.database.connection() as conn:
            conn.execute(self.shard.statements.relay_purge, [keep])

    def until_look(self) -> float:
        """Seconds until this relay's next idle look may be due: its next point on duty, looked at again
        after at most one duty window (who is on duty may change meanwhile)."""
        every = self.router.relay_poll
        if self._turns is None:
            return every
        return max(0.0, min(self._turns.next_turn("relay", every, group=RELAY_GROUP), turns.DUTY))

    def on_duty(self, at: float) -> bool:
        """Is the idle look at wall-clock time *at* this process's (yes while its turns are unknown)?"""
        if self._turns is None:
            return True
        return self._turns.on_duty(self.router.relay_poll, at, group=RELAY_GROUP)

    def _pass(self) -> None:
        while (moved := self.router.relay(self.name)) > 0:
            self.moved += moved
            if moved < RELAY_BATCH:
                break
        self._purge()

    def _run(self) -> None:
        failing = False
        look = True  # the first pass: whatever waits already
        while not self._stopped:
            wait = self.until_look()
            if look:
                try:
                    self._pass()
                    if failing:
                        self.router.logger.info("The relay of database %r works again.", self.name)
                    failing = False
                except (psycopg.Error, ConnectionClosed) as e:
                    if not failing:
                        self.router.logger.warning(
                            "The relay of database %r failed (%s); it tries again.", self.name, e
                        )
                    failing, wait = True, RETRY_INTERVAL
                except Exception:
                    self.router.logger.exception("The relay of database %r failed; it tries again.", self.name)
                    failing, wait = True, RETRY_INTERVAL
            rang = self._event.wait(wait)
            self._event.clear()
            at = time.time()
            look = rang or failing or self.on_duty(at)
            if look and not rang and not failing:
                self.looks += 1
                self.looked_at.append(at)


__all__ = [
    "RELAYED_KEEP",
    "RELAY_GROUP",
    "RoutedResultBackend",
    "RELAY_BATCH",
    "RELAY_POLL",
    "Relay",
    "RouteError",
    "RoutedBroker",
    "RoutedSchedules",
]
