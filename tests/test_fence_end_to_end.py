"""The fence holds end to end: tokens unique per delivery, effects tied to the ack,
cancel before start, eta, re-sends, close and join (issue "The fence holds end to end")."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from helpers import Factory, acked, expire_and_rescue, query, wait_for

from dramatiq_pg_fenced import PostgresBroker, SchemaError
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy


def message(queue: str = "default", message_id: str | None = None) -> dramatiq.Message[Any]:
    options: dict[str, Any] = {}
    m = dramatiq.Message(queue_name=queue, actor_name="nobody", args=(), kwargs={}, options=options)
    return m.copy(message_id=message_id) if message_id else m


def deliver(broker: PostgresBroker, queue: str = "default") -> PostgresMessageProxy:
    consumer = broker.consume(queue, prefetch=1, timeout=100)
    delivered = wait_for(lambda: next(consumer), 30, "a delivery")
    assert isinstance(delivered, PostgresMessageProxy)
    delivered.consumer = consumer  # type: ignore[attr-defined]  # to settle it through its own consumer
    return delivered


def stale_writes(broker: PostgresBroker) -> int:
    return int(broker.stats()["totals"].get("stale_writes", 0))


def test_a_stale_delivery_cannot_settle_a_message_sent_again_under_the_same_id(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Attempt numbers restart when an id is inserted again after its row was acked; the fence must not."""
    a = dramatiq_pg_broker_factory()
    b = dramatiq_pg_broker_factory(schema=a.schema)
    a.declare_queue("default")
    b.declare_queue("default")
    first = message()
    a.enqueue(first)
    stale = deliver(a)  # attempt 1 in A, which then stalls past its lease
    expire_and_rescue(a)
    current = deliver(b)  # attempt 2 in B, which finishes: the row is gone
    current.consumer.ack(current)  # type: ignore[attr-defined]
    assert b.flush_outcomes(10) and acked(b, first.message_id)

    a.enqueue(first.copy())  # the same id again (a re-send, a duplicate pipeline step): attempt 1 anew
    again = deliver(b)
    assert again.message_id == stale.message_id and again.attempt == stale.attempt == 1
    before = stale_writes(a)

    stale.consumer.ack(stale)  # type: ignore[attr-defined]
    assert a.flush_outcomes(10)
    info = b.inspect(first.message_id)
    assert info is not None and (info["state"], info["attempt"]) == ("running", 1)  # the new delivery's, untouched
    assert stale_writes(a) == before + 1
    again.consumer.ack(again)  # type: ignore[attr-defined]
    assert b.flush_outcomes(10) and acked(b, first.message_id)


# -- a delivery's effects share its fence ------------------------------------------------
def test_a_stale_deliverys_result_is_not_written_beside_the_current_ones_ack(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Two deliveries of one message settle in one batch: only the current one's result lands,
    whatever the order (the writer once decided by message id which acks applied)."""
    from dramatiq.results import Results
    from dramatiq.results.result import wrap_result

    from dramatiq_pg_fenced.core.delivery import Outcome, ResultWrite
    from dramatiq_pg_fenced.core.fencing import Write
    from dramatiq_pg_fenced.features.results import PostgresBackend

    broker = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=broker.schema)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    broker.declare_queue("default")
    other.declare_queue("default")
    sent = message()
    broker.enqueue(sent)
    stale = deliver(broker)
    expire_and_rescue(broker)
    current = deliver(other)
    assert (stale.attempt, current.attempt) == (1, 2)
    key = backend.build_message_key(sent)

    def ack(d: PostgresMessageProxy, value: str) -> Outcome:
        data = backend.encoder.encode(wrap_result(value))
        write = ResultWrite(key, d.message_id, d.attempt, data, 60_000, d.delivery)
        return Outcome(Write.ACK, d.message_id, d.attempt, d.delivery, queue_name="default", result=write)

    broker.parts.writer.write([ack(current, "current"), ack(stale, "stale")])  # the stale one last
    assert backend.get_result(sent) == "current"
    assert acked(broker, sent.message_id)


def _group_members(broker: PostgresBroker, runs: list[str], events: dict[str, Any]) -> tuple[Any, ...]:
    def slow(n: int) -> None:
        first = "slow" not in runs
        runs.append("slow")
        if first:  # paused past its lease: redelivered meanwhile, and finishes first
            events["started"].set()
            events["lease_lost"].wait(10)
            events["stale_done"].set()
        else:
            events["stale_done"].wait(10)

    def fast(n: int) -> None:
        runs.append("fast")

    def last(n: int) -> None:
        events["release_last"].wait(10)
        runs.append("last")

    def done() -> None:
        runs.append("done")

    return (
        dramatiq.actor(slow, broker=broker, queue_name="slow", max_retries=0),
        dramatiq.actor(fast, broker=broker, queue_name="fast", max_retries=0),
        dramatiq.actor(last, broker=broker, queue_name="fast", max_retries=0),
        dramatiq.actor(done, broker=broker, queue_name="fast", max_retries=0),
    )


@pytest.mark.parametrize("fenced", [True])
def test_a_redelivered_group_member_counts_down_once_and_completion_runs_once(
    dramatiq_pg_broker_factory: Factory, fenced: bool
) -> None:
    """Member `slow` pauses past its lease and is redelivered; its stale delivery finishes first,
    then the redelivery, then `fast`.  The group must not count `slow` twice: the completion waits
    for `last`, and runs once.  (With Dramatiq's own GroupCallbacks, fenced=False, it runs early.)"""
    import threading

    from dramatiq.middleware import GroupCallbacks

    from dramatiq_pg_fenced.features.rate_limits import FencedGroupCallbacks
    from dramatiq_pg_fenced.features.rate_limits import PostgresBackend as RateLimits

    callbacks = FencedGroupCallbacks if fenced else GroupCallbacks
    a = dramatiq_pg_broker_factory(lease_seconds=1, rescue_interval=0.2, poll_interval=0.1)
    b = dramatiq_pg_broker_factory(schema=a.schema, lease_seconds=1, rescue_interval=0.2, poll_interval=0.1)
    for broker in (a, b):
        broker.add_middleware(callbacks(RateLimits(broker=broker)))
    runs: list[str] = []
    events = {name: threading.Event() for name in ("started", "lease_lost", "stale_done", "release_last")}
    slow_a, fast_a, last_a, done_a = _group_members(a, runs, events)
    _group_members(b, runs, events)

    worker_a = dramatiq.Worker(a, queues={"slow"}, worker_threads=1, worker_timeout=100)
    worker_a.queue_prefetch = 1  # holding the stale delivery, A claims nothing more
    worker_a.start()
    worker_b = dramatiq.Worker(b, worker_threads=3, worker_timeout=100)
    try:
        g = dramatiq.group([slow_a.message(1), fast_a.message(2), last_a.message(3)], broker=a)
        g.add_completion_callback(done_a.message())
        g.run()
        assert events["started"].wait(10)
        a.parts.keeper.stop()  # A is "paused": its lease is no longer extended
        worker_b.start()
        wait_for(lambda: runs.count("slow") == 2, 30, "the redelivery")
        events["lease_lost"].set()
        wait_for(lambda: runs.count("fast") == 1, 30, "the other member")
        wait_for(lambda: a.stats()["process"]["held"] == 0, 30, "the stale delivery's outcome")
        wait_for(lambda: b.stats()["process"]["held"] <= 1, 30, "the redelivery's outcome")  # `last` still runs
        assert "done" not in runs, runs  # two of three members are done: no completion yet
        events["release_last"].set()
        wait_for(lambda: runs.count("done") == 1, 30, "the completion")
        b.join("fast", timeout=10_000)
    finally:
        events["release_last"].set()
        worker_b.stop()
        worker_a.stop()
    assert runs.count("done") == 1, runs
    assert runs.index("done") > runs.index("last"), runs
    assert a.stats()["process"]["dropped_effects"] >= 1  # the stale countdown, counted


def test_a_pipeline_step_of_a_stale_delivery_is_not_sent(dramatiq_pg_broker_factory: Factory) -> None:
    """The next pipeline step (and on_success callbacks) ride with the ack: a fenced-out ack sends nothing."""
    broker = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=broker.schema)
    broker.declare_queue("default")
    other.declare_queue("default")
    sent = message()
    broker.enqueue(sent)
    stale = deliver(broker)
    expire_and_rescue(broker)
    current = deliver(other)
    follow_up = message()

    from dramatiq_pg_fenced.core import delivery

    for b, d in ((broker, stale), (other, current)):  # what the middleware do after the actor, on its thread
        delivery.start(d)
        delivery.defer_effects()
        b.enqueue(follow_up.copy(message_id=f"{follow_up.message_id[:-1]}{d.attempt}"))
        assert b.inspect(f"{follow_up.message_id[:-1]}{d.attempt}") is None  # not sent yet
        d.consumer.ack(d)  # type: ignore[attr-defined]
        assert b.flush_outcomes(10)
    assert broker.inspect(f"{follow_up.message_id[:-1]}1") is None  # the stale delivery's: dropped
    assert broker.inspect(f"{follow_up.message_id[:-1]}2") is not None  # the current one's: sent with its ack
    assert broker.stats()["process"]["dropped_effects"] == 1
    assert other.stats()["process"]["dropped_effects"] == 0


def test_the_actor_body_sends_at_once_or_with_the_ack_when_asked(dramatiq_pg_broker_factory: Factory) -> None:
    from helpers import running_worker

    broker = dramatiq_pg_broker_factory()
    seen: dict[str, Any] = {}

    @dramatiq.actor(broker=broker)
    def child(tag: str) -> None:
        pass

    @dramatiq.actor(broker=broker)
    def parent() -> None:
        plain = child.send("plain")
        seen["plain"] = broker.inspect(plain.message_id)
        with broker.with_ack():
            tied = child.send("tied")
        seen["tied"] = broker.inspect(tied.message_id)
        seen["tied_id"] = tied.message_id

    with running_worker(broker):
        parent.send()
        broker.join("default", timeout=10_000)
    assert seen["plain"] is not None  # the actor body's sends are enqueued at once
    assert seen["tied"] is None  # ... unless tied to the ack
    assert broker.stats()["queues"] == {}  # and the tied one was sent with the ack, and ran


def test_enqueue_many_in_with_ack_waits_for_the_ack_and_is_dropped_with_a_stale_delivery(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """``enqueue_many`` is tied to the ack like ``send()``: none of its messages escape a fenced-out delivery."""
    import threading

    from helpers import running_worker

    broker = dramatiq_pg_broker_factory(lease_seconds=1)
    seen: dict[str, Any] = {}
    go = threading.Event()

    @dramatiq.actor(broker=broker)
    def child(tag: str, n: int) -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=0)
    def parent(tag: str) -> None:
        with broker.with_ack():
            sent = broker.enqueue_many([child.message(tag, n) for n in range(3)])
        seen[tag] = [broker.inspect(m.message_id) for m in sent]
        if tag == "stale":
            from dramatiq_pg_fenced.core import delivery

            running = delivery.running()  # this delivery (the test thread may not have stored its message yet)
            assert running is not None
            broker.cancel(running.message_id)  # fenced out before its ack
            go.set()

    with running_worker(broker):
        parent.send("tied")
        broker.join("default", timeout=10_000)
        assert seen["tied"] == [None, None, None]  # not written before the ack ...
        assert broker.stats()["process"]["dropped_effects"] == 0
        parent.send("stale")
        wait_for(go.is_set, 10, "the stale delivery")
        broker.join("default", timeout=10_000, fail_fast=False)
    ran = query(broker, "SELECT count(*) FROM {schema}.message WHERE actor_name = 'child'")
    assert ran == [(0,)]  # ... and the tied ones ran (acked, gone); the stale delivery's never existed
    assert seen["stale"] == [None, None, None]
    assert broker.stats()["process"]["dropped_effects"] >= 3


def test_enqueue_many_inside_batch_is_written_at_its_end_or_not_at_all(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job(n: int) -> None:
        pass

    with pytest.raises(RuntimeError), broker.batch():
        broker.enqueue_many([job.message(n) for n in range(3)])
        raise RuntimeError("the block fails")
    assert query(broker, "SELECT count(*) FROM {schema}.message") == [(0,)]
    with broker.batch():
        broker.enqueue_many([job.message(n) for n in range(3)])
        job.send(3)
        assert query(broker, "SELECT count(*) FROM {schema}.message") == [(0,)]
    assert query(broker, "SELECT count(*) FROM {schema}.message") == [(4,)]


# -- cancel means never starts -------------------------------------------------------------
@pytest.mark.parametrize("listen", [True, False])
def test_a_message_cancelled_while_prefetched_never_starts(dramatiq_pg_broker_factory: Factory, listen: bool) -> None:
    import threading
    import time

    from helpers import running_worker

    broker = dramatiq_pg_broker_factory(listen=listen, poll_interval=0.1)
    release = threading.Event()
    ran: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def work(n: int) -> None:
        ran.append(n)
        if n == 0:
            release.wait(10)

    with running_worker(broker, threads=1, prefetch=2):
        work.send(0)
        wait_for(lambda: ran == [0], 10, "the first message")
        second = work.send(1)
        wait_for(lambda: (broker.inspect(second.message_id) or {}).get("state") == "running", 10, "the prefetch")
        time.sleep(0.05)  # it waits in the prefetch (a cancel racing the claim itself, within 5 ms, may miss)
        assert broker.cancel(second.message_id).value == "cancelled_running"
        release.set()
        broker.join("default", timeout=10_000)
    assert ran == [0]
    assert broker.stats()["process"]["stale_writes"] == 0


def test_one_read_lets_every_waiting_delivery_start_and_refuses_a_cancelled_one(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given 6 deliveries waiting in a worker's prefetch past the start check's window, one of them
    cancelled and no notification heard (listen off), I expect their starts to read the database once
    in all (the read covers every waiting delivery), the cancelled one refused and the others let
    through (before, each read its own row); and a delivery that waits past the window again after
    that read, to read again."""
    import time

    from dramatiq_pg_fenced.core import leases

    monkeypatch.setattr(leases, "START_CHECK_AFTER", 1.0)  # wide, so the starts below fall within it
    broker = dramatiq_pg_broker_factory(listen=False, poll_interval=30)
    broker.declare_queue("q")

    @dramatiq.actor(queue_name="q", broker=broker)
    def job(n: int) -> None:
        pass

    broker.enqueue_many([job.message(n) for n in range(7)])
    consumer = broker.consume("q", prefetch=7, timeout=2000)
    got = [next(consumer) for _ in range(7)]
    assert all(isinstance(m, PostgresMessageProxy) for m in got)
    gate = broker.parts.gate
    reads: list[int] = []
    real = gate.statements

    class Counted:
        def __getattr__(self, name: str) -> Any:
            if name == "still_held_many":
                reads.append(1)
            return getattr(real, name)

    monkeypatch.setattr(gate, "statements", Counted())
    assert broker.cancel(got[2].message_id).value == "cancelled_running"
    time.sleep(1.1)  # every delivery waited past the window since its claim
    answers = [broker.why_not_start(m) for m in got[:6]]
    assert len(reads) == 1
    assert [a is None for a in answers] == [True, True, False, True, True, True]
    assert "it was cancelled" in str(answers[2])  # found gone by the one read, and so lost
    time.sleep(1.1)  # the last one waits past the window since that read
    assert broker.why_not_start(got[6]) is None and len(reads) == 2


# -- no silent loss through options ----------------------------------------------------------
def test_a_message_with_dramatiqs_eta_option_runs_when_due(dramatiq_pg_broker_factory: Factory) -> None:
    from dramatiq.common import current_millis
    from helpers import running_worker

    broker = dramatiq_pg_broker_factory(poll_interval=0.1)
    ran: list[int] = []

    @dramatiq.actor(broker=broker)
    def work(n: int) -> None:
        ran.append(n)

    later = work.message(1).copy(options={"eta": current_millis() + 400})
    broker.enqueue(later)
    info = broker.inspect(later.message_id)
    assert info is not None and info["available_at"] > info["enqueued_at"]  # a server-side delay
    with running_worker(broker):
        wait_for(lambda: ran == [1], 10, "the message with an eta")
        broker.join("default", timeout=10_000)


# -- re-sending an existing id -----------------------------------------------------------------
def test_a_send_under_an_existing_id_is_reported_and_counted(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    broker = dramatiq_pg_broker_factory()
    broker.declare_queue("default")
    sent = message()
    broker.enqueue(sent)
    with caplog.at_level("WARNING"):
        broker.enqueue(sent.copy())
        broker.enqueue_many([sent.copy(), message()])
    assert f"Message {sent.message_id} not enqueued" in caplog.text
    assert "1 of 2 messages not enqueued" in caplog.text
    assert broker.stats()["process"]["duplicate_sends"] == 2
    assert broker.stats()["queues"]["default"]["queued"] == 2


# -- close ---------------------------------------------------------------------------------------
def test_close_writes_pending_outcomes_builds_nothing_new_and_may_be_called_twice(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    broker = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=broker.schema)
    broker.declare_queue("default")
    sent = message()
    broker.enqueue(sent)
    d = deliver(broker)
    d.consumer.ack(d)  # type: ignore[attr-defined]
    broker.close()
    assert not broker.started  # no new pool, no new writer thread
    broker.close()
    assert acked(other, sent.message_id)  # the pending ack was written


def test_close_waits_for_a_background_chore_running_so_it_opens_no_pool_after_it(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chore (here maintenance) that was mid-tick when close() came must end before close returns:
    if it reached for a connection after the pool closed, it would open a new pool, left to leak (CI
    saw ``broker.started`` after close in the test above)."""
    import threading
    import time

    from dramatiq_pg_fenced.core.maintenance import Maintenance

    ticking, ticked = threading.Event(), threading.Event()
    real_tick = Maintenance.tick

    def slow_tick(self: Maintenance) -> None:
        ticking.set()
        time.sleep(0.5)  # close() comes meanwhile
        try:
            real_tick(self)
        finally:
            ticked.set()

    monkeypatch.setattr(Maintenance, "tick", slow_tick)
    broker = dramatiq_pg_broker_factory(rescue_interval=0.05)
    broker.declare_queue("default")
    broker.consume("default", prefetch=1, timeout=100)
    assert ticking.wait(10), "maintenance never ticked"
    broker.close()
    assert ticked.is_set(), "close() returned while a chore was still running"
    assert not broker.started  # the chore opened no pool after close


def test_an_outcome_settled_after_close_is_said_and_not_written_and_the_message_comes_back(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """An actor that finishes after ``close()`` (a worker thread past its join): its ack is not lost in
    silence; it is logged, not written (the writer is stopped), and the message is delivered again."""
    broker = dramatiq_pg_broker_factory(lease_seconds=1)
    other = dramatiq_pg_broker_factory(schema=broker.schema, lease_seconds=1, rescue_interval=0.2)
    broker.declare_queue("default")
    other.declare_queue("default")
    sent = message()
    broker.enqueue(sent)
    d = deliver(broker)
    broker.close()
    with caplog.at_level("ERROR", logger=broker.logger.name):
        d.consumer.ack(d)  # type: ignore[attr-defined]
    assert "came after the broker closed" in caplog.text
    assert not broker.started and not acked(other, sent.message_id)
    again = deliver(other)
    assert again.message_id == sent.message_id and again.attempt == d.attempt + 1


# -- join as Dramatiq's StubBroker ------------------------------------------------------------------
def test_join_raises_the_actors_exception_by_default(dramatiq_pg_broker_factory: Factory) -> None:
    from helpers import running_worker

    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker, max_retries=0)
    def fail() -> None:
        raise LookupError("as with the StubBroker")

    with running_worker(broker):
        fail.send()
        with pytest.raises(LookupError, match="StubBroker"):
            broker.join("default", timeout=10_000)


# -- leases survive what is not an outage of the whole process ------------------------------------
def test_a_row_locked_elsewhere_and_a_busy_pool_hold_up_no_lease(dramatiq_pg_broker_factory: Factory) -> None:
    """The keeper extends on a connection of its own, and skips a row another session has locked
    (extended next time, not taken for lost) instead of waiting for it with every other lease."""
    import time

    import psycopg

    broker = dramatiq_pg_broker_factory(lease_seconds=1.5, pool_max_size=1)
    broker.declare_queue("default")
    for _ in range(3):
        broker.enqueue(message())
    consumer = broker.consume("default", prefetch=3, timeout=100)
    held = [wait_for(lambda: next(consumer), 10, "a delivery") for _ in range(3)]
    locked, others = held[0], held[1:]

    def expiries(conn: psycopg.Connection) -> dict[str, Any]:
        rows = conn.execute(
            f'SELECT message_id::text, lease_expires_at FROM "{broker.schema}".message WHERE state = %s', ["running"]
        ).fetchall()
        return dict(rows)

    with psycopg.connect(broker.url, autocommit=True) as outside, psycopg.connect(broker.url) as locker:
        locker.execute(
            f'SELECT 1 FROM "{broker.schema}".message WHERE message_id = %s FOR UPDATE', [locked.message_id]
        )  # an open transaction holds the row
        before = expiries(outside)
        with broker.database.connection():  # the pool's only connection is busy throughout
            deadline = time.monotonic() + 10
            while not all(expiries(outside)[d.message_id] > before[d.message_id] for d in others):
                assert time.monotonic() < deadline, "the other leases were not extended"
                time.sleep(0.05)
        assert not broker.parts.leases.is_lost(locked.message_id)  # locked elsewhere is not lost
        locker.rollback()
    for d in held:
        consumer.ack(d)
    assert broker.flush_outcomes(10)
    assert broker.stats()["totals"].get("stale_writes", 0) == 0


# -- one line per condition, not one per try ---------------------------------------------------
def test_a_missing_schema_is_said_once_not_by_every_part_on_every_try(
    dramatiq_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    import time
    import uuid as uuid_

    import psycopg
    from psycopg import sql

    schema = f"t_{uuid_.uuid4().hex[:12]}"
    broker = PostgresBroker(dramatiq_pg_url, schema=schema, poll_interval=0.05, rescue_interval=0.05, lease_seconds=1)
    broker.declare_queue("default")
    try:
        with caplog.at_level("INFO"):
            consumer = broker.consume("default", prefetch=1, timeout=50)
            deadline = time.monotonic() + 2
            while time.monotonic() < deadline:
                assert next(consumer) is None  # no schema: nothing to claim, no exception into Dramatiq
        said = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR", "CRITICAL")]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert "migrate" in said[0].getMessage() and schema in said[0].getMessage()
        caplog.clear()
        with caplog.at_level("INFO"):
            broker.migrate()
            sent = message()
            broker.enqueue(sent)
            got = wait_for(lambda: next(consumer), 10, "a delivery once migrated")
        assert got.message_id == sent.message_id
    finally:
        broker.close()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_a_schema_dropped_under_a_running_broker_is_said_once_and_taken_up_again_once_migrated(
    dramatiq_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a broker whose parts all run (claims, rescue, heartbeat) on a migrated schema, when
    someone drops the schema (a test's teardown, an operator's mistake), I expect the same single
    "not ready" line as at a start without one, not a traceback from every part on every tick
    (seen: "Maintenance failed; trying again." from a dropped schema's broker), and the work to go
    on once the schema is back."""
    import time
    import uuid as uuid_

    import psycopg
    from psycopg import sql

    schema = f"t_{uuid_.uuid4().hex[:12]}"
    broker = PostgresBroker(dramatiq_pg_url, schema=schema, poll_interval=0.05, rescue_interval=0.05, lease_seconds=1)
    broker.declare_queue("default")
    drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
    try:
        broker.migrate()
        consumer = broker.consume("default", prefetch=1, timeout=50)
        first = message()
        broker.enqueue(first)
        held = wait_for(lambda: next(consumer), 10, "a delivery")  # its lease is extended meanwhile
        time.sleep(0.3)  # the rescue has run
        caplog.clear()
        with caplog.at_level("INFO"):
            with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
                conn.execute(drop)
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline:
                assert next(consumer) is None  # nothing to claim, no exception into Dramatiq
            with pytest.raises(SchemaError, match="migrate"):
                broker.enqueue(message())  # a send says what to do
            consumer.ack(held)  # the writer tries it again until the schema is back
            time.sleep(0.5)
        said = [r for r in caplog.records if r.levelname in ("WARNING", "ERROR", "CRITICAL")]
        assert len(said) == 1, [r.getMessage() for r in said]
        assert "migrate" in said[0].getMessage() and schema in said[0].getMessage()
        broker.migrate()
        sent = message()
        broker.enqueue(sent)
        got = wait_for(lambda: next(consumer), 10, "a delivery once migrated again")
        assert got.message_id == sent.message_id
        consumer.ack(got)
    finally:
        broker.close()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(drop)


def test_a_missing_object_of_the_callers_own_is_raised_as_it_is_and_the_schema_stays_ready(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    """A statement of the application's own on the broker's connection (a fenced transaction's, say)
    that names a table, column or function that does not exist gets PostgreSQL's own error, not a
    "schema not ready" one: the schema is checked again, found ready, and nothing is said."""
    import psycopg

    broker = dramatiq_pg_broker_factory()
    broker.declare_queue("default")
    with caplog.at_level("INFO"):
        for text, error in (
            ("SELECT * FROM no_such_table_here", psycopg.errors.UndefinedTable),
            ("SELECT no_such_column FROM pg_class", psycopg.errors.UndefinedColumn),
            ("SELECT no_such_function_here()", psycopg.errors.UndefinedFunction),
            ("SELECT * FROM no_such_schema_here.t", psycopg.errors.UndefinedTable),
        ):
            with pytest.raises(error), broker.database.connection() as conn:
                conn.execute(text)
        sent = message()
        broker.enqueue(sent)  # the broker goes on as before
    assert broker.inspect(sent.message_id) is not None
    assert [r.getMessage() for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []


# -- connection faults: named, and within connect_timeout -----------------------------------------
@pytest.mark.parametrize(
    ("where", "words"),
    [
        (
            {"host": "127.0.0.1", "port": "1", "password": "s3cret-pw"},
            ["cannot reach PostgreSQL at 127.0.0.1:1/", "refused"],
        ),
        (
            {"host": "no-such-host.invalid", "password": "s3cret-pw"},
            ["cannot reach PostgreSQL", "no-such-host.invalid"],
        ),
        ({"dbname": "no_such_database"}, ["refused the connection", 'database "no_such_database" does not exist']),
        ({"user": "no_such_role", "password": "s3cret-pw"}, ["refused the connection", "no_such_role"]),
    ],
)
def test_connection_faults_are_named_at_once_and_never_show_the_password(
    dramatiq_pg_url: str, where: dict[str, str], words: list[str]
) -> None:
    import time

    from dramatiq.errors import ConnectionClosed
    from psycopg.conninfo import make_conninfo

    url = make_conninfo(dramatiq_pg_url, **where)  # the test server (TCP or a socket folder), one thing wrong
    broker = PostgresBroker(url, schema="t_never", connect_timeout=5)
    broker.declare_queue("default")
    start = time.monotonic()
    try:
        with pytest.raises(ConnectionClosed) as raised:
            broker.enqueue(message())
    finally:
        broker.close()
    took = time.monotonic() - start
    text = str(raised.value)
    for word in words:
        assert word in text, text
    assert "s3cret-pw" not in text
    assert took < broker.database.connect_timeout, f"took {took:.1f} s"  # the old way waited twice connect_timeout


def test_a_malformed_connection_string_is_a_value_error_at_construction() -> None:
    with pytest.raises(ValueError, match="malformed") as raised:
        PostgresBroker("host=db password=s3cret-pw 'unterminated")
    assert "s3cret-pw" not in str(raised.value)
