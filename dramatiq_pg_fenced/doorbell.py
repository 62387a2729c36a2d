"""LISTEN/NOTIFY doorbells: one listening connection per process and channel.

Producers ring with a short key (a queue name, a result key), never a
payload; ``"*"`` wakes everyone.  Waiters always re-check the database after
a wake-up and at least every poll interval, and every waiter is woken when
the connection is (re)established, so a notification lost while nobody
listened costs one check, never a message or a result.  The broker's
consumers, the results backend and the rate limiters all use this class.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql

logger = logging.getLogger(__name__)


class Doorbell:
    def __init__(self, conninfo: str, channel: str, *, connect_timeout: int = 5) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.connect_timeout = connect_timeout
        self._waiters: dict[str, set[threading.Event]] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

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
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=self.connect_timeout) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    backoff = 0.1
                    self.ring()  # whatever was sent while we were not listening is found by one check
                    while not self._stopped.is_set():
                        for note in conn.notifies(timeout=1.0):
                            self.ring(note.payload)
            except psycopg.Error as e:
                if self._stopped.is_set():
                    return  # closing: the server may go away first
                logger.warning("LISTEN %s connection lost (%s); waiters poll until it is back.", self.channel, e)
                self.ring()
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 5.0)
