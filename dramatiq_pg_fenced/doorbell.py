"""LISTEN/NOTIFY doorbells: one listening connection per process and channel.

Producers ring with a short key (a queue name, a result key), never a
payload; ``"*"`` wakes everyone.  On a *timed* channel (the broker's), the
key may be followed by a tab and a number of milliseconds: "this key is due
then" (a delayed message, a retry's backoff), and the key rings when that
time has passed, so delays do not wait for the next poll.  Waiters always
re-check the database after a wake-up and at least every poll interval, and
every waiter is woken when the connection is (re)established, so a
notification lost while nobody listened costs one check, never a message or
a result.  A lost connection is made again at once, then at the pace of
reconnect.py while the server is away.  So is one to a server that no longer
takes writes (a demoted primary keeps its sockets open, and producers now
notify on the new one): the listener asks its server every
:data:`CHECK_EVERY` seconds, and leaves at once when another part of the
process has found it read-only.  A payload that starts with ``!`` is
a command, ``"!name arg"``, passed to the handler registered with
:meth:`Doorbell.on` (the broker's ``!cancel <message id>`` and
``!interrupt <message id> <delivery>``).  The broker's consumers, the
results backend and the rate limiters all use this class.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

from .reconnect import RETRY_INTERVAL, PacedConnection, reports_read_only, server_for

logger = logging.getLogger(__name__)

#: Seconds between two round trips of the listening connection that ask whether its server still
#: takes writes (and is still there).
CHECK_EVERY = 5.0


class Doorbell:
    #: Timers kept at most; beyond that the farthest wait for the poll.
    MAX_TIMERS = 10_000

    def __init__(self, conninfo: str, channel: str, *, connect_timeout: int = 5, timed: bool = False) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.connect_timeout = connect_timeout
        self.timed = timed
        self._timers: list[tuple[float, str]] = []  # (monotonic due time, key), a heap; listener thread only
        self._timed: dict[str, int] = {}  # per key: how many "due later" notifications arrived
        self._waiters: dict[str, set[threading.Event]] = {}
        self._handlers: dict[str, Callable[[str], None]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def on(self, command: str, handler: Callable[[str], None]) -> None:
        """Call *handler* with the argument of every ``"!command arg"`` notification."""
        with self._lock:
            self._handlers[command] = handler

    def subscribe(self, key: str) -> threading.Event:
        """An event set whenever *key* rings (or may have rung); starts listening."""
        event = threading.Event()
        with self._lock:
            self._waiters.setdefault(key, set()).add(event)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"dramatiq-pg-{self.channel}", daemon=True)
                self._thread.start()
        return event

    def unsubscribe(self, key: str, event: threading.Event) -> None:
        with self._lock:
            waiters = self._waiters.get(key)
            if waiters is not None:
                waiters.discard(event)
                if not waiters:
                    del self._waiters[key]

    @contextmanager
    def waiting(self, key: str) -> Iterator[threading.Event]:
        event = self.subscribe(key)
        try:
            yield event
        finally:
            self.unsubscribe(key, event)

    def has_waiters(self, key: str) -> bool:
        """Is anyone subscribed to *key*?"""
        with self._lock:
            return bool(self._waiters.get(key))

    def timed_count(self, key: str) -> int:
        """How many "due later" notifications *key* got: a change means new delayed rows."""
        return self._timed.get(key, 0)

    def stop(self) -> None:
        self._stopped.set()

    def ring(self, key: str | None = None) -> None:
        """Wake the waiters of *key*, or everyone for ``None`` / ``"*"``."""
        with self._lock:
            if key is None or key == "*":
                events = [e for waiters in self._waiters.values() for e in waiters]
            else:
                events = list(self._waiters.get(key, ()))
        for event in events:
            event.set()

    def _run(self) -> None:
        server = server_for(self.conninfo)
        lost = False  # since the last LISTEN that worked; said once, not per try
        while not self._stopped.is_set():
            try:
                with PacedConnection.connect(
                    self.conninfo, autocommit=True, connect_timeout=self.connect_timeout
                ) as conn:
                    if conn.stale:  # a server that takes no writes: producers notify elsewhere
                        raise psycopg.OperationalError("the server takes no writes")
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    if lost:
                        logger.info("LISTEN %s is back.", self.channel)
                    lost = False
                    self.ring()  # whatever was sent while we were not listening is found by one check
                    checked = time.monotonic()
                    while not self._stopped.is_set() and not conn.stale:
                        self._listen(conn)
                        if time.monotonic() - checked > CHECK_EVERY:
                            checked = time.monotonic()
                            conn.execute(b"")  # its reply carries the server's settings, a reload's included
                            if reports_read_only(conn):
                                server.unwritable("it reports itself read-only", conn.generation)
                    if conn.stale and not self._stopped.is_set():
                        raise psycopg.OperationalError("the server no longer takes writes")
            except psycopg.Error as e:
                if self._stopped.is_set():
                    return  # closing: the server may go away first
                if not lost:
                    # A terminated connection is made again at once; a server that is away, every
                    # RETRY_INTERVAL, or as soon as another part of the process connects.
                    logger.info("LISTEN %s connection lost (%s); waiters poll until it is back.", self.channel, e)
                    lost = True
                    self.ring()
                    continue
                server.pause(RETRY_INTERVAL)

    def _listen(self, conn: psycopg.Connection) -> None:
        """Wait up to a second, or until the next timer is due, for one batch of notifications; ring them
        and the due timers.  (One batch at a time: leaving psycopg's generator mid-batch would drop the rest.)"""
        until = time.monotonic() + 1.0
        if self._timers:
            until = min(until, self._timers[0][0])
        for note in conn.notifies(timeout=max(until - time.monotonic(), 0.0), stop_after=1):
            if note.payload.startswith("!"):
                self._command(note.payload[1:])
                continue
            key, tab, wait_ms = note.payload.partition("\t")
            if not (tab and self.timed):
                self.ring(note.payload)
                continue
            try:
                self._add_timer(time.monotonic() + int(wait_ms) / 1000, key)
            except ValueError:
                self.ring(key)
                continue
            self._timed[key] = self._timed.get(key, 0) + 1
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            self.ring(heapq.heappop(self._timers)[1])

    def _command(self, text: str) -> None:
        command, _, arg = text.partition(" ")
        handler = self._handlers.get(command)
        if handler is not None:
            try:
                handler(arg)
            except Exception:
                logger.exception("Handler of %r notifications failed.", command)

    def _add_timer(self, due: float, key: str) -> None:
        if len(self._timers) >= self.MAX_TIMERS:
            farthest = max(self._timers)
            if due >= farthest[0]:
                return  # the poll finds it
            self._timers.remove(farthest)
            heapq.heapify(self._timers)
        heapq.heappush(self._timers, (due, key))


def poll_pauses(poll_interval: float, *, listening: bool) -> Iterator[float]:
    """Pauses between re-reads of a blocking wait.

    Listening, a notification ends a pause early: ``poll_interval`` each.
    Without LISTEN (PgBouncer) nothing does: 10 ms first, doubling up to
    ``poll_interval``, so what is ready within milliseconds is read within
    milliseconds, and a long wait costs a few reads more than plain polling.
    """
    pause = poll_interval if listening else min(0.01, poll_interval)
    while True:
        yield pause
        pause = min(pause * 2, poll_interval)


def look_back(queues: list[str], *, ring: bool = True) -> list[str]:
    """Payloads that tell consumers rows went back to *queues* at their old place in line, then ring them.

    ``"!back <queue>"`` comes first, so a consumer woken by the ring already
    knows to claim from the head (see :class:`~.consumer.Floor`).  *ring*
    false: the ``"!back"`` payloads only (a statement to follow rings).
    """
    return [f"!back {q}" for q in queues] + (list(queues) if ring else [])
