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
database: it looks at them and makes sure the commits that wrote them are on disk (an ack commits
asynchronously by default; moved before its flush and undone by a crash, its delivery would run
again and send the row twice: ``relay_look`` in db/queries/ forces the flush with a durable write if the
WAL writer has not flushed them yet), takes them (``FOR UPDATE SKIP LOCKED``, at the version it
looked at), inserts them there (durably, each with its attempt number, lost deliveries, last error
and send time: a move never lowers an attempt), where a row of the
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

**Sends inside a transaction** (``fenced_transaction()``, ``transaction(conn)``, the framework
integrations' blocks, and the transaction a database's broker joins by default: Django's
``transaction.atomic()`` on a ``DjangoPostgresBroker``'s database) go to the transaction's database
whatever their queue's: a foreign queue's message is an outbox row of that transaction, relayed once
it committed (see :mod:`.sends`).

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

import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import psycopg
from dramatiq.broker import Broker
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.logging import get_logger
from dramatiq.message import Message
from dramatiq.results import Results

from ..broker import PostgresBroker
from ..core import delivery
from ..core.consumer import PostgresConsumer
from ..core.delivery import PostgresMessageProxy
from ..core.interrupt import Interrupter
from ..errors import describe_failure
from ..features.exactly_once import Fence
from ..features.rate_limits import FencedGroupCallbacks
from ..features.rate_limits import PostgresBackend as RateLimiterBackend
from ..features.schedules import Schedules
from ..hooks import SkipNoopHooks
from ..middleware import FencedDelivery
from ..ops import finding
from ..sending.unique import UniqueMessages
from . import groups
from .backends import RoutedResultBackend, RoutedSchedules
from .relay import RELAY_BATCH, RELAY_GROUP, RELAY_POLL, RELAYED_KEEP, Relay, RelayMethods
from .sends import OpenTransactions


class RouteError(ValueError):
    """A route names a database the broker does not have, or a queue has no route and no default."""


class RoutedBroker(RelayMethods, SkipNoopHooks, Broker):
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
        #: The database whose transaction this thread's sends are written in, if one is open (routed_sends.py).
        self.open_transactions = OpenTransactions(self.shards, RouteError)
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
        then relayed; inside :meth:`transaction` or :meth:`fenced_transaction`: into that transaction's
        database, on its connection, then relayed, see :mod:`.routed_sends`)."""
        if not isinstance(message, PostgresMessageProxy):
            if (open_ := self.open_transactions.open()) is not None:
                return open_.enqueue(message, delay=delay)
            if (joined := self._joined()) is not None:
                with self.transaction(joined[1], database=joined[0], block="transaction.atomic()"):
                    return self.enqueue(message, delay=delay)
        return self._of(message).enqueue(message, delay=delay)

    def enqueue_many(self, messages: Any, *, delay: int | None = None) -> list[Message]:
        """Each database's messages in one statement there (see :meth:`PostgresBroker.enqueue_many`);
        inside :meth:`transaction` or :meth:`fenced_transaction`, all in that transaction."""
        if (open_ := self.open_transactions.open()) is not None:
            return open_.enqueue_many(messages, delay=delay)
        if (joined := self._joined()) is not None:
            with self.transaction(joined[1], database=joined[0], block="transaction.atomic()"):
                return self.enqueue_many(messages, delay=delay)
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

    def _joined(self) -> tuple[str, psycopg.Connection] | None:
        """The database, and connection, of the transaction a send made now joins by default, if one is
        open: the first database whose broker names one (:meth:`PostgresBroker.joined_transaction`:
        Django's atomic block on its database), whatever the message's queue (one of another database
        is then an outbox row of it).  Not inside ``with_ack()`` or ``batch()``: they decide."""
        if delivery.tied_sends() is not None or any(s._local.batch is not None for s in self.shards.values()):
            return None
        for name, shard in self.shards.items():
            if (conn := shard.joined_transaction(quiet=True)) is not None:
                return name, conn
        return None

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

    def _name(self, shard: PostgresBroker) -> str:
        return next(name for name, s in self.shards.items() if s is shard)

    def fence(self) -> Fence:
        """The running delivery's fence (for the framework integrations); the connection it begins on is
        then known to be in the delivery's database (:meth:`transaction` on it opens that one)."""
        shard = self._running()
        return self.open_transactions.fence(shard.fence(), self._name(shard))

    @contextmanager
    def fenced_transaction(self, conn: psycopg.Connection | None = None) -> Iterator[psycopg.Connection]:
        """The running delivery's (see :meth:`PostgresBroker.fenced_transaction`): on its database.
        Every send inside is a row of the block, a queue's of another database too (an outbox row,
        relayed once the block committed: :mod:`.routed_sends`)."""
        shard = self._running()
        with shard.fenced_transaction(conn) as c, self.open_transactions.opened(self._name(shard)):
            yield c

    @contextmanager
    def with_ack(self) -> Iterator[None]:
        """The running delivery's (see :meth:`PostgresBroker.with_ack`); refused inside :meth:`transaction`."""
        with (self.open_transactions.open() or self._running()).with_ack():
            yield

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Sends wait until the block ends, then go in one statement per database."""
        with ExitStack() as stack:
            for shard in self.shards.values():
                stack.enter_context(shard.batch())
            yield

    @contextmanager
    def transaction(
        self, conn: psycopg.Connection, *, block: str = "", database: str | None = None
    ) -> Iterator[psycopg.Connection]:
        """Sends inside are written on *conn*, in your transaction (the outbox pattern), whatever their
        queue: one of another database is an outbox row there, relayed to its database once your
        transaction commits (:mod:`.routed_sends`).  *conn* must be connected to one of this broker's
        databases (with its schema): *database*, its name, or read from *conn* once per connection
        (:class:`RouteError` if it is none of them).  *block*: as :meth:`PostgresBroker.transaction`'s."""
        if database is None:
            database = self.open_transactions.database_of(conn)
        elif database not in self.shards:
            raise RouteError(f"database {database!r} is not one of {sorted(self.shards)}")
        with self.shards[database].transaction(conn, block=block), self.open_transactions.opened(database):
            yield conn

    def stats(self) -> dict[str, Any]:
        """Per database: :meth:`PostgresBroker.stats`, its routes and the relayed messages it refused
        (``relay_conflicts``, ever); this process's relays' refusals (``process``); and the databases
        that did not answer (``unreachable``, skipped: the others' figures are still given)."""
        out: dict[str, Any] = {}
        away: list[str] = []
        for name, shard in self.shards.items():
            try:
                figures = shard.stats()
            except Exception as e:
                if not finding.unreachable(e):
                    raise
                self.logger.warning("Database %r did not answer: %s", name, describe_failure(e))
                away.append(name)
                continue
            figures["routes"] = sorted(q for q in self.queues | set(self.routes) if self.database_of(q) == name)
            # Moved here from other databases and refused (their id or unique key taken), ever.
            figures["relay_conflicts"] = int(figures["totals"].get("relay_conflicts", 0))
            out[name] = figures
        return {"databases": out, "process": {"relay_conflicts": self.relay_conflicts}, "unreachable": away}

    def _sites(self) -> list[Any]:
        from ..ops.fleet import Fleet

        return Fleet.of(self).sites

    def cancel(self, message_id: str, *, seen: str | None = None) -> Any:
        """Cancel a message wherever it lives, in flight between two databases included (a relay's
        move is waited for: :func:`.finding.cancel`).  A database that does not answer is skipped;
        :class:`~.finding.Unreachable`, naming it, when none of the others has the message."""
        return finding.cancel(self._sites(), message_id, seen=seen).checked(message_id)

    def inspect(self, message_id: str) -> dict[str, Any] | None:
        """The message as its database has it, with a ``database`` key; ``None`` if none has it.  A
        database that does not answer is skipped; :class:`~.finding.Unreachable`, naming it, when
        none of the others has the message."""
        found = finding.locate(self._sites(), message_id).checked(message_id)
        if found.site is None or found.info is None:
            return None
        return {**found.info, "database": found.site.name}

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
        from ..ops.metrics import databases_registry

        return databases_registry(self)

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
