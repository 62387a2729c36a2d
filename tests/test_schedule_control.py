"""Operators acting on schedules: a pause holds on every process (the database says so), a resume owes
nothing of the paused time, and "run now" enqueues one message per click however many schedulers race."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
from helpers import query
from test_schedules import Factory, db_now, messages, twin

from dramatiq_pg_fenced.features.schedule_control import UnknownSchedule


def audit(broker: object) -> list[tuple]:
    return query(broker, "SELECT who, action, selection->>'schedule', touched FROM {schema}.audit ORDER BY id")


def test_given_a_paused_schedule_I_expect_no_process_to_enqueue_its_ticks_and_a_resume_to_owe_none_of_them(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    first = dramatiq_pg_broker_factory()
    one, scheduler_one = twin(dramatiq_pg_broker_factory, first.schema, every=1, missed="once", grace=3600)
    two, scheduler_two = twin(dramatiq_pg_broker_factory, first.schema, every=1, missed="once", grace=3600)
    scheduler_one.declare(list(one.schedules))
    scheduler_two.declare(list(two.schedules))
    # Process two read the schedule before the pause: its tick statement still finds the row paused.
    scheduled = two.schedules.get("tick")
    assert scheduled is not None
    assert one.schedules.pause("tick", who="alice") is True
    assert one.schedules.pause("tick", who="alice") is False  # paused already
    query(first, "UPDATE {schema}.schedule SET changed_at = now() - interval '1 hour'")  # an hour of ticks due
    now = db_now(first).replace(microsecond=0)
    with two.database.connection() as conn:
        assert not scheduler_two._enqueue(conn, scheduled, now)
    for scheduler, broker in ((scheduler_one, one), (scheduler_two, two)):
        scheduler.run_once(list(broker.schedules))
    assert messages(first) == []
    # Resumed: the hour of ticks that fell while paused is not owed (missed="once" would enqueue one).
    assert two.schedules.resume("tick", who="bob") is True
    resumed = db_now(first)
    scheduler_one.run_once(list(one.schedules))
    ticks = [m["options"]["tick"] for m in messages(first)]
    assert all(t > (resumed - timedelta(seconds=1)).isoformat() for t in ticks), ticks
    assert audit(first) == [
        ("alice", "schedule_pause", "tick", 1), ("alice", "schedule_pause", "tick", 0),
        ("bob", "schedule_resume", "tick", 1),
    ]  # fmt: skip
    with pytest.raises(UnknownSchedule):
        one.schedules.pause("nope", who="alice")


def test_given_one_run_now_click_and_racing_schedulers_I_expect_one_extra_message_and_its_audit_row_completed(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    first = dramatiq_pg_broker_factory()
    racers = [twin(dramatiq_pg_broker_factory, first.schema, every=86400, args=[7]) for _ in range(4)]
    racers[0][1].declare(list(racers[0][0].schedules))
    racers[0][0].schedules.pause("tick", who="alice")  # a paused schedule still runs when asked to
    asked = racers[0][0].schedules.run_now("tick", who="carol")
    assert asked.new
    assert not racers[1][0].schedules.run_now("tick", who="carol", click=asked.click).new  # the form sent twice
    barrier = threading.Barrier(len(racers))

    def race(broker: object, scheduler: object) -> None:
        barrier.wait()
        scheduler.run_once(list(broker.schedules))  # type: ignore[attr-defined]

    threads = [threading.Thread(target=race, args=pair) for pair in racers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    found = messages(first)
    assert len(found) == 1 and found[0]["args"] == [7] and found[0]["options"]["run_now"] is True
    assert sum(s.runs_taken for _, s in racers) == 1
    assert audit(first)[-1] == ("carol", "schedule_run_now", "tick", 1)
    for broker, scheduler in racers:  # taken: nothing more on later passes
        scheduler.run_once(list(broker.schedules))
    assert len(messages(first)) == 1
    with pytest.raises(UnknownSchedule):
        racers[0][0].schedules.run_now("nope", who="carol")
