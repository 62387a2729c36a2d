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
- The outage is logged once when it starts (server and cause), as a reminder at
  most every :data:`REMINDER_INTERVAL`, and once when it ends.  The parts do
  not log a line per try.  Only when some part of the process waits for the
  server (:attr:`Server.awaited`: a worker's consumers): a ``send()`` or a
  command that fails says why itself, and retries nothing.

Imports nothing of ours.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import ConnectionPool
from psycopg_pool.pool import AddConnection

logger = logging.getLogger(__name__)

#: While a server is down: the longest pause, in seconds, before a pool or the doorbell tries to
#: connect again.  The process makes one real attempt per 80% of it at most.
RETRY_INTERVAL = 0.5
_MIN_GAP = 0.8 * RETRY_INTERVAL
#: While a server is down: seconds between two "still unreachable" lines.
REMINDER_INTERVAL = 60.0

C = TypeVar("C")


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

    @property
    def down(self) -> bool:
        return self._down_since is not None

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
        # libpq says 'connection to server at "host", port N failed: <cause>'; we name the server ourselves.
        cause = (str(error).splitlines() or [type(error).__name__])[0].rsplit(" failed: ", 1)[-1]
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
    """``host:port/dbname`` of a connection string, never its password."""
    try:
        info = conninfo_to_dict(conninfo)
    except psycopg.Error:
        info = {}
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


def server_for(conninfo: str) -> Server:
    """The one :class:`Server` of this process for the server *conninfo* names."""
    key = where(conninfo)
    with _servers_lock:
        server = _servers.get(key)
        if server is None:
            server = _servers[key] = Server(key)
        return server


class PacedConnection(psycopg.Connection[Any]):
    """A psycopg connection whose ``connect`` goes through the :class:`Server` it names."""

    @classmethod
    def connect(cls, conninfo: str = "", **kwargs: Any) -> Any:  # type: ignore[override]
        return server_for(conninfo).connect(lambda: super(PacedConnection, cls).connect(conninfo, **kwargs))


class PacedPool(ConnectionPool):
    """psycopg_pool's ``ConnectionPool``, reconnecting every :data:`RETRY_INTERVAL` at the longest
    (jittered) instead of after its doubling backoff, its attempts paced per server.

    psycopg_pool schedules a failed connection's next attempt with ``schedule_task``; only that
    delay is capped here.  Its ``reconnect_timeout`` still applies: a connection it gave up on
    is made again when a client asks for one.
    """

    def __init__(self, conninfo: str = "", **kwargs: Any) -> None:
        kwargs.setdefault("connection_class", PacedConnection)
        super().__init__(conninfo, **kwargs)

    def schedule_task(self, task: Any, delay: float) -> None:
        if isinstance(task, AddConnection):
            delay = min(delay, random.uniform(_MIN_GAP, RETRY_INTERVAL))
        super().schedule_task(task, delay)


__all__ = ["RETRY_INTERVAL", "REMINDER_INTERVAL", "PacedConnection", "PacedPool", "Server", "server_for", "where"]
