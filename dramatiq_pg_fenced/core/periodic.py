"""A background chore: a daemon thread that runs ``tick()`` every interval until stopped."""

from __future__ import annotations

import logging
import threading

import psycopg

from ..db.reconnect import RETRY_INTERVAL
from ..errors import SchemaError, lost_connection


class Periodic:
    """Subclasses set :attr:`name` and :attr:`what` and implement :meth:`tick`.

    A failed tick never ends the thread: the next one tries again, after
    :data:`~.reconnect.RETRY_INTERVAL` when the connection was lost (the
    database may be back from an outage; reconnect.py logs the outage once,
    so the lost connection is only a debug line here).  A statement the
    server refused is a warning; anything else is logged with its traceback.
    """

    name = "dramatiq-pg-periodic"  #: the thread's name
    what = "A background chore"  #: the subject of its log lines

    def __init__(self, interval: float, logger: logging.Logger) -> None:
        self.interval = interval
        self.logger = logger
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def halt(self) -> None:
        """Ask the thread to end after its current tick, without waiting for it."""
        self._stopped.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread and wait (at most *timeout* seconds) for a tick under way: one that went on
        after the broker closed its pool would open a new one, left to leak."""
        self.halt()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def tick(self) -> None:
        raise NotImplementedError

    def next_wait(self) -> float:
        """Seconds to wait before the next tick (the fixed interval; a subclass may decide per tick)."""
        return self.interval

    def _run(self) -> None:
        lost = False
        while not self._stopped.wait(min(RETRY_INTERVAL, self.next_wait()) if lost else self.next_wait()):
            lost = False
            try:
                self.tick()
            except SchemaError:
                pass  # the database layer says so, once (then once a minute)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                lost = lost_connection(e)
                if lost:
                    self.logger.debug("%s lost its connection: %s", self.what, e)
                else:
                    self.logger.warning("%s could not run a statement: %s", self.what, e)
            except Exception:
                self.logger.exception("%s failed; trying again.", self.what)
