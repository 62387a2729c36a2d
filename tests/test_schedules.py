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
from dramatiq_pg_fenced.cli import main
from dramatiq_pg_fenced.schedules import DEFAULT_MISSED, Schedule, Scheduler, Timing, schedule

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
    ):
        assert other.fingerprint != one.fingerprint


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


def twin(factory: Factory, schema: str, every: float = 1, **options: object) -> tuple[PostgresBroker, Scheduler]:
    """Another 'process': a broker on the same schema, its own declaration of the ``tick`` schedule."""
    broker = factory(schema=schema)

    @dramatiq.actor(broker=broker, actor_name="tick")
    def tick() -> None: ...

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
    racers[0][1].declare(list(racers[0][0].schedules), first=True)
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
    scheduler.declare([scheduled], first=True)
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
    scheduler.declare(list(broker.schedules), first=True)
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


def test_a_schedule_changed_in_code_is_enqueued_only_by_the_process_that_declared_last(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    old, old_scheduler = twin(dramatiq_pg_broker_factory, dramatiq_pg_broker_factory().schema, every=1)
    old_scheduler.declare(list(old.schedules), first=True)
    new, new_scheduler = twin(dramatiq_pg_broker_factory, old.schema, every=2)
    new_scheduler.declare(list(new.schedules), first=True)  # a later deploy
    old_scheduler.declare(list(old.schedules), first=False)  # the old process's periodic declaration
    for _ in range(12):
        with caplog.at_level(logging.WARNING, logger="test.scheduler"):
            old_scheduler.run_once(list(old.schedules))
        new_scheduler.run_once(list(new.schedules))
        threading.Event().wait(0.25)
    assert old_scheduler.enqueued == 0
    assert new_scheduler.enqueued >= 1
    ticks = [datetime.fromisoformat(m["options"]["tick"]) for m in messages(old)]
    assert all(t.second % 2 == 0 for t in ticks)
    assert sum("declared differently" in r.getMessage() for r in caplog.records) == 1  # said once
    (row,) = [s for s in new.stats()["schedules"] if s["name"] == "tick"]
    assert row["schedule"] == "every 2s"


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
    scheduler.declare(list(broker.schedules), first=True)
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
    scheduler.declare(list(broker.schedules), first=True)
    with broker.database.connection() as conn:
        pid = conn.info.backend_pid
    with psycopg.connect(broker.database.url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", [pid])
    scheduler.start()
    try:
        wait_for(lambda: scheduler.enqueued >= 1, what="a tick after the connection broke")
    finally:
        scheduler.stop()
