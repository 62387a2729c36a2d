"""The database layer: one per broker or backend, shared when they share a database.

A :class:`Database` owns, per process, a pool of autocommit connections and
the LISTEN doorbells; after ``fork`` the child builds its own (the parent's
sockets are not the child's to use or close).  It checks once per process
that the schema is migrated, runs idempotent work again once on a fresh
connection when the first one was broken, and names failures for people:
the server and the cause, never the password.

A server that takes no writes (a standby, a primary demoted with its sockets
open) is a lost connection here: the connection that met it, and every other
made to that server before, is dropped, and the next one is dialled anew (see
reconnect.py), so libpq's ``target_session_attrs=read-write`` finds the new
primary.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar

import psycopg
from dramatiq.errors import ConnectionClosed
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout

from ..conditions import Condition
from ..errors import (
    MISSING_OBJECT,
    SchemaError,
    ServerUnwritable,
    as_lost,
    describe_failure,
    lost_connection,
    unwritable,
)
from . import migrations
from .doorbell import Doorbell
from .reconnect import (
    RETRY_INTERVAL,
    PacedConnection,
    PacedPool,
    Server,
    check_readable,
    seed,
    server_for,
    unseed,
    where,
)
from .shield import shielded

T = TypeVar("T")

#: This process's id, refreshed in a forked child: checked on every
#: connection, and os.getpid() is a system call.
_pid = os.getpid()


def _refresh_pid() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_refresh_pid)


def this_process() -> int:
    """This process's id, without a system call."""
    return _pid


#: Seconds after which the pool closes the connections it did not use (above one): an idle worker
#: process keeps one pooled connection and its LISTEN connection (docs/operating.md, "Connections").
POOL_MAX_IDLE = 20.0


def connection_kwargs(connect_timeout: int, *, prepare: bool = True) -> dict[str, Any]:
    """How our pools connect: autocommit, and with ``prepare=False`` no server-side prepared statements.

    ``listen=False`` is the set-up for PgBouncer in transaction pooling, where
    each transaction may run on another server connection: a statement psycopg
    prepared (after its fifth run) on one is missing on the next, or clashes
    with another client's of the same name.  So there nothing is prepared.
    """
    kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": connect_timeout}
    if not prepare:
        kwargs["prepare_threshold"] = None
    return kwargs


def new_pool(
    url: str, *, max_size: int, connect_timeout: int, name: str, prepare: bool = True, reads: bool = False
) -> ConnectionPool:
    """An opened pool of autocommit connections, for this process only (not fork-safe).

    ``prepare=False``: never prepare statements (see :func:`connection_kwargs`).
    It reconnects at a steady pace after an outage (see reconnect.py), not
    after psycopg_pool's doubling backoff.  ``reads=True``: a pool that only
    reads, whose server may be a standby (:func:`.reconnect.check_readable`).
    """
    extra: dict[str, Any] = {"check": check_readable} if reads else {}
    pool = PacedPool(
        url,
        min_size=1,
        max_size=max_size,
        kwargs=connection_kwargs(connect_timeout, prepare=prepare),
        timeout=connect_timeout * 2,
        max_idle=POOL_MAX_IDLE,
        open=False,
        name=f"dramatiq-pg-{name}-{os.getpid()}",
        **extra,
    )
    logging.getLogger("psycopg.pool").setLevel(logging.ERROR)  # we report connection failures ourselves
    pool.open(wait=False)
    return pool


class ServerDown(psycopg.OperationalError):
    """Refused without a try: the process knows the server is unreachable (the last attempt's cause)."""


def _ready(pool: ConnectionPool) -> int:
    """Connections idle in *pool* now; for a pool of the caller's own, what its statistics say."""
    if isinstance(pool, PacedPool):
        return pool.ready
    return int(pool.get_stats().get("pool_available", 1))


class _ProcessLocal:
    """What must not cross a fork: the pool, the listening connections."""

    def __init__(self, pool: ConnectionPool, owns_pool: bool) -> None:
        self.pid = os.getpid()
        self.pool = pool
        self.owns_pool = owns_pool
        self.schema_checked = False
        self.doorbells: dict[str, Doorbell] = {}
        self.server: Server | None = None  # what this process knows of reaching the server (reconnect.py)

    def close(self) -> None:
        for doorbell in self.doorbells.values():
            doorbell.stop()
        if self.owns_pool:
            self.pool.close()


class Database:
    """Connections to one database and schema, for the current process.

    Parameters:
      url: libpq connection string or URL (``""``: libpq's defaults).
      pool: a ``psycopg_pool.ConnectionPool`` of autocommit connections the
        caller owns; used instead of ``url`` for queries (LISTEN still needs
        a connection of its own, made with the pool's conninfo).
      schema: checked to be migrated on the first connection of a process.
      prepare: ``False`` turns psycopg's server-side prepared statements off
        in the pool made from ``url`` (behind PgBouncer in transaction pooling).
      name: for the pool's name in logs.
      reads: only reads go through it (operators' reads from a replica: the
        broker's ``read_url``): its server may be a hot standby, which is no
        reason to drop a connection (see :func:`.reconnect.check_readable`).
    """

    def __init__(
        self,
        url: str | None,
        *,
        pool: ConnectionPool | None = None,
        schema: str,
        connect_timeout: int,
        pool_max_size: int,
        prepare: bool = True,
        name: str = "broker",
        reads: bool = False,
    ) -> None:
        self.url = url or ""
        if self.url:
            try:
                conninfo_to_dict(self.url)
            except psycopg.ProgrammingError as e:  # libpq's words name the fault, never the password
                raise ValueError(f"malformed PostgreSQL URL or connection string: {e}") from None
        self.given_pool = pool
        self.schema = schema
        self.connect_timeout = connect_timeout
        self.pool_max_size = pool_max_size
        self.prepare = prepare
        self.name = name
        self.reads = reads
        self._lock = threading.Lock()
        self._local: _ProcessLocal | None = None
        #: The schema is missing or old: said once (then once a minute), not by every part on every try.
        self.schema_unready = Condition(logging.getLogger(__name__), f"Schema {schema!r} is not ready")

    # -- per process ----------------------------------------------------------
    def _here(self) -> _ProcessLocal:
        local = self._local
        if local is None or local.pid != _pid:
            with self._lock:
                local = self._local
                if local is None or local.pid != os.getpid():
                    pool = self.given_pool or new_pool(
                        self.url,
                        max_size=self.pool_max_size,
                        connect_timeout=self.connect_timeout,
                        name=self.name,
                        prepare=self.prepare,
                        reads=self.reads,
                    )
                    local = self._local = _ProcessLocal(pool, owns_pool=self.given_pool is None)
        return local

    @property
    def started(self) -> bool:
        """Has this process made a pool or a listening connection yet?"""
        local = self._local
        return local is not None and local.pid == os.getpid()

    @property
    def conninfo(self) -> str:
        """Where LISTEN connects: the URL, else the given pool's conninfo."""
        if self.url or self.given_pool is None:
            return self.url
        given = self.given_pool.conninfo
        return given() if callable(given) else str(given)

    def doorbell(self, channel: str, *, timed: bool = False) -> Doorbell:
        """This process's doorbell on *channel* (it starts listening on its first subscriber)."""
        local = self._here()
        with self._lock:
            doorbell = local.doorbells.get(channel)
            if doorbell is None:
                doorbell = local.doorbells[channel] = Doorbell(
                    self.conninfo, channel, connect_timeout=self.connect_timeout, timed=timed
                )
            return doorbell

    def started_doorbell(self, channel: str) -> Doorbell | None:
        """The doorbell on *channel* if this process made one (for tests and stats)."""
        local = self._local
        if local is None or local.pid != os.getpid():
            return None
        return local.doorbells.get(channel)

    def close(self) -> None:
        """Stop the doorbells and close the pool this process made (never a given one)."""
        with self._lock:
            local, self._local = self._local, None
        if local is not None and local.pid == os.getpid():
            local.close()

    # -- connections ----------------------------------------------------------
    @contextmanager
    def connection(
        self, *, raw: bool = False, timeout: float | None = None, fail_fast: bool | None = None
    ) -> Iterator[psycopg.Connection]:
        """A pooled autocommit connection to a migrated schema, waited for at most *timeout* seconds
        (the pool's by default).

        With ``raw=True`` psycopg's errors pass through (the background threads
        handle them); otherwise connection failures become Dramatiq's
        ``ConnectionClosed``.  A missing or old schema raises
        :class:`~.errors.SchemaError` either way.
        """
        local = self._here()
        try:
            with (
                shielded(),  # an interruptible actor stops after the pool's bookkeeping, never inside it
                self._pooled(local, fail_fast=not raw if fail_fast is None else fail_fast, timeout=timeout) as conn,
            ):
                if not local.schema_checked:
                    try:
                        migrations.check(conn, self.schema, url_hint=self.safe_url())
                    except SchemaError as e:
                        self.schema_unready.hit(str(e))
                        raise
                    local.schema_checked = True
                    self.schema_unready.clear()
                try:
                    yield conn
                except psycopg.Error as e:
                    if isinstance(e, MISSING_OBJECT):
                        self.check_again(conn, e)
                    if not unwritable(e) or self.reads:  # a reader that wrote: a bug, not a failover
                        raise
                    self.drop_unwritable(conn, e)
                    lost = as_lost(e)
                    if lost is e:
                        raise
                    raise lost from e
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            if lost_connection(e) and not isinstance(e, PoolTimeout) and local.owns_pool and not unwritable(e):
                # One broken connection usually means all idle ones are (server
                # restart, pg_terminate_backend): drop them now, not one per retry.
                with suppress(Exception):
                    local.pool.check()
            if raw:
                raise
            raise ConnectionClosed(self.describe(e)) from None

    def check_again(self, conn: psycopg.Connection, error: psycopg.Error) -> None:
        """A statement on *conn* found a table, schema or function missing (``MISSING_OBJECT``): if
        the schema was dropped or taken back under this running process, raise
        :class:`~.errors.SchemaError` (said once, as at a start without it, and checked again at the
        next pooled connection) instead of *error* from every part on every try.  Otherwise (the
        caller's own object was missing) return, and the caller raises *error*."""
        try:
            migrations.check(conn, self.schema, url_hint=self.safe_url())
        except SchemaError as e:
            local = self._local
            if local is not None:
                local.schema_checked = False
            self.schema_unready.hit(str(e))
            raise e from error
        except psycopg.Error:
            pass

    @contextmanager
    def _pooled(self, local: _ProcessLocal, *, fail_fast: bool, timeout: float | None) -> Iterator[psycopg.Connection]:
        """The pool's connection.  For the application's own calls (``fail_fast``): waited for at most
        ``connect_timeout`` seconds, and refused at once, with the cause (:class:`ServerDown`), while
        this process knows the server is unreachable (refused, unknown host, wrong password...), some
        part of it tries the server again (the pool in the background, the doorbell: reconnect.py)
        and no connection is ready: a ``send()`` in a web request must not hang on a database that is
        down, nor one to a database that is up behind it (RoutedBroker), and the first one made after
        the server's return gets the connection the pool made.  When nobody tried the server lately,
        the call asks the pool (which so tries it), and is refused after one reconnect round of the
        pool (``RETRY_INTERVAL``) if that fails.  The background parts wait for the pool (and so an
        outage is announced: reconnect.py)."""
        server = local.server
        if server is None:
            server = local.server = server_for(self.conninfo)
        if not fail_fast:
            server.awaited = True
            with local.pool.connection(timeout=timeout) as conn:
                yield conn
            return
        if server.down and server.tried_lately and _ready(local.pool) == 0:
            # Known unreachable, and tried again in the background (this pool's attempts, the doorbell):
            # refused now, without waiting on the pool.  A producer that also sends to other databases
            # (RoutedBroker) is not held up by this one; the first send after the return finds the
            # connection the pool made.  Tried by nobody lately: the pool is asked (so it tries).
            raise ServerDown(server.cause)
        start = time.monotonic()
        deadline = start + (self.connect_timeout if timeout is None else timeout)
        while True:
            try:
                conn = local.pool.getconn(timeout=max(min(0.05, deadline - time.monotonic()), 0.001))
                break
            except PoolTimeout:
                now = time.monotonic()
                if now >= deadline:
                    raise
                if server.down and now - start > 1.2 * RETRY_INTERVAL:
                    raise psycopg.OperationalError(server.cause) from None
                if server.read_only and not self.reads and now - start > 1.2 * RETRY_INTERVAL:
                    raise ServerUnwritable(server.read_only) from None
        try:
            yield conn
        finally:
            local.pool.putconn(conn)

    def run(self, work: Callable[[psycopg.Connection], T], *, transaction: bool = False) -> T:
        """Run idempotent *work* on a pooled connection; once more on a fresh
        one if the first was broken.  Connection failures become Dramatiq's
        ``ConnectionClosed``."""
        for tries in (1, 2):
            try:
                with self.connection(raw=True, fail_fast=True) as conn:
                    if not transaction:
                        return work(conn)
                    with conn.transaction():
                        return work(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if tries == 2 or isinstance(e, (PoolTimeout, ServerDown)):
                    raise ConnectionClosed(self.describe(e)) from None
        raise AssertionError("unreachable")

    def drop_unwritable(self, conn: psycopg.Connection, error: BaseException) -> None:
        """*conn*'s server answered as one that takes no writes (*error*): close *conn* and drop every
        connection made to that server before (this pool's at once; the other parts' at their next
        use: reconnect.py), so the next ones are dialled anew and find the new primary."""
        server = getattr(conn, "server", None)
        if not isinstance(server, Server):
            server = server_for(self.conninfo)
        cause = str(error).splitlines()[0] if str(error) else type(error).__name__
        bumped = server.unwritable(cause, getattr(conn, "generation", None))
        with suppress(Exception):
            conn.close()
        local = self._local
        if bumped and local is not None and local.pid == _pid and local.owns_pool:
            with suppress(Exception):
                local.pool.drain()

    def found_ready(self, conn: PacedConnection, kwargs: dict[str, Any]) -> None:
        """The start-up check found the schema ready on *conn*, a connection of this process's own made
        with *kwargs*: make this process's pool now, with *conn* as its first connection (one connection
        fewer to wait for before the first claim; the pool's first statements run on a server process
        that has read the schema already), and take the check as the pool's (the first pooled
        connection would check the schema again).  A schema dropped afterwards is found by the first
        statement that misses it (:meth:`check_again`).  A pool made already, or given, does not take
        *conn*: it is closed."""
        if self.given_pool is None and not self.started:
            seed(conn, self.url, kwargs)
        else:
            conn.close()
        try:
            local = self._here()
        except BaseException:
            unseed(self.url)  # nothing to take it
            raise
        local.schema_checked = True

    def connect(self) -> psycopg.Connection:
        """A connection of its own (not pooled), paced like the pool's while the server is away.

        For a part that must not wait behind the pool (the lease keeper); its
        owner closes it.  The schema is not checked on it.
        """
        return PacedConnection.connect(self.conninfo, **connection_kwargs(self.connect_timeout, prepare=self.prepare))

    def migrate(self) -> list[int]:
        """Create or upgrade the schema; returns the versions applied."""
        local = self._here()
        try:
            with local.pool.connection() as conn:
                applied = migrations.migrate(conn, self.schema)
        except (psycopg.OperationalError, psycopg.InterfaceError) as e:
            raise ConnectionClosed(self.describe(e)) from None
        local.schema_checked = True
        return applied

    # -- naming failures --------------------------------------------------------
    def _info(self) -> dict[str, object]:
        try:
            return dict(conninfo_to_dict(self.conninfo))
        except psycopg.Error:
            return {}

    def describe(self, error: BaseException) -> str:
        """An operational error in one line, naming the server but never the password."""
        info = self._info()
        at = where(self.conninfo)
        if isinstance(error, PoolTimeout) and self.conninfo:
            # The pool only says it timed out; one direct try tells why (refused, auth, unknown host...).
            try:
                psycopg.connect(self.conninfo, connect_timeout=self.connect_timeout).close()
            except psycopg.Error as direct:
                error = direct
        text = describe_failure(error, at)
        password = info.get("password")
        if password:
            text = text.replace(str(password), "***")
        return text

    def safe_url(self) -> str:
        """The URL for messages: the password masked; ``URL`` when there is none to show."""
        info = self._info()
        if not info:
            return "URL"
        return f"postgresql://{info.get('user') or ''}@{where(self.conninfo)}"
