"""Maintenance: the chores of a consuming process, on a thread apart from lease extension.

While the listening processes take turns (turns.py), rescue, purge and
history are done by one of them per window of their period, in turn, not by
every process; each process does them all while its turns are unknown (its
LISTEN connection down, or ``listen=False``).

- **Rescue**, every ``rescue_interval``: rows of any process whose lease
  expired go back to their queue (a crashed or paused worker's messages are
  claimable again within one interval), keeping their place in line; a
  message whose deliveries ended that way ``max_deliveries`` times is
  dead-lettered instead.  A pass looks only at the leases that expired since
  its previous one (less ``RESCUE_MARGIN``) and at those it saw locked, a full
  pass every ``FULL_RESCUE_EVERY``: see :meth:`Maintenance.rescue`.
- **Vacuum**, after every few thousand claims of this process: claimed rows
  leave dead entries at the head of the claim index, and without this every
  claim of a long backlog steps over more of them until autovacuum comes by
  (once a minute with PostgreSQL's defaults).  A role that may not vacuum the
  table (not its owner) leaves it to autovacuum, and says so once.
- **Purge**, once a minute: dead letters and cancellations older than
  ``dead_message_ttl``, and outcome tallies older than two hours.
- **Reindex**, checked every ``reindex.CHECK_EVERY`` by the process on duty, on a thread and a
  connection of its own: an index of the message table bloated by a pinned horizon that has ended
  is rebuilt with ``REINDEX CONCURRENTLY`` (see :mod:`.reindex`).
- **Heartbeat**, every ``processes.HEARTBEAT_SECONDS`` while a worker runs in
  this process: its row in ``process``, on a connection of the pool, as the rescue
  (see :mod:`.processes`); the purge deletes the rows of processes gone for an hour.
- **Samples** for the console's charts, tried every ``samples.SAMPLE_EVERY``
  seconds by the process on duty (turns.py; every process that runs a worker while
  its turns are unknown) until one takes that minute's sample (see :mod:`.samples`:
  its depth within a budget), then as the next minute begins; the purge deletes samples older than a day.  On duty, its
  pooled connection is in use (the idle polls): no connection check before the try.
- **History**, every ``HISTORY_PURGE_EVERY`` seconds: acked messages, and the attempt
  log's rows (migration 023), older than ``keep_finished``, oldest first, in batches of ``HISTORY_BATCH`` rows, each
  its own short transaction (``SKIP LOCKED``: processes never wait for each
  other), for at most ``HISTORY_PURGE_BUDGET`` seconds a tick; a tick that runs
  out of time leaves the rest for the next tick.

:class:`PurgeSchedule` does the same kind of bounded purge for the results
and rate-limit backends, triggered by their use rather than by a thread.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta

from ..config import Settings
from ..db.database import Database
from ..db.doorbell import look_back
from ..db.statements import Statements
from . import reindex, samples
from .fencing import State
from .leases import Leases
from .periodic import Periodic
from .processes import PURGE_AFTER, Heartbeat
from .turns import Turns

#: Claims by this process between two vacuums of the message table, and the
#: shortest pause between them (seconds).
VACUUM_AFTER_CLAIMS = 5000
VACUUM_MIN_INTERVAL = 10.0
#: Leases (``lease_seconds`` each) after its lease lapsed that maintenance waits before it finishes a
#: message its fenced transaction committed (migration 016), without what the delivery caused after its
#: block.  The lease keeper of the delivery's process extends the committed row while its actor runs on
#: and until its outcome writer finishes it (with those effects), so a lapsed lease means that process
#: stopped extending it: it died, or was stopped or cut off from the database for longer than the lease.
#: The grace lets one stopped or cut off for a while come back and finish the row itself.
COMMITTED_GRACE_LEASES = 10
#: A periodic rescue looks only at leases that expired since its previous pass (less this margin), and
#: at those that pass saw locked: the lease index keeps the entries of every lease taken since another
#: session's snapshot, and a pass over all of them would cost more with every message (issue 41).  The
#: margin covers a claim or extension that commits after the pass that would have seen its lease
#: expired (a claim's lease counts from its transaction's start).  ``finish_committed`` does the same.
RESCUE_MARGIN = timedelta(seconds=10)
#: Seconds between two full rescues (and finishes of committed rows) of a process, its first one
#: included: they take what landed behind the window (a claim that committed later than the margin,
#: the database's clock set back, a block that held its row longer than the grace).
FULL_RESCUE_EVERY = 300.0
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
        self,
        leases: Leases,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        heartbeat: Heartbeat | None = None,
        turns: Turns | None = None,
    ) -> None:
        super().__init__(settings.rescue_interval, logger)
        self.heartbeat = heartbeat
        self.turns = turns
        self.leases = leases
        self.database = database
        self.statements = statements
        self.settings = settings
        self._last_purge = 0.0
        self._last_finish = -math.inf
        #: Where the next periodic rescue's and finish's windows start (None: a full pass), and
        #: when the last full pass began (monotonic).
        self._rescue_since: datetime | None = None
        self._finish_since: datetime | None = None
        self._last_full = -math.inf
        self._last_full_finish = -math.inf
        self._last_history_purge = 0.0
        self._next_sample = 0.0  # monotonic time of the next try of the charts' sample
        self._history_behind = False
        self._vacuumed_at_claims = 0
        self._last_vacuum = 0.0
        self._may_vacuum: bool | None = None
        self.reindexer = reindex.Reindexer(database, statements, settings.schema, logger)
        self._last_reindex = time.monotonic()  # the first check a period after the start

    def next_wait(self) -> float:
        """The interval, on the grid of the process's chores (turns.py): a rescue never falls on one
        of its idle polls, so that an idle process needs one pooled connection."""
        if self.turns is None:
            return self.interval
        return self.turns.until_grid("rescue", self.interval)

    def _mine(self, chore: str, period: float) -> bool:
        return self.turns is None or self.turns.mine(chore, period)

    def tick(self) -> None:
        on_duty = self.turns is None or self.turns.on_duty(self.interval)
        if on_duty:
            self.rescue(full=False)
        if self.heartbeat is not None and self.heartbeat.due():
            with self.database.connection(raw=True) as conn:  # (one pooled connection, as the rescue's)
                self.heartbeat.beat(conn)
        claims = self.leases.claims
        if (
            claims - self._vacuumed_at_claims >= VACUUM_AFTER_CLAIMS
            and time.monotonic() - self._last_vacuum > VACUUM_MIN_INTERVAL
        ):
            self._vacuumed_at_claims = claims
            self._last_vacuum = time.monotonic()
            self.vacuum()
        if (
            on_duty  # one process at a time tries: eight idle processes tried 32 times a minute, each a transaction
            and self.heartbeat is not None
            and self.heartbeat.active  # a process running a worker: the charts' sample
            and time.monotonic() >= self._next_sample
        ):
            self._next_sample = time.monotonic() + samples.SAMPLE_EVERY
            with self.database.connection(raw=True) as conn:
                if samples.take_sample(conn, self.statements):
                    self._next_sample = time.monotonic() + samples.until_next_minute()
        if time.monotonic() - self._last_purge > PURGE_EVERY and self._mine("purge", PURGE_EVERY):
            self._last_purge = time.monotonic()
            self.purge()
        every = self.reindexer.every()
        if time.monotonic() - self._last_reindex > every and self._mine("reindex", every):
            self._last_reindex = time.monotonic()
            if self.may_vacuum():  # the same privileges: the table's owner (or MAINTAIN)
                self.reindexer.start()
        if time.monotonic() - self._last_history_purge > HISTORY_PURGE_EVERY and (
            self._history_behind or self._mine("history", HISTORY_PURGE_EVERY)
        ):
            self._history_behind = self.purge_history() >= HISTORY_BATCH  # behind: go on at the next tick
            if not self._history_behind:
                self._last_history_purge = time.monotonic()

    def rescue(self, *, full: bool = True) -> int:
        """Return expired leases (of any process) to their queues, or dead-letter them at ``max_deliveries``.

        Returns how many rows it took back.  Also finishes the messages whose fenced transaction
        committed and whose lease lapsed (their process stopped extending it before its outcome
        writer finished them) :data:`COMMITTED_GRACE_LEASES` leases ago: as done, without what
        they caused after their block.  With *full* false (the periodic pass), only the leases that
        expired since the previous pass (less :data:`RESCUE_MARGIN`) and those it saw locked, unless
        a full pass is due (:data:`FULL_RESCUE_EVERY`): see ``rescue`` in db/queries/lifecycle.py.
        """
        began = time.monotonic()
        full = full or began - self._last_full >= FULL_RESCUE_EVERY
        with self.database.connection(raw=True) as conn:
            since = None if full else self._rescue_since
            rescue = self.statements.rescue_logged if self.settings.keep_finished > 0 else self.statements.rescue
            rows = conn.execute(rescue, {"max": self.settings.max_deliveries, "since": since}).fetchall()
            if full:
                self._last_full = began  # done (a failed one is tried again at the next pass)
            next_at = next(r[4] for r in rows if r[0] is None)
            rows = [r[:4] for r in rows if r[0] is not None]
            self._rescue_since = next_at - RESCUE_MARGIN
            finished: list[tuple[str, str]] = []
            if time.monotonic() - self._last_finish >= self.settings.lease_seconds:  # (a grace of ten leases)
                self._last_finish = time.monotonic()
                finish = self.statements.finish_committed_keep if self.settings.keep_finished > 0 else self.statements.finish_committed
                grace = COMMITTED_GRACE_LEASES * self.settings.lease_seconds
                # Its own full pass: it runs once per lease at most, not at every rescue.
                whole = full or began - self._last_full_finish >= FULL_RESCUE_EVERY
                since = None if whole else self._finish_since
                finished = conn.execute(finish, {"grace": grace, "writer": "maintenance", "since": since}).fetchall()
                if whole:
                    self._last_full_finish = began
                # Its next window starts where this one ended (by the rescue's clock, a little earlier), less the margin.
                self._finish_since = next_at - timedelta(seconds=grace) - RESCUE_MARGIN
            queued = sorted({r[1] for r in rows if r[3] == State.QUEUED.value})
            if queued and self.settings.listen:
                conn.execute(self.statements.notify, [self.settings.channel, look_back(queued)])
        for message_id, queue_name in finished:
            self.logger.warning(
                "Message %s on queue %r, whose fenced transaction committed, was finished by maintenance without "
                "what it caused after its block (result, next pipeline step, callbacks, group countdown): the "
                "lease of its committed row lapsed (over %g s ago): its process stopped extending it (it died, or was "
                "stopped or cut off from the database) before writing its outcome.",
                message_id,
                queue_name,
                COMMITTED_GRACE_LEASES * self.settings.lease_seconds,
            )
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
                    "(a long backlog's claims may slow down between its runs) and do not rebuild its indexes "
                    "when a long transaction elsewhere has bloated them (core/reindex.py).",
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
            conn.execute(self.statements.process_purge, [PURGE_AFTER])
            conn.execute(self.statements.sample_purge, [samples.KEEP_SAMPLES])

    def purge_history(self) -> int:
        """Delete history and the attempt log older than ``keep_finished`` in bounded batches, within one
        budget; returns the larger of the two last batches' sizes (a full batch: behind)."""
        deadline = time.monotonic() + HISTORY_PURGE_BUDGET
        last = 0
        for statement in (self.statements.purge_history, self.statements.purge_attempts):
            while True:
                with self.database.connection(raw=True) as conn:
                    deleted = max(conn.execute(statement, [self.settings.keep_finished, HISTORY_BATCH]).rowcount, 0)
                if deleted < HISTORY_BATCH or time.monotonic() > deadline:
                    break
            last = max(last, deleted)
        return last


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
