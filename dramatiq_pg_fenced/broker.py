"""PostgresBroker: Dramatiq messages as rows in PostgreSQL, fenced per attempt."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager, suppress
from enum import Enum
from typing import Any, TypeVar, cast

import psycopg
from dramatiq.broker import Broker, MessageProxy
from dramatiq.errors import BrokerError, ConnectionClosed, QueueJoinTimeout, QueueNotFound
from dramatiq.logging import get_logger
from dramatiq.message import Message
from dramatiq.middleware import Middleware, MiddlewareError
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from . import migrations
from .consumer import PostgresConsumer, PostgresMessageProxy
from .doorbell import Doorbell
from .errors import DeadLetterError, PayloadTooLarge, describe_failure, lost_connection
from .leases import Leases
from .outcomes import Outcome, OutcomeWriter, describe
from .reconnect import PacedPool
from .sql import check_queue, check_schema, statements

T = TypeVar("T")

#: This process's id, refreshed in a forked child: _state() checks it on
#: every call, and os.getpid() is a system call.
_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)

#: Defaults, also listed in the README's configuration table.
DEFAULT_SCHEMA = "dramatiq"
DEFAULT_LEASE_SECONDS = 30.0
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
DEFAULT_DEAD_MESSAGE_TTL = 7 * 86400


class CancelOutcome(str, Enum):
    """What :meth:`PostgresBroker.cancel` did."""

    QUEUED = "cancelled_queued"  #: it was waiting (maybe for a retry backoff); it will never run
    RUNNING = "cancelled_running"  #: it was running; that attempt's outcome is fenced out
    ALREADY_CANCELLED = "already_cancelled"
    DEAD = "already_dead"  #: it had been dead-lettered; nothing changed
    NOT_FOUND = "not_found"  #: unknown id, or already finished (acked rows leave the table)


def new_pool(url: str, *, max_size: int, connect_timeout: int, name: str) -> ConnectionPool:
    """An opened pool of autocommit connections, for this process only (not fork-safe).

    It reconnects at a steady pace after an outage (see reconnect.py), not after psycopg_pool's doubling backoff.
    """
    pool = PacedPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs={"autocommit": True, "connect_timeout": connect_timeout},
        timeout=connect_timeout * 2,
        open=False,
        name=f"dramatiq-pg-{name}-{os.getpid()}",
    )
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # we report connection failures ourselves
    pool.open(wait=False)
    return pool


class _ProcessState:
    """Everything that must not cross a fork: pool, threads, listening connection."""

    def __init__(self, broker: PostgresBroker) -> None:
        self.pid = os.getpid()
        self.owns_pool = broker._given_pool is None
        self.pool = broker._given_pool or new_pool(
            broker.url, max_size=broker.pool_max_size, connect_timeout=broker.connect_timeout, name="broker"
        )
        self.schema_checked = False
        conninfo = broker.url
        if not conninfo and broker._given_pool is not None:  # LISTEN needs a connection of its own, like the pool's
            given = broker._given_pool.conninfo
            conninfo = given() if callable(given) else given
        self.doorbell = (
            Doorbell(conninfo, broker.channel, connect_timeout=broker.connect_timeout, timed=True)
            if broker.listen
            else None
        )
        self.leases = Leases(broker)
        self.writer = OutcomeWriter(broker)
        # Queues whose last claim failed in flight: it may have committed rows
        # this process never saw.  The next claim of the queue releases them.
        self.unsure_claims: set[str] = set()

    def close(self) -> None:
        self.writer.stop()
        self.leases.stop()
        if self.doorbell is not None:
            self.doorbell.stop()
        if self.owns_pool:
            self.pool.close()


class PostgresBroker(Broker):
    """A Dramatiq broker that keeps messages in PostgreSQL.

    Parameters:
      url: libpq connection string or URL.  ``None`` uses libpq's defaults
        (``PGHOST`` and friends).
      pool: a ``psycopg_pool.ConnectionPool`` you own (autocommit
        connections); used instead of ``url`` for queries.
      schema: where the tables live (``broker.migrate()`` creates it).
      lease_seconds: how long a claimed message is held without extension.
      poll_interval: seconds between claims when no doorbell rings.
      listen: ``False`` turns LISTEN/NOTIFY off (PgBouncer transaction pooling).
      max_payload_bytes: larger encoded messages are refused at enqueue.
      dead_message_ttl: seconds dead letters and cancellations are kept.
      synchronous_commit: ``False`` enqueues with ``synchronous_commit = off``
        (faster; a database crash may lose the last few enqueued messages).
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
        rescue_interval: float = 1.0,
        listen: bool = True,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        dead_message_ttl: int = DEFAULT_DEAD_MESSAGE_TTL,
        pool_max_size: int = 8,
        connect_timeout: int = 5,
        synchronous_commit: bool = True,
    ) -> None:
        self.schema = check_schema(schema)
        if lease_seconds <= 0 or poll_interval <= 0 or rescue_interval <= 0:
            raise ValueError("lease_seconds, poll_interval and rescue_interval must be positive")
        super().__init__(middleware=middleware)
        self.logger = get_logger(__name__, type(self))
        self.url = url or ""
        self._given_pool = pool
        self.lease_seconds = float(lease_seconds)
        self.poll_interval = float(poll_interval)
        self.rescue_interval = float(rescue_interval)
        self.listen = listen
        self.max_payload_bytes = max_payload_bytes
        self.dead_message_ttl = dead_message_ttl
        self.pool_max_size = pool_max_size
        self.connect_timeout = connect_timeout
        self.synchronous_commit = synchronous_commit
        self.channel = f"{self.schema}_wake"
        self.consumer_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.queues: set[str] = set()
        self._sql = statements(self.schema)
        self._state_lock = threading.Lock()
        self._proc: _ProcessState | None = None
        self._counts_lock = threading.Lock()
        self._counts = {"stale_writes": 0, "cancelled_writes": 0}
        self._dead: OrderedDict[str, BaseException | None] = OrderedDict()
        self._local = threading.local()  # per thread: an open batch() or transaction()
        self._closing: list[Callable[[], None]] = []  # backends on our pool: their listeners stop with us

    # -- process state ------------------------------------------------------
    def _state(self) -> _ProcessState:
        proc = self._proc
        if proc is None or proc.pid != _pid:
            with self._state_lock:
                proc = self._proc
                if proc is None or proc.pid != os.getpid():
                    # After fork the parent's pool and threads are not ours: start afresh.
                    self.consumer_id = f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
                    proc = self._proc = _ProcessState(self)
        return proc

    @property
    def _leases(self) -> Leases:
        return self._state().leases

    @property
    def _writer(self) -> OutcomeWriter:
        return self._state().writer

    def _doorbell_event(self, queue_name: str) -> threading.Event | None:
        doorbell = self._state().doorbell
        return doorbell.subscribe(queue_name) if doorbell is not None else None

    def _describe(self, error: BaseException) -> str:
        """An operational error, naming the server but never the password."""
        try:
            info = conninfo_to_dict(self.url)
        except psycopg.Error:
            info = {}
        where = f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"
        if isinstance(error, PoolTimeout) and self.url:
            # The pool only says it timed out; one direct try tells why (refused, auth, unknown host...).
            try:
                psycopg.connect(self.url, connect_timeout=self.connect_timeout).close()
            except psycopg.Error as direct:
                error = direct
        text = describe_failure(error, where)
        password = info.get("password")
        if password:
            text = text.replace(str(password), "***")
        return text

    @contextmanager
    def _pool_connection(self, *, raw: bool = False, timeout: float | None = None) -> Iterator[psycopg.Connection]:
        """A pooled autocommit connection, waited for at most *timeout* seconds (the pool's by default).

        With ``raw=True`` psycopg's errors pass through (the background threads
        handle them); otherwise connection failures become Dramatiq's
        ``ConnectionClosed`` and a missing schema a :class:`SchemaError`.
        """
        proc = self._state()
        try:
            with proc.pool.connection(timeout=timeout) as conn:
                if not proc.schema_checked:
                    migrations.check(conn, self.schema, url_hint=self._safe_url())
                    proc.schema_checked = True
                yield conn
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            if lost_connection(e) and not isinstance(e, PoolTimeout) and proc.owns_pool:
                # One broken connection usually means all idle ones are (server
                # restart, pg_terminate_backend): drop them now, not one per retry.
                with suppress(Exception):
                    proc.pool.check()
            if raw:
                raise
            raise ConnectionClosed(self._describe(e)) from None

    def _run(self, work: Callable[[psycopg.Connection], T], *, transaction: bool = False) -> T:
        """Run idempotent *work* on a pooled connection; once more on a fresh
        one if the first was broken.  Connection failures become Dramatiq's
        ``ConnectionClosed``."""
        for tries in (1, 2):
            try:
                with self._pool_connection(raw=True) as conn:
                    if not transaction:
                        return work(conn)
                    with conn.transaction():
                        return work(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if tries == 2 or isinstance(e, PoolTimeout):
                    raise ConnectionClosed(self._describe(e)) from None
        raise AssertionError("unreachable")

    def _safe_url(self) -> str:
        if not self.url:
            return "URL"
        try:
            info = conninfo_to_dict(self.url)
        except psycopg.Error:
            return "URL"
        if info.get("password"):
            info["password"] = "***"
        host = info.get("host") or "localhost"
        return f"postgresql://{info.get('user') or ''}@{host}:{info.get('port') or 5432}/{info.get('dbname') or ''}"

    # -- Dramatiq's Broker API ----------------------------------------------------
    def migrate(self) -> list[int]:
        """Create or upgrade the schema; returns the versions applied."""
        try:
            with self._state().pool.connection() as conn:
                applied = migrations.migrate(conn, self.schema)
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            raise ConnectionClosed(self._describe(e)) from None
        self._state().schema_checked = True
        return applied

    def close(self) -> None:
        """Write pending outcomes, stop the background threads (those of backends on our pool too), close the pool."""
        with self._state_lock:
            proc, self._proc = self._proc, None
        for close in self._closing:
            close()
        if proc is not None and proc.pid == os.getpid():
            proc.close()

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 5000) -> PostgresConsumer:
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)
        return PostgresConsumer(self, queue_name, prefetch, timeout)

    def declare_queue(self, queue_name: str) -> None:
        """Remember the queue; no I/O (called at import time by ``@actor``)."""
        if queue_name not in self.queues:
            check_queue(queue_name)
            self.emit_before("declare_queue", queue_name)
            self.queues.add(queue_name)
            self.emit_after("declare_queue", queue_name)

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_before``, calling only the middleware that implement the hook.

        Dramatiq calls every middleware for every hook of every message, and
        most inherit a no-op: skipping those saves a tenth of a worker's CPU
        per message.  Order, errors and logging are Dramatiq's.
        """
        name = "before_" + signal
        for middleware, hook in self._hooks(name):
            try:
                hook(self, *args, **kwargs)
            except MiddlewareError:
                raise
            except Exception:
                self.logger.critical("Unexpected failure in %s of %r.", name, middleware, exc_info=True)

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        """Dramatiq's ``emit_after`` (reverse order), skipping inherited no-op hooks."""
        name = "after_" + signal
        for middleware, hook in self._hooks(name):
            try:
                hook(self, *args, **kwargs)
            except Exception:
                self.logger.critical("Unexpected failure in %s of %r.", name, middleware, exc_info=True)

    def _hooks(self, name: str) -> list[tuple[Middleware, Callable[..., Any]]]:
        """The (middleware, bound hook) pairs that do something, in call order; rebuilt when the middleware change."""
        key = tuple(map(id, self.middleware))
        cache: dict[str, list[tuple[Middleware, Callable[..., Any]]]] | None = self.__dict__.get("_hook_cache")
        if cache is None or self.__dict__.get("_hook_key") != key:
            cache = self.__dict__["_hook_cache"] = {}
            self.__dict__["_hook_key"] = key
        hooks = cache.get(name)
        if hooks is None:
            noop = getattr(Middleware, name, None)
            order = reversed(self.middleware) if name.startswith("after_") else self.middleware
            hooks = []
            for middleware in order:
                hook = getattr(middleware, name, None)
                if hook is not None and (noop is None or getattr(hook, "__func__", None) is not noop):
                    hooks.append((middleware, hook))
            cache[name] = hooks
        return hooks

    def get_declared_queues(self) -> set[str]:
        return self.queues.copy()

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Store a message; with ``delay`` (ms) it becomes due at ``now() + delay`` (database clock).

        A message this broker delivered (Dramatiq's Retries middleware sends
        the same proxy back) is not inserted again: its row goes back to the
        queue, fenced on the delivering attempt.
        """
        if isinstance(message, PostgresMessageProxy):
            return cast(Message, self._retry(message, delay))
        self.emit_before("enqueue", message, delay)
        batch = getattr(self._local, "batch", None)
        if batch is not None:
            batch.append((message, delay))  # written, and emit_after sent, when the block ends
            return message
        self._insert([(message, delay)])
        self.emit_after("enqueue", message, delay)
        return message

    def enqueue_many(self, messages: Iterable[Message], *, delay: int | None = None) -> list[Message]:
        """Store many messages in one round trip and one commit."""
        messages = list(messages)
        for message in messages:
            self.emit_before("enqueue", message, delay)
        self._insert([(m, delay) for m in messages])
        for message in messages:
            self.emit_after("enqueue", message, delay)
        return messages

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Collect every message sent in this thread inside the block; insert them in one round trip at its end.

        ``with broker.batch(): group(...).run()`` enqueues a whole group at
        once.  If the block raises, nothing is enqueued.
        """
        if getattr(self._local, "batch", None) is not None:
            yield  # nested: the outer block writes
            return
        items: list[tuple[Message, int | None]] = []
        self._local.batch = items
        try:
            yield
        finally:
            self._local.batch = None
        self._insert(items)
        for message, delay in items:
            self.emit_after("enqueue", message, delay)

    @contextmanager
    def transaction(self, conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
        """Enqueue on *conn*, inside the caller's own transaction (the outbox pattern).

        Messages sent in this thread inside the block are written with the
        caller's connection: they become visible only if the caller's
        transaction commits and vanish if it rolls back.  The doorbell rings at
        commit (NOTIFY is transactional).
        """
        previous = getattr(self._local, "conn", None)
        self._local.conn = conn
        try:
            yield conn
        finally:
            self._local.conn = previous

    def _encode(self, message: Message) -> bytes:
        if "attempt" in message.options:
            message = message.copy()
            message.options.pop("attempt", None)
        data = message.encode()
        if len(data) > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"message {message.message_id} for actor {message.actor_name!r} encodes to {len(data)} bytes, "
                f"over max_payload_bytes={self.max_payload_bytes}; pass large data by reference"
            )
        return data

    def _insert(self, items: list[tuple[Message, int | None]]) -> None:
        if not items:
            return
        cols: list[list[Any]] = [[], [], [], [], [], []]
        for message, delay in items:
            check_queue(message.queue_name)
            actor = self.actors.get(message.actor_name)
            for col, value in zip(
                cols,
                (
                    message.message_id,
                    message.queue_name,
                    message.actor_name,
                    actor.priority if actor is not None else 0,
                    max(int(delay or 0), 0),
                    self._encode(message),
                ),
                strict=True,
            ):
                col.append(value)
        caller_conn = getattr(self._local, "conn", None)
        if caller_conn is not None:
            self._write_insert(caller_conn, cols)  # the caller's transaction decides
            return
        # Idempotent by message_id (ON CONFLICT DO NOTHING): safe to run again.
        # One statement, so autocommit makes it one round trip and one commit.
        self._run(lambda conn: self._write_insert(conn, cols))

    def _write_insert(self, conn: psycopg.Connection, cols: list[list[Any]]) -> None:
        if len(cols[0]) == 1:  # a plain send(): one row of scalars is cheaper than unnest
            statement = self._sql.enqueue_one if self.synchronous_commit else self._sql.enqueue_one_relaxed
            conn.execute(statement, [*(col[0] for col in cols), self.channel, self.listen])
            return
        statement = self._sql.enqueue if self.synchronous_commit else self._sql.enqueue_relaxed
        conn.execute(statement, [*cols, self.channel, self.listen])

    def _retry(self, message: PostgresMessageProxy, delay: int | None) -> PostgresMessageProxy:
        self.emit_before("enqueue", message, delay)
        if message.settled:
            self.logger.warning(
                "Message %s was already settled by attempt %d; retry ignored.", message.message_id, message.attempt
            )
        else:
            message.settled = True
            exc = message._exception
            error = message.options.get("traceback") or (repr(exc) if exc is not None else None)
            try:
                payload = self._encode(message._message)
            except PayloadTooLarge:
                # Dramatiq's traceback option made it grow; last_error keeps the traceback anyway.
                slim = {k: v for k, v in message._message.options.items() if k != "traceback"}
                try:
                    payload = self._encode(dataclasses.replace(message._message, options=slim))
                except PayloadTooLarge as e:
                    # Raising here would let the ack that follows drop the message: dead-letter it instead.
                    self.logger.error("Message %s cannot be retried: %s", message.message_id, e)
                    self._writer.submit(
                        Outcome(
                            "nack",
                            message.message_id,
                            message.attempt,
                            error=f"retry refused: {e}\n{error}",
                            queue_name=message.queue_name,
                            exception=exc,
                        )
                    )
                    self.emit_after("enqueue", message, delay)
                    return message
            self._writer.submit(
                Outcome(
                    "retry",
                    message.message_id,
                    message.attempt,
                    payload=payload,
                    delay_ms=max(int(delay or 0), 0),
                    error=error,
                    queue_name=message.queue_name,
                )
            )
        self.emit_after("enqueue", message, delay)
        return message

    def _requeue(self, proxies: list[PostgresMessageProxy]) -> None:
        """Release unstarted deliveries now, fenced; the attempt number stays."""
        ids = [p.message_id for p in proxies]
        attempts = [p.attempt for p in proxies]

        def release(conn: psycopg.Connection) -> set[str]:
            rows = conn.execute(self._sql.requeue, [ids, attempts]).fetchall()
            released = {str(r[0]) for r in rows}
            stale = [("requeue", p.message_id, p.attempt) for p in proxies if p.message_id not in released]
            if stale:
                self._report_stale(conn, stale)
            if released and self.listen:
                conn.execute(self._sql.notify, [self.channel, sorted({p.queue_name for p in proxies})])
            return released

        released = self._run(release, transaction=True)
        for p in proxies:
            p.settled = True
            self._leases.release(p.message_id, p.attempt)
        self.logger.info("Released %d unstarted message(s).", len(released))

    def _report_stale(
        self,
        conn: psycopg.Connection,
        stale: list[tuple[str, str, int]],
        retried: Collection[tuple[str, int]] = (),
    ) -> None:
        """Log and count fenced-out writes.  Called inside the writing transaction.

        *retried* holds the (message id, attempt) pairs whose previous try
        failed with a broken connection: it may have committed, so a row that
        looks as that write left it is not counted as stale.
        """
        rows = conn.execute(self._sql.current, [[mid for _, mid, _ in stale]]).fetchall()
        current = {str(r[0]): (r[1], r[2]) for r in rows}
        n_stale = n_cancelled = 0
        for kind, message_id, attempt in stale:
            now = current.get(message_id)
            if now is not None and now[0] == "cancelled":
                n_cancelled += 1
                self.logger.info(
                    "Message %s was cancelled; the %s of attempt %d is dropped.", message_id, kind, attempt
                )
                continue
            if (message_id, attempt) in retried and _left_by(kind, attempt, now):
                self.logger.info(
                    "The %s of message %s by attempt %d was probably written by a try whose connection broke "
                    "at commit; not counted as stale.",
                    kind,
                    message_id,
                    attempt,
                )
                continue
            n_stale += 1
            self.logger.warning(describe(kind, message_id, attempt, now))
        with self._counts_lock:
            self._counts["stale_writes"] += n_stale
            self._counts["cancelled_writes"] += n_cancelled
        if n_stale:
            conn.execute(self._sql.count_stale, [n_stale])

    def _remember_dead(self, message_id: str, exception: BaseException | None) -> None:
        with self._counts_lock:
            self._dead[message_id] = exception
            while len(self._dead) > 1000:
                self._dead.popitem(last=False)

    def flush(self, queue_name: str) -> None:
        """Drop every message of the queue, dead letters included."""
        self.flush_queues([queue_name])

    def flush_all(self) -> None:
        self.flush_queues(sorted(self.queues))

    def flush_queues(self, queue_names: list[str]) -> None:
        self._run(lambda conn: conn.execute(self._sql.flush, [queue_names]))

    def join(self, queue_name: str, *, timeout: int | None = None, fail_fast: bool = False, interval: int = 20) -> None:
        """Wait until the queue has nothing queued, delayed or running.

        Raises:
          QueueJoinTimeout: after ``timeout`` milliseconds.
          The actor's exception (or :class:`DeadLetterError` when it failed in
          another process) with ``fail_fast=True`` once a message of the queue
          was dead-lettered since the last flush.
        """
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            if self._proc is not None:
                self._writer.flush(timeout=1.0)
            if fail_fast:
                dead = self._run(lambda conn: conn.execute(self._sql.dead_letters, [queue_name]).fetchone())
                if dead is not None:
                    exc = self._dead.get(str(dead[0]))
                    if exc is not None:
                        raise exc
                    raise DeadLetterError(str(dead[0]), dead[1])
            row = self._run(lambda conn: conn.execute(self._sql.pending, [queue_name]).fetchone())
            if row is not None and row[0] == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(interval / 1000)

    # -- operations -------------------------------------------------------------
    def cancel(self, message_id: str) -> CancelOutcome:
        """Cancel a message so it never runs (again).

        Queued messages are cancelled whatever their attempt (a retry waiting
        for its backoff included).  A running message is marked cancelled: its
        attempt's ack, nack and retry become no-ops.  Nothing here is fenced on
        an attempt: cancellation is an administrative action on the message.
        """
        row = self._run(lambda conn: conn.execute(self._sql.cancel, [message_id]).fetchone())
        if row is not None:
            return CancelOutcome.QUEUED if row[0] == "queued" else CancelOutcome.RUNNING
        now = self._run(lambda conn: conn.execute(self._sql.state_of, [message_id]).fetchone())
        if now is None:
            return CancelOutcome.NOT_FOUND
        return CancelOutcome.ALREADY_CANCELLED if now[0] == "cancelled" else CancelOutcome.DEAD

    def is_cancelled(self, message_id: str) -> bool:
        """For actors: was my message cancelled while I run?"""
        row = self._run(lambda conn: conn.execute(self._sql.state_of, [message_id]).fetchone())
        return row is not None and row[0] == "cancelled"

    def inspect(self, message_id: str) -> dict[str, Any] | None:
        """What operators need to understand a message; ``None`` if unknown."""
        row = self._run(lambda conn: conn.execute(self._sql.inspect, [message_id]).fetchone())
        if row is None:
            return None
        keys = (
            "message_id", "queue_name", "actor_name", "priority", "state", "attempt", "enqueued_at",
            "available_at", "lease_expires_at", "lease_holder", "finished_at", "last_error",
        )  # fmt: skip
        info = dict(zip(keys, row[:-1], strict=True))
        info["message_id"] = str(info["message_id"])
        try:
            decoded = Message.decode(bytes(row[-1]))
            info["retries"] = decoded.options.get("retries", 0)
            info["args"], info["kwargs"] = decoded.args, decoded.kwargs
        except Exception as e:  # an undecodable row is still worth inspecting
            info["retries"] = None
            info["decode_error"] = str(e)
        return info

    def compact(self, *, lock_timeout: float = 5.0) -> dict[str, int]:
        """Give back the space a drained backlog left behind; returns the table's size before and after.

        Workers reuse emptied pages anyway; this returns them to the file
        system after a one-off spike.  It runs ``VACUUM (FULL)``, which locks
        the message table (enqueues and claims wait) for as long as copying
        its live rows takes: milliseconds when it is nearly empty, so run it
        then.  It waits at most *lock_timeout* seconds for the lock and fails
        rather than queue every worker behind it.  Needs the table's owner
        (or ``MAINTAIN`` on PostgreSQL 17+).
        """
        table = f'"{self.schema}".message'

        def size(conn: psycopg.Connection) -> int:
            row = conn.execute(self._sql.message_size, [table]).fetchone()
            return int(row[0]) if row and row[0] is not None else 0

        with self._pool_connection() as conn:  # autocommit: VACUUM refuses to run in a transaction
            before = size(conn)
            try:
                conn.execute(self._sql.lock_timeout, [f"{int(lock_timeout * 1000)}ms"])
                conn.execute(self._sql.compact)
            except psycopg.Error as e:
                if lost_connection(e):
                    raise  # ConnectionClosed, as for every other call
                raise BrokerError(f"cannot compact {table}: {describe_failure(e)}") from None
            finally:
                with suppress(psycopg.Error):
                    conn.execute(self._sql.lock_timeout, ["0"])
            after = size(conn)
        return {"bytes_before": before, "bytes_after": after}

    def stats(self) -> dict[str, Any]:
        """Counters of this process, totals from the database, and queue sizes."""
        with self._counts_lock:
            local = dict(self._counts)
        totals: dict[str, int] = dict(self._run(lambda conn: conn.execute(self._sql.counters).fetchall()))
        queues: dict[str, dict[str, int]] = {}
        for queue_name, state, count in self._run(lambda conn: conn.execute(self._sql.queue_stats).fetchall()):
            queues.setdefault(queue_name, {})[state] = count
        held = self._leases.held() if self._proc is not None else {}
        return {"process": {**local, "held": len(held)}, "totals": totals, "queues": queues}


def _left_by(kind: str, attempt: int, now: tuple[str, int] | None) -> bool:
    """Does the row look as the *kind* write of *attempt* would have left it?"""
    if kind == "ack":
        return now is None
    if kind == "nack":
        return now == ("dead", attempt)
    if kind == "retry":
        return now == ("queued", attempt)
    return False


__all__ = ["PostgresBroker", "CancelOutcome", "MessageProxy"]
