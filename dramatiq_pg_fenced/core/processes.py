"""Worker processes, for operators: each registers itself in ``{schema}.process``.

A process that runs a Dramatiq worker on the broker (``FencedDelivery``'s
``after_worker_boot``) writes its row at once: host, pid, queues, threads,
package version.  Its maintenance loop (a thread it runs anyway, on the pool
connection the rescue uses) writes it again every :data:`HEARTBEAT_SECONDS`
with this process's counts from its lease registry: ``busy`` (actors running
now) and ``prefetched`` (claimed, not started), per queue too, and the ids of
the messages whose actor runs (as many as its busy threads at most).  That is
one small upsert per process per heartbeat, whatever the traffic.  A clean
shutdown (``after_worker_shutdown``) deletes the row; a row whose heartbeat
stopped for :data:`STALE_AFTER_BEATS` of its intervals (its ``beat_seconds``:
:data:`HEARTBEAT_SECONDS`, or the maintenance loop's interval if longer) is
shown ``stale``, and the
once-a-minute purge of any process deletes it after :data:`PURGE_AFTER`
seconds.

Readers (:func:`processes`, the overview's running / prefetched split and the
running list's ``started`` in :mod:`.admin`) see each process's counts as of
its last heartbeat.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from datetime import datetime, timezone
from typing import Any

import psycopg
from dramatiq.errors import ConnectionClosed

from ..config import __version__
from ..db.database import Database
from ..db.statements import Statements
from .leases import Leases

#: Seconds between two heartbeats of a worker process.
HEARTBEAT_SECONDS = 10.0
#: Heartbeats missed before a process is shown stale.
STALE_AFTER_BEATS = 3
#: Seconds after its last heartbeat a stale process's row is deleted.
PURGE_AFTER = 3600


def package_version() -> str:
    """This package's version (``__version__``, which the wheel's metadata is built from: reading the
    installed metadata instead took 7-11 ms of a worker's start-up, measured)."""
    return __version__


class Heartbeat:
    """This process's row: written at worker boot, again every heartbeat, deleted at clean shutdown.

    Thread-safe: the worker's main thread registers and unregisters, the maintenance thread beats.
    """

    def __init__(
        self, leases: Leases, database: Database, statements: Statements, process_id: str, *, tick: float
    ) -> None:
        """*tick*: seconds between two runs of the maintenance loop that beats (a heartbeat waits for one)."""
        self.leases = leases
        self.tick = tick
        self.database = database
        self.statements = statements
        self.process_id = process_id
        self._lock = threading.Lock()
        self._queues: list[str] | None = None  # None: no worker runs here (nothing to show)
        self._threads = 0
        self._last = 0.0

    def register(self, queues: Iterable[str], threads: int, logger: logging.Logger) -> None:
        """A worker starts in this process: write the row now (one statement; a failure is only logged,
        the next heartbeat writes it)."""
        with self._lock:
            self._queues = sorted(set(queues))
            self._threads = int(threads)
            self._last = 0.0
        try:
            with self.database.connection() as conn:
                self.beat(conn)
        except ConnectionClosed as e:  # the outage is logged once (reconnect.py); the next heartbeat writes it
            logger.debug("Could not register this worker process (%s) yet: %s", self.process_id, e)
        except Exception as e:  # the maintenance loop tries again at the next heartbeat
            logger.warning("Could not register this worker process (%s): %s", self.process_id, e)

    @property
    def active(self) -> bool:
        """Does a worker run in this process (registered, not shut down)?"""
        with self._lock:
            return self._queues is not None

    def due(self) -> bool:
        """Is a heartbeat due (a worker runs here, and the last one is older than :data:`HEARTBEAT_SECONDS`)?"""
        with self._lock:
            return self._queues is not None and time.monotonic() - self._last >= HEARTBEAT_SECONDS

    def beat(self, conn: psycopg.Connection) -> bool:
        """Write the row with the counts of now (one upsert); ``False`` if no worker runs here."""
        with self._lock:
            if self._queues is None:
                return False
            queues, threads = self._queues, self._threads
            self._last = time.monotonic()
        per_queue = self.leases.activity()
        running = self.leases.running_since()
        host, pid = os.uname().nodename, os.getpid()
        params = {
            "id": self.process_id,
            "host": host,
            "pid": pid,
            "queues": queues,
            "threads": threads,
            "busy": sum(b for b, _ in per_queue.values()),
            "prefetched": sum(p for _, p in per_queue.values()),
            "per_queue": json.dumps({q: [b, p] for q, (b, p) in sorted(per_queue.items())}),
            "running": [mid for mid, _ in running],
            "running_since": [datetime.fromtimestamp(t, timezone.utc) for _, t in running],
            "version": package_version(),
            "beat_seconds": max(HEARTBEAT_SECONDS, self.tick),
        }
        conn.execute(self.statements.process_beat, params)
        return True

    def unregister(self) -> None:
        """The worker shut down cleanly: delete the row (best effort: a row left behind goes stale)."""
        with self._lock:
            if self._queues is None:
                return
            self._queues = None
        try:
            with self.database.connection() as conn:
                conn.execute(self.statements.process_delete, [self.process_id])
        except Exception:  # shown stale, purged later
            pass


_COLUMNS = (
    "process_id", "host", "pid", "queues", "threads", "busy", "prefetched", "per_queue", "version",
    "started_at", "heartbeat_at", "heartbeat_age", "beat_seconds",
)  # fmt: skip


def processes(database: Database, statements: Statements, *, stale_after: float | None = None) -> list[dict[str, Any]]:
    """Every registered worker process, the most recent heartbeat first.

    Each: ``process_id`` (its lease holder's prefix), ``host``, ``pid``,
    ``queues``, ``threads``, ``busy`` (actors running), ``prefetched``
    (claimed, not started), ``per_queue`` (queue -> ``{"busy", "prefetched"}``),
    ``version``, ``started_at``, ``heartbeat_at``, ``heartbeat_age`` (seconds,
    by the database clock), ``beat_seconds`` (its heartbeat's interval) and
    ``stale``: no heartbeat for *stale_after* seconds (default
    :data:`STALE_AFTER_BEATS` of its intervals).
    """
    rows = database.run(lambda conn: conn.execute(statements.process_list).fetchall())
    out = []
    for row in rows:
        info = dict(zip(_COLUMNS, row, strict=True))
        info["queues"] = list(info["queues"])
        info["per_queue"] = {q: {"busy": v[0], "prefetched": v[1]} for q, v in (info["per_queue"] or {}).items()}
        info["heartbeat_age"] = float(info["heartbeat_age"])
        limit = stale_after if stale_after is not None else STALE_AFTER_BEATS * info["beat_seconds"]
        info["stale"] = info["heartbeat_age"] > limit
        out.append(info)
    return out
