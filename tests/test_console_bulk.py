"""Bulk actions over selected ids or a filtered set: each counted first, then done through the fenced
paths, and recorded in the audit log."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from helpers import query, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.ops import bulk


def message(queue: str, actor: str = "job", *args: object, **kwargs: object) -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue, actor_name=actor, args=args, kwargs=kwargs, options={})


def state_of(broker: PostgresBroker, message_id: str) -> str | None:
    rows = query(broker, "SELECT state FROM {schema}.message WHERE message_id = %s", [message_id])
    return rows[0][0] if rows else None


def claim(broker: PostgresBroker, queue: str) -> Any:
    consumer = broker.consume(queue, prefetch=1, timeout=100)
    return consumer, wait_for(lambda: next(consumer), 30, "a delivery")


def test_run_now_makes_only_the_selected_delayed_messages_due_and_is_recorded(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("b")
    later = [message("b", "job", n) for n in range(4)]
    for m in later:
        broker.enqueue(m, delay=3_600_000)
    due = message("b", "job", 99)
    broker.enqueue(due)
    # Given three of four delayed messages selected by argument, the preview counts them
    assert broker.bulk_preview("run_now", queue="b", args=[1]).count == 1
    ids = [m.message_id for m in later[:3]] + [due.message_id]
    assert broker.bulk_preview("run_now", ids=ids) == bulk.Preview("run_now", 3, False)
    # When it runs
    done = broker.bulk("run_now", who="alice", ids=ids)
    # Then those three are due now, the fourth still waits, and the log says who did what to how many
    assert (done.previewed, done.touched, done.skipped) == (3, 3, {})
    rows = query(broker, "SELECT message_id::text FROM {schema}.message WHERE available_at <= now()")
    assert sorted(r[0] for r in rows) == sorted(ids)
    (entry,) = broker.audit_log().rows
    assert (entry["id"], entry["who"], entry["action"], entry["previewed"], entry["touched"]) == (
        done.audit_id, "alice", "run_now", 3, 3)  # fmt: skip
    assert entry["selection"] == {"ids": sorted(ids), "ids_count": 4} and entry["ended_at"] is not None


def test_cancel_goes_through_the_cancel_path_and_fences_out_a_running_delivery(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("c")
    running = message("c", "job", 1)
    broker.enqueue(running)
    consumer, proxy = claim(broker, "c")
    queued = [message("c", "job", n) for n in range(2, 5)]
    broker.enqueue_many(queued)
    dead = message("c", "job", 9)
    broker.enqueue(dead)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now() WHERE message_id = %s",
          [dead.message_id])  # fmt: skip
    # Given the queue's running and queued messages (the dead one is not for cancelling)
    assert broker.bulk_preview("cancel", queue="c").count == 4
    result = broker.bulk("cancel", who="bob", queue="c")
    assert (result.previewed, result.touched) == (4, 4)
    assert {state_of(broker, m.message_id) for m in [running, *queued]} == {"cancelled"}
    assert state_of(broker, dead.message_id) == "dead"
    # Then the running delivery's ack is fenced out: the message stays cancelled
    consumer.ack(proxy)
    broker.flush_outcomes(10)
    assert state_of(broker, running.message_id) == "cancelled"
    assert broker.parts.stale.counts()["cancelled_writes"] == 1  # its ack, counted as a cancelled delivery's
    consumer.close()


def test_purge_never_touches_running_messages_and_takes_history_by_state_done(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("p")
    running = message("p", "job", 0)
    broker.enqueue(running)
    consumer, _ = claim(broker, "p")
    rest = [message("p", "job", n) for n in range(1, 4)]
    broker.enqueue_many(rest)
    kept = message("p", "job", 5)
    broker.enqueue(kept)
    query(broker, "WITH d AS (DELETE FROM {schema}.message WHERE message_id = %s RETURNING *)"
          " INSERT INTO {schema}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,"
          " finished_at, payload) SELECT message_id, seq, queue_name, actor_name, 0, 1, enqueued_at, now(), payload"
          " FROM d", [kept.message_id])  # fmt: skip
    # A purge of the queue counts the queued and the kept one, never the running one
    assert broker.bulk_preview("purge", queue="p").count == 4
    assert broker.bulk_preview("purge", queue="p", state="done").count == 1
    result = broker.bulk("purge", who="carol", queue="p")
    assert (result.previewed, result.touched) == (4, 4)
    assert state_of(broker, running.message_id) == "running"
    assert query(broker, "SELECT count(*) FROM {schema}.message") == [(1,)]
    assert query(broker, "SELECT count(*) FROM {schema}.history") == [(0,)]
    consumer.close()


def test_redrive_of_a_filtered_set_resets_retries_and_a_cap_bounds_one_call(
    dramatiq_pg_broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("r")
    dead = [message("r", "charge", n) for n in range(5)]
    other = [message("r", "mail", n) for n in range(2)]
    broker.enqueue_many(dead + other)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now()")
    monkeypatch.setattr(bulk, "MAX_BULK", 3)
    # Given 5 dead messages of one actor, and a cap of 3 per call
    assert broker.bulk_preview("redrive", actor="charge") == bulk.Preview("redrive", 3, True)
    first = broker.bulk("redrive", who="dan", actor="charge")
    second = broker.bulk("redrive", who="dan", actor="charge")
    assert (first.touched, second.touched) == (3, 2)
    assert {state_of(broker, m.message_id) for m in dead} == {"queued"}
    assert {state_of(broker, m.message_id) for m in other} == {"dead"}
    log = broker.audit_log(limit=1)
    assert log.rows[0]["id"] == second.audit_id and log.next is not None
    assert broker.audit_log(after=log.next).rows[0]["id"] == first.audit_id


def test_bulk_actions_refuse_what_they_cannot_do(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    with pytest.raises(ValueError, match="nothing selects every message"):
        broker.bulk_preview("purge")
    with pytest.raises(ValueError, match="unknown action"):
        broker.bulk_preview("explode", queue="x")
    with pytest.raises(ValueError, match="who"):
        broker.bulk("purge", who="", queue="x")
    with pytest.raises(ValueError):
        broker.bulk_preview("cancel", ids=["not-a-uuid"])
    # a state the action does not apply to selects nothing
    assert broker.bulk_preview("redrive", queue="x", state="queued").count == 0
    assert broker.audit_log().rows == []
