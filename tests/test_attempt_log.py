"""A message's whole story (issue 42, point 2): every attempt that ended without an ack is in the attempt
log (migration 023), written with its outcome and fenced as it is; inspect and the message page show
it with the acks and the operators' actions, in order.  Real PostgreSQL, real workers."""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
from dramatiq.middleware import CurrentMessage
from helpers import Factory, expire_and_rescue, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import delivery
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy
from dramatiq_pg_fenced.ops import admin


def attempt_rows(broker: PostgresBroker, message_id: str) -> list[tuple]:
    """(attempt, outcome, error) of the message's attempt log, in the order written."""
    return query(
        broker,
        "SELECT attempt, outcome, error FROM {schema}.attempt_log WHERE message_id = %s ORDER BY id",
        [message_id],
    )


def deliver(broker: PostgresBroker, queue: str = "default") -> PostgresMessageProxy:
    consumer = broker.consume(queue, prefetch=1, timeout=100)
    delivered = wait_for(lambda: next(consumer), 30, "a delivery")
    assert isinstance(delivered, PostgresMessageProxy)
    delivered.consumer = consumer  # type: ignore[attr-defined]  # settled through its own consumer
    return delivered


def retry_late(broker: PostgresBroker, proxy: PostgresMessageProxy, error: str) -> None:
    """What a worker thread does when its actor fails with retries left (Dramatiq's Retries, then the ack)."""
    delivery.start(proxy)
    proxy.stuff_exception(ValueError(error))
    delivery.defer_effects()
    broker.enqueue(proxy, delay=0)
    proxy.consumer.ack(proxy)  # type: ignore[attr-defined]  # (a no-op after the retry)
    assert broker.flush_outcomes(10)
    delivery.start(None)


def flaky(broker: PostgresBroker, fails: int) -> dramatiq.Actor:
    """An actor that fails its first *fails* runs (``ValueError: boom <n>``), then returns."""
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=5, min_backoff=1, max_backoff=5)
    def charge(order: int) -> None:
        runs.append(order)
        if len(runs) <= fails:
            raise ValueError(f"boom {len(runs)}")

    return charge


def test_a_message_that_fails_twice_then_succeeds_shows_three_attempts_with_both_errors(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given an actor that fails twice and then succeeds, run by a real worker, I expect inspect to list
    attempts 1 and 2 as retried with their errors (the traceback kept whole) and its story to end with
    the ack of attempt 3, each attempt with its process, its claim and end as dates, and its run time."""
    broker = dramatiq_pg_broker
    charge = flaky(broker, fails=2)
    with running_worker(broker, threads=1):
        sent = charge.send(7)
        broker.join("default", timeout=30_000)
    info = broker.inspect(sent.message_id)
    assert info is not None and info["state"] == "done"
    attempts = info["attempts"]
    assert [(a["attempt"], a["outcome"], a["error"]) for a in attempts] == [
        (1, "retried", "ValueError: boom 1"),
        (2, "retried", "ValueError: boom 2"),
    ]
    assert all("Traceback (most recent call last)" in a["error_text"] for a in attempts)
    for a in attempts:
        assert a["consumer_id"].startswith(broker.consumer_id + "/default/")  # the consumer that claimed it
        assert a["claimed_at"] <= a["ended_at"] and a["ran_seconds"] >= 0
    story = admin.story(info)
    assert [(e["kind"], e["attempt"], e["outcome"]) for e in story] == [
        ("attempt", 1, "retried"),
        ("attempt", 2, "retried"),
        ("done", 3, "done"),
    ]


def test_a_message_rescued_after_its_worker_stopped_renewing_shows_its_lease_lost(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given a real worker whose actor hangs on attempt 1 while its lease lapses (its keeper no longer
    extends it) and maintenance takes the message back, then a second worker that runs it to the end,
    and the first actor failing at last, I expect attempt 1 as 'lease lost', attempt 2's ack, and the
    first actor's late retry recorded as fenced out, never as retried."""
    stuck = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=stuck.schema)
    started, go = threading.Event(), threading.Event()
    for broker in (stuck, other):

        @dramatiq.actor(broker=broker, max_retries=3, min_backoff=1, max_backoff=5)
        def work() -> None:
            if CurrentMessage.get_current_message().options["attempt"] == 1:
                started.set()
                go.wait(30)
                raise ValueError("too late")

        broker.add_middleware(CurrentMessage())
    with running_worker(stuck, threads=1, prefetch=1):  # holding attempt 1, it claims nothing more
        sent = stuck.actors["work"].send()
        wait_for(started.is_set, 30, "attempt 1 to start")
        stuck.parts.keeper.stop()  # its worker stops renewing the lease (a paused process)
        assert expire_and_rescue(stuck) == 1
        with running_worker(other, threads=1):
            done = lambda: (i := other.inspect(sent.message_id)) is not None and i["state"] == "done"  # noqa: E731
            wait_for(done, 30, "attempt 2")
        go.set()  # the first actor fails at last: its retry is refused by the fence
        wait_for(lambda: len(attempt_rows(stuck, sent.message_id)) == 2, 30, "the late retry's record")
    rows = attempt_rows(stuck, sent.message_id)
    assert [(a, o) for a, o, _ in rows] == [(1, "lease lost"), (1, "fenced out")]
    assert rows[1][2].startswith("its retry was refused: the row is gone: the message is finished")
    assert "ValueError: too late" in rows[1][2]
    info = stuck.inspect(sent.message_id)
    assert info is not None and [h["attempt"] for h in info["history"]] == [2]
    assert not [a for a in info["attempts"] if a["outcome"] == "retried"]


def test_a_late_retry_by_a_stale_attempt_is_recorded_as_fenced_out_not_retried(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given attempt 1 whose lease lapsed and was rescued, and attempt 2 running in another process, when
    attempt 1 retries late and then attempt 2 retries, I expect the log: attempt 1 lease lost, attempt 1
    fenced out (the reason: attempt 2 holds it), attempt 2 retried; the message queued by attempt 2 alone."""
    a = dramatiq_pg_broker_factory()
    b = dramatiq_pg_broker_factory(schema=a.schema)
    for broker in (a, b):
        broker.declare_queue("default")
    sent = a.enqueue(dramatiq.Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}))
    first = deliver(a)
    expire_and_rescue(a)
    second = deliver(b)
    retry_late(a, first, "attempt 1's failure")
    retry_late(b, second, "attempt 2's failure")
    rows = attempt_rows(a, sent.message_id)
    assert [(n, outcome) for n, outcome, _ in rows] == [(1, "lease lost"), (1, "fenced out"), (2, "retried")]
    assert rows[1][2].startswith("its retry was refused: the message was redelivered: attempt 2 holds it now")
    assert "attempt 1's failure" in rows[1][2]
    assert "attempt 2's failure" in rows[2][2]
    process = query(a, "SELECT consumer_id FROM {schema}.attempt_log WHERE outcome = 'fenced out'")
    assert process == [(a.consumer_id,)]  # the process whose write was refused
    assert query(a, "SELECT state, attempt, last_error FROM {schema}.message")[0][:2] == ("queued", 2)


def test_the_end_of_a_cancelled_delivery_and_a_release_at_shutdown_are_recorded(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given a delivery released unstarted as its worker stops, then one cancelled while it ran that
    fails afterwards, I expect attempt 1 'requeued' and attempt 2 'cancelled' with its error."""
    broker = dramatiq_pg_broker
    broker.declare_queue("default")
    sent = broker.enqueue(dramatiq.Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}))
    first = deliver(broker)
    first.consumer.requeue([first])  # type: ignore[attr-defined]
    second = deliver(broker)
    assert broker.cancel(sent.message_id).value == "cancelled_running"
    retry_late(broker, second, "failed after its cancel")
    rows = attempt_rows(broker, sent.message_id)
    assert [(n, outcome) for n, outcome, _ in rows] == [(1, "requeued"), (2, "cancelled")]
    assert "failed after its cancel" in rows[1][2]


def test_a_cancelled_delivery_whose_holder_stopped_ends_as_cancelled_when_its_lease_lapses(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given a delivery cancelled while it ran whose process then stops extending its lease (it died, or
    was paused), I expect maintenance to end it as 'cancelled' once the lease lapsed (the row keeps its
    state, loses its lease and delivery token), and the holder's late write, if it comes, to be refused
    and recorded as fenced out, counted as a cancelled write."""
    broker = dramatiq_pg_broker
    broker.declare_queue("default")
    sent = broker.enqueue(dramatiq.Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}))
    held = deliver(broker)
    assert broker.cancel(sent.message_id).value == "cancelled_running"
    broker.parts.keeper.stop()  # its process no longer extends the lease
    query(broker, "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 s'")
    broker.parts.maintenance.rescue()
    assert attempt_rows(broker, sent.message_id) == [(1, "cancelled", None)]
    assert query(broker, "SELECT state, lease_expires_at, delivery FROM {schema}.message") == [("cancelled", None, None)]
    retry_late(broker, held, "failed after its lease lapsed")
    rows = attempt_rows(broker, sent.message_id)
    assert [(n, outcome) for n, outcome, _ in rows] == [(1, "cancelled"), (1, "fenced out")]
    assert "failed after its lease lapsed" in rows[1][2]
    assert broker.stats()["process"]["cancelled_writes"] >= 1


def test_an_operators_cancel_and_redrive_appear_in_the_story_in_order(dramatiq_pg_broker: PostgresBroker) -> None:
    """Given a message that a real worker dead-letters, which an operator re-drives and, while it waits,
    cancels and re-drives again (bulk actions naming it, recorded in the audit log), then a worker acks,
    I expect its story: the failures, re-drive, cancel, re-drive, then the ack, in that order."""
    broker = dramatiq_pg_broker
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=1, min_backoff=1, max_backoff=5)
    def fragile() -> None:
        runs.append(1)
        if len(runs) <= 2:
            raise RuntimeError(f"fragile {len(runs)}")

    sent = fragile.send()
    with running_worker(broker, threads=1):
        wait_for(lambda: broker.inspect(sent.message_id)["state"] == "dead", 30, "the dead letter")
        broker.pause("default")  # the re-driven message waits while the operator changes their mind
        for action in ("redrive", "cancel", "redrive"):
            assert broker.bulk(action, who="alice", ids=[sent.message_id]).touched == 1
        broker.resume("default")
        wait_for(lambda: broker.inspect(sent.message_id)["state"] == "done", 30, "the ack")
    story = admin.story(broker.inspect(sent.message_id))
    assert [(e["kind"], e.get("outcome") or e["action"]) for e in story] == [
        ("attempt", "retried"),
        ("attempt", "dead"),
        ("audit", "redrive"),
        ("audit", "cancel"),
        ("audit", "redrive"),
        ("done", "done"),
    ]
    assert {e["who"] for e in story if e["kind"] == "audit"} == {"alice"}
    assert story[1]["error"] == "RuntimeError: fragile 2"


def test_nothing_is_recorded_when_the_broker_keeps_no_history(dramatiq_pg_broker_factory: Factory) -> None:
    """Given keep_finished=0, I expect no attempt row for retries, a lost lease, a late fenced-out retry,
    a release or a dead letter (the hot paths pay nothing), and inspect's attempts empty."""
    broker = dramatiq_pg_broker_factory(keep_finished=0)
    charge = flaky(broker, fails=2)
    with running_worker(broker, threads=1):
        sent = charge.send(1)
        broker.join("default", timeout=30_000)
    other = broker.enqueue(dramatiq.Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}))
    first = deliver(broker)
    expire_and_rescue(broker)
    retry_late(broker, first, "late")
    second = deliver(broker)
    second.consumer.requeue([second])  # type: ignore[attr-defined]
    assert broker.stats()["totals"].get("stale_writes", 0) >= 1  # the late retry was fenced out
    assert query(broker, "SELECT count(*) FROM {schema}.attempt_log") == [(0,)]
    assert broker.inspect(other.message_id)["attempts"] == []
    assert broker.inspect(sent.message_id) is None  # (nor any history)


def test_the_attempt_log_is_purged_with_the_history(dramatiq_pg_broker_factory: Factory) -> None:
    """Given attempt rows older and younger than keep_finished, I expect maintenance's history purge to
    delete the older ones only, in its bounded batches."""
    broker = dramatiq_pg_broker_factory(keep_finished=60)
    insert = (
        "INSERT INTO {schema}.attempt_log (message_id, attempt, ended_at, outcome)"
        " SELECT gen_random_uuid(), 1, now() - %s * interval '1 second', 'retried' FROM generate_series(1, %s)"
    )
    query(broker, insert, [120, 2500])  # older than keep_finished: more than one batch
    query(broker, insert, [10, 3])
    broker.parts.maintenance.purge_history()
    assert query(broker, "SELECT count(*) FROM {schema}.attempt_log") == [(3,)]


def story_rows(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [tr.text for tr in driver.find_elements(By.CSS_SELECTOR, "#story tbody tr")]


def test_a_story_puts_attempts_acks_and_actions_in_the_order_they_happened() -> None:
    """Given inspect's attempts, history and audit rows (no database), I expect one list by time: an
    attempt and an ack by their end, an action by its start; at one instant, the attempt first."""
    from datetime import datetime, timedelta, timezone

    t = datetime(2026, 12, 6, 22, 57, 13, tzinfo=timezone.utc)
    at = [t + timedelta(seconds=s) for s in range(5)]
    info = {
        "attempts": [
            {"attempt": 1, "outcome": "retried", "ended_at": at[0], "claimed_at": at[0]},
            {"attempt": 2, "outcome": "dead", "ended_at": at[2], "claimed_at": at[1]},
        ],
        "history": [{"attempt": 3, "finished_at": at[4], "lease_holder": "w/q/0", "claimed_at": at[3]}],
        "audit": [{"id": 7, "at": at[2], "who": "alice", "action": "redrive", "touched": 1, "ended_at": at[2]}],
    }
    story = admin.story(info)
    assert [(e["kind"], e.get("attempt")) for e in story] == [("attempt", 1), ("attempt", 2), ("audit", None),
                                                               ("done", 3)]  # fmt: skip
    assert story[-1]["consumer_id"] == "w/q/0" and story[-1]["outcome"] == "done"


def test_a_cancel_and_a_redrive_from_the_messages_page_are_audited_and_in_its_story(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given an operator who cancels a waiting message from its page and re-drives it, I expect both in the
    audit log under their name, and in the story a read-only user sees on the message's page."""
    from test_console_actions import AUTH, basic, call

    from dramatiq_pg_fenced.dashboard import dashboard_app

    broker = dramatiq_pg_broker
    broker.declare_queue("default")
    sent = broker.enqueue(dramatiq.Message(queue_name="default", actor_name="nobody", args=(), kwargs={}, options={}))
    app = dashboard_app(broker, actions=True, auth=AUTH)
    alice = basic("alice", "pw-alice")
    for action in ("cancel", "redrive"):
        form = {"token": app.token, "action": action, "message_id": sent.message_id,
                "seen": broker.inspect(sent.message_id)["version"], "next": f"/message/{sent.message_id}"}  # fmt: skip
        assert call(app, "/action", "POST", form, authorization=alice)[0] == "303 See Other"
    info = broker.inspect(sent.message_id)
    assert info["state"] == "queued"
    audited = [(a["who"], a["action"], a["touched"]) for a in info["audit"]]
    assert audited == [("alice", "cancel", 1), ("alice", "redrive", 1)]
    status, _, body = call(app, f"/message/{sent.message_id}", authorization=basic("bob", "pw-bob"))
    assert status == "200 OK" and body.count("<tr class=audit>") == 2 and ">alice<" in body
