"""Dramatiq rate limiters, barriers and group callbacks on PostgreSQL.

``PostgresBackend`` is a ``RateLimiterBackend``, so Dramatiq's
``ConcurrentRateLimiter``, ``WindowRateLimiter``, ``BucketRateLimiter``,
``Barrier`` and the ``GroupCallbacks`` middleware work with no Redis::

    from dramatiq.middleware import GroupCallbacks
    from dramatiq.rate_limits import ConcurrentRateLimiter
    from dramatiq_pg_fenced import rate_limits

    backend = rate_limits.PostgresBackend(broker=broker)  # or PostgresBackend(url)
    broker.add_middleware(GroupCallbacks(backend))
    mutex = ConcurrentRateLimiter(backend, "reports", limit=1)

Keys live in ``{schema}.rate_limit`` with an expiry (``ttl``, in ms); an
expired key counts as absent, as in Redis.  Every operation is one atomic
statement (``INSERT ... ON CONFLICT`` or a conditional ``UPDATE``), except
``incr_and_sum``, which locks all the keys it sums in one order inside one
transaction.  ``wait_notify`` records an event that lives for its ``ttl``
(so a late ``wait`` still sees it, like Redis's list) and NOTIFYs the key;
``wait`` listens, with a polling fallback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from threading import Event
from typing import Any

import psycopg
from dramatiq.message import Message
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits import RateLimiterBackend
from psycopg_pool import ConnectionPool

from ..config import (
    DEFAULT_BACKEND_POOL_MAX_SIZE,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_PURGE_INTERVAL,
    DEFAULT_SCHEMA,
)
from ..core.delivery import PostgresMessageProxy, write_pending
from ..core.maintenance import PurgeSchedule
from ..db.database import Database
from ..db.doorbell import poll_pauses
from ..db.statements import BIGINT_MAX, BIGINT_MIN, check_schema, rate_limits_channel, statements
from .host import HostBroker


class _Changed(Exception):
    """A key vanished between creating and locking it (purged): start the transaction again."""


class PostgresBackend(RateLimiterBackend):
    """A Dramatiq rate-limiter backend on PostgreSQL.

    Parameters:
      url: libpq connection string or URL (``None``: libpq's defaults).
      pool: a ``psycopg_pool.ConnectionPool`` of autocommit connections you own.
      schema: where the tables live (migration 002); defaults to the
        broker's, else ``"dramatiq"``.
      broker: a :class:`PostgresBroker` whose pool to share (when in its schema).
      listen: ``False`` turns LISTEN off, and prepared statements in a pool
        made from ``url`` (PgBouncer transaction pooling); ``wait`` then polls.
        Defaults to the broker's setting.
      poll_interval: seconds between re-reads in ``wait``.
      purge_interval: seconds between purges of expired keys, per process.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        broker: HostBroker | None = None,
        listen: bool | None = None,
        poll_interval: float | None = None,
        purge_interval: float = DEFAULT_PURGE_INTERVAL,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        pool_max_size: int = DEFAULT_BACKEND_POOL_MAX_SIZE,
    ) -> None:
        if broker is not None:
            schema = broker.schema if schema is None else schema
            listen = broker.listen if listen is None else listen
            poll_interval = broker.poll_interval if poll_interval is None else poll_interval
        self.schema = check_schema(schema or DEFAULT_SCHEMA)
        self.listen = True if listen is None else listen
        self.poll_interval = float(poll_interval or DEFAULT_POLL_INTERVAL)
        self.channel = rate_limits_channel(self.schema)
        self.statements = statements(self.schema)
        shared = broker if broker is not None and broker.schema == self.schema else None
        if broker is not None and shared is None and url is None and pool is None:
            url = broker.url  # same database, another schema: a pool of our own
        self._owns_database = shared is None
        self.database = (
            shared.database
            if shared is not None
            else Database(
                url,
                pool=pool,
                schema=self.schema,
                connect_timeout=connect_timeout,
                pool_max_size=pool_max_size,
                prepare=self.listen,  # listen=False: maybe behind a transaction pooler
                name="rate-limits",
            )
        )
        self._purges = PurgeSchedule(self.database, self.statements.rate_limit_purge, purge_interval)

    def _one(self, statement: bytes, params: Any) -> Any:
        self._purges.maybe()
        with self.database.connection() as conn:
            return conn.execute(statement, params).fetchone()

    def add(self, key: str, value: int, ttl: int) -> bool:
        """Set *key* to *value* for *ttl* ms unless it exists (and has not expired)."""
        return self._one(self.statements.rate_limit_add, {"key": key, "value": value, "ttl": ttl}) is not None

    def incr(self, key: str, amount: int, maximum: int, ttl: int) -> bool:
        """Add *amount* unless the value would exceed *maximum*; the key then lives *ttl* ms."""
        return self._change(key, amount, BIGINT_MIN, maximum, ttl)

    def decr(self, key: str, amount: int, minimum: int, ttl: int) -> bool:
        """Subtract *amount* unless the value would fall below *minimum*; the key then lives *ttl* ms.

        A worker thread's pending result is written first: a group member
        counting itself done on a barrier must have its result visible.
        """
        write_pending()
        return self._change(key, -amount, minimum, BIGINT_MAX, ttl)

    def _change(self, key: str, delta: int, low: int, high: int, ttl: int) -> bool:
        # An absent key counts as 0: inserting *delta* is right only if delta
        # itself is in bounds; otherwise only an existing, live value can take it.
        statement = self.statements.rate_limit_upsert if low <= delta <= high else self.statements.rate_limit_update
        params = {"key": key, "delta": delta, "low": low, "high": high, "ttl": ttl}
        return self._one(statement, params) is not None

    def incr_and_sum(self, key: str, keys: Callable[[], Iterable[str]], amount: int, maximum: int, ttl: int) -> bool:
        """Add *amount* to *key* unless it, or the sum over ``keys()`` plus *amount*, would exceed *maximum*.

        All the keys are locked (created as expired placeholders if new) in
        one order, so concurrent callers summing overlapping windows serialise
        and never both see room for the last slot.
        """
        summed = list(keys())
        wanted = sorted({key, *summed})
        self._purges.maybe()
        while True:
            try:
                with self.database.connection() as conn, conn.transaction():
                    return self._incr_and_sum(conn, key, summed, wanted, amount, maximum, ttl)
            except (_Changed, psycopg.errors.DeadlockDetected):
                continue

    def _incr_and_sum(
        self,
        conn: psycopg.Connection,
        key: str,
        summed: list[str],
        wanted: list[str],
        amount: int,
        maximum: int,
        ttl: int,
    ) -> bool:
        """One try, inside the caller's transaction (which holds the locks until it commits)."""
        conn.execute(self.statements.rate_limit_placeholders, [wanted])
        values: dict[str, int] = dict(conn.execute(self.statements.rate_limit_lock, [wanted]).fetchall())
        if len(values) != len(wanted):
            raise _Changed
        value = values[key] + amount
        if value > maximum or amount + sum(values[k] for k in summed) > maximum:
            return False
        conn.execute(self.statements.rate_limit_set, [value, ttl, key])
        return True

    def wait(self, key: str, timeout: int | None) -> bool:
        """Wait up to *timeout* ms (``None``: forever) for an event on *key*; ``True`` if there was one.

        An event notified earlier and not yet expired counts (as with Redis).
        """
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        doorbell = self.database.doorbell(self.channel) if self.listen else None
        pauses = poll_pauses(self.poll_interval, listening=doorbell is not None)
        with doorbell.waiting(key) if doorbell is not None else nullcontext(Event()) as event:
            while True:
                event.clear()
                if self._one(self.statements.rate_limit_event, [key]) is not None:
                    return True
                remaining = self.poll_interval if deadline is None else deadline - time.monotonic()
                if remaining <= 0:
                    return False
                event.wait(min(remaining, next(pauses)))

    def wait_notify(self, key: str, ttl: int) -> None:
        """Record an event on *key* for *ttl* ms and wake every ``wait`` on it, in any process."""
        self._one(self.statements.rate_limit_notify, {"key": key, "ttl": ttl, "channel": self.channel})

    def purge(self) -> int:
        """Delete expired keys in bounded batches; returns how many."""
        return self._purges.purge()

    def close(self) -> None:
        """Stop the listener and close the pool this backend made (not the broker's: it closes them)."""
        if self._owns_database:
            self.database.close()


class FencedGroupCallbacks(GroupCallbacks):
    """Dramatiq's ``GroupCallbacks``, with each member's countdown tied to its ack.

    With Dramatiq's own middleware a member counts its group's barrier down
    as soon as its actor returns, before its ack: a member redelivered after
    that (its worker paused past its lease, crashed before the ack) counts
    down twice, and the completion callbacks run early, or twice.  Here, for
    deliveries of a :class:`PostgresBroker` whose rate-limiter backend shares
    its database and schema, the countdown and the completion messages are
    written in the transaction of the member's ack, only if that ack applies:
    each member counts once, the completion is sent once.  Anything else is
    handled as Dramatiq does.  On a :class:`~.routing.RoutedBroker`, the backend's database is
    the groups' home, and members of other databases count down through their outbox
    (see :mod:`.groups`).
    """

    counts_with_the_ack = True  #: what ``FencedDelivery`` looks for at worker boot

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None, exception: Any = None) -> None:
        if exception is None and isinstance(message, PostgresMessageProxy) and self._shares(broker):
            key = message.options.get("group_completion_uuid")
            callbacks = message.options.get("group_completion_callbacks")
            if key and callbacks:
                completions: list[Message[Any]] = [Message(**callback) for callback in callbacks]
                if broker.countdown(message, key, self.barrier_ttl, completions):
                    return
        super().after_process_message(broker, message, result=result, exception=exception)

    def _shares(self, broker: Any) -> bool:
        backend = self.rate_limiter_backend
        home_of = getattr(broker, "home_of", None)  # a RoutedBroker: one of its databases (groups.py)
        if home_of is not None:
            return home_of(backend) is not None
        return (
            isinstance(backend, PostgresBackend)
            and getattr(broker, "database", None) is backend.database
            and getattr(broker, "schema", None) == backend.schema
        )


__all__ = ["FencedGroupCallbacks", "PostgresBackend"]
