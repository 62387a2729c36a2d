"""Getting back to the database as soon as it is back, without hammering it while it is away.

psycopg_pool retries a failed connection 1, 2, 4, 8, 16... seconds apart, so
after an outage of 20 s its next try may come ten seconds after the server is
back, and every part of a worker (consumers, outcome writer, lease keeper) waits
for it.  Here, every connection a process makes to one server goes through one
:class:`Server`:

- The pools (:class:`PacedPool`) try again every :data:`RETRY_INTERVAL` at the
  longest (not less than 80% of it), so a part waiting for a connection gets
  one within about that long after the server accepts connections again.  The
  LISTEN doorbell tries as often, and is woken as soon as any part of the
  process connects.
- While the server is down, the whole process makes at most one real attempt
  per 80% of :data:`RETRY_INTERVAL`: any other attempt in that time fails at
  once with the last error, without touching the network (a server that is
  starting up forks a backend for every attempt it turns down).
- The outage is logged once when it starts (server and cause: with several
  hosts in the URL, each host tried and its own cause), as a reminder at most
  every :data:`REMINDER_INTERVAL`, and once when it ends.  The parts do not log
  a line per try.  Only when some part of the process waits for the server
  (:attr:`Server.awaited`: a worker's consumers): a ``send()`` or a command
  that fails says why itself, and retries nothing.
- While the server is known down and some part tries it again (:attr:`Server.tried_lately`), the
  application's calls are refused at once instead of waiting on the pool (database.py); the pools
  never give up trying, and a checkout that meets connections broken by the outage checks the next
  ready one at once (psycopg_pool paused 1, 2, 4 s... between failed checks).
- A server that takes no writes (a standby, a primary demoted with its sockets
  open: SQLSTATE 25006) is a lost connection too.  The part that meets it says
  so (:meth:`Server.unwritable`): every connection made to it before is then
  dropped, by the pool's check on checkout (:func:`check_connection`), the
  doorbell and the lease keeper, and new ones are dialled, which libpq's
  ``target_session_attrs=read-write`` steers to the new primary.  Said once,
  with its end.
- The pools check a connection on checkout (:func:`check_connection`): for free
  when it was handed out within :data:`CHECK_IDLE` seconds, with one round trip
  when it was idle longer, so a demoted or dead server is left within seconds.
  A pool that only reads, from a replica (``read_url``), is checked the same way
  for a dead server, but a server that takes no writes is what it wants
  (:func:`check_readable`).
- Every connection made here has TCP keepalives and a TCP user timeout
  (:data:`TCP_DEFAULTS`, unless its URL sets them): a server that stops
  answering without closing the socket (its host died, a firewall or NAT
  forgot the connection, a failover moved its address) fails the statement
  waiting on it within about 10 s, where the operating system's defaults
  would wait two hours for a reply, or 15 minutes for an acknowledgement.

Imports nothing of ours.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import random
import re
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool, PoolTimeout
from psycopg_pool.pool import AddConnection

logger = logging.getLogger(__name__)

#: While a server is down: the longest pause, in seconds, before a pool or the doorbell tries to
#: connect again.  The process makes one real attempt per 80% of it at most.
RETRY_INTERVAL = 0.5
_MIN_GAP = 0.8 * RETRY_INTERVAL
#: While a server is down: seconds between two "still unreachable" lines.
REMINDER_INTERVAL = 60.0
#: A pooled connection not handed out for this many seconds is checked with a round trip on checkout.
CHECK_IDLE = 2.0
#: libpq's TCP settings on every connection made here, each unless the URL (or connection string)
#: sets it: a connection whose server stops answering without closing it (a blackholed socket) fails
#: after 5 s of silence and 3 unanswered probes 2 s apart (keepalives: a statement waiting for its
#: reply), or after 10 s of data sent and not acknowledged (``tcp_user_timeout``, in ms; libpq 12+).
#: Linux's own: keepalives after two hours; unacknowledged data retried for about 15 minutes.
TCP_DEFAULTS = {
    "keepalives": "1",
    "keepalives_idle": "5",
    "keepalives_interval": "2",
    "keepalives_count": "3",
    "tcp_user_timeout": "10000",
}

C = TypeVar("C")

#: How a checkout waits between two failed checks when no connection is ready (a test may count them).
_pause = time.sleep


class Server:
    """What this process knows about reaching one server (host, port, database)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self._cond = threading.Condition()
        self._down_since: float | None = None  # monotonic
        self._cause = ""
        self._last_try = 0.0  # monotonic start of the last real attempt while down
        self._last_report = 0.0
        self._returns = 0  # how many times the server came back: wakes pause()
        #: Does a part of this process wait for the server (and resume when it is back)?  Only then is an
        #: outage announced; set by the database layer for its background parts.
        self.awaited = False
        self._announced = False  # this outage was logged
        #: Bumped when the server is found to take no writes: connections made before are dropped.
        self.generation = 0
        self._unwritable_since: float | None = None  # monotonic
        self._unwritable_report = 0.0
        self._unwritable_cause = ""

    @property
    def down(self) -> bool:
        return self._down_since is not None

    @property
    def tried_lately(self) -> bool:
        """While it is down: was it tried within two of the pools' paces (so some part of the process,
        a pool in the background, the doorbell, tries it again, and will see its return)?"""
        return self._down_since is not None and time.monotonic() - self._last_try <= 2 * RETRY_INTERVAL

    @property
    def cause(self) -> str:
        """Why the last attempt failed (libpq's words, the server named by :attr:`where`)."""
        return self._cause

    def connect(self, connect: Callable[[], C]) -> C:
        """Run *connect* (which opens a connection to this server), paced while the server is down."""
        if self._down_since is not None:
            with self._cond:
                now = time.monotonic()
                if self._down_since is not None:
                    if now - self._last_try < _MIN_GAP:
                        raise psycopg.OperationalError(f"{self._cause} (not tried again yet)")
                    self._last_try = now
        try:
            conn = connect()
        except psycopg.OperationalError as e:
            self._failed(e)
            raise
        self._connected()
        return conn

    def pause(self, seconds: float = RETRY_INTERVAL) -> None:
        """Wait *seconds*, or less if the server comes back meanwhile (some part of the process connected)."""
        with self._cond:
            returns = self._returns
            self._cond.wait_for(lambda: self._returns != returns, seconds)

    def _failed(self, error: psycopg.OperationalError) -> None:
        cause = connect_failure(error)
        now = time.monotonic()
        with self._cond:
            self._cause = cause
            if self._down_since is None:
                self._down_since = self._last_try = now
                self._announced = False
            if not self._announced:
                if not self.awaited:
                    return  # nobody here waits: the caller's error says it all
                self._announced, self._last_report = True, now
                logger.warning(
                    "Cannot connect to PostgreSQL at %s: %s. Trying again every %.1f s; work resumes when it is back.",
                    self.where,
                    cause,
                    RETRY_INTERVAL,
                )
            elif now - self._last_report >= REMINDER_INTERVAL:
                self._last_report = now
                logger.warning(
                    "PostgreSQL at %s is still unreachable after %.0f s: %s.", self.where, now - self._down_since, cause
                )

    @property
    def read_only(self) -> str | None:
        """While the server is known to take no writes: why (else ``None``)."""
        return self._unwritable_cause if self._unwritable_since is not None else None

    def unwritable(self, cause: str, made_in: int | None = None) -> bool:
        """A connection to this server (made in generation *made_in*) was answered as by a server that
        takes no writes: drop every connection made before now.  Said once, then once a minute while
        it lasts; its end is said by :meth:`writable`.  Returns whether this report started a new
        generation (one per event, not one per part that meets it)."""
        now = time.monotonic()
        with self._cond:
            bumped = made_in is None or made_in == self.generation
            if bumped:
                self.generation += 1
            if self._unwritable_since is None or not self._unwritable_cause:
                self._unwritable_cause = cause
            if self._unwritable_since is None:
                self._unwritable_since = self._unwritable_report = now
                line = (
                    f"PostgreSQL at {self.where} takes no writes ({cause}): a standby, or a primary demoted or "
                    "made read-only. Its connections are dropped and made again (with target_session_attrs="
                    "read-write in the URL, libpq finds the new primary); outcomes wait and are written there."
                )
            elif now - self._unwritable_report >= REMINDER_INTERVAL:
                self._unwritable_report = now
                line = f"PostgreSQL at {self.where} still takes no writes after {now - self._unwritable_since:.0f} s."
            else:
                return bumped
        logger.warning(line)
        return bumped

    def writable(self) -> None:
        """A connection was made to a server that says it takes writes: the unwritable spell, if any, is over."""
        if self._unwritable_since is None:
            return
        with self._cond:
            since, self._unwritable_since = self._unwritable_since, None
        if since is not None:
            logger.info(
                "PostgreSQL at %s takes writes again (it took none for %.1f s).", self.where, time.monotonic() - since
            )

    def _connected(self) -> None:
        if self._down_since is None:
            return
        with self._cond:
            if self._down_since is None:
                return
            down_for = time.monotonic() - self._down_since
            self._down_since = None
            self._returns += 1
            self._cond.notify_all()
            announced = self._announced
        if announced:
            logger.info("PostgreSQL at %s is reachable again (unreachable for %.1f s).", self.where, down_for)


_servers: dict[str, Server] = {}
_servers_lock = threading.Lock()


def _forget_servers() -> None:
    """In a forked child: the parent's view (and maybe a lock held at the fork) is not ours."""
    global _servers_lock
    _servers.clear()
    _servers_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_servers)


def where(conninfo: str) -> str:
    """``host:port/dbname`` of a connection string (``h1:p1,h2:p2/dbname`` with several hosts), never its
    password."""
    try:
        info = conninfo_to_dict(conninfo)
    except psycopg.Error:
        info = {}
    hosts = str(info.get("host") or "localhost").split(",")
    ports = str(info.get("port") or 5432).split(",")
    if len(ports) < len(hosts):  # libpq: one port for all hosts
        ports = ports[:1] * len(hosts)
    servers = ",".join(f"{host or 'localhost'}:{port or 5432}" for host, port in zip(hosts, ports, strict=False))
    return f"{servers}/{info.get('dbname') or ''}"


def server_for(conninfo: str) -> Server:
    """The one :class:`Server` of this process for the server *conninfo* names."""
    key = where(conninfo)
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = Server(key)
        return server


_MULTI_HOST = re.compile(r"^- host: '([^']*)', port: '([^']*)'.*? failed: (.*)$")
_ONE_HOST = re.compile(
    r'connection to server (?:at "([^"]*)"(?: \([^)]*\))?, port (\w+)|on socket "([^"]*)") failed: (.*)$'
)


def connect_failure(error: BaseException) -> str:
    """Why a connection could not be made, libpq's words without the server's name, which we give.

    With several hosts in the URL, each host tried and its own cause: ``h1:5432: session is
    read-only; h2:5432: Connection refused`` (psycopg lists them all; the first line names the last).
    """
    lines = str(error).splitlines() or [type(error).__name__]
    causes: dict[str, str] = {}
    for line in lines:  # psycopg's list of every attempt, if any
        if found := _MULTI_HOST.match(line):
            host, port, cause = found.groups()
            causes.setdefault(f"{host}:{port}", cause.rsplit(" failed: ", 1)[-1])
    for line in lines if not causes else ():  # else libpq's, one line per host
        if found := _ONE_HOST.search(line):
            host, port, socket, cause = found.groups()
            causes.setdefault(socket or f"{host}:{port}", cause)
    if len(causes) > 1:
        return "; ".join(f"{where}: {cause}" for where, cause in causes.items())
    # libpq says 'connection to server at "host", port N failed: <cause>'; we name the server ourselves.
    return lines[0].rsplit(" failed: ", 1)[-1]


def reports_read_only(conn: psycopg.Connection[Any]) -> bool:
    """Does the server of *conn* say (as of its last reply) that it takes no writes?

    PostgreSQL 14+ reports ``default_transaction_read_only`` and ``in_hot_standby`` with every reply
    after they change (a reload included); older servers and some proxies report neither: ``False``.
    """
    info = conn.info
    return info.parameter_status("default_transaction_read_only") == "on" or (
        info.parameter_status("in_hot_standby") == "on"
    )


@functools.lru_cache(maxsize=32)
def _tcp_defaults(conninfo: str, libpq: int) -> tuple[tuple[str, str], ...]:
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return ()  # the connection attempt says what is wrong with it
    unknown = {"tcp_user_timeout"} if libpq < 120000 else set()
    return tuple((k, v) for k, v in TCP_DEFAULTS.items() if k not in given and k not in unknown)


def tcp_defaults(conninfo: str) -> dict[str, str]:
    """The :data:`TCP_DEFAULTS` that *conninfo* does not set (libpq before 12: no ``tcp_user_timeout``)."""
    return dict(_tcp_defaults(conninfo, psycopg.pq.version()))


class PacedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose ``connect`` goes through the :class:`Server` it names, with
    :data:`TCP_DEFAULTS` the URL does not set, and which remembers that server's generation (see
    :meth:`Server.unwritable`) and when it was last checked."""

    server: Server
    generation: int
    checked_at: float

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:  # type: ignore[override]
        server = server_for(conninfo)
        seeded = _take_seed(conninfo, kwargs, server)
        if seeded is not None:
            return seeded
        conn = server.connect(lambda: cls.connect_once(conninfo, **kwargs))
        if not reports_read_only(conn):
            server.writable()
        return conn

    @property
    def stale(self) -> bool:
        """Made before its server was found to take no writes, or the server says it takes none now."""
        return self.generation != self.server.generation or reports_read_only(self)

    @classmethod
    def connect_once(cls, conninfo: str = "", **kwargs: Any) -> Any:
        """One attempt, not through the :class:`Server` (not paced, no outage said): what :meth:`connect`
        paces, and the start-up check's connection (startup.py), which may become a pool's first
        (:func:`seed`)."""
        server = server_for(conninfo)
        generation = server.generation
        conn = super().connect(conninfo, **{**tcp_defaults(conninfo), **kwargs})
        conn.server, conn.generation, conn.checked_at = server, generation, time.monotonic()
        return conn


#: Seconds a seeded connection waits to be taken: the pool it was left for connects within milliseconds.
SEED_WAIT = 5.0
#: What a seed must have been made with to stand for a new connection (the rest is how to connect).
_SEED_KEYS = ("autocommit", "prepare_threshold")
_seeds: dict[tuple[int, str], tuple[PacedConnection, dict[str, Any], float]] = {}
_seeds_lock = threading.Lock()


_DEFAULT = object()  # a setting not given: psycopg's default, which None is not (prepare_threshold)


def _settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Of *kwargs*, what a connection keeps from them."""
    return {k: kwargs.get(k, _DEFAULT) for k in _SEED_KEYS}


def seed(conn: PacedConnection, conninfo: str, kwargs: dict[str, Any]) -> None:
    """Leave *conn* (idle, made in this process with *kwargs* by :meth:`PacedConnection.connect_once`)
    for the next :meth:`PacedConnection.connect` to *conninfo* with the same settings: a worker's
    start-up check hands its connection to the pool it makes next, one connection fewer to wait for
    before the first claim (each took 6-10 ms on the 2-core VM, and a new server process is slower
    at its first statements).  A seed not taken within :data:`SEED_WAIT` seconds is closed."""
    unseed(conninfo)
    with _seeds_lock:
        _seeds[(os.getpid(), conninfo)] = (conn, _settings(kwargs), time.monotonic())


def unseed(conninfo: str) -> None:
    """Close what :func:`seed` left for *conninfo* in this process, if it is still there."""
    with _seeds_lock:
        found = _seeds.pop((os.getpid(), conninfo), None)
    if found is not None:
        found[0].close()


def _take_seed(conninfo: str, kwargs: dict[str, Any], server: Server) -> PacedConnection | None:
    """The connection :func:`seed` left for *conninfo*, if it still stands for a new one made with *kwargs*."""
    if not _seeds:
        return None
    with _seeds_lock:
        found = _seeds.pop((os.getpid(), conninfo), None)
    if found is None:
        return None
    conn, made_with, at = found
    usable = (
        made_with == _settings(kwargs)
        and time.monotonic() - at <= SEED_WAIT
        and not conn.closed
        and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        and conn.generation == server.generation
    )
    if not usable:
        conn.close()
        return None
    if not reports_read_only(conn):
        server.writable()
    return conn


def check_connection(conn: psycopg.Connection[Any]) -> None:
    """The pools' check on checkout: raises (and closes *conn*, so the pool replaces it) when it was made
    before its server was found to take no writes, or its server says it takes none (asked again with
    one round trip, as is one not handed out for :data:`CHECK_IDLE` seconds), or that round trip fails."""
    if not isinstance(conn, PacedConnection):
        return
    if conn.generation != conn.server.generation:
        conn.close()
        raise psycopg.OperationalError("connection made before its server was found to take no writes")
    now = time.monotonic()
    read_only = reports_read_only(conn)
    if now - conn.checked_at > CHECK_IDLE or read_only:
        try:
            conn.execute(b"")  # the reply carries the server's reported settings, a reload's included
        except psycopg.Error:
            conn.close()
            raise
        read_only = reports_read_only(conn)
    conn.checked_at = now
    if read_only:
        conn.server.unwritable("it reports itself read-only", conn.generation)
        conn.close()
        raise psycopg.OperationalError("connection to a server that takes no writes")
    # One made while the server took no writes, which says now that it takes them: the spell is over
    # (else only a new connection would say so, and sends would still be refused as to a read-only server).
    conn.server.writable()


def check_readable(conn: psycopg.Connection[Any]) -> None:
    """The check on checkout of a pool that only reads (operators' reads from a replica: ``read_url``):
    as :func:`check_connection` for a dead server (one round trip when the connection was not handed
    out for :data:`CHECK_IDLE` seconds), but a server that takes no writes is what it wants; it
    neither drops the connection nor says anything about that server."""
    if not isinstance(conn, PacedConnection):
        return
    now = time.monotonic()
    if now - conn.checked_at > CHECK_IDLE:
        try:
            conn.execute(b"")
        except psycopg.Error:
            conn.close()
            raise
    conn.checked_at = now


class PacedPool(ConnectionPool):
    """psycopg_pool's ``ConnectionPool``, reconnecting every :data:`RETRY_INTERVAL` at the longest
    (jittered) instead of after its doubling backoff, its attempts paced per server.

    psycopg_pool schedules a failed connection's next attempt with ``schedule_task``; only that
    delay is capped here.  Its ``reconnect_timeout`` still applies: a connection it gave up on
    is made again when a client asks for one.
    """

    def __init__(self, conninfo: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("connection_class", PacedConnection)
        kwargs.setdefault("check", check_connection)
        # Never give up reconnecting (psycopg_pool's default: after 5 minutes): while its server is
        # down, the pool's own attempts are what sees it back (a send fails at once meanwhile).
        kwargs.setdefault("reconnect_timeout", math.inf)
        super().__init__(conninfo, **kwargs)

    @property
    def ready(self) -> int:
        """Connections idle in the pool now (none is made or checked to say so)."""
        return len(self._pool)

    def _getconn_with_check_loop(self, deadline: float) -> Any:
        """psycopg_pool's checkout, but a connection that fails its check (one broken by a restart,
        made before a failover) is followed at once by the next ready one: psycopg_pool paused 1, 2,
        4 s... between two failed checks, so a pool of a few connections broken by an outage held the
        part asking (a consumer's claim, the outcome writer) for seconds after the server's return.
        With none ready, the wait is the pool's own (a new connection, paced by :class:`Server`); a
        new connection that fails its check (a standby's) is followed by a pause of at most
        :data:`RETRY_INTERVAL`, so such a server is not dialled in a loop."""
        while True:
            was_ready = bool(self._pool)  # (read unlocked: a hint, whichever connection comes)
            conn = self._getconn_unchecked(deadline - time.monotonic())
            try:
                self._check_connection(conn)
            except Exception:
                self._putconn(conn, from_getconn=True)
            except BaseException:  # cancellation, KeyboardInterrupt: keep the connection, try no more
                self._putconn(conn, from_getconn=True)
                raise
            else:
                return conn
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolTimeout()
            if not was_ready:  # a connection made for us failed: the next new one would too, for now
                _pause(min(random.uniform(_MIN_GAP, RETRY_INTERVAL), left))
            # else one that idled through an outage or failover: the next one is checked at once

    def _shrink_pool(self) -> None:
        """Every ``max_idle`` seconds: close every connection above ``min_size`` that stayed unused
        all that time, not one of them per ``max_idle`` as psycopg_pool does: a worker's start (every
        consumer's first claim at once) leaves a pool that an idle worker must not keep for hours
        (docs/operating.md, "Connections")."""
        with self._lock:
            unused = self._nconns_min
        for _ in range(max(unused, 1)):
            before = self._nconns
            super()._shrink_pool()  # after the first, what is idle now is what stayed unused
            if self._nconns >= before:
                break

    def schedule_task(self, task: Any, delay: float) -> None:
        if isinstance(task, AddConnection):
            delay = min(delay, random.uniform(_MIN_GAP, RETRY_INTERVAL))
        super().schedule_task(task, delay)


__all__ = [
    "CHECK_IDLE",
    "RETRY_INTERVAL",
    "TCP_DEFAULTS",
    "REMINDER_INTERVAL",
    "PacedConnection",
    "PacedPool",
    "Server",
    "check_connection",
    "check_readable",
    "connect_failure",
    "reports_read_only",
    "seed",
    "server_for",
    "tcp_defaults",
    "unseed",
    "where",
]
