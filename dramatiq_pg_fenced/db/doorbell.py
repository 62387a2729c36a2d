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
``!interrupt <message id> <delivery>``).  An *attendant*
(:meth:`Doorbell.attend`, the broker's turns) is told of each new listening
connection, may use it now and then, and is told when it is lost.  It may
also decide *whether* to listen (every listening backend of a database
pays a transaction for every NOTIFY in it, on any channel): ``admit`` is
asked before LISTEN, and may wait on the connection a few seconds for its
turn and say no (asked again then); ``stay`` is asked after each ring and
each check, and a no makes the doorbell UNLISTEN, tell ``leave`` and ask
``admit`` again.  Whatever rang while it did not listen is found by the
waiters' own checks: when it listens again every waiter is woken.  The
broker's consumers, the results backend and the rate limiters all use this
class.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import psycopg
from psycopg import sql

from .reconnect import RETRY_INTERVAL, PacedConnection, Server, reports_read_only, server_for

logger = logging.getLogger(__name__)

#: Seconds between two round trips of the listening connection that ask whether its server still
#: takes writes (and is still there).
CHECK_EVERY = 5.0


class Attendant(Protocol):
    """What rides a doorbell's listening connection (the broker's :class:`~.turns.Turns`)."""

    def listening(self, conn: psycopg.Connection) -> None:
        """A new listening connection (LISTEN done)."""

    def check(self, conn: psycopg.Connection) -> bool:
        """Every second or so, on the listening connection; returns whether it made a round trip on it
        (it runs a statement only when one is due; that one then stands for the doorbell's check)."""

    def deaf(self) -> None:
        """The listening connection is lost (or closing)."""

    # Optional (the broker's turns): whether to listen at all; see the module docstring.
    # def admit(self, conn: psycopg.Connection) -> bool: ...
    # def stay(self, key: str | None) -> bool: ...
    # def leave(self, conn: psycopg.Connection) -> None: ...
    # def heard(self) -> None: ...  (LISTEN is in place: it hears from now on)


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
        self._timers_rung: dict[str, int] = {}  # per key: how many of their timers rang it
        self._waiters: dict[str, set[threading.Event]] = {}
        self._handlers: dict[str, Callable[[str], None]] = {}
        self._attendants: list[Attendant] = []
        self._ring_hooks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection | None = None  # the listening connection while there is one

    def on(self, command: str, handler: Callable[[str], None]) -> None:
        """Call *handler* with the argument of every ``"!command arg"`` notification."""
        with self._lock:
            self._handlers[command] = handler

    def attend(self, attendant: Attendant) -> None:
        """Tell *attendant* of the listening connection (once per attendant)."""
        with self._lock:
            if attendant not in self._attendants:
                self._attendants.append(attendant)

    def subscribe(self, key: str, event: threading.Event | None = None) -> threading.Event:
        """An event set whenever *key* rings (or may have rung); starts listening.  *event*: one of
        yours, to wait for several keys at once."""
        event = threading.Event() if event is None else event
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

    def timers_rung(self, key: str) -> int:
        """How many times a timer (a "due later" notification's) rang *key* when it was due."""
        return self._timers_rung.get(key, 0)

    def stop(self) -> None:
        self._stopped.set()
        conn = self._conn
        if conn is not None:  # a wait for its turn to listen ends now (its seats are freed with it)
            try:
                conn.cancel_safe(timeout=1.0)
            except Exception:  # noqa: BLE001 - closing anyway
                logger.debug("Could not cancel the %s listener's wait.", self.channel, exc_info=True)

    def ring(self, key: str | None = None) -> None:
        """Wake the waiters of *key*, or everyone for ``None`` / ``"*"``."""
        with self._lock:
            if key is None or key == "*":
                keys = list(self._waiters)
                events = [e for waiters in self._waiters.values() for e in waiters]
            else:
                keys = [key]
                events = list(self._waiters.get(key, ()))
            hooks = list(self._ring_hooks)
        for hook in hooks:  # before the waiters wake: they read what the hooks recorded
            for k in keys:
                hook(k)
        for event in events:
            event.set()

    def on_ring(self, hook: Callable[[str], None]) -> None:
        """Call *hook* with each key rung (on the listener's thread, in the order of the notifications)."""
        with self._lock:
            if hook not in self._ring_hooks:
                self._ring_hooks.append(hook)

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
                    if lost:
                        logger.info("LISTEN %s is back.", self.channel)
                    lost = False
                    self._conn = conn
                    self._attend("listening", conn)
                    while not self._stopped.is_set() and not conn.stale:
                        if not self._attend("admit", conn):  # not our turn to listen; it waited, then checked
                            if reports_read_only(conn):
                                server.unwritable("it reports itself read-only", conn.generation)
                            continue
                        self._listening(conn, server)
                    if conn.stale and not self._stopped.is_set():
                        raise psycopg.OperationalError("the server no longer takes writes")
            except psycopg.Error as e:
                self._attend("deaf")  # before the ring below: the woken re-read their turns
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

    def _listening(self, conn: PacedConnection, server: Server) -> None:
        """LISTEN on *conn* until the doorbell stops, the server takes no writes or an attendant says
        not to stay (then UNLISTEN, and the attendants are told)."""
        listen = sql.Identifier(self.channel)
        conn.execute(sql.SQL("LISTEN {}").format(listen))
        self._attend("heard", conn)
        self.ring()  # whatever was sent while we were not listening is found by one check
        checked = time.monotonic()
        while not self._stopped.is_set() and not conn.stale:
            stay = self._listen(conn)
            # Each second at most; an attendant's round trip (when one is due) is the check's too.
            asked = self._attend("check", conn)
            if asked or time.monotonic() - checked > CHECK_EVERY:
                checked = time.monotonic()
                if not asked:
                    conn.execute(b"")  # its reply carries the server's settings, a reload's included
                if reports_read_only(conn):
                    server.unwritable("it reports itself read-only", conn.generation)
            if not (stay and self._stay(None)):
                conn.execute(sql.SQL("UNLISTEN {}").format(listen))
                self._attend("leave", conn)
                return

    def _stay(self, key: str | None) -> bool:
        with self._lock:
            stays = [getattr(a, "stay", None) for a in self._attendants]
        return all(stay(key) for stay in stays if stay is not None)

    def _attend(self, event: str, conn: psycopg.Connection | None = None) -> bool:
        """Tell the attendants of *event*; returns whether one made a round trip on *conn* (for
        ``admit``: whether all admit).  A lost connection passes through, anything else is logged
        (and the attendant told it is deaf: it must not act on what it could not read)."""
        with self._lock:
            attendants = list(self._attendants)
        asked = event == "admit"
        for attendant in attendants:
            try:
                if conn is None:
                    attendant.deaf()
                elif event == "check":
                    asked = bool(attendant.check(conn)) or asked
                elif event in ("admit", "leave", "heard"):
                    act = getattr(attendant, event, None)
                    if act is not None:
                        asked = bool(act(conn) if event != "heard" else act()) and asked
                else:
                    attendant.listening(conn)
            except psycopg.OperationalError:
                raise
            except Exception:
                logger.warning("%s on the %s listening connection failed.", event, self.channel, exc_info=True)
                attendant.deaf()
        return asked

    def _listen(self, conn: psycopg.Connection) -> bool:
        """Wait up to a second, or until the next timer is due, for one batch of notifications; ring them
        and the due timers.  (One batch at a time: leaving psycopg's generator mid-batch would drop the rest.)
        Returns whether the attendants would stay after those rings."""
        until = time.monotonic() + 1.0
        if self._timers:
            until = min(until, self._timers[0][0])
        rung: list[str] = []
        for note in conn.notifies(timeout=max(until - time.monotonic(), 0.0), stop_after=1):
            if note.payload.startswith("!"):
                self._command(note.payload[1:])
                continue
            key, tab, wait_ms = note.payload.partition("\t")
            if not (tab and self.timed):
                self.ring(note.payload)  # in order with the commands (Answered counts them so)
                rung.append(note.payload)
                continue
            try:
                self._add_timer(time.monotonic() + int(wait_ms) / 1000, key)
            except ValueError:
                self.ring(key)
                rung.append(key)
                continue
            self._timed[key] = self._timed.get(key, 0) + 1
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            rung.append(heapq.heappop(self._timers)[1])
            self._timers_rung[rung[-1]] = self._timers_rung.get(rung[-1], 0) + 1
            self.ring(rung[-1])
        return all([self._stay(key) for key in rung])  # each asked, after the batch (it is read whole)

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
    knows to claim from the head (see :class:`~.floor.Floor`).  *ring*
    false: the ``"!back"`` payloads only (a statement to follow rings).
    """
    return [f"!back {q}" for q in queues] + (list(queues) if ring else [])
