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
  result.  Without LISTEN (``listen=False``, PgBouncer) it re-reads after
  10 ms, doubling up to ``poll_interval``.  Sub-second timeouts are respected.
- **Fencing.**  A message our broker delivered carries
  ``options["attempt"]``.  Its result is written only while its row is still
  held by that attempt (a stored exception: while that attempt's nack holds
  it), and a stored result is only ever replaced by the same or a later
  attempt.  A worker that lost its lease cannot overwrite the outcome of the
  current attempt; its write is logged and counted as a stale write.  A row
  the delivery's ``fenced_transaction()`` moved to ``committed`` is still that
  delivery's (its process keeps its lease until its outcome is written): the
  result, or the exception the actor raised after its block, is stored.
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
  runs only after every member's result is committed.
- **Stored exceptions** ride the nack that dead-letters their message, in its
  transaction, only if it applies (``PostgresBroker.stored_exception``, for a
  backend on the broker's schema, with ``broker=`` or a pool of its own).
  Dramatiq's Results stores them in ``after_nack``, after the nack: written
  apart, a fenced-out worker's error could become the outcome of a message the
  rescuer dead-lettered.  Our ``store_exception`` then skips the message.
- **A message that ended with nothing stored** (dead-lettered by the rescuer,
  cancelled, an actor without ``store_results``) makes ``get_result`` raise
  ``ResultFailure`` saying so, at once (``_ended``).
- Without ``broker=``, every other write happens at once in the calling
  thread, with the same fence.
"""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import nullcontext
from typing import Any

from dramatiq.errors import BrokerConnectionError
from dramatiq.logging import get_logger
from dramatiq.middleware import Middleware
from dramatiq.results import ResultBackend, ResultMissing, ResultTimeout
from dramatiq.results.backend import DEFAULT_TIMEOUT, Missing
from dramatiq.results.result import wrap_exception, wrap_result
from psycopg_pool import ConnectionPool

from ..config import (
    DEFAULT_BACKEND_POOL_MAX_SIZE,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_PURGE_INTERVAL,
    DEFAULT_SCHEMA,
)
from ..core.delivery import PostgresMessageProxy, ResultWrite, attempt_of, defer_pending, deferring, write_pending
from ..core.fencing import StaleWrites, State, Write
from ..core.interrupt import MessageCancelled
from ..core.maintenance import PurgeSchedule
from ..db.database import Database
from ..db.doorbell import poll_pauses
from ..db.statements import check_schema, results_channel, statements
from ..errors import DeadLetterError, ResultNotStored
from .host import HostBroker


class PostgresBackend(ResultBackend):
    """A Dramatiq result backend that stores results in PostgreSQL.

    Parameters:
      url: libpq connection string or URL (``None``: libpq's defaults).
      pool: a ``psycopg_pool.ConnectionPool`` of autocommit connections you own.
      schema: where the tables live; the broker's schema (migration 002
        creates the ``result`` table next to the messages, whose rows fence
        the writes).  Defaults to the broker's, else ``"dramatiq"``.
      broker: the :class:`PostgresBroker` that runs the actors: share its
        database and commit results with acks (see the module docstring).
      namespace: as Dramatiq's backends.
      encoder: as Dramatiq's backends.
      use_namespace_prefix_keys: as Dramatiq's backends.
      listen: ``False`` turns LISTEN off, and prepared statements in a pool
        made from ``url`` (PgBouncer transaction pooling); blocking reads then
        poll.  Defaults to the broker's setting.
      poll_interval: seconds between re-reads while blocking.
      purge_interval: seconds between purges of expired results, per process.
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        pool: ConnectionPool | None = None,
        schema: str | None = None,
        broker: HostBroker | None = None,
        namespace: str = "dramatiq-results",
        encoder: Any = None,
        use_namespace_prefix_keys: bool = False,
        listen: bool | None = None,
        poll_interval: float | None = None,
        purge_interval: float = DEFAULT_PURGE_INTERVAL,
        connect_timeout: int = DEFAULT_CONNECT_TIMEOUT,
        pool_max_size: int = DEFAULT_BACKEND_POOL_MAX_SIZE,
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
        self.statements = statements(self.schema)
        self.database = (
            broker.database
            if broker is not None
            else Database(
                url,
                pool=pool,
                schema=self.schema,
                connect_timeout=connect_timeout,
                pool_max_size=pool_max_size,
                prepare=self.listen,  # listen=False: maybe behind a transaction pooler
                name="results",
            )
        )
        self.stale = StaleWrites(self.statements, self.logger)
        self._purges = PurgeSchedule(self.database, self.statements.result_purge, purge_interval)
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
        self._purges.maybe()
        if not block:
            data = self._read(key, str(message.message_id))
            if data is Missing:
                raise ResultMissing(message)
            return self.unwrap_result(data)
        deadline = time.monotonic() + timeout / 1000
        doorbell = self.database.doorbell(self.channel) if self.listen else None
        pauses = poll_pauses(self.poll_interval, listening=doorbell is not None)
        with doorbell.waiting(key) if doorbell is not None else nullcontext(threading.Event()) as event:
            while True:
                event.clear()  # a notification from here on ends the wait below
                data = self._read(key, str(message.message_id))
                if data is not Missing:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise ResultTimeout(message)
                event.wait(min(remaining, next(pauses)))
        return self.unwrap_result(data)

    def _get(self, message_key: str) -> Any:
        """Dramatiq's low-level hook: the result under *message_key*, or ``Missing``."""
        return self._read(message_key, "")

    def _read(self, message_key: str, message_id: str) -> Any:
        """The stored result; when there is none and the message was dead-lettered or cancelled, a
        failure that says so (nothing will be stored: the rescuer's dead letter at ``max_deliveries``
        stores no exception, and a stale worker's error never is)."""
        with self.database.connection() as conn:
            params = {"key": message_key, "id": message_id if _is_uuid(message_id) else None}
            data, live, state, error = conn.execute(self.statements.result_get, params).fetchone() or (None,) * 4
            if data is None:
                return Missing if state is None else _ended(message_id, state, error)
            if not live:
                conn.execute(self.statements.result_drop_expired, [message_key])
                return Missing
        return self.encoder.decode(bytes(data))

    # -- writing ------------------------------------------------------------------
    def store_result(self, message: Any, result: Any, ttl: int) -> None:
        """Store a result for *ttl* ms, fenced on the message's attempt (see the module docstring)."""
        if isinstance(message, PostgresMessageProxy) and message.retried_at_once:
            # Its outcome was handed over without it (a retry the actor made itself): a result rides
            # only an ack, and this delivery has none.  Written now, it could land before that retry.
            self.logger.info(
                "The result of message %s (attempt %d) is not stored: that delivery was already retried.",
                message.message_id,
                message.attempt,
            )
            return
        write = self._write_for(message, wrap_result(result), ttl)
        if self.broker is not None and self.broker.holds(message):
            message.pending_result = write  # committed with the ack of this attempt
            defer_pending(lambda: self._write_pending(message))
        else:
            self._store_now(write, [State.RUNNING, State.COMMITTED])
        self._purges.maybe()

    def store_exception(self, message: Any, exception: Exception, ttl: int) -> None:
        """Store an actor's exception for *ttl* ms; ``get_result`` raises ``ResultFailure`` for it."""
        if isinstance(message, PostgresMessageProxy) and message.exception_stored:
            return  # it rode the nack (PostgresBroker.stored_exception)
        write = self.exception_write(message, exception, ttl)
        if self.broker is not None and isinstance(message, PostgresMessageProxy) and message.settled:
            # After the nack (Dramatiq's order): the same writer, so it lands
            # with or right after the nack, and only if the nack applied.
            self.broker.submit_result(message, write)
        else:
            self._store_now(write, [State.RUNNING, State.DEAD, State.COMMITTED])
        self._purges.maybe()

    def exception_write(self, message: Any, exception: BaseException, ttl: int) -> ResultWrite:
        """*exception* as the stored result of *message* (``get_result`` raises ``ResultFailure``)."""
        return self._write_for(message, wrap_exception(exception), ttl)

    def _store(self, message_key: str, result: Any, ttl: int) -> None:
        """Dramatiq's low-level hook: an unfenced write under *message_key*."""
        self._store_now(ResultWrite(message_key, "", None, self.encoder.encode(result), int(ttl)), [])

    def _write_for(self, message: Any, wrapped: Any, ttl: int) -> ResultWrite:
        return ResultWrite(
            key=self.build_message_key(message),
            message_id=str(message.message_id),
            attempt=attempt_of(message),
            data=self.encoder.encode(wrapped),
            ttl_ms=int(ttl),
            delivery=message.delivery if isinstance(message, PostgresMessageProxy) else None,
            failure=self._failure_data,
        )

    def _failure_data(self, reason: str) -> bytes:
        """What is stored when the database refuses a result: ``get_result`` raises ``ResultFailure`` with *reason*."""
        return self.encoder.encode(wrap_exception(ResultNotStored(reason)))

    def _store_now(self, write: ResultWrite, states: list[State]) -> bool:
        """Write at once; fenced on the row being at the attempt in one of *states* when there is an attempt."""
        params = {
            "keys": [write.key],
            "ids": [write.message_id],
            "attempts": [write.attempt],
            "deliveries": [write.delivery],
            "data": [write.data],
            "ttls": [write.ttl_ms],
            "channel": self.channel,
        }
        with self.database.connection() as conn:
            if write.attempt is None:
                return conn.execute(self.statements.result_store, params).fetchone() is not None
            fenced = {**params, "states": [s.value for s in states]}
            if conn.execute(self.statements.result_store_fenced, fenced).fetchone() is not None:
                return True
            self.stale.report(conn, [(Write.RESULT, write.message_id, write.attempt, write.delivery)])
        return False

    def _write_pending(self, message: PostgresMessageProxy) -> None:
        write = message.pending_result
        if write is None or message.settled or message.committed:
            return  # (committed: the result rides the outcome that finishes its committed row, fenced on it)
        try:
            self._store_now(write, [State.RUNNING])
        except BrokerConnectionError:
            return  # the ack still carries it
        message.pending_result = None

    # -- maintenance ----------------------------------------------------------------
    def purge(self) -> int:
        """Delete expired results, oldest first, in bounded batches; returns how many."""
        return self._purges.purge()

    def close(self) -> None:
        """Stop the listener and close the pool this backend made (not the broker's: it closes them)."""
        if self.broker is None:
            self.database.close()


def _is_uuid(text: str) -> bool:
    try:
        uuid.UUID(text)
    except ValueError:
        return False
    return True


def _ended(message_id: str, state: str, error: str | None) -> dict[str, Any]:
    """What ``get_result`` raises (as ``ResultFailure``) for a message that ended without a result."""
    if state == State.CANCELLED.value:
        return wrap_exception(MessageCancelled(f"message {message_id} was cancelled"))
    return wrap_exception(DeadLetterError(message_id, error))


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
        if deferring() is None:  # a follow-up tied to the ack is written with the result anyway
            write_pending()


__all__ = ["PostgresBackend", "WritePendingResults"]
