"""Maintenance: the chores of a consuming process, on a thread apart from lease extension.

- **Rescue**, every ``rescue_interval``: rows of any process whose lease
  expired go back to their queue (a crashed or paused worker's messages are
  claimable again within one interval), keeping their place in line; a
  message whose deliveries ended that way ``max_deliveries`` times is
  dead-lettered instead.
- **Vacuum**, after every few thousand claims of this process: claimed rows
  leave dead entries at the head of the claim index, and without this every
  claim of a long backlog steps over more of them until autovacuum comes by
  (once a minute with PostgreSQL's defaults).  A role that may not vacuum the
  table (not its owner) leaves it to autovacuum, and says so once.
- **Purge**, once a minute: dead letters and cancellations older than
  ``dead_message_ttl``, and outcome tallies older than two hours.
- **History**, every ``HISTORY_PURGE_EVERY`` seconds: acked messages older than
  ``keep_finished``, oldest first, in batches of ``HISTORY_BATCH`` rows, each
  its own short transaction (``SKIP LOCKED``: processes never wait for each
  other), for at most ``HISTORY_PURGE_BUDGET`` seconds a tick; a tick that runs
  out of time leaves the rest for the next tick.

:class:`PurgeSchedule` does the same kind of bounded purge for the results
and rate-limit backends, triggered by their use rather than by a thread.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable

from .config import Settings
from .database import Database
from .doorbell import look_back
from .fencing import State
from .leases import Leases
from .periodic import Periodic
from .sql import Statements

#: Claims by this process between two vacuums of the message table, and the
#: shortest pause between them (seconds).
VACUUM_AFTER_CLAIMS = 5000
VACUUM_MIN_INTERVAL = 10.0
#: Seconds a fenced transaction's ``committed`` row is kept at least (migration 010): its effects are
#: written with its deletion, so it must outlive any writer backlog.
COMMITTED_KEEP = 3600
#: Seconds between two purges of old dead letters and cancellations.
PURGE_EVERY = 60.0
#: Rows deleted per bounded purge statement (a purge runs a few of them).
PURGE_BATCH = 1000
#: History: seconds between purges, rows per statement, seconds per tick at most.
HISTORY_PURGE_EVERY = 10.0
HISTORY_BATCH = 2000
HISTORY_PURGE_BUDGET = 2.0

logger = logging.getLogger(__name__)


class Maintenance(Periodic):
    """The rescue / vacuum / purge loop of one consuming process."""

    name = "dramatiq-pg-maintenance"
    what = "Maintenance"

    def __init__(
        self, leases: Leases, database: Database, statements: Statements, settings: Settings, logger: logging.Logger
    ) -> None:
        super().__init__(settings.rescue_interval, logger)
        self.leases = leases
        self.database = database
        self.statements = statements
        self.settings = settings
        self._last_purge = 0.0
        self._last_history_purge = 0.0
        self._vacuumed_at_claims = 0
        self._last_vacuum = 0.0
        self._may_vacuum: bool | None = None

    def tick(self) -> None:
        self.rescue()
        claims = self.leases.claims
        if (
            claims - self._vacuumed_at_claims >= VACUUM_AFTER_CLAIMS
            and time.monotonic() - self._last_vacuum > VACUUM_MIN_INTERVAL
        ):
            self._vacuumed_at_claims = claims
            self._last_vacuum = time.monotonic()
            self.vacuum()
        if time.monotonic() - self._last_purge > PURGE_EVERY:
            self._last_purge = time.monotonic()
            self.purge()
        if time.monotonic() - self._last_history_purge > HISTORY_PURGE_EVERY:
            if self.purge_history() < HISTORY_BATCH:  # else: behind, go on at the next tick
                self._last_history_purge = time.monotonic()

    def rescue(self) -> int:
        """Return expired leases (of any process) to their queues, or dead-letter them at ``max_deliveries``.

        Returns how many rows it took back.
        """
        with self.database.connection(raw=True) as conn:
            rows = conn.execute(self.statements.rescue, {"max": self.settings.max_deliveries}).fetchall()
            queued = sorted({r[1] for r in rows if r[3] == State.QUEUED.value})
            if queued and self.settings.listen:
                conn.execute(self.statements.notify, [self.settings.channel, look_back(queued)])
        for message_id, queue_name, attempt, state in rows:
            if state == State.QUEUED.value:
                self.logger.warning(
                    "Lease of message %s on queue %r (attempt %d) expired; it is queued for redelivery.",
                    message_id,
                    queue_name,
                    attempt,
                )
            else:
                self.logger.error(
                    "Lease of message %s on queue %r (attempt %d) expired, and %d of its deliveries ended "
                    "without an outcome: it is dead-lettered (max_deliveries).",
                    message_id,
                    queue_name,
                    attempt,
                    self.settings.max_deliveries,
                )
        return len(rows)

    def may_vacuum(self) -> bool:
        """Asked once per process: may this role vacuum the message table?"""
        if self._may_vacuum is None:
            with self.database.connection(raw=True) as conn:
                table = f'"{self.settings.schema}".message'
                row = conn.execute(self.statements.may_vacuum, [table]).fetchone()
            self._may_vacuum = bool(row and row[0])
            if not self._may_vacuum:
                self.logger.info(
                    "This database role may not VACUUM %s.message; workers leave it to autovacuum "
                    "(a long backlog's claims may slow down between its runs).",
                    self.settings.schema,
                )
        return self._may_vacuum

    def vacuum(self) -> bool:
        """Vacuum the message table if this role may; returns whether it did."""
        if not self.may_vacuum():
            return False
        with self.database.connection(raw=True) as conn:
            conn.execute(self.statements.vacuum)
        return True

    def purge(self) -> None:
        with self.database.connection(raw=True) as conn:
            conn.execute(self.statements.purge_finished, [self.settings.dead_message_ttl])
            conn.execute(self.statements.purge_throughput)
            # Left by workers that died between a fenced transaction's commit and its effects' write.
            conn.execute(self.statements.purge_committed, [max(self.settings.dead_message_ttl, COMMITTED_KEEP)])

    def purge_history(self) -> int:
        """Delete history older than ``keep_finished`` in bounded batches; returns the last batch's size."""
        deadline = time.monotonic() + HISTORY_PURGE_BUDGET
        deleted = 0
        while True:
            with self.database.connection(raw=True) as conn:
                deleted = conn.execute(
                    self.statements.purge_history, [self.settings.keep_finished, HISTORY_BATCH]
                ).rowcount
            if deleted < HISTORY_BATCH or time.monotonic() > deadline:
                return max(deleted, 0)


class PurgeSchedule:
    """Bounded purges of expired rows, at most once per *interval* per process, in the background."""

    def __init__(self, database: Database, statement: bytes, interval: float) -> None:
        self.database = database
        self.statement = statement
        self.interval = interval
        self._lock = threading.Lock()
        self._pid = -1
        self._next = 0.0

    def purge(self) -> int:
        """Run the bounded delete until it finds little left; returns rows deleted."""
        total = 0
        for _ in range(10):
            with self.database.connection() as conn:
                deleted = conn.execute(self.statement, [PURGE_BATCH]).rowcount
            total += max(deleted, 0)
            if deleted < PURGE_BATCH:
                break
        return total

    def maybe(self, purge: Callable[[], int] | None = None) -> None:
        """Start a purge in the background if one is due in this process."""
        now = time.monotonic()
        if now < self._next and self._pid == os.getpid():
            return
        with self._lock:
            if self._pid != os.getpid():
                # Processes started together (the dramatiq CLI) spread their purges out.
                self._pid = os.getpid()
                self._next = now + random.random() * self.interval
            if now < self._next:
                return
            self._next = now + self.interval
        run = purge or self.purge

        def background() -> None:
            try:
                run()
            except Exception as e:  # the next interval tries again
                logger.warning("Purge of expired rows failed: %s", e)

        threading.Thread(target=background, name="dramatiq-pg-purge", daemon=True).start()
