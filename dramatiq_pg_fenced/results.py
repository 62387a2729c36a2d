"""Dramatiq results in PostgreSQL: a ``ResultBackend`` that needs no Redis.

One URL gives the broker, the results backend and group completion
callbacks::

    import dramatiq
    from dramatiq_pg_fenced.results import setup

    broker, backend = setup("postgresql://app@db/app", store_results=True)
    broker.migrate()  # or: dramatiq-pg-fenced migrate --url ...
    dramatiq.set_broker(broker)

    @dramatiq.actor
    def add(x, y):
        return x + y

    add.send(1, 2).get_result(block=True)  # 3

By hand, the same is::

    broker = PostgresBroker(url)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(GroupCallbacks(rate_limits.PostgresBackend(broker=broker)))
    broker.add_middleware(Results(backend=backend))  # after GroupCallbacks: see below

How it behaves, and why:

- Results live in ``{schema}.result`` with an expiry (the Results
  middleware's ``result_ttl``).  Expired rows read as missing, are deleted
  when read, and are purged in batches at most every ``purge_interval``
  seconds per process.
- ``get_result(block=True)`` waits on LISTEN/NOTIFY (one listening connection
  per process, the result key as payload) and re-reads at least every
  ``poll_interval`` seconds: a lost notification costs one interval, never a
  result.  Sub-second timeouts are respected.
- **Fencing.**  A message our broker delivered carries
  ``options["attempt"]``.  Its result is written only while its row is still
  held by that attempt (a stored exception: while that attempt's nack holds
  it), and a stored result is only ever replaced by the same or a later
  attempt.  A worker that lost its lease cannot overwrite the outcome of the
  current attempt; its write is logged and counted as a stale write.
- **With** ``broker=`` (the broker that runs the actors; it shares its pool):
  a result is handed to the broker's outcome writer and committed in the same
  transaction as the ack of its attempt, only if that ack applies.  A reader
  that sees the message finished sees its result, and a database outage
  delays both, losing neither.  Dramatiq stores a result *before* its
  middleware enqueues follow-ups (the next pipeline step, ``on_success``,
  group completion callbacks); when a follow-up is enqueued, the pending
  result is written first (fenced), so a follow-up always finds it, as with
  Redis.  So is it before a group member counts itself done on the group's
  barrier (a rate-limit ``decr``): with ``Results`` added after
  ``GroupCallbacks`` (as ``setup`` does; Dramatiq runs ``after_*`` hooks in
  reverse order, so the result is stored first), the completion callback
  runs only after every member's result is committed.  Stored exceptions (Dramatiq stores them after the nack, once
  retries are exhausted) go through the same writer right after the nack.
- Without ``broker=``, every write happens at once in the calling thread,
  with the same fence.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.errors import BrokerConnectionError, ConnectionClosed
from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware
from dramatiq.results import ResultBackend, ResultMissing, ResultTimeout
from dramatiq.results.backend import DEFAULT_TIMEOUT, Missing
from dramatiq.results.result import wrap_exception, wrap_result
from psycopg_pool import ConnectionPool, PoolTimeout

from . import migrations
from .broker import new_pool
from .consumer import PostgresMessageProxy
from .doorbell import Doorbell
from .errors import describe_failure, lost_connection
from .outcomes import Outcome, ResultWrite, describe
from .sql import check_schema, results_channel, statements

if TYPE_CHECKING:
    from .broker import PostgresBroker

DEFAULT_SCHEMA = "dramatiq"
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_PURGE_INTERVAL = 60.0
#: Rows deleted per purge statement (a purge runs a few of them).
PURGE_BATCH = 1000

logger = logging.getLogger(__name__)


class Connections:
    """Where a backend's queries go, and its listener.

    With a broker: the broker's pool (already per process and fork-safe).
    Otherwise a pool of our own (or the caller's), created lazily and again
    after ``fork``, like the broker's.  Also runs the periodic purge.
    """

    def __init__(
        self,
        *,
        url: str | None,
        pool: ConnectionPool | None,
        broker: PostgresBroker | None,
        schema: str,
        channel: str,
        listen: bool,
        connect_timeout: int,
        pool_max_size: int,
        purge_interval: float,
    ) -> None:
        self.url = url
        self.given_pool = pool
        self.broker = broker
        self.schema = schema
        self.channel = channel
        self.listen = listen
        self.connect_timeout = connect_timeout
        self.pool_max_size = pool_max_size
        self.purge_interval = purge_interval
        self._lock = threading.Lock()
        self._pid = -1
        self._pool: ConnectionPool | None = None
        self._listener: Doorbell | None = None
        self._checked = False
        self._next_purge = 0.0
        if broker is not None:
            broker._closing.append(self.close)  # nothing works on a closed broker's pool: stop with it

    @property
    def conninfo(self) -> str:
        if self.broker is not None:
            return self.broker.url
        if self.url is not None:
            return self.url
        if self.given_pool is not None:
            return str(self.given_pool.conninfo)
        return ""

    def _this_process(self) -> None:
        """After fork the parent's pool and listener are not ours (nor ours to close)."""
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    self._pool = self._listener = None
                    self._checked = False
                    # Processes started together (the dramatiq CLI) spread their purges out.
                    self._next_purge = time.monotonic() + random.random() * self.purge_interval
                    self._pid = os.getpid()

    def _own_pool(self) -> ConnectionPool:
        if self.given_pool is not None:
            return self.given_pool
        with self._lock:
            if self._pool is None:
                self._pool = new_pool(
                    self.url or "", max_size=self.pool_max_size, connect_timeout=self.connect_timeout, name=self.channel
                )
            return self._pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A pooled autocommit connection; connection failures raise Dramatiq's ``ConnectionClosed``."""
        if self.broker is not None:
            with self.broker._pool_connection() as conn:
                yield conn
            return
        self._this_process()
        try:
            with self._own_pool().connection() as conn:
                if not self._checked:
                    migrations.check(conn, self.schema)
                    self._checked = True
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            pool = self._pool  # ours, not a given one
            if pool is not None and lost_connection(e) and not isinstance(e, PoolTimeout):
                # As the broker does: the idle connections are probably broken too (server restart,
                # pg_terminate_backend); drop them now, not one failed call at a time after the return.
                with suppress(Exception):
                    pool.check()
            raise ConnectionClosed(describe_failure(e)) from None

    def listener(self) -> Doorbell | None:
        if not self.listen:
            return None
        self._this_process()
        with self._lock:
            if self._listener is None:
                self._listener = Doorbell(self.conninfo, self.channel, connect_timeout=self.connect_timeout)
            return self._listener

    def purge(self, statement: bytes) -> int:
        """Run a bounded-batch delete *statement* until it finds little left; returns rows deleted."""
        total = 0
        for _ in range(10):
            with self.connection() as conn:
                deleted = conn.execute(statement, [PURGE_BATCH]).rowcount
            total += max(deleted, 0)
            if deleted < PURGE_BATCH:
                break
        return total

    def maybe_purge(self, purge: Callable[[], int]) -> None:
        """Run *purge* in the background, at most once per ``purge_interval`` per process."""
        self._this_process()
        now = time.monotonic()
        if now < self._next_purge:
            return
        with self._lock:
            if now < self._next_purge:
                return
            self._next_purge = now + self.purge_interval

        def run() -> None:
            try:
                purge()
            except Exception as e:  # the next interval tries again
                logger.warning("Purge of expired rows failed: %s", e)

        threading.Thread(target=run, name="dramatiq-pg-purge", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            listener, pool = self._listener, self._pool
            self._listener = self._pool = None
            mine = self._pid == os.getpid()
        if mine and listener is not None:
            listener.stop()
        if mine and pool is not None:
            pool.close()


class PostgresBackend(ResultBackend):
    """A Dramatiq result backend that stores results in PostgreSQL.

    Parameters:
      url: libpq connection string or URL (``None``: libpq's defaults).
      pool: a ``psycopg_pool.ConnectionPool`` of autocommit connections you own.
      schema: where the tables live; the broker's schema (migration 002
        creates the ``result`` table next to the messages, whose rows fence
        the writes).  Defaults to the broker's, else ``"dramatiq"``.
      broker: the :class:`PostgresBroker` that runs the actors: share its pool
        and commit results with acks (see the module docstring).
      namespace, encoder, use_namespace_prefix_keys: as Dramatiq's backends.
      listen: ``False`` turns LISTEN off (PgBouncer transaction pooling);
        blocking reads then poll.  Defaults to the broker's setting.
      poll_interval: seconds between re-reads while blocking.
      purge_interval: seconds between purges of expired results, per process.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        broker: PostgresBroker | None = None,
        namespace: str = "dramatiq-results",
        encoder: Any = None,
        use_namespace_prefix_keys: bool = False,
        listen: bool | None = None,
        poll_interval: float | None = None,
        purge_interval: float = DEFAULT_PURGE_INTERVAL,
        connect_timeout: int = 5,
        pool_max_size: int = 4,
    ) -> None:
        super().__init__(namespace=namespace, encoder=encoder, use_namespace_prefix_keys=use_namespace_prefix_keys)
        if broker is not None:
            if schema is not None and schema != broker.schema:
                raise ValueError(
                    f"schema {schema!r} differs from the broker's {broker.schema!r}: results are fenced on the "
                    "broker's message rows, so they live in its schema"
                )
            schema = broker.schema
            listen = broker.listen if listen is None else listen
            poll_interval = broker.poll_interval if poll_interval is None else poll_interval
        self.logger = get_logger(__name__, type(self))
        self.schema = check_schema(schema or DEFAULT_SCHEMA)
        self.broker = broker
        self.listen = True if listen is None else listen
        self.poll_interval = float(poll_interval or DEFAULT_POLL_INTERVAL)
        self.channel = results_channel(self.schema)
        self._sql = statements(self.schema)
        self._db = Connections(
            url=url,
            pool=pool,
            broker=broker,
            schema=self.schema,
            channel=self.channel,
            listen=self.listen,
            connect_timeout=connect_timeout,
            pool_max_size=pool_max_size,
            purge_interval=purge_interval,
        )
        if broker is not None:
            broker.add_middleware(WritePendingResults(self))

    # -- reading ------------------------------------------------------------------
    def get_result(self, message: Any, *, block: bool = False, timeout: int | None = None) -> Any:
        """Get a result; with ``block=True`` wait up to ``timeout`` ms (default 10 s).

        Raises:
          ResultMissing: not blocking, and there is no live result.
          ResultTimeout: blocking, and none arrived in time.
          ResultFailure: the actor failed (its exception was stored).
        """
        if timeout is None:
            timeout = DEFAULT_TIMEOUT
        key = self.build_message_key(message)
        self._db.maybe_purge(self.purge)
        if not block:
            data = self._get(key)
            if data is Missing:
                raise ResultMissing(message)
            return self.unwrap_result(data)
        deadline = time.monotonic() + timeout / 1000
        listener = self._db.listener()
        with listener.waiting(key) if listener is not None else nullcontext(threading.Event()) as event:
            while True:
                event.clear()  # a notification from here on ends the wait below
                data = self._get(key)
                if data is not Missing:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResultTimeout(message)
                event.wait(min(remaining, self.poll_interval))
        return self.unwrap_result(data)

    def _get(self, message_key: str) -> Any:
        with self._db.connection() as conn:
            row = conn.execute(self._sql.result_get, [message_key]).fetchone()
            if row is None:
                return Missing
            data, live = row
            if not live:
                conn.execute(self._sql.result_drop_expired, [message_key])
                return Missing
        return self.encoder.decode(bytes(data))

    # -- writing ------------------------------------------------------------------
    def store_result(self, message: Any, result: Any, ttl: int) -> None:
        """Store a result for *ttl* ms, fenced on the message's attempt (see the module docstring)."""
        write = self._write_for(message, wrap_result(result), ttl)
        if self._held_by_broker(message):
            message.pending_result = write  # committed with the ack of this attempt
            _pending.item = (self, message)
        else:
            self._store_now(write, ["running"])
        self._db.maybe_purge(self.purge)

    def store_exception(self, message: Any, exception: Exception, ttl: int) -> None:
        """Store an actor's exception for *ttl* ms; ``get_result`` raises ``ResultFailure`` for it."""
        write = self._write_for(message, wrap_exception(exception), ttl)
        if self.broker is not None and isinstance(message, PostgresMessageProxy) and message.settled:
            # After the nack (Dramatiq's order): the same writer, so it lands
            # with or right after the nack, and only if the nack applied.
            outcome = Outcome("result", message.message_id, message.attempt, queue_name=message.queue_name)
            outcome.result = write
            self.broker._writer.submit(outcome)
        else:
            self._store_now(write, ["running", "dead"])
        self._db.maybe_purge(self.purge)

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        """Dramatiq's low-level hook: an unfenced write under *message_key*."""
        self._store_now(ResultWrite(message_key, "", None, self.encoder.encode(result), int(ttl)), [])

    def _write_for(self, message: Any, wrapped: Any, ttl: int) -> ResultWrite:
        attempt = message.options.get("attempt")
        return ResultWrite(
            key=self.build_message_key(message),
            message_id=str(message.message_id),
            attempt=int(attempt) if attempt is not None else None,
            data=self.encoder.encode(wrapped),
            ttl_ms=int(ttl),
        )

    def _held_by_broker(self, message: Any) -> bool:
        """Did our broker deliver this very attempt in this process (so its ack is still to come)?"""
        broker = self.broker
        if broker is None or not isinstance(message, PostgresMessageProxy) or message.settled:
            return False
        proc = broker._proc
        if proc is None or proc.pid != os.getpid():
            return False
        return proc.leases.holding(message.message_id) == (message.queue_name, message.attempt)

    def _store_now(self, write: ResultWrite, states: list[str]) -> bool:
        """Write at once; fenced on the row being at the attempt in one of *states* when there is an attempt."""
        params = {
            "keys": [write.key],
            "ids": [write.message_id],
            "attempts": [write.attempt],
            "data": [write.data],
            "ttls": [write.ttl_ms],
            "channel": self.channel,
        }
        with self._db.connection() as conn:
            if write.attempt is None:
                return conn.execute(self._sql.result_store, params).fetchone() is not None
            if conn.execute(self._sql.result_store_fenced, {**params, "states": states}).fetchone() is not None:
                return True
            now = conn.execute(self._sql.state_of, [write.message_id]).fetchone()
            if now is not None and now[0] == "cancelled":
                self.logger.info(
                    "Message %s was cancelled; the result of attempt %d is dropped.", write.message_id, write.attempt
                )
            else:
                self.logger.warning(describe("result", write.message_id, write.attempt, now))
                conn.execute(self._sql.count_stale, [1])
        return False

    def _write_pending(self, message: PostgresMessageProxy) -> None:
        write = message.pending_result
        if write is None or message.settled:
            return
        try:
            self._store_now(write, ["running"])
        except BrokerConnectionError:
            return  # the ack still carries it
        message.pending_result = None

    # -- maintenance ----------------------------------------------------------------
    def purge(self) -> int:
        """Delete expired results, oldest first, in bounded batches; returns how many."""
        return self._db.purge(self._sql.result_purge)

    def close(self) -> None:
        """Stop the listener and close the pool this backend made (not the broker's)."""
        self._db.close()


_pending = threading.local()  # per worker thread: (backend, message) whose result waits for its ack


def write_pending() -> None:
    """Write now the result this thread's message still holds for its ack.

    Called before anything another process acts on as "this message is
    done": enqueueing a follow-up message, or counting down a group's
    barrier.  If the database is away, the ack still carries the result.
    """
    item = getattr(_pending, "item", None)
    if item is None:
        return
    _pending.item = None
    backend, message = item
    backend._write_pending(message)


class WritePendingResults(Middleware):
    """Installed on the broker by :class:`PostgresBackend`: before a worker
    thread enqueues a follow-up message, it writes the result that would
    otherwise wait for the ack, keeping Dramatiq's order (result, then
    follow-ups)."""

    def __init__(self, backend: PostgresBackend) -> None:
        self.backend = backend

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        from dramatiq.middleware import GroupCallbacks
        from dramatiq.results import Results

        kinds = [type(m) for m in broker.middleware]
        group = next((i for i, k in enumerate(kinds) if issubclass(k, GroupCallbacks)), None)
        results = next((i for i, k in enumerate(kinds) if issubclass(k, Results)), None)
        if group is not None and results is not None and group > results:
            # after_* hooks run in reverse order: GroupCallbacks would count down before Results stores.
            self.backend.logger.warning(
                "GroupCallbacks is added after Results: a group's completion callback may run before "
                "the last member's result is stored. Add GroupCallbacks first (results.setup() does)."
            )

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        write_pending()


def setup(
    url: str | None = None,
    *,
    schema: str = DEFAULT_SCHEMA,
    store_results: bool = False,
    result_ttl: int | None = None,
    group_callbacks: bool = True,
    **broker_options: Any,
) -> tuple[PostgresBroker, PostgresBackend]:
    """A broker with the Results middleware (and, by default, GroupCallbacks) on one database.

    Returns ``(broker, backend)``; ``broker_options`` go to
    :class:`PostgresBroker`.  Nothing is set globally: call
    ``dramatiq.set_broker(broker)``.
    """
    from dramatiq.middleware import GroupCallbacks
    from dramatiq.results import Results

    from .broker import PostgresBroker
    from .rate_limits import PostgresBackend as RateLimiterBackend

    broker = PostgresBroker(url, schema=schema, **broker_options)
    backend = PostgresBackend(broker=broker)
    if group_callbacks:
        broker.add_middleware(GroupCallbacks(RateLimiterBackend(broker=broker)))
    # Added last, so its after_process_message runs first (Dramatiq runs them
    # in reverse): a member's result is stored before it counts down its group.
    broker.add_middleware(Results(backend=backend, store_results=store_results, result_ttl=result_ttl))
    return broker, backend


__all__ = ["PostgresBackend", "setup"]
