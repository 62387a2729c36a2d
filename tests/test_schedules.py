"""Periodic messages: when ticks fall, what is refused at declaration, and one message per tick
however many schedulers race for it (the statement, the scheduler, a worker, the CLI)."""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import NamedTuple

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.stub import StubBroker
from helpers import query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.cli.command import main
from dramatiq_pg_fenced.db import migrations
from dramatiq_pg_fenced.features.scheduler import Scheduler
from dramatiq_pg_fenced.features.schedules import DEFAULT_MISSED, Schedule, Timing, schedule

UTC = timezone.utc


def at(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


# -- when ticks fall (no database) ------------------------------------------------------
def test_interval_ticks_are_the_multiples_of_the_interval_since_the_epoch() -> None:
    timing = Timing.parse(every=10)
    assert timing.after(at("2026-01-01 00:00:03")) == at("2026-01-01 00:00:10")
    assert timing.after(at("2026-01-01 00:00:10")) == at("2026-01-01 00:00:20")  # strictly after
    assert Timing.parse(every=timedelta(minutes=1)).every_ms == 60_000


def test_late_ticks_within_the_grace_are_each_enqueued() -> None:
    timing = Timing.parse(every=1)
    due = timing.due(at("2026-01-01 00:00:00"), at("2026-01-01 00:00:05.5"), grace=60, missed="skip")
    assert due == [at(f"2026-01-01 00:00:0{s}") for s in range(1, 6)]


def test_ticks_missed_while_nothing_ran_run_once_by_default_or_are_skipped() -> None:
    timing = Timing.parse(every=3600)
    since, now = at("2026-01-01 00:00:00"), at("2026-01-01 05:00:30")
    # 01:00 to 05:00 are more than 20 s late: missed.  "once": one message, for the latest.
    assert timing.due(since, now, grace=20, missed="once") == [at("2026-01-01 05:00:00")]
    assert timing.due(since, now, grace=20, missed="skip") == []
    # Within the grace 05:00 is late, not missed: both policies enqueue it.
    assert timing.due(since, now, grace=60, missed="skip") == [at("2026-01-01 05:00:00")]
    assert DEFAULT_MISSED == "once"


def test_a_missed_tick_and_the_late_ones_after_it_come_oldest_first() -> None:
    timing = Timing.parse(every=10)
    due = timing.due(at("2026-01-01 00:00:00"), at("2026-01-01 00:10:25"), grace=12, missed="once")
    assert due == [at("2026-01-01 00:10:10"), at("2026-01-01 00:10:20")]


def test_cron_in_a_time_zone_follows_debian_cron_across_daylight_saving_changes() -> None:
    # New York, 2026-03-08: 02:00 EST jumps to 03:00 EDT.  A job at 02:30 runs at the jump, once.
    spring = Timing.parse("30 2 * * *", tz="America/New_York")
    assert spring.due(at("2026-03-08 06:00"), at("2026-03-09 12:00"), grace=86400 * 2, missed="once") == [
        at("2026-03-08 07:00"),  # 03:00 EDT
        at("2026-03-09 06:30"),  # 02:30 EDT the next day
    ]
    # 2026-11-01: 02:00 EDT falls back to 01:00 EST.  A job at 01:30 runs once, in the first pass.
    autumn = Timing.parse("30 1 * * *", tz="America/New_York")
    assert autumn.due(at("2026-11-01 04:00"), at("2026-11-01 12:00"), grace=86400, missed="once") == [
        at("2026-11-01 05:30")
    ]
    # Jobs more frequent than hourly follow the wall clock: both passes of the repeated hour.
    often = Timing.parse("*/30 * * * *", tz="America/New_York")
    due = often.due(at("2026-11-01 04:59"), at("2026-11-01 07:00"), grace=86400, missed="once")
    assert due == [at("2026-11-01 05:00"), at("2026-11-01 05:30"), at("2026-11-01 06:00"), at("2026-11-01 06:30")] + [
        at("2026-11-01 07:00")
    ]
    assert len(set(due)) == len(due)


def test_the_latest_missed_cron_tick_is_found_without_walking_from_long_ago() -> None:
    timing = Timing.parse("0 3 * * *", tz="Europe/Paris")
    assert timing.latest(at("2026-06-15 12:00"), at("2016-01-01 00:00")) == at("2026-06-15 01:00")  # 03:00 CEST
    assert timing.latest(at("2026-06-15 12:00"), at("2026-06-15 01:00")) is None


def test_cron_with_seconds_in_the_first_field() -> None:
    timing = Timing.parse("*/15 * * * * *")
    assert timing.after(at("2026-01-01 00:00:01")) == at("2026-01-01 00:00:15")


@pytest.mark.parametrize(
    ("cron", "every", "tz", "words"),
    [
        ("61 * * * *", None, None, "bad cron expression"),
        ("* * *", None, None, "bad cron expression"),
        ("* * * * * * *", None, None, "bad cron expression"),
        ("0 0 30 2 *", None, None, "bad cron expression"),  # February 30th: never
        ("", None, None, "non-empty string"),
        (5, None, None, "non-empty string"),
        ("* * * * *", None, "Mars/Olympus_Mons", "unknown time zone"),
        ("* * * * *", None, "", "unknown time zone"),
        ("* * * * *", None, "../../etc/passwd", "unknown time zone"),
        ("* * * * *", None, 2, "IANA time zone name"),
        (None, 0, None, "at least 1 second"),
        (None, 0.5, None, "at least 1 second"),
        (None, -5, None, "at least 1 second"),
        (None, float("nan"), None, "at least 1 second"),
        (None, "10", None, "seconds or a timedelta"),
        (None, True, None, "seconds or a timedelta"),
        (None, 10, "UTC", "no time zone"),
        ("* * * * *", 10, None, "one of the two"),
        (None, None, None, "one of the two"),
    ],
)
def test_bad_timings_are_refused_with_the_reason(cron: object, every: object, tz: object, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Timing.parse(cron, every, tz)


def test_a_name_declared_twice_an_unknown_actor_and_bad_options_are_refused() -> None:
    broker = PostgresBroker("postgresql://nobody@127.0.0.1:1/none", schema="unused")  # never connects

    @dramatiq.actor(broker=broker)
    def report() -> None: ...

    broker.schedules.add(report, every=60)
    with pytest.raises(ValueError, match="declared twice"):
        broker.schedules.add(report, "0 * * * *")
    broker.schedules.add(report, "0 * * * *", name="report-hourly")  # a name of its own is fine
    with pytest.raises(ValueError, match="no actor named 'nope'"):
        broker.schedules.add("nope", every=60)
    with pytest.raises(ValueError, match="Dramatiq actor"):
        broker.schedules.add(object(), every=60, name="x")
    with pytest.raises(ValueError, match="invalid schedule name"):
        broker.schedules.add(report, every=60, name="no spaces please")
    with pytest.raises(ValueError, match="missed="):
        broker.schedules.add(report, every=60, name="a", missed="sometimes")
    with pytest.raises(ValueError, match="grace="):
        broker.schedules.add(report, every=60, name="b", grace=0)
    with pytest.raises(ValueError, match="cannot be encoded"):
        broker.schedules.add(report, every=60, name="c", args=(object(),))
    with pytest.raises(ValueError, match="args="):
        broker.schedules.add(report, every=60, name="d", args="abc")
    for version in (-1, True, 1.5, "2"):
        with pytest.raises(ValueError, match="version="):
            broker.schedules.add(report, every=60, name="e", version=version)  # type: ignore[arg-type]
    assert [s.name for s in broker.schedules] == ["report", "report-hourly"]
    broker.schedules.add("report", every=30, name="by-name")  # an actor by its name
    assert broker.schedules.get("by-name") is not None


def test_the_decorator_needs_an_actor_of_a_postgres_broker() -> None:
    stub = StubBroker()

    with pytest.raises(TypeError, match="PostgresBroker"):

        @schedule(every=60)
        @dramatiq.actor(broker=stub)
        def elsewhere() -> None: ...

    with pytest.raises(TypeError, match="above @dramatiq.actor"):

        @schedule(every=60)
        def not_an_actor() -> None: ...


def test_the_fingerprint_changes_with_the_definition_only() -> None:
    timing = Timing.parse(every=60)
    one = Schedule("s", "a", "default", timing, (1,), {"k": "v"})
    assert one.fingerprint == Schedule("s", "a", "default", Timing.parse(every=60), (1,), {"k": "v"}).fingerprint
    for other in (
        Schedule("s", "a", "default", Timing.parse(every=61), (1,), {"k": "v"}),
        Schedule("s", "a", "default", timing, (2,), {"k": "v"}),
        Schedule("s", "b", "default", timing, (1,), {"k": "v"}),
        Schedule("s", "a", "default", timing, (1,), {"k": "v"}, missed="skip"),
        Schedule("s", "a", "default", timing, (1,), {"k": "v"}, version=1),
    ):
        assert other.fingerprint != one.fingerprint
    # version 0 leaves the fingerprints stored before version= existed as they were
    assert one.fingerprint == "f79307a8b00c4eac8b247d0086c1cfc5"


# -- against the database ------------------------------------------------------------
Factory = Callable[..., PostgresBroker]


def scheduler_of(broker: PostgresBroker) -> Scheduler:
    """A scheduler as a worker process runs it, driven pass by pass by the test."""
    return Scheduler(
        broker.schedules,
        broker.database,
        broker.statements,
        broker.settings,
        logging.getLogger("test.scheduler"),
        row=broker.enqueuer.row,
    )


def twin(factory: Factory, schema: str, every: float | None = 1, **options: object) -> tuple[PostgresBroker, Scheduler]:
    """Another 'process': a broker on the same schema, its own declaration of the ``tick`` schedule
    (``every=None, cron=...`` for a cron expression)."""
    broker = factory(schema=schema)

    @dramatiq.actor(broker=broker, actor_name="tick")
    def tick(*args: object, **kwargs: object) -> None: ...

    broker.schedules.add(tick, every=every, name="tick", **options)  # type: ignore[arg-type]
    return broker, scheduler_of(broker)


def messages(broker: PostgresBroker) -> list[dict]:
    """Every message of the schema (queued or acked), decoded."""
    rows = query(broker, "SELECT payload FROM {schema}.message UNION ALL SELECT payload FROM {schema}.history")
    return [json.loads(bytes(r[0])) for r in rows]


def db_now(broker: PostgresBroker) -> datetime:
    return query(broker, "SELECT clock_timestamp()")[0][0]


def test_many_schedulers_racing_for_the_same_ticks_enqueue_each_tick_once(dramatiq_pg_broker_factory: Factory) -> None:
    first = dramatiq_pg_broker_factory()
    racers = [twin(dramatiq_pg_broker_factory, first.schema) for _ in range(4)]
    racers[0][1].declare(list(racers[0][0].schedules))
    start = query(first, "SELECT changed_at FROM {schema}.schedule")[0][0]
    barrier = threading.Barrier(len(racers))
    errors: list[BaseException] = []

    def race(scheduler: Scheduler) -> None:
        try:
            for _ in range(15):
                barrier.wait()
                scheduler.run_once(list(scheduler.schedules))
                barrier.wait()
                threading.Event().wait(0.25)
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=race, args=(s,)) for _, s in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    ticks = Counter(m["options"]["tick"] for m in messages(first))
    assert ticks and max(ticks.values()) == 1, ticks.most_common(3)
    seconds = sorted(datetime.fromisoformat(t) for t in ticks)
    assert seconds[0] > start  # nothing from before the schedule was declared
    assert len(seconds) == (seconds[-1] - seconds[0]).total_seconds() + 1  # none missing in between
    assert sum(s.enqueued for _, s in racers) == len(seconds)


def test_the_database_clock_decides_a_tick_not_yet_due_or_already_passed_is_refused(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    broker = dramatiq_pg_broker_factory()
    broker, scheduler = twin(dramatiq_pg_broker_factory, broker.schema, every=1)
    scheduled = broker.schedules.get("tick")
    assert scheduled is not None
    scheduler.declare([scheduled])
    now = db_now(broker).replace(microsecond=0)
    with broker.database.connection() as conn:
        # A host whose clock runs 10 s ahead computes a tick that is not due by the database's clock.
        assert not scheduler._enqueue(conn, scheduled, now + timedelta(seconds=10))
        assert scheduler._enqueue(conn, scheduled, now)
        # A scheduler that computed an older tick and comes back late (paused) is refused.
        assert not scheduler._enqueue(conn, scheduled, now - timedelta(seconds=1))
        assert not scheduler._enqueue(conn, scheduled, now)
    assert len(messages(broker)) == 1


@pytest.mark.parametrize("missed", ["once", "skip"])
def test_ticks_missed_while_no_scheduler_ran_follow_the_policy(
    dramatiq_pg_broker_factory: Factory, missed: str
) -> None:
    broker = dramatiq_pg_broker_factory()
    broker, scheduler = twin(dramatiq_pg_broker_factory, broker.schema, every=3600, missed=missed, grace=5)
    scheduler.declare(list(broker.schedules))
    # Every scheduler was down for ten hours: the last tick and the declaration are old.
    query(
        broker,
        "UPDATE {schema}.schedule SET changed_at = date_trunc('hour', now()) - interval '10 hours',"
        " last_tick = date_trunc('hour', now()) - interval '10 hours'",
    )
    now = db_now(broker)
    scheduler.run_once(list(broker.schedules))
    cut = now - timedelta(seconds=5)
    missed_ticks = [t for t in (datetime.fromisoformat(m["options"]["tick"]) for m in messages(broker)) if t <= cut]
    if missed == "once":
        assert missed_ticks == [Timing.parse(every=3600).latest(cut, now - timedelta(hours=10))]
    else:
        assert missed_ticks == []
    scheduler.run_once(list(broker.schedules))  # a second pass adds nothing missed
    assert len([m for m in messages(broker) if datetime.fromisoformat(m["options"]["tick"]) <= cut]) == len(
        missed_ticks
    )


def test_a_schedule_changed_in_code_is_enqueued_only_by_the_processes_with_the_newer_definition(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    old, old_scheduler = twin(dramatiq_pg_broker_factory, dramatiq_pg_broker_factory().schema, every=1)
    old_scheduler.declare(list(old.schedules))
    new, new_scheduler = twin(dramatiq_pg_broker_factory, old.schema, every=2)
    new_scheduler.declare(list(new.schedules))  # a later deploy
    changed_at = query(new, "SELECT changed_at FROM {schema}.schedule")[0][0]
    old_scheduler.declare(list(old.schedules))  # the old process's periodic declaration
    for _ in range(12):
        with caplog.at_level(logging.WARNING, logger="test.scheduler"):
            old_scheduler.run_once(list(old.schedules))
        new_scheduler.run_once(list(new.schedules))
        threading.Event().wait(0.25)
    assert old_scheduler.enqueued == 0
    assert new_scheduler.enqueued >= 1
    ticks = [datetime.fromisoformat(m["options"]["tick"]) for m in messages(old)]
    assert all(t.second % 2 == 0 for t in ticks if t > changed_at)  # (one of the old timing may be owed)
    assert sum("has a newer definition" in r.getMessage() for r in caplog.records) == 1  # said once
    (row,) = [s for s in new.stats()["schedules"] if s["name"] == "tick"]
    assert row["schedule"] == "every 2s"
    assert row["outdated"]  # an older definition is still declared: the deploy is not over


def daily_at(moment: datetime) -> str:
    """A cron expression (seconds first) that ticks once a day, at *moment*'s time of day (UTC)."""
    return f"{moment.second} {moment.minute} {moment.hour} * * *"


def declared_an_hour_ago(broker: PostgresBroker) -> None:
    """As if the stored definition had been declared an hour ago (and no tick enqueued since)."""
    query(broker, "UPDATE {schema}.schedule SET changed_at = now() - interval '1 hour', created_at = changed_at")


def test_a_tick_due_before_a_change_and_within_its_grace_is_enqueued_once_with_the_new_definition(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    probe = dramatiq_pg_broker_factory(schema=schema)
    due = db_now(probe).replace(microsecond=0) - timedelta(seconds=2)
    # Given a schedule with a 60 s grace whose tick fell due 2 s ago and is not enqueued yet
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(due), args=("old",))
    old_scheduler.declare(list(old.schedules))
    declared_an_hour_ago(old)
    # When a deploy declares it again with new arguments, and every scheduler runs a pass
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(due), args=("new",))
    new_scheduler.declare(list(new.schedules))
    for scheduler in (old_scheduler, new_scheduler, old_scheduler, new_scheduler):
        scheduler.run_once(list(scheduler.schedules))
    # I expect that tick enqueued once, with the declaration in force (the new one)
    (message,) = messages(new)
    assert datetime.fromisoformat(message["options"]["tick"]) == due
    assert message["args"] == ["new"]
    assert old_scheduler.enqueued == 0


def test_a_timing_change_owes_the_old_timings_late_ticks_and_none_of_the_new_timings_past_ones(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    probe = dramatiq_pg_broker_factory(schema=schema)
    now = db_now(probe).replace(microsecond=0)
    old_tick, new_timings_past_tick = now - timedelta(seconds=2), now - timedelta(seconds=10)
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(old_tick))
    old_scheduler.declare(list(old.schedules))
    declared_an_hour_ago(old)
    # The new timing ticks at a time of day 10 s ago: never a tick of the definition in force then
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(new_timings_past_tick))
    new_scheduler.declare(list(new.schedules))
    new_scheduler.run_once(list(new.schedules))
    assert [datetime.fromisoformat(m["options"]["tick"]) for m in messages(new)] == [old_tick]


@pytest.mark.parametrize("missed", ["once", "skip"])
def test_a_change_keeps_the_old_definitions_policy_for_ticks_it_missed(
    dramatiq_pg_broker_factory: Factory, missed: str
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    probe = dramatiq_pg_broker_factory(schema=schema)
    missed_tick = db_now(probe).replace(microsecond=0) - timedelta(seconds=30)
    # Given a tick 30 s ago, past a 5 s grace: missed while no scheduler ran (a deploy's downtime)
    old, old_scheduler = twin(
        dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(missed_tick), grace=5, missed=missed
    )
    old_scheduler.declare(list(old.schedules))
    declared_an_hour_ago(old)
    new, new_scheduler = twin(
        dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(missed_tick), grace=5, missed=missed, args=(2,)
    )
    new_scheduler.declare(list(new.schedules))
    new_scheduler.run_once(list(new.schedules))
    # The old definition's policy decides, as if its scheduler had run a pass at the change
    expected = [missed_tick] if missed == "once" else []
    assert [datetime.fromisoformat(m["options"]["tick"]) for m in messages(new)] == expected


def test_a_change_racing_the_old_definitions_schedulers_enqueues_the_late_tick_once(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    probe = dramatiq_pg_broker_factory(schema=schema)
    due = db_now(probe).replace(microsecond=0) - timedelta(seconds=1)
    olds = [twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(due), args=("old",)) for _ in range(3)]
    olds[0][1].declare(list(olds[0][0].schedules))
    declared_an_hour_ago(probe)
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=None, cron=daily_at(due), args=("new",))
    barrier = threading.Barrier(len(olds) + 1)
    errors: list[BaseException] = []

    def run(step: Callable[[], object]) -> None:
        try:
            barrier.wait()
            step()
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    steps = [lambda s=s, b=b: s.run_once(list(b.schedules)) for b, s in olds]
    steps.append(lambda: new_scheduler.declare(list(new.schedules)))
    threads = [threading.Thread(target=run, args=(step,)) for step in steps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    new_scheduler.run_once(list(new.schedules))
    (message,) = messages(new)  # by one side or the other, never both
    assert datetime.fromisoformat(message["options"]["tick"]) == due


def stored_schedule(broker: PostgresBroker) -> str:
    (row,) = [s for s in broker.stats()["schedules"] if s["name"] == "tick"]
    return str(row["schedule"])


def test_an_old_process_restarting_after_a_new_one_does_not_take_its_schedule_back(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    # Given a rolling deploy: the old code declared every 1 s, then the new code every 2 s
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=1)
    old_scheduler.declare(list(old.schedules))
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=2)
    new_scheduler.declare(list(new.schedules))
    # (A tick of the old definition that fell due between the two declarations is owed, and enqueued
    # by this one: at an odd second when a second's turn fell in between, about one run in fifty.)
    declared = db_now(new)
    # When an old process starts again (a crash, a rescheduled pod) after the new ones
    restarted = scheduler_of(old)
    with caplog.at_level(logging.WARNING, logger="test.scheduler"):
        restarted.declare(list(old.schedules))
        for _ in range(10):
            restarted.run_once(list(old.schedules))
            new_scheduler.run_once(list(new.schedules))
            threading.Event().wait(0.25)
    # I expect the newer definition to stay, and only its processes to enqueue
    assert stored_schedule(new) == "every 2s"
    assert restarted.enqueued == 0 and new_scheduler.enqueued >= 1
    ticks = [datetime.fromisoformat(m["options"]["tick"]) for m in messages(new)]
    assert all(t.second % 2 == 0 for t in ticks if t > declared), ticks
    assert any("out of date" in r.getMessage() for r in caplog.records)


def fingerprint_of(broker: PostgresBroker) -> str:
    scheduled = broker.schedules.get("tick")
    assert scheduled is not None
    return scheduled.fingerprint


def test_a_newer_definition_nobody_declares_any_more_gives_way_to_an_older_one(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=1)
    old_scheduler.declare(list(old.schedules))
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=2)
    new_scheduler.declare(list(new.schedules))
    old_scheduler.declare(list(old.schedules))
    assert stored_schedule(new) == "every 2s"
    # When the newer processes are gone for longer than STALE_AFTER (a rollback)
    query(
        new,
        "UPDATE {schema}.schedule_version SET last_seen = now() - interval '1 hour' WHERE fingerprint = %s",
        [fingerprint_of(new)],
    )
    old_scheduler.declare(list(old.schedules))
    # I expect the older definition to take over and be enqueued
    assert stored_schedule(old) == "every 1s"
    wait_for(lambda: old_scheduler.run_once(list(old.schedules)) and old_scheduler.enqueued, what="an old tick")
    # and the newer one to win again when its code comes back
    new_scheduler.declare(list(new.schedules))
    assert stored_schedule(new) == "every 2s"


def test_a_higher_version_wins_whatever_order_the_definitions_were_first_declared_in(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str, cli: Callable[..., Ran]
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    two, two_scheduler = twin(dramatiq_pg_broker_factory, schema, every=1, version=2)
    two_scheduler.declare(list(two.schedules))
    one, one_scheduler = twin(dramatiq_pg_broker_factory, schema, every=2, version=1)  # first seen later
    one_scheduler.declare(list(one.schedules))
    assert stored_schedule(one) == "every 1s"
    three, three_scheduler = twin(dramatiq_pg_broker_factory, schema, every=3, version=3)
    three_scheduler.declare(list(three.schedules))
    two_scheduler.declare(list(two.schedules))
    (row,) = three.stats()["schedules"]
    assert (row["schedule"], row["version"], row["outdated"]) == ("every 3s", 3, True)
    shown = cli(dramatiq_pg_url, schema, "schedules").stdout
    assert "every 3s (version 3)" in shown and "an older definition is still declared" in shown


def test_the_migration_knows_the_definitions_stored_before_it_as_older_ones(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=1)
    old_scheduler.declare(list(old.schedules))
    # Given a schema as migration 009 finds it: a stored definition, no order of definitions
    query(old, "DELETE FROM {schema}.schedule_version")
    (text,) = [text for version, _, text in migrations.available() if version == 9]
    query(old, text)
    query(old, text)  # safe to run twice
    assert query(old, "SELECT name, fingerprint FROM {schema}.schedule_version") == [("tick", fingerprint_of(old))]
    # When the new code declares, then an old process starts again
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=2)
    new_scheduler.declare(list(new.schedules))
    scheduler_of(old).declare(list(old.schedules))
    # I expect the definition stored before the migration to count as the older one
    assert stored_schedule(new) == "every 2s"


class Ran(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., Ran]:
    """The ``dramatiq-pg-fenced`` command, run in this process (its entry point, ``main``)."""

    def run(url: str, schema: str, *args: str) -> Ran:
        capsys.readouterr()
        code = main(["--url", url, "--schema", schema, *args])
        out, err = capsys.readouterr()
        return Ran(code, out, err)

    return run


def test_stats_and_the_cli_show_each_schedule_its_last_and_next_tick_and_stale_ones(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str, cli: Callable[..., Ran]
) -> None:
    broker, scheduler = twin(dramatiq_pg_broker_factory, dramatiq_pg_broker_factory().schema, every=1)
    scheduler.declare(list(broker.schedules))
    wait_for(lambda: scheduler.run_once(list(broker.schedules)) is not None and scheduler.enqueued, what="a tick")
    (row,) = broker.stats()["schedules"]
    (message,) = messages(broker)
    assert row["name"] == "tick" and row["actor_name"] == "tick" and not row["stale"]
    assert row["last_message_id"] == message["message_id"]
    assert row["last_tick"] == datetime.fromisoformat(message["options"]["tick"])
    assert row["next_tick"] > row["last_tick"]

    shown = cli(dramatiq_pg_url, broker.schema, "schedules")
    assert shown.returncode == 0, shown.stderr
    assert "tick" in shown.stdout and message["message_id"] in shown.stdout and "active" in shown.stdout
    stats = cli(dramatiq_pg_url, broker.schema, "stats", "--json")
    assert json.loads(stats.stdout)["schedules"][0]["last_message_id"] == message["message_id"]

    # Removed from the code: no scheduler declares it any more.
    query(broker, "UPDATE {schema}.schedule SET seen_at = now() - interval '1 hour'")
    (row,) = broker.stats()["schedules"]
    assert row["stale"] and row["next_tick"] is None
    assert "stale" in cli(dramatiq_pg_url, broker.schema, "schedules").stdout
    assert cli(dramatiq_pg_url, broker.schema, "schedules", "--forget", "tick").returncode == 0
    assert broker.stats()["schedules"] == []
    missing = cli(dramatiq_pg_url, broker.schema, "schedules", "--forget", "tick")
    assert missing.returncode == 1 and "no schedule 'tick'" in missing.stderr
    # Forgotten while a scheduler still declares it: it comes back (without overwriting anyone's definition).
    scheduler.tick()
    scheduler.tick()
    (row,) = broker.stats()["schedules"]
    assert row["name"] == "tick" and not row["stale"]


def test_forgetting_a_schedule_does_not_let_an_old_process_put_its_definition_back(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str, cli: Callable[..., Ran]
) -> None:
    schema = dramatiq_pg_broker_factory().schema
    old, old_scheduler = twin(dramatiq_pg_broker_factory, schema, every=1)
    old_scheduler.declare(list(old.schedules))
    new, new_scheduler = twin(dramatiq_pg_broker_factory, schema, every=2)
    new_scheduler.declare(list(new.schedules))
    # When an operator forgets the schedule and the old process declares first (its periodic declaration)
    assert cli(dramatiq_pg_url, schema, "schedules", "--forget", "tick").returncode == 0
    old_scheduler.declare(list(old.schedules))
    old_scheduler.run_once(list(old.schedules))
    # I expect the old definition not to come back, nor to be enqueued
    assert [s["schedule"] for s in new.stats()["schedules"]] in ([], ["every 2s"])
    assert old_scheduler.enqueued == 0
    new_scheduler.declare(list(new.schedules))
    assert stored_schedule(new) == "every 2s"


def test_a_worker_runs_the_scheduler_and_its_actor_gets_each_tick(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(poll_interval=0.2)
    got: list[str] = []

    @schedule(every=1, kwargs={"word": "hi"})
    @dramatiq.actor(broker=broker)
    def beat(word: str) -> None:
        got.append(word)

    with running_worker(broker, threads=2):
        wait_for(lambda: len(got) >= 2, what="two ticks delivered")
        assert broker.parts.scheduler.enqueued >= 2
    assert set(got) == {"hi"}
    ticks = Counter(m["options"]["tick"] for m in messages(broker))
    assert max(ticks.values()) == 1


def test_a_broker_with_run_schedules_false_runs_no_scheduler(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(run_schedules=False)

    @schedule(every=1)
    @dramatiq.actor(broker=broker)
    def quiet() -> None: ...

    with running_worker(broker, threads=1):
        threading.Event().wait(1.5)
    assert messages(broker) == []
    assert query(broker, "SELECT count(*) FROM {schema}.schedule")[0][0] == 0


def test_the_standalone_scheduler_command_refuses_a_module_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scheduler", "tests.apps.no_such_app"]) == 2
    assert "cannot import 'tests.apps.no_such_app'" in capsys.readouterr().err
    assert main(["scheduler", "tests.helpers"]) == 2  # imports, but sets no PostgresBroker with schedules


def test_a_pass_survives_a_broken_connection(dramatiq_pg_broker_factory: Factory) -> None:
    broker, scheduler = twin(dramatiq_pg_broker_factory, dramatiq_pg_broker_factory().schema, every=1)
    scheduler.declare(list(broker.schedules))
    with broker.database.connection() as conn:
        pid = conn.info.backend_pid
    with psycopg.connect(broker.database.url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    scheduler.start()
    try:
        wait_for(lambda: scheduler.enqueued >= 1, what="a tick after the connection broke")
    finally:
        scheduler.stop()
