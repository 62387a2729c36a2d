"""The LISTEN/NOTIFY doorbell: one listening connection per process.

Producers ring with the queue name only (never the payload).  Consumers wait
on their queue's event with a timeout, so a lost notification only costs one
poll interval: polling alone is correct, the doorbell only makes it fast.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import psycopg
from psycopg import sql

logger = logging.getLogger(__name__)


class Doorbell:
    def __init__(self, conninfo: str, channel: str, *, connect_timeout: int = 5) -> None:
        self.conninfo = conninfo
        self.channel = channel
        self.connect_timeout = connect_timeout
        self.events: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def event(self, queue_name: str) -> threading.Event:
        with self._lock:
            event = self.events[queue_name]
        self.start()
        return event

    def ring_all(self) -> None:
        with self._lock:
            for event in self.events.values():
                event.set()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dramatiq-pg-doorbell", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stopped.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=self.connect_timeout) as conn:
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    backoff = 0.1
                    self.ring_all()  # anything sent while we were away is found by one claim
                    while not self._stopped.is_set():
                        for note in conn.notifies(timeout=1.0):
                            with self._lock:
                                event = self.events.get(note.payload)
                            if event is not None:
                                event.set()
            except psycopg.Error as e:
                logger.warning("Doorbell connection lost (%s); consumers poll until it is back.", type(e).__name__)
                self.ring_all()
                self._stopped.wait(backoff)
                backoff = min(backoff * 2, 5.0)
