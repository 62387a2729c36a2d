"""Periodic messages: each tick of a schedule enqueued exactly once, by whichever process gets there first.

Declare schedules next to their actors::

    @schedule("0 3 * * *", tz="Europe/Paris")     # cron (5 fields, or 6 with seconds first)
    @dramatiq.actor
    def nightly_report(): ...

    @schedule(every=10)                           # an interval, in seconds (or a timedelta)
    @dramatiq.actor
    def heartbeat(): ...

or ``broker.schedules.add("actor_name", "*/5 * * * *")``.  Every ``dramatiq``
worker process of the broker runs a :class:`Scheduler` thread (``scheduler=False``
on the broker turns it off; ``dramatiq-pg-fenced scheduler MODULE`` runs one
alone).  There is no leader: for a due tick every scheduler runs the same
statement (``schedule_tick`` in db/queries/), which advances the schedule's
``last_tick`` under its row lock, records the tick and inserts its message,
all or nothing; a tick at or before ``last_tick`` is refused, so one process
wins and the others, and any that computed the tick long ago and come back
late, do nothing.

Policies:

- **Clock**: the database's.  A scheduler reads ``clock_timestamp()``, and the
  statement refuses a tick that is not due by ``now()``; a host's own clock
  decides nothing (only how long a scheduler sleeps before it looks again).
- **Late and missed ticks**: a tick found due within ``grace`` seconds (60 by
  default) of its time is enqueued, each one (a scheduler that stalled briefly
  catches up).  Older ticks were missed while no scheduler ran:
  ``missed="once"`` (the default) enqueues one message for the latest of them,
  then the schedule goes on; ``missed="skip"`` enqueues none of them.  Ticks
  from before a schedule was first declared never count.
- **Daylight saving**: cron expressions run in their time zone (``tz``, UTC by
  default) as Debian's cron runs them (cronsim): a job at a fixed time that
  falls in the hour skipped in spring runs when the clocks jump; one in the
  hour repeated in autumn runs once.  Jobs that run more often than hourly
  follow the wall clock, so they run in both passes of a repeated hour.
  Intervals ignore time zones: their ticks are the multiples of the interval
  since the Unix epoch, the same for every process.
- **Changed in code**: each scheduler declares its definitions when it
  starts and every 30 s.  The newer definition wins, in an order the database
  keeps (table ``schedule_version``): a higher ``version=`` (0 by default),
  then the definition first declared last.  So in a rolling deploy an old
  process that starts again after the new ones does not take the schedule
  back, nor after ``--forget``; a process whose definition is not the stored
  one stops enqueuing that schedule (it says so once).  A definition no
  scheduler has declared for STALE_AFTER seconds gives way to the others (a
  rollback takes over once the newer processes are gone).
- **Ticks owed across a change**: the definition that takes over first
  enqueues what the one it replaces would have enqueued in a pass at that
  moment: that one's ticks still within its grace (and a missed one, by its
  policy).  They get the new definition's message (arguments, options,
  actor): the process enqueuing them, and the workers that will run them, have
  the new code, and the old arguments are not stored.  The new timing counts
  from the change on: none of its ticks from before it are owed.
- **Removed in code**: a schedule no running scheduler declares any more is
  enqueued by nobody; its row stays, listed as stale by ``dramatiq-pg-fenced
  schedules`` (``--forget NAME`` removes it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from dramatiq.message import Message

from ..db.database import Database
from ..db.statements import Statements, check_queue

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: Policies for ticks missed while no scheduler ran (see the module docstring).
MISSED_POLICIES = ("once", "skip")
DEFAULT_MISSED = "once"
#: Seconds after its time a tick is still enqueued (late, not missed).
DEFAULT_GRACE = 60.0
#: The shortest interval: one second.
MIN_EVERY_MS = 1000
#: Seconds a scheduler sleeps at most before it reads the database clock again.
MAX_SLEEP = 5.0
#: Seconds between two declarations of a running scheduler's schedules (seen_at).
SEEN_EVERY = 30.0
#: A schedule no scheduler declared for this long is stale (stats, CLI).
STALE_AFTER = 120.0
#: Tick records are kept this long (seconds), purged every PURGE_EVERY seconds in batches.
KEEP_TICKS = 86400
PURGE_EVERY = 600.0
PURGE_BATCH = 5000
#: Ticks one schedule enqueues in one pass at most (the rest in the next pass).
MAX_TICKS_PER_PASS = 1000
#: Names: letters, digits and ``._:-`` (at most 200).
_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


class CronError(ValueError):
    """A cron expression that cronsim refuses (its ``CronSimError``, which this module does not import
    until a cron schedule is read: a worker without one never loads cronsim)."""


def _cron_tick(expr: str, start: datetime, *, reverse: bool = False) -> datetime:
    """The next tick of *expr* after *start* (before it with *reverse*); ``StopIteration`` when none."""
    from cronsim import CronSim, CronSimError

    try:
        return next(CronSim(expr, start, reverse=reverse))
    except CronSimError as e:
        raise CronError(str(e)) from e


# -- when ticks fall (pure: no database) --------------------------------------------
@dataclasses.dataclass(frozen=True)
class Timing:
    """When a schedule ticks: a cron expression in a time zone, or an interval in milliseconds."""

    cron: str | None = None
    timezone: str | None = None
    every_ms: int | None = None

    @classmethod
    def parse(cls, cron: Any = None, every: Any = None, tz: Any = None) -> Timing:
        """Check and normalise what a user declared; :class:`ValueError` says what is wrong."""
        if (cron is None) == (every is None):
            raise ValueError("give a cron expression or every=<seconds>, one of the two")
        if every is not None:
            if tz is not None:
                raise ValueError("an interval (every=) has no time zone: its ticks are multiples of it since the epoch")
            if isinstance(every, timedelta):
                seconds = every.total_seconds()
            elif isinstance(every, (int, float)) and not isinstance(every, bool):
                seconds = float(every)
            else:
                raise ValueError(f"every= takes seconds or a timedelta, not {every!r}")
            if not math.isfinite(seconds) or seconds * 1000 < MIN_EVERY_MS:
                raise ValueError(f"every= must be at least 1 second, not {every!r}")
            return cls(every_ms=round(seconds * 1000))
        if not isinstance(cron, str) or not cron.strip():
            raise ValueError(f"a cron expression is a non-empty string, not {cron!r}")
        zone = tz if tz is not None else "UTC"
        if not isinstance(zone, str):
            raise ValueError(f"tz= takes an IANA time zone name such as 'Europe/Paris', not {zone!r}")
        timing = cls(cron=" ".join(cron.split()), timezone=zone)
        try:
            if not zone:
                raise ValueError(zone)
            timing.zone()
        except (ZoneInfoNotFoundError, ValueError, TypeError, OSError):
            raise ValueError(f"unknown time zone {zone!r} (an IANA name such as 'Europe/Paris' or 'UTC')") from None
        try:
            first = timing.after(datetime.now(UTC))
        except CronError as e:
            raise ValueError(f"bad cron expression {cron!r}: {e}") from None
        if first is None:
            raise ValueError(f"cron expression {cron!r} never matches (in the next 50 years)")
        return timing

    def zone(self) -> ZoneInfo:
        return ZoneInfo("UTC" if self.timezone is None else self.timezone)

    def describe(self) -> str:
        if self.every_ms is not None:
            return f"every {self.every_ms / 1000:g}s"
        return f"{self.cron} ({self.timezone})"

    def after(self, moment: datetime) -> datetime | None:
        """The first tick strictly after *moment* (UTC); ``None`` if none in 50 years."""
        if self.every_ms is not None:
            ms = _ms(moment)
            return _at((ms // self.every_ms + 1) * self.every_ms)
        assert self.cron is not None
        try:
            return _cron_tick(self.cron, moment.astimezone(self.zone())).astimezone(UTC)
        except StopIteration:
            return None

    def latest(self, moment: datetime, since: datetime) -> datetime | None:
        """The last tick at or before *moment* and strictly after *since*; ``None`` if there is none."""
        if moment <= since:
            return None
        if self.every_ms is not None:
            last = _at(_ms(moment) // self.every_ms * self.every_ms)
            return last if last > since else None
        assert self.cron is not None
        # cronsim's reverse iteration finds a recent match fast; the forward
        # iteration from a little before it is the one that applies the
        # daylight-saving rules exactly as the schedulers do.
        floor = moment.replace(microsecond=0)
        try:
            back = _cron_tick(self.cron, (floor + timedelta(microseconds=1)).astimezone(self.zone()), reverse=True)
        except StopIteration:
            return None
        start = max(since, back.astimezone(UTC) - timedelta(hours=3))
        found: datetime | None = None
        tick: datetime | None = self.after(start)
        while tick is not None and tick <= moment:
            found = tick
            tick = self.after(tick)
        return found

    def due(
        self, since: datetime, now: datetime, *, grace: float, missed: str, limit: int = MAX_TICKS_PER_PASS
    ) -> list[datetime]:
        """The ticks to enqueue at *now* when every tick up to *since* is done, oldest first.

        Ticks in ``(now - grace, now]`` are late at most: each of them.  Ticks
        in ``(since, now - grace]`` were missed: with ``missed="once"`` the latest
        of them comes first, with ``"skip"`` none.
        """
        cut = now - timedelta(seconds=grace)
        ticks: list[datetime] = []
        if missed == "once" and since < cut:
            latest_missed = self.latest(cut, since)
            if latest_missed is not None:
                ticks.append(latest_missed)
        tick: datetime | None = self.after(max(since, cut))
        while tick is not None and tick <= now and len(ticks) < limit:
            ticks.append(tick)
            tick = self.after(tick)
        return ticks


def _ms(moment: datetime) -> int:
    delta = moment - EPOCH
    return (delta.days * 86400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _at(ms: int) -> datetime:
    return EPOCH + timedelta(milliseconds=ms)


# -- declaring schedules ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Schedule:
    """One declared schedule: which actor gets a message, with what, and when."""

    name: str
    actor_name: str
    queue_name: str
    timing: Timing
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    missed: str = DEFAULT_MISSED
    grace: float = DEFAULT_GRACE
    version: int = 0

    @property
    def fingerprint(self) -> str:
        """A hash of the whole definition: processes that declare the same schedule the same way agree on it."""
        definition: dict[str, Any] = {
            "actor": self.actor_name,
            "queue": self.queue_name,
            "timing": dataclasses.asdict(self.timing),
            "args": list(self.args),
            "kwargs": self.kwargs,
            "options": self.options,
            "missed": self.missed,
            "grace_ms": self.grace_ms,
        }
        if self.version:  # (absent at 0: the fingerprints stored before version= existed stay the same)
            definition["version"] = self.version
        text = json.dumps(definition, sort_keys=True, default=repr, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    @property
    def grace_ms(self) -> int:
        return round(self.grace * 1000)

    def message(self, tick: datetime) -> Message:
        """The message of one tick (a new id; ``options`` say which schedule and tick)."""
        options = {**self.options, "schedule": self.name, "tick": tick.isoformat()}
        return Message(
            queue_name=self.queue_name,
            actor_name=self.actor_name,
            args=tuple(self.args),
            kwargs=dict(self.kwargs),
            options=options,
            message_id=str(uuid.uuid4()),
        )


class Schedules:
    """The schedules declared in this process for one broker (``broker.schedules``)."""

    def __init__(
        self,
        lookup: Callable[[str], Any] | None = None,
        where: Callable[[str], tuple[Database, Statements]] | None = None,
    ) -> None:
        self._lookup = lookup
        self._where = where  #: the database keeping a schedule (name -> (database, statements))
        self._by_name: dict[str, Schedule] = {}

    # -- operators' actions (features/schedule_control.py), on every process ---------------------
    def _control(self, name: str) -> tuple[Database, Statements]:
        if self._where is None:
            raise RuntimeError("this registry has no database: use broker.schedules")
        return self._where(name)

    def pause(self, name: str, *, who: str = "python") -> bool:
        """Pause schedule *name* on every process (stored in the database); whether it was running.
        Recorded in the audit log under *who*."""
        from . import schedule_control

        return schedule_control.pause(*self._control(name), name, who=who)

    def resume(self, name: str, *, who: str = "python") -> bool:
        """Resume schedule *name* (the ticks that fell while paused are not enqueued); whether it was paused."""
        from . import schedule_control

        return schedule_control.resume(*self._control(name), name, who=who)

    def run_now(self, name: str, *, who: str = "python", click: str | None = None) -> Any:
        """Ask for one extra message of schedule *name* now, enqueued by its scheduler exactly once per *click*
        (a new one when not given); returns a :class:`.schedule_control.RunRequest`."""
        from . import schedule_control

        return schedule_control.run_now(*self._control(name), name, who=who, click=click)

    def add(
        self,
        actor: Any,
        cron: str | None = None,
        *,
        every: float | timedelta | None = None,
        tz: str | None = None,
        name: str | None = None,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        missed: str = DEFAULT_MISSED,
        grace: float = DEFAULT_GRACE,
        version: int = 0,
    ) -> Schedule:
        """Declare a schedule of *actor* (a Dramatiq actor, or the name of one declared on this broker).

        *version* orders this definition against the ones other processes
        declare under the same name: a higher one wins whenever it is
        declared; at equal versions the definition first declared last wins
        (see the module docstring).  Leave it at 0 unless that order is not
        the one you deploy in.

        Raises :class:`ValueError` for a bad cron expression, time zone,
        interval, policy, version or name, a name declared twice, an actor this
        broker does not know, or arguments the message encoder cannot encode.
        """
        actor_name, queue_name = self._actor(actor)
        name = actor_name if name is None else name
        if not isinstance(name, str) or not 0 < len(name) <= 200 or not set(name) <= _NAME_CHARS:
            raise ValueError(f"invalid schedule name {name!r}: use letters, digits and '._:-' (at most 200)")
        if name in self._by_name:
            raise ValueError(f"schedule {name!r} is declared twice; give the second one a name of its own (name=...)")
        if missed not in MISSED_POLICIES:
            raise ValueError(f"missed= is one of {', '.join(map(repr, MISSED_POLICIES))}, not {missed!r}")
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 < grace < math.inf:
            raise ValueError(f"grace= takes a positive number of seconds, not {grace!r}")
        if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
            raise ValueError(f"args= takes a tuple or a list, not {args!r}")
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2**63:
            raise ValueError(f"version= takes a whole number, 0 or more, not {version!r}")
        timing = Timing.parse(cron, every, tz)
        scheduled = Schedule(
            name,
            actor_name,
            queue_name,
            timing,
            tuple(args),
            dict(kwargs or {}),
            dict(options or {}),
            missed,
            grace,
            version,
        )
        try:
            scheduled.message(datetime.now(UTC)).encode()
        except Exception as e:
            raise ValueError(f"the message of schedule {name!r} cannot be encoded: {e}") from None
        self._by_name[name] = scheduled
        return scheduled

    def _actor(self, actor: Any) -> tuple[str, str]:
        if isinstance(actor, str):
            found = self._lookup(actor) if self._lookup is not None else None
            if found is None:
                raise ValueError(
                    f"no actor named {actor!r} is declared on this broker (declare it before its schedule)"
                )
            actor = found
        actor_name, queue_name = getattr(actor, "actor_name", None), getattr(actor, "queue_name", None)
        if not isinstance(actor_name, str) or not isinstance(queue_name, str):
            raise ValueError(f"a schedule needs a Dramatiq actor or the name of one, not {actor!r}")
        check_queue(queue_name)
        return actor_name, queue_name

    def remove(self, name: str) -> None:
        """Forget a schedule in this process (before its scheduler starts)."""
        del self._by_name[name]

    def get(self, name: str) -> Schedule | None:
        return self._by_name.get(name)

    def __iter__(self) -> Iterator[Schedule]:
        return iter(sorted(self._by_name.values(), key=lambda s: s.name))

    def __len__(self) -> int:
        return len(self._by_name)


def schedule(
    cron: str | None = None,
    *,
    every: float | timedelta | None = None,
    tz: str | None = None,
    name: str | None = None,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    options: dict[str, Any] | None = None,
    missed: str = DEFAULT_MISSED,
    grace: float = DEFAULT_GRACE,
    version: int = 0,
) -> Callable[[Any], Any]:
    """Decorate a Dramatiq actor (put it above ``@dramatiq.actor``) to send it a message on every tick.

    See :meth:`Schedules.add` for the parameters; the actor's broker must be a
    :class:`~.broker.PostgresBroker`.
    """

    def decorate(actor: Any) -> Any:
        registry = getattr(getattr(actor, "broker", None), "schedules", None)
        if not isinstance(registry, Schedules):
            raise TypeError("@schedule goes above @dramatiq.actor, on an actor whose broker is a PostgresBroker")
        registry.add(
            actor,
            cron,
            every=every,
            tz=tz,
            name=name,
            args=args,
            kwargs=kwargs,
            options=options,
            missed=missed,
            grace=grace,
            version=version,
        )
        return actor

    return decorate


# -- what operators see ------------------------------------------------------------
_LIST_COLUMNS = (
    "name", "actor_name", "queue_name", "cron", "timezone", "every_ms", "missed", "grace_ms", "version", "created_at",
    "changed_at", "seen_at", "outdated_seen_at", "last_tick", "last_message_id", "last_enqueued_at",
    "paused_at", "paused_by", "resumed_at", "runs_pending",
)  # fmt: skip


def overview(database: Database, statements: Statements) -> list[dict[str, Any]]:
    """Every stored schedule: the definition in force, last tick and that tick's message, next tick, whether
    it is stale (no scheduler declares it), whether it is paused (``paused_at``, ``paused_by``; migration 022)
    and its "run now" clicks not yet enqueued (``runs_pending``), and whether a running scheduler still declares an older
    definition (``outdated``: processes with old code, which enqueue nothing)."""
    rows = database.run(lambda conn: conn.execute(statements.schedule_list).fetchall())
    found = []
    for row in rows:
        item = dict(zip(_LIST_COLUMNS, row[:-1], strict=True))
        now: datetime = row[-1]
        timing = Timing(item["cron"], item["timezone"], item["every_ms"])
        item["last_message_id"] = None if item["last_message_id"] is None else str(item["last_message_id"])
        item["schedule"] = timing.describe()
        item["stale"] = (now - item["seen_at"]).total_seconds() > STALE_AFTER
        older = item["outdated_seen_at"]
        item["outdated"] = older is not None and (now - older).total_seconds() <= STALE_AFTER
        try:
            since = max(now, item["last_tick"] or now)
            item["next_tick"] = None if item["stale"] or item["paused_at"] else timing.after(since)
        except (CronError, ZoneInfoNotFoundError, ValueError):
            item["next_tick"] = None  # stored by another version of the definition rules
        found.append(item)
    return found


def forget(database: Database, statements: Statements, name: str) -> bool:
    """Remove a schedule's row; returns whether there was one.

    The order of its definitions stays (schedule_version): a scheduler that
    still declares the newest one puts the row back; an older one never does.
    """
    return database.run(lambda conn: conn.execute(statements.schedule_forget, [name]).fetchone()) is not None
