"""The scheduler of one process: enqueues the due ticks of its schedules, exactly once across
processes (``schedule_tick``: one row per schedule and tick, by the database clock); the schedules
themselves are declared in :mod:`.schedules`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfoNotFoundError

import psycopg
from dramatiq.message import Message

from ..config import Settings
from ..core.delivery import Row
from ..core.periodic import Periodic
from ..db.database import Database
from ..db.statements import Statements
from .schedule_control import take_runs
from .schedules import (
    KEEP_TICKS,
    MAX_SLEEP,
    MAX_TICKS_PER_PASS,
    PURGE_BATCH,
    PURGE_EVERY,
    SEEN_EVERY,
    STALE_AFTER,
    CronError,
    Schedule,
    Schedules,
    Timing,
)


class Scheduler(Periodic):
    """Enqueues the due ticks of this process's schedules; sleeps until the next one is due (database clock)."""

    name = "dramatiq-pg-scheduler"
    what = "The scheduler"

    def __init__(
        self,
        schedules: Schedules,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        row: Callable[[Message, int | None], Row],
    ) -> None:
        super().__init__(MAX_SLEEP, logger)
        self.schedules = schedules
        self.database = database
        self.statements = statements
        self.settings = settings
        self.row = row
        self.enqueued = 0  #: ticks this process won
        self.runs_taken = 0  #: "run now" clicks this process enqueued
        self._wait = 0.0
        self._declared_at: float | None = None
        self._purged_at = time.monotonic()
        self._stale: dict[str, str] = {}  # name -> the other fingerprint, said once
        self._missed: dict[str, datetime] = {}  # name -> the last tick before the gap, said once

    def next_wait(self) -> float:
        return self._wait

    def tick(self) -> None:
        self._wait = 1.0  # if this pass fails
        mine = list(self.schedules)
        if not mine:
            self._wait = MAX_SLEEP
            return
        if self._declared_at is None or time.monotonic() - self._declared_at > SEEN_EVERY:
            self.declare(mine)
            self._declared_at = time.monotonic()
        self._wait = self.run_once(mine)
        if time.monotonic() - self._purged_at > PURGE_EVERY:
            self._purged_at = time.monotonic()
            self.purge()

    def declare(self, mine: list[Schedule]) -> list[tuple[Schedule, datetime, str]]:
        """Declare this process's definitions and install those that win; returns the owed ticks it enqueued.

        Which declaration is newer is decided by the database, in one order
        every process sees (``schedule_winners`` in db/queries/): the higher
        ``version``, then the definition first declared last.  Not the last
        process to start: an old process that starts again in a rolling
        deploy, or declares after an operator's ``--forget``, does not take a
        schedule back from newer code.  A definition nobody has declared for
        STALE_AFTER seconds gives way, so a rollback takes over once the newer
        processes are gone.

        A definition that replaces another first enqueues what the old one
        still owes: what its scheduler would have enqueued in a pass at this
        moment (ticks of its timing late within its grace; one it missed, by
        its policy).  So a change loses no tick that fell due before it, and
        owes none of the new timing's past ticks.  Those ticks get the new
        definition's message, as the ticks after the change do: this process
        has the new code, and so will the workers that run them; the old
        arguments are not stored.
        """
        params = self._definitions(mine)
        enqueued: list[tuple[Schedule, datetime, str]] = []
        by_name = {s.name: s for s in mine}
        with self.database.connection(raw=True) as conn, conn.transaction():
            conn.execute(self.statements.schedule_versions_lock)
            conn.execute(self.statements.schedule_versions_seen, params)
            rows = conn.execute(
                self.statements.schedule_winners, {"names": params["names"], "live": STALE_AFTER}
            ).fetchall()
            winning: list[Schedule] = []
            outdated: list[str] = []
            owed: list[tuple[Schedule, datetime]] = []
            for name, winner, stored, cron, zone, every_ms, missed, grace_ms, last_tick, changed_at, now in rows:
                scheduled = by_name[name]
                if winner != scheduled.fingerprint:
                    outdated.append(name)
                    continue
                winning.append(scheduled)
                if stored is not None and stored != scheduled.fingerprint:
                    old = Timing(cron, zone, every_ms)
                    since = changed_at if last_tick is None else max(last_tick, changed_at)
                    owed += [(scheduled, t) for t in self._owed(scheduled, old, since, now, grace_ms / 1000, missed)]
            if winning:
                conn.execute(self.statements.schedule_declare, self._definitions(winning))
            if outdated:
                conn.execute(self.statements.schedule_outdated, [outdated])
            for scheduled, tick in owed:
                message_id = self._tick(conn, scheduled, tick)
                if message_id is not None:
                    enqueued.append((scheduled, tick, message_id))
        for scheduled, tick, message_id in enqueued:  # committed
            self.enqueued += 1
            self.logger.info(
                "Schedule %r: its definition changed; tick %s of the old one, still owed, enqueued as message %s.",
                scheduled.name,
                tick,
                message_id,
            )
        return enqueued

    @staticmethod
    def _definitions(mine: list[Schedule]) -> dict[str, list[Any]]:
        return {
            "names": [s.name for s in mine],
            "actors": [s.actor_name for s in mine],
            "queues": [s.queue_name for s in mine],
            "crons": [s.timing.cron for s in mine],
            "timezones": [s.timing.timezone for s in mine],
            "every_ms": [s.timing.every_ms for s in mine],
            "missed": [s.missed for s in mine],
            "grace_ms": [s.grace_ms for s in mine],
            "versions": [s.version for s in mine],
            "fingerprints": [s.fingerprint for s in mine],
        }

    def _owed(
        self, scheduled: Schedule, old: Timing, since: datetime, now: datetime, grace: float, missed: str
    ) -> list[datetime]:
        """The ticks the replaced definition (its timing, grace and policy) would enqueue at *now*, all of them."""
        ticks: list[datetime] = []
        try:
            while True:
                batch = old.due(since, now, grace=grace, missed=missed)
                ticks += batch
                if len(batch) < MAX_TICKS_PER_PASS:
                    return ticks
                since, missed = batch[-1], "skip"
        except (CronError, ZoneInfoNotFoundError, ValueError) as e:
            self.logger.warning(
                "Schedule %r: the definition it replaces (%s) cannot be read here (%s); "
                "its ticks still owed are not enqueued.",
                scheduled.name,
                old.describe(),
                e,
            )
            return ticks

    def run_once(self, mine: list[Schedule]) -> float:
        """Enqueue every due tick of *mine*; returns the seconds until the next one is due (at most MAX_SLEEP)."""
        with self.database.connection(raw=True) as conn:
            rows = conn.execute(self.statements.schedule_read, [[s.name for s in mine]]).fetchall()
            read_at = time.monotonic()
            now: datetime = rows[0][0]
            stored = {r[1]: r for r in rows if r[1] is not None}
            for scheduled in mine:
                row = stored.get(scheduled.name)
                if row is None:
                    self._declared_at = -math.inf  # forgotten by an operator: put back next pass (never overwriting)
                    continue
                _, _, fingerprint, last_tick, changed_at, paused = row
                if fingerprint != scheduled.fingerprint:
                    self._say_stale(scheduled, fingerprint)
                    continue
                self._stale.pop(scheduled.name, None)
                if paused:  # by an operator (schedule_control); schedule_tick would refuse its ticks anyway
                    continue
                since = changed_at if last_tick is None else max(last_tick, changed_at)
                due = scheduled.timing.due(since, now, grace=scheduled.grace, missed=scheduled.missed)
                if since < now - timedelta(seconds=scheduled.grace) and self._missed.get(scheduled.name) != since:
                    self._missed[scheduled.name] = since
                    self._say_missed(scheduled, since, now)
                for tick in due:
                    self._enqueue(conn, scheduled, tick)
            self.runs_taken += take_runs(
                conn, self.statements, self.settings, [s for s in mine if stored.get(s.name) is not None],
                self.row, self.logger,
            )  # fmt: skip
        upcoming = [t for t in (s.timing.after(now) for s in mine if s.name not in self._stale) if t is not None]
        if not upcoming:
            return MAX_SLEEP
        wait = (min(upcoming) - now).total_seconds() - (time.monotonic() - read_at) + 0.002
        return min(max(wait, 0.001), MAX_SLEEP)

    def _enqueue(self, conn: psycopg.Connection, scheduled: Schedule, tick: datetime) -> bool:
        message_id = self._tick(conn, scheduled, tick)
        if message_id is not None:
            self.enqueued += 1
            self.logger.debug("Schedule %r: tick %s enqueued as message %s.", scheduled.name, tick, message_id)
        return message_id is not None

    def _tick(self, conn: psycopg.Connection, scheduled: Schedule, tick: datetime) -> str | None:
        """Run ``schedule_tick``; the message's id if this call enqueued the tick."""
        # A unique key of the actor (unique.py) is not applied: the tick is the message's uniqueness.
        message_id, queue_name, actor_name, priority, _, payload, *_ = self.row(scheduled.message(tick), None)
        inserted = conn.execute(
            self.statements.schedule_tick,
            {
                "name": scheduled.name,
                "fingerprint": scheduled.fingerprint,
                "tick": tick,
                "id": message_id,
                "queue": queue_name,
                "actor": actor_name,
                "priority": priority,
                "payload": payload,
                "channel": self.settings.channel,
                "listen": self.settings.listen,
            },
        ).fetchone()
        return message_id if inserted and inserted[0] else None

    def _say_stale(self, scheduled: Schedule, other: str) -> None:
        if self._stale.get(scheduled.name) != other:
            self._stale[scheduled.name] = other
            self.logger.warning(
                "Schedule %r has a newer definition (newer code, or a higher version=) than this process's "
                "(%s, version %d); this process's is out of date and it does not enqueue this schedule. "
                "Deploy the new code here to run it again.",
                scheduled.name,
                scheduled.timing.describe(),
                scheduled.version,
            )

    def _say_missed(self, scheduled: Schedule, since: datetime, now: datetime) -> None:
        cut = now - timedelta(seconds=scheduled.grace)
        if scheduled.timing.latest(cut, since) is None:
            return  # nothing was missed, only late
        what = "one message for the latest of them" if scheduled.missed == "once" else "none of them"
        self.logger.info(
            "Schedule %r missed its ticks between %s and %s (no scheduler ran); missed=%r enqueues %s.",
            scheduled.name,
            since.isoformat(),
            cut.isoformat(),
            scheduled.missed,
            what,
        )

    def purge(self) -> int:
        """Delete tick records older than KEEP_TICKS (one bounded batch)."""
        with self.database.connection(raw=True) as conn:
            return max(conn.execute(self.statements.schedule_purge_ticks, [KEEP_TICKS, PURGE_BATCH]).rowcount, 0)
