"""The operator's console from the API: history, re-drive, pause, purge, lists, per-queue figures."""

from __future__ import annotations

import threading
import uuid

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage
from helpers import Factory, expire_and_rescue, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import maintenance as maintenance_module
from dramatiq_pg_fenced.core.maintenance import HISTORY_BATCH
from dramatiq_pg_fenced.ops import admin, listing, messages


def message(queue: str = "default", actor: str = "x", **options: object) -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue, actor_name=actor, args=(1,), kwargs={}, options=dict(options))


def test_an_acked_message_is_kept_for_keep_finished_then_purged_in_batches(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process's own maintenance purges the history every HISTORY_PURGE_EVERY seconds, the worker
    # stopped or not: a loaded pass saw it take the old rows below before the test's purge did (0 == 10).
    monkeypatch.setattr(maintenance_module, "HISTORY_PURGE_EVERY", float("inf"))
    broker = dramatiq_pg_broker_factory(keep_finished=3600)
    dramatiq.set_broker(broker)

    @dramatiq.actor(broker=broker)
    def work(n: int) -> None:
        pass

    sent = [work.send(i) for i in range(3)]
    with running_worker(broker):
        for m in sent:
            wait_for(lambda m=m: (i := broker.inspect(m.message_id)) and i["state"] == "done", 30, "the ack")
    rows = query(broker, "SELECT count(*) FROM {schema}.history")
    assert rows == [(3,)]
    assert query(broker, "SELECT count(*) FROM {schema}.message") == [(0,)]

    # Given history older than keep_finished, more rows than one batch
    query(
        broker,
        "INSERT INTO {schema}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,"
        " finished_at, payload) SELECT gen_random_uuid(), g, 'default', 'work', 0, 1, now(), now() - interval '2 hours',"
        " '\\x00' FROM generate_series(1, %s) AS g",
        [HISTORY_BATCH + 10],
    )
    # When the maintenance loop purges, I expect only the recent rows left, in batches of HISTORY_BATCH
    maintenance = broker.parts.maintenance
    assert maintenance.purge_history() == 10  # the last (short) batch
    assert query(broker, "SELECT count(*) FROM {schema}.history") == [(3,)]


def test_without_history_an_acked_message_is_gone(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(keep_finished=0)
    dramatiq.set_broker(broker)

    @dramatiq.actor(broker=broker)
    def work() -> None:
        pass

    m = work.send()
    with running_worker(broker):
        broker.join(work.queue_name, timeout=30_000)
        broker.flush_outcomes()
    assert broker.inspect(m.message_id) is None
    assert query(broker, "SELECT count(*) FROM {schema}.history") == [(0,)]
    # The outcome still counts for the per-minute figures
    (q,) = broker.queue_overview()
    assert q["queue"] == "default" and q["done_last_minute"] >= 1 and q["done_last_hour"] == 1


def test_a_dead_letter_redriven_runs_again_with_its_retries_reset(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.add_middleware(CurrentMessage())
    runs: list[int] = []
    fixed = threading.Event()

    @dramatiq.actor(max_retries=1, min_backoff=10, max_backoff=10)
    def flaky() -> None:
        msg = CurrentMessage.get_current_message()
        runs.append(msg.options.get("retries", 0))
        if not fixed.is_set():
            raise RuntimeError("bug")

    m = flaky.send()
    with running_worker(broker):
        wait_for(lambda: (i := broker.inspect(m.message_id)) and i["state"] == "dead", 30, "the dead letter")
        assert runs == [0, 1]
        dead = broker.inspect(m.message_id)
        assert dead["retries"] == 1 and dead["attempt"] == 2 and "bug" in dead["last_error"]

        # A queued message cannot be re-driven; neither can an unknown one
        assert broker.redrive(str(uuid.uuid4())) is False
        fixed.set()
        # When I re-drive it, it runs with retries 0 (so it would get its full retry budget again)
        assert broker.redrive(m.message_id) is True
        info = wait_for(lambda: (i := broker.inspect(m.message_id)) and i["state"] == "done" and i, 30, "the ack")
    assert runs == [0, 1, 0]
    assert info["attempt"] == 3  # the attempt number never goes back
    assert broker.redrive(m.message_id) is False  # done: nothing to re-drive


def test_redrive_is_fenced_on_the_state_it_read(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("default")
    m = message(retries=3, traceback="boom")
    broker.enqueue(m)
    assert broker.cancel(m.message_id).value == "cancelled_queued"
    assert broker.redrive(m.message_id) is True
    info = broker.inspect(m.message_id)
    assert info["state"] == "queued" and info["retries"] == 0 and "traceback" not in info["options"]
    assert broker.redrive(m.message_id) is False  # queued now: a second re-drive changes nothing
    with pytest.raises(ValueError, match="not a message id"):
        broker.redrive("nope")


def test_a_redrive_never_resurrects_another_incarnation_of_the_id(
    dramatiq_pg_broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a dead letter (attempt 1); when, between the re-drive's read and its write, it is
    purged and its id sent again, claimed once and dead-lettered (the same id, state and
    attempt), I expect the re-drive to leave the new message alone: still dead, its own payload."""
    broker = dramatiq_pg_broker
    broker.declare_queue("q2")
    old = message("q2", note="old")
    broker.enqueue(old)
    dead = "UPDATE {schema}.message SET state = 'dead', attempt = 1, finished_at = now() WHERE message_id = %s"
    query(broker, dead, [old.message_id])
    new = dramatiq.Message(queue_name="q2", actor_name="x", args=(2,), kwargs={}, options={"note": "new"},
                           message_id=old.message_id)  # fmt: skip
    reset = admin.reset_payload

    def meanwhile(payload: bytes) -> bytes:  # called after the read, before the write
        if query(broker, "SELECT count(*) FROM {schema}.message WHERE message_id = %s", [old.message_id]) == [(1,)]:
            assert broker.purge_queue("q2", ("dead",)) == {"dead": 1}
            broker.enqueue(new)
            query(broker, dead, [new.message_id])
        return reset(payload)

    monkeypatch.setattr(messages, "reset_payload", meanwhile)
    done = admin.redrive(broker.database, broker.statements, [old.message_id], broker.channel)
    assert done.redriven == [] and old.message_id in done.skipped
    info = broker.inspect(old.message_id)
    assert (info["state"], info["attempt"], info["options"]["note"], list(info["args"])) == ("dead", 1, "new", [2])


def test_a_redrive_or_cancel_from_a_page_applies_only_to_the_row_it_showed(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given what an operator read of a message (inspect's version, as the dashboard's forms
    carry it); when the message changed since (re-driven and dead again, or gone and its id
    sent again), I expect a re-drive or cancel naming that version to change nothing."""
    broker = dramatiq_pg_broker
    broker.declare_queue("q3")
    m = message("q3")
    broker.enqueue(m)
    seen_queued = broker.inspect(m.message_id)["version"]
    broker.cancel(m.message_id)
    seen = broker.inspect(m.message_id)["version"]
    assert broker.redrive(m.message_id, seen=seen) is True
    broker.cancel(m.message_id)  # cancelled again, at the same attempt: another version
    assert broker.redrive(m.message_id, seen=seen) is False
    assert broker.inspect(m.message_id)["state"] == "cancelled"
    # Gone (acked), and its id sent again: a cancel for the one shown does not reach the new one
    query(broker, "DELETE FROM {schema}.message WHERE message_id = %s", [m.message_id])
    broker.enqueue(m)
    assert broker.cancel(m.message_id, seen=seen_queued).value == "not_found"
    assert broker.inspect(m.message_id)["state"] == "queued"
    assert broker.cancel(m.message_id, seen=broker.inspect(m.message_id)["version"]).value == "cancelled_queued"
    with pytest.raises(ValueError, match="version"):
        broker.redrive(m.message_id, seen="nope")


def test_redrive_a_whole_queue(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("q1")
    messages = [message("q1") for _ in range(7)]
    broker.enqueue_many(messages)
    for m in messages[:5]:
        broker.cancel(m.message_id)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now() WHERE message_id = ANY(%s::uuid[])",
          [[m.message_id for m in messages[:3]]])  # fmt: skip
    done = broker.redrive_queue("q1")  # dead only, by default
    assert sorted(done.redriven) == sorted(m.message_id for m in messages[:3]) and not done.skipped
    assert broker.redrive_queue("q1", ("cancelled",)).redriven.__len__() == 2
    assert {broker.inspect(m.message_id)["state"] for m in messages} == {"queued"}
    with pytest.raises(ValueError, match="only dead or cancelled"):
        broker.redrive_queue("q1", ("queued",))


def test_a_paused_queue_is_not_claimed_until_resumed(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    ran = threading.Event()

    @dramatiq.actor(queue_name="paused")
    def job() -> None:
        ran.set()

    assert broker.pause("paused") is True
    assert broker.pause("paused") is False  # already
    with running_worker(broker):
        m = job.send()
        assert not ran.wait(1.5)  # more than a poll interval: claims skip it
        (q,) = broker.queue_overview()
        assert q["queue"] == "paused" and q["paused_since"] is not None and q["due"] == 1
        assert broker.resume("paused") is True
        assert ran.wait(10)
    assert broker.resume("paused") is False
    wait_for(lambda: broker.inspect(m.message_id)["state"] == "done", 10, "the ack")


def test_purge_a_queue_by_state_never_running_rows(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("p")
    messages = [message("p") for _ in range(6)]
    broker.enqueue_many(messages)
    broker.cancel(messages[0].message_id)
    query(broker, "UPDATE {schema}.message SET state = 'running', attempt = 1 WHERE message_id = %s",
          [messages[1].message_id])  # fmt: skip
    assert broker.purge_queue("p", ("cancelled",)) == {"cancelled": 1}
    assert broker.purge_queue("p") == {"queued": 4, "dead": 0, "cancelled": 0, "done": 0}
    assert broker.inspect(messages[1].message_id)["state"] == "running"
    with pytest.raises(ValueError, match="cannot purge state 'running'"):
        broker.purge_queue("p", ("running",))


def test_lists_are_keyset_pages(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("l")
    messages = [message("l", actor="a" if i % 2 else "b") for i in range(25)]
    broker.enqueue_many(messages)
    seen: list[str] = []
    after = None
    while True:
        page = broker.list_messages("l", "queued", after=after, limit=10)
        seen += [r["message_id"] for r in page.rows]
        if page.next is None:
            break
        after = page.next
    assert seen == [m.message_id for m in messages]  # claim order, every one once
    only_a = broker.list_messages("l", "queued", actor="a", limit=100).rows
    assert {r["actor_name"] for r in only_a} == {"a"} and len(only_a) == 12

    for m in messages[:12]:
        broker.cancel(m.message_id)
    first = broker.list_messages("l", "cancelled", limit=5)
    second = broker.list_messages("l", "cancelled", limit=5, after=first.next)
    third = broker.list_messages("l", "cancelled", limit=5, after=second.next)
    ids = [r["message_id"] for page in (first, second, third) for r in page.rows]
    assert sorted(ids) == sorted(m.message_id for m in messages[:12]) and third.next is None
    assert ids[0] == messages[11].message_id  # most recently finished first
    with pytest.raises(ValueError, match="cannot list"):
        broker.list_messages("l", "bogus")


def test_the_overview_counts_what_operators_ask_for(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("o")
    broker.enqueue_many([message("o") for _ in range(4)])
    broker.enqueue(message("o"), delay=60_000)
    dead, cancelled, running = message("o"), message("o"), message("o")
    broker.enqueue_many([dead, cancelled, running])
    broker.cancel(cancelled.message_id)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now() WHERE message_id = %s",
          [dead.message_id])  # fmt: skip
    query(
        broker,
        "UPDATE {schema}.message SET state = 'running', attempt = 1, lease_expires_at = now() - interval '1 s'"
        " WHERE message_id = %s",
        [running.message_id],
    )
    query(broker, "UPDATE {schema}.message SET available_at = now() - interval '90 s' WHERE state = 'queued'"
          " AND available_at <= now()")  # fmt: skip
    (q,) = broker.queue_overview()
    assert (q["due"], q["delayed"], q["expired_leases"], q["dead"], q["cancelled"]) == (4, 1, 1, 1, 1)
    # the claimed row: no worker process said its actor started, so it counts as prefetched
    assert (q["running"], q["prefetched"]) == (0, 1)
    assert q["queued"] == 5  # due now and later
    assert 89 < q["oldest_due_seconds"] < 120
    assert q["paused_since"] is None
    (capped,) = broker.queue_overview(cap=2)
    assert capped["due"] == 2


def test_an_actor_filter_reads_a_bounded_window_per_page(
    dramatiq_pg_broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setattr(listing, "FILTER_WINDOW", 10)
    broker = dramatiq_pg_broker
    broker.declare_queue("w")
    messages = [message("w", actor="common") for _ in range(25)] + [message("w", actor="rare")]
    broker.enqueue_many(messages)
    # Given the only match past the first two windows, pages come back empty but say how far they looked
    first = broker.list_messages("w", "queued", actor="rare", limit=5)
    assert first.rows == [] and first.searched == 10 and first.next
    second = broker.list_messages("w", "queued", actor="rare", limit=5, after=first.next)
    assert second.rows == [] and second.searched == 10
    third = broker.list_messages("w", "queued", actor="rare", limit=5, after=second.next)
    assert [r["message_id"] for r in third.rows] == [messages[-1].message_id]
    assert third.next is None and third.searched is None


def test_a_rescued_lease_counts_as_a_redelivery(dramatiq_pg_broker: PostgresBroker) -> None:
    from dramatiq_pg_fenced.ops import admin

    broker = dramatiq_pg_broker
    broker.declare_queue("r")
    m = message("r")
    broker.enqueue(m)
    query(
        broker,
        "UPDATE {schema}.message SET state = 'running', attempt = 1, lease_expires_at = now() - interval '1 s'"
        " WHERE message_id = %s",
        [m.message_id],
    )
    assert expire_and_rescue(broker, "message_id = %s", [m.message_id]) == 1
    assert admin.counters(broker.database, broker.statements)["redeliveries"] == 1
    assert broker.inspect(m.message_id)["state"] == "queued"


def test_stale_writes_are_counted_per_queue(dramatiq_pg_broker: PostgresBroker) -> None:
    from dramatiq_pg_fenced.ops import admin

    broker = dramatiq_pg_broker
    broker.declare_queue("s")
    broker.enqueue(message("s"))
    consumer = broker.consume("s", prefetch=1, timeout=1000)
    try:
        delivery = wait_for(lambda: next(consumer), 10, "the claim")
        # Given the message was redelivered meanwhile (attempt 2 holds it)
        query(
            broker,
            "UPDATE {schema}.message SET attempt = 2, delivery = gen_random_uuid() WHERE message_id = %s",
            [delivery.message_id],
        )
        consumer.ack(delivery)  # attempt 1's ack is fenced out
        assert broker.flush_outcomes(10)
    finally:
        consumer.close()
    (q,) = broker.queue_overview()
    assert q["queue"] == "s" and q["stale_writes"] == 1
    assert admin.counters(broker.database, broker.statements)["stale_writes"] == 1


def test_a_queue_is_known_by_its_rows_history_pause_schedule_or_declaration(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    from dramatiq_pg_fenced.ops import admin

    broker = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=broker.schema)  # another process: declares nothing
    broker.declare_queue("declared")
    broker.enqueue(message("rows"))
    query(
        broker,
        "INSERT INTO {schema}.history (message_id, seq, queue_name, actor_name, priority, attempt,"
        " enqueued_at, finished_at, payload) VALUES (gen_random_uuid(), 1, 'kept', 'x', 0, 1, now(), now(), '')",
    )
    query(broker, "INSERT INTO {schema}.schedule (name, actor_name, queue_name, every_ms, missed, grace_ms,"
          " fingerprint) VALUES ('s', 'x', 'scheduled', 1000, 'skip', 0, 'f')")  # fmt: skip
    assert admin.known_queues(broker.database, broker.statements) == ["kept", "rows", "scheduled"]

    # Given a queue nothing names, I expect every operator method to refuse it, naming the known ones
    for act in (
        lambda b: b.pause("nosuch"),
        lambda b: b.resume("nosuch"),
        lambda b: b.purge_queue("nosuch"),
        lambda b: b.redrive_queue("nosuch"),
        lambda b: b.list_messages("nosuch", "queued"),
    ):
        with pytest.raises(admin.UnknownQueue, match="no queue 'nosuch'.*known: kept, rows, scheduled"):
            act(other)
    assert query(broker, "SELECT count(*) FROM {schema}.paused_queue") == [(0,)]
    # A queue this broker's actors declared is known to it; create=True pauses one ahead of any message
    assert broker.pause("declared") is True
    with pytest.raises(admin.UnknownQueue):
        other.pause("ahead")
    assert other.pause("ahead", create=True) is True
    assert [q["queue"] for q in other.queue_overview()] == ["ahead", "declared", "rows"]


def test_bulk_re_drive_and_purge_of_one_actor(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("b")
    ours, others = [message("b", actor="ours") for _ in range(3)], [message("b", actor="other") for _ in range(2)]
    broker.enqueue_many(ours + others)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now()")
    assert sorted(broker.redrive_queue("b", actor="ours").redriven) == sorted(m.message_id for m in ours)
    assert {broker.inspect(m.message_id)["state"] for m in others} == {"dead"}
    assert broker.purge_queue("b", ("dead",), actor="nobody") == {"dead": 0}
    assert broker.purge_queue("b", actor="other") == {"queued": 0, "dead": 2, "cancelled": 0, "done": 0}
    assert {broker.inspect(m.message_id)["state"] for m in ours} == {"queued"}
