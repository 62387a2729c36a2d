"""PostgresBroker under Dramatiq's own worker, as Dramatiq tests its Redis and RabbitMQ brokers."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.errors import QueueJoinTimeout
from dramatiq.middleware import CurrentMessage
from helpers import Factory, acked, clear_of_idle_polls, query, running_worker, wait_for
from psycopg import sql

from dramatiq_pg_fenced import CancelOutcome, DeadLetterError, PostgresBroker, SchemaError
from dramatiq_pg_fenced.core import floor as floors
from dramatiq_pg_fenced.core.consumer import PostgresConsumer
from dramatiq_pg_fenced.db import migrations

# -- helpers ------------------------------------------------------------------


def rows(broker: PostgresBroker) -> list[tuple]:
    return query(broker, "SELECT message_id::text, state, attempt FROM {schema}.message ORDER BY seq")


def own_row_clock(broker: PostgresBroker) -> tuple[dt.datetime, dt.datetime, dt.datetime]:
    """From inside an actor: (enqueued_at, available_at, clock_timestamp()) of the running row, all on the DB clock."""
    message = CurrentMessage.get_current_message()
    assert message is not None
    found = query(
        broker,
        "SELECT enqueued_at, available_at, clock_timestamp() FROM {schema}.message WHERE message_id = %s",
        [message.message_id],
    )
    return found[0]


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    """A broker that polls often, so tests do not lean on the doorbell alone."""
    broker = dramatiq_pg_broker_factory(poll_interval=0.1)
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def fresh_schema(dramatiq_pg_url: str) -> Iterator[str]:
    """A schema name nobody migrated; dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


# -- actors run ---------------------------------------------------------------
def test_actors_run(dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker) -> None:
    seen = []

    @dramatiq.actor
    def add(x: int, *, y: int = 0) -> None:
        seen.append(x + y)

    for i in range(20):
        add.send(i, y=100)
    dramatiq_pg_broker.join(add.queue_name, timeout=30_000)

    assert sorted(seen) == [i + 100 for i in range(20)]
    assert rows(dramatiq_pg_broker) == []  # acked rows leave the table


def test_messages_carry_attempt_one_on_first_delivery(broker: PostgresBroker) -> None:
    attempts = []

    @dramatiq.actor
    def look() -> None:
        message = CurrentMessage.get_current_message()
        attempts.append(message.options["attempt"])

    with running_worker(broker):
        look.send()
        broker.join(look.queue_name, timeout=30_000)
    assert attempts == [1]


# -- retries ----------------------------------------------------------------------
def test_retries_with_backoff_and_growing_attempt(broker: PostgresBroker) -> None:
    runs: list[dict[str, Any]] = []

    @dramatiq.actor(max_retries=5, min_backoff=100, max_backoff=10_000)
    def flaky() -> None:
        message = CurrentMessage.get_current_message()
        enqueued_at, available_at, started = own_row_clock(broker)
        run = {
            "attempt": message.options["attempt"],
            "retries": message.options.get("retries", 0),
            "available_at": available_at,
            "started": started,
        }
        runs.append(run)
        if len(runs) < 3:
            run["failed"] = own_row_clock(broker)[2]
            raise RuntimeError("not yet")

    with running_worker(broker):
        message = flaky.send()
        broker.join(flaky.queue_name, timeout=30_000)

    assert [r["attempt"] for r in runs] == [1, 2, 3]
    assert [r["retries"] for r in runs] == [0, 1, 2]
    for before, after in zip(runs, runs[1:], strict=False):
        # Dramatiq's backoff for retry n is at least min_backoff * 2**n.
        least = dt.timedelta(milliseconds=100 * 2 ** before["retries"])
        assert after["available_at"] - before["failed"] >= least
        assert after["started"] >= after["available_at"]
    assert acked(broker, message.message_id, attempt=3)  # the last attempt acked it


def test_dead_letter_after_retries_are_exhausted(broker: PostgresBroker) -> None:
    calls = []

    @dramatiq.actor(max_retries=2, min_backoff=10, max_backoff=50)
    def doomed() -> None:
        calls.append(1)
        raise ValueError("always broken")

    with running_worker(broker):
        message = doomed.send()
        broker.join(doomed.queue_name, timeout=30_000, fail_fast=False)

    assert len(calls) == 3
    info = broker.inspect(message.message_id)
    assert info is not None
    assert info["state"] == "dead"
    assert info["attempt"] == 3
    assert info["retries"] == 2  # as written by the last retry
    assert "ValueError: always broken" in info["last_error"]
    assert info["finished_at"] is not None


def test_throws_dead_letters_without_retrying(broker: PostgresBroker) -> None:
    calls = []

    @dramatiq.actor(max_retries=5, throws=(KeyError,))
    def picky() -> None:
        calls.append(1)
        raise KeyError("expected")

    with running_worker(broker):
        message = picky.send()
        broker.join(picky.queue_name, timeout=30_000, fail_fast=False)
    assert len(calls) == 1
    info = broker.inspect(message.message_id)
    assert info is not None and info["state"] == "dead" and info["attempt"] == 1


# -- delays -------------------------------------------------------------------------
def test_delayed_messages_are_not_early(broker: PostgresBroker) -> None:
    seen: list[tuple[int, dt.datetime, dt.datetime, dt.datetime]] = []

    @dramatiq.actor
    def later(delay: int) -> None:
        seen.append((delay, *own_row_clock(broker)))

    with running_worker(broker):
        later.send(0)
        sent = [later.send_with_options(args=(d,), delay=d) for d in (300, 1000)]
        assert all("eta" not in m.options for m in sent)  # the database holds it, not the worker's memory
        broker.join(later.queue_name, timeout=30_000)

    assert sorted(d for d, *_ in seen) == [0, 300, 1000]
    for delay, enqueued_at, available_at, started in seen:
        assert available_at - enqueued_at == dt.timedelta(milliseconds=delay)
        assert started >= available_at
    assert broker.get_declared_delay_queues() == set()


def test_delays_and_backoffs_ring_the_doorbell_when_due(dramatiq_pg_broker_factory: Factory) -> None:
    """With polling and the worker's own timeout far away (30 s, 3 s), delayed messages and a retry's
    backoff still start within a fraction of a second of being due: the enqueue and the retry
    announce when they are due, and each process's listener rings the queue then."""
    broker = dramatiq_pg_broker_factory(poll_interval=30)
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    late: dict[str, list[float]] = {"delay": [], "backoff": []}
    failed: set[str] = set()

    @dramatiq.actor
    def later() -> None:
        _, available_at, started = own_row_clock(broker)
        late["delay"].append((started - available_at).total_seconds())

    @dramatiq.actor(max_retries=1, min_backoff=500, max_backoff=500)
    def flaky() -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        if message.message_id not in failed:
            failed.add(message.message_id)
            raise RuntimeError("first attempt fails")
        _, available_at, started = own_row_clock(broker)  # the retry set available_at to the end of its backoff
        late["backoff"].append((started - available_at).total_seconds())

    with running_worker(broker, timeout=3_000):
        wait_for(lambda: broker.parts.turns.hearing() is not None, 30, "the listener to hear")
        bell = broker.database.started_doorbell(broker.channel)
        assert bell is not None
        for delay in (400, 800, 1200, 1600):
            later.send_with_options(delay=delay)
        flaky.send()
        # Each of the five announced when it is due ("queue<TAB>ms"), and the listener's timer rang the
        # queue then: five timers, each rung (a timer that never rings fails this wait).
        wait_for(lambda: bell.timers_rung(later.queue_name) >= 5, 20, "the five timers to ring")
        wait_for(lambda: len(late["delay"]) == 4 and len(late["backoff"]) == 1, 20, "the delayed runs")
    assert all(s >= 0 for s in late["delay"] + late["backoff"]), late  # none early
    # How late they started is a figure, not a test (benchmarks/latency_steps.py reports the idle path):
    # shown with -s; without the ring, 1.4 s or more here (the worker's 3 s timeout).
    print("started after due, s:", late)


@pytest.mark.parametrize("listen", [True, False])
def test_delays_nobody_heard_of_start_on_time(dramatiq_pg_broker_factory: Factory, listen: bool) -> None:
    """Delayed rows no listener announced (sent before the worker started, several delays in one
    statement, or no LISTEN at all) still start on time: after a short claim the consumer reads when
    the queue's next delayed row is due and waits until then, not for the poll (30 s) or the
    worker's timeout (3 s)."""
    broker = dramatiq_pg_broker_factory(poll_interval=30, listen=listen)
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    late: list[float] = []

    @dramatiq.actor
    def later(n: int) -> None:
        _, available_at, started = own_row_clock(broker)
        late.append((started - available_at).total_seconds())

    for n, delay in enumerate((600, 1200)):  # before any worker listens
        later.send_with_options(args=(n,), delay=delay)
    later.send_with_options(args=(99,), delay=3_600_000)  # due in an hour: never run here, always found next
    with running_worker(broker, timeout=3_000) as worker:
        with broker.batch():  # one statement, three delays: a timer for the first one at most
            for n, delay in enumerate((500, 900, 1300), start=2):
                later.send_with_options(args=(n,), delay=delay)
        wait_for(lambda: len(late) == 5, 20, "the delayed runs")
        consumer = worker.consumers[later.queue_name].consumer
        # Each claim that came back short read when the queue's next delayed row is due, and found
        # one (the hour's at least): that is what the consumer waits for, not the poll.
        assert consumer.due_found >= 1, consumer.due_found
    assert all(s >= 0 for s in late), late  # none early
    # How late they started is a figure, not a test: shown with -s; without reading the next due time,
    # 1.7 s or more here (the worker's 3 s timeout).
    print("started after due, s:", late)


def test_a_drained_queue_is_not_claimed_again_until_the_doorbell_rings(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Dramatiq asks for the next message as soon as it takes one.  When the claim that brought it
    came back short (nothing more was due), the consumer does not claim again, which would find
    nothing and compete for the CPU with the worker thread starting that message, until the doorbell
    rings or the poll interval (an hour here) passes; the next message sent still comes at once.

    The floor's look back from the head (once a second after a short claim from the floor) is put
    off here: on a slow machine it fell due within the worker's next ask and claimed nothing.  So is
    the start: the claim that follows the listener's first LISTEN is waited for before the loop.  So
    is the idle poll: it falls on a wall-clock grid (with the 30 s interval this test had, a round
    of the loop ran across a point of it in about one run of ten: the "[1, 0]" seen in CI)."""
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 3600.0)
    broker = dramatiq_pg_broker_factory(poll_interval=3600)
    broker.declare_queue("q")
    claims: list[int] = []
    real = PostgresConsumer._claim_rows

    def counted(self: PostgresConsumer, conn: psycopg.Connection, limit: int) -> list[tuple]:
        rows = real(self, conn, limit)
        claims.append(len(rows))
        return rows

    monkeypatch.setattr(PostgresConsumer, "_claim_rows", counted)
    consumer = broker.consume("q", prefetch=4, timeout=300)
    wait_for(lambda: broker.database.started_doorbell(broker.channel) is not None and next(consumer) is None)
    # Once LISTEN is in place (turns.heard), every consumer claims once, for a ring sent while nobody
    # listened: on a slow machine that came after the half second below, inside the loop ([1, 0]).
    wait_for(lambda: broker.parts.turns.hearing() is not None, 10, "the listener to hear")
    time.sleep(0.5)  # the listener connected (and rang once)
    assert next(consumer) is None
    clear_of_idle_polls(broker, "q", 3600, 15)
    # An idle poll whose point the wait above ran past is owed: asked for nothing, it claims now.  Asked
    # first in the loop, it claimed the message sent there, and the ring of that send, heard after the
    # claim began, made a second claim (the "[1, 0]" in round 0 of a CI run; forced with the point ~3 s
    # ahead of the last claim, it came every time).
    assert next(consumer) is None
    rounds: list[list[int]] = []
    for n in range(4):
        claims.clear()
        message: dramatiq.Message[Any] = dramatiq.Message(
            queue_name="q", actor_name="nobody", args=(n,), kwargs={}, options={}
        )
        sent = time.monotonic()
        broker.enqueue(message)
        delivered = next(consumer)
        assert delivered is not None and delivered.message_id == message.message_id
        # the doorbell, not the poll: none falls in the 15 s cleared above (no speed asserted: a loaded
        # machine took 2.5 s to hear and claim, in a fresh-venv run)
        assert time.monotonic() - sent < 15
        assert next(consumer) is None  # the worker's next ask: nothing claimed for it
        rounds.append(list(claims))
        consumer.ack(delivered)
    consumer.close()
    assert rounds == [[1]] * 4  # a consumer that claimed again after every short claim: [1, 0] each


def test_a_claim_is_not_planned_again_at_every_call(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    """A consumer's claim runs as a prepared statement whose plan PostgreSQL keeps (a generic plan):
    with its LIMIT a parameter, the kept plan counted on taking a tenth of the queue, lost to a plan
    made for the call every time, and every claim was planned again (0.6 ms of the server each, 40%
    of its time in a drain).  Each limit now has its own statement; after a few custom plans the kept
    one is used.  (Before: 0 generic plans, a custom plan per claim.)"""
    broker = dramatiq_pg_broker_factory()
    broker.declare_queue("q")
    consumer = broker.consume("q", prefetch=8, timeout=100)
    message = dramatiq.Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={})
    broker.enqueue_many([message.copy(message_id=str(uuid.uuid4())) for _ in range(5000)])  # a backlog
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("ANALYZE {}.message").format(sql.Identifier(broker.schema)))
        for _ in range(20):
            assert len(consumer._claim_rows(conn, 8)) == 8
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE '%%SKIP LOCKED%%'"
        ).fetchall()
    consumer.close()
    # One statement for the one limit, prepared at its first call (two: a claim from the head passes its
    # place in line as text, not as a timestamp; see floor.Floor).
    assert plans and all(custom <= 5 for _, custom in plans), plans
    assert sum(generic for generic, _ in plans) >= 12, plans


def test_delayed_message_waits_in_the_table(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def never_yet() -> None:
        pass

    message = never_yet.send_with_options(delay=3_600_000)
    consumer = broker.consume(never_yet.queue_name, prefetch=4, timeout=200)
    try:
        assert next(consumer) is None  # not due: nothing is claimed
    finally:
        consumer.close()
    info = broker.inspect(message.message_id)
    assert info is not None and info["state"] == "queued" and info["attempt"] == 0
    with pytest.raises(QueueJoinTimeout):
        broker.join(never_yet.queue_name, timeout=100)  # a delayed message is still pending


# -- priorities -----------------------------------------------------------------------
def test_priorities_order_the_claim(broker: PostgresBroker) -> None:
    @dramatiq.actor(priority=10)
    def low(n: int) -> None:
        pass

    @dramatiq.actor(priority=0)
    def high(n: int) -> None:
        pass

    for n in range(3):
        low.send(n)
    for n in range(3):
        high.send(n)

    consumer = broker.consume("default", prefetch=3, timeout=1000)
    try:
        first = [next(consumer) for _ in range(3)]
        assert [(m.actor_name, m.args[0]) for m in first] == [("high", 0), ("high", 1), ("high", 2)]
        assert {state for _, state, _ in rows(broker)} == {"queued", "running"}
        for m in first:
            consumer.ack(m)
        broker.flush_outcomes(10)
        rest = [next(consumer) for _ in range(3)]
        assert [(m.actor_name, m.args[0]) for m in rest] == [("low", 0), ("low", 1), ("low", 2)]
        for m in rest:
            consumer.ack(m)
        broker.flush_outcomes(10)
    finally:
        consumer.close()
    assert rows(broker) == []


def test_priorities_order_processing(broker: PostgresBroker) -> None:
    order = []

    @dramatiq.actor(priority=100)
    def low(n: int) -> None:
        order.append(("low", n))

    @dramatiq.actor(priority=0)
    def high(n: int) -> None:
        order.append(("high", n))

    for n in range(3):
        low.send(n)
    for n in range(3):
        high.send(n)
    with running_worker(broker, threads=1, prefetch=1):
        broker.join("default", timeout=30_000)

    assert order == [("high", 0), ("high", 1), ("high", 2), ("low", 0), ("low", 1), ("low", 2)]


# -- queues and join --------------------------------------------------------------------
def test_many_queues(broker: PostgresBroker) -> None:
    seen: dict[str, list[int]] = {}
    lock = threading.Lock()
    actors = []
    for i in range(6):

        def fn(n: int, queue: str = f"q{i}") -> None:
            with lock:
                seen.setdefault(queue, []).append(n)

        actors.append(dramatiq.actor(fn, actor_name=f"fn{i}", queue_name=f"q{i}"))

    with running_worker(broker):
        for actor in actors:
            for n in range(5):
                actor.send(n)
        for actor in actors:
            broker.join(actor.queue_name, timeout=30_000)

    assert broker.get_declared_queues() == {f"q{i}" for i in range(6)}
    assert {q: sorted(ns) for q, ns in seen.items()} == {f"q{i}": list(range(5)) for i in range(6)}


def test_join_timeout(dramatiq_pg_broker: PostgresBroker) -> None:
    @dramatiq.actor
    def idle() -> None:
        pass

    idle.send()
    with pytest.raises(QueueJoinTimeout):
        dramatiq_pg_broker.join(idle.queue_name, timeout=200)


def test_join_of_an_empty_queue_returns(dramatiq_pg_broker: PostgresBroker) -> None:
    @dramatiq.actor
    def idle() -> None:
        pass

    dramatiq_pg_broker.join(idle.queue_name, timeout=5_000)


def test_join_fail_fast_raises_the_actors_exception(broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    class Boom(Exception):
        pass

    @dramatiq.actor(max_retries=0)
    def explode() -> None:
        raise Boom("kaboom")

    with running_worker(broker):
        message = explode.send()
        with pytest.raises(Boom, match="kaboom"):
            broker.join(explode.queue_name, fail_fast=True, timeout=30_000)

    # Another process (here: another broker object) only knows what the row says.
    other = PostgresBroker(dramatiq_pg_url, schema=broker.schema)
    try:
        with pytest.raises(DeadLetterError, match="kaboom") as info:
            other.join(explode.queue_name, fail_fast=True, timeout=5_000)
        assert info.value.message_id == message.message_id
        other.join(explode.queue_name, timeout=5_000, fail_fast=False)  # then a dead letter is not pending
    finally:
        other.close()

    broker.flush(explode.queue_name)
    broker.join(explode.queue_name, fail_fast=True, timeout=5_000)  # flush forgets dead letters


def test_flush_and_flush_all(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name="a")
    def in_a() -> None:
        pass

    @dramatiq.actor(queue_name="b")
    def in_b() -> None:
        pass

    for _ in range(3):
        in_a.send()
        in_b.send()
    broker.flush("a")
    assert query(broker, "SELECT queue_name, count(*) FROM {schema}.message GROUP BY 1") == [("b", 3)]
    broker.flush_all()
    assert rows(broker) == []


# -- shutdown -------------------------------------------------------------------------------
def test_graceful_shutdown_returns_prefetched_messages_at_once(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(lease_seconds=600)  # a lapsed lease cannot explain a release
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    started, release = threading.Event(), threading.Event()
    attempts: dict[str, int] = {}

    @dramatiq.actor
    def slow(n: int) -> None:
        message = CurrentMessage.get_current_message()
        attempts[message.message_id] = message.options["attempt"]
        started.set()
        release.wait(30)

    for n in range(5):
        slow.send(n)

    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)  # prefetch 2: one runs, one waits
    worker.start()
    assert started.wait(30)
    stopper = threading.Thread(target=worker.stop)
    stopper.start()
    wait_for(lambda: not any(t.running for t in worker.workers), what="the worker threads to be told to stop")
    release.set()  # the running message finishes; the prefetched one is never started
    stopper.join(60)
    assert not stopper.is_alive()
    assert broker.flush_outcomes(10)

    left = rows(broker)
    assert all(state == "queued" for _, state, _ in left), left
    assert len(attempts) == 1 and len(left) == 4
    assert any(attempt == 1 for _, _, attempt in left)  # the prefetched one, released with its attempt kept
    assert broker.parts.leases.snapshot() == {}

    # A new worker takes them, each delivery one attempt further.
    ran_before = dict(attempts)
    with running_worker(broker):
        broker.join(slow.queue_name, timeout=30_000)
    assert len(attempts) == 5
    assert {mid: attempts[mid] for mid, _, _ in left} == {mid: attempt + 1 for mid, _, attempt in left}
    assert all(attempts[mid] == 1 for mid in ran_before)


# -- encoders and enqueue paths ------------------------------------------------------------
def test_pickle_encoder(dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker) -> None:
    dramatiq.set_encoder(dramatiq.PickleEncoder())  # restored by conftest
    seen = []

    @dramatiq.actor
    def take(value: Any) -> None:
        seen.append(value)

    value = {"when": dt.datetime(2024, 1, 2, 3, 4, 5), "tags": {1, 2}, "raw": b"\x00\xff"}
    message = take.send(value)
    info = dramatiq_pg_broker.inspect(message.message_id)
    if info is not None:  # may already be done
        assert info["args"] == (value,)
    dramatiq_pg_broker.join(take.queue_name, timeout=30_000)
    assert seen == [value]


def test_pickle_payload_is_stored_as_bytes(dramatiq_pg_broker: PostgresBroker) -> None:
    dramatiq.set_encoder(dramatiq.PickleEncoder())

    @dramatiq.actor
    def take(value: Any) -> None:
        pass

    take.send({1, 2, 3})
    [(payload,)] = query(dramatiq_pg_broker, "SELECT payload FROM {schema}.message")
    assert bytes(payload)[:1] == b"\x80"  # a pickle, not JSON


def test_enqueue_many(broker: PostgresBroker) -> None:
    seen = []

    @dramatiq.actor
    def count(n: int) -> None:
        seen.append(n)

    messages = [count.message(n) for n in range(50)]
    assert broker.enqueue_many(messages) == messages
    assert len(rows(broker)) == 50
    with running_worker(broker):
        broker.join(count.queue_name, timeout=30_000)
    assert sorted(seen) == list(range(50))


def test_batch_inserts_at_block_end(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def noop(n: int) -> None:
        pass

    with broker.batch():
        for n in range(10):
            noop.send(n)
        with broker.batch():  # nested blocks write with the outer one
            noop.send(10)
        assert rows(broker) == []
    assert len(rows(broker)) == 11

    with pytest.raises(RuntimeError), broker.batch():
        noop.send(99)
        raise RuntimeError("abandon")
    assert len(rows(broker)) == 11  # nothing from the failed block


def test_transaction_commit_and_rollback(broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    seen = []

    @dramatiq.actor
    def after_commit(n: int) -> None:
        seen.append(n)

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            after_commit.send(1)
        assert rows(broker) == []  # not visible before the caller commits
        conn.commit()
        assert len(rows(broker)) == 1

        with broker.transaction(conn):
            after_commit.send(2)
        conn.rollback()
        assert len(rows(broker)) == 1

        with pytest.raises(RuntimeError), conn.transaction(), broker.transaction(conn):
            after_commit.send(3)
            raise RuntimeError("the caller's transaction fails")
        assert len(rows(broker)) == 1

    after_commit.send(4)  # outside the block: the broker's own connection again
    with running_worker(broker):
        broker.join(after_commit.queue_name, timeout=30_000)
    assert sorted(seen) == [1, 4]


# -- schema and migrations ---------------------------------------------------------------
def test_migrate_is_idempotent(dramatiq_pg_broker: PostgresBroker) -> None:
    assert dramatiq_pg_broker.migrate() == []
    assert dramatiq_pg_broker.migrate() == []
    versions = query(dramatiq_pg_broker, "SELECT version FROM {schema}.schema_version ORDER BY 1")
    assert [v for (v,) in versions] == [v for v, _, _ in migrations.available()]


def test_concurrent_migrate_from_threads(dramatiq_pg_url: str, fresh_schema: str) -> None:
    brokers = [PostgresBroker(dramatiq_pg_url, schema=fresh_schema) for _ in range(4)]
    barrier = threading.Barrier(len(brokers))
    results: list[Any] = [None] * len(brokers)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = brokers[i].migrate()
        except Exception as e:  # reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(brokers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert all(isinstance(r, list) for r in results), results
        everything = [v for v, _, _ in migrations.available()]
        assert sorted(results, key=len) == [[]] * (len(brokers) - 1) + [everything]
        _send_and_receive(brokers[0])
    finally:
        for b in brokers:
            b.close()


def test_concurrent_migrate_from_processes(dramatiq_pg_url: str, fresh_schema: str) -> None:
    code = (
        "import json, sys\n"
        "from dramatiq_pg_fenced import PostgresBroker\n"
        "b = PostgresBroker(sys.argv[1], schema=sys.argv[2])\n"
        "print(json.dumps(b.migrate()))\n"
        "b.close()\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, dramatiq_pg_url, fresh_schema], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    results = sorted((json.loads(out) for out in outputs), key=len)
    assert results == [[], [], [v for v, _, _ in migrations.available()]]


def _send_and_receive(broker: PostgresBroker) -> None:
    broker.declare_queue("default")
    broker.enqueue(dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={}))
    consumer = broker.consume("default", timeout=5000)
    try:
        message = next(consumer)
        assert message is not None and message.options["attempt"] == 1
        consumer.ack(message)
        broker.flush_outcomes(10)
    finally:
        consumer.close()


def test_unmigrated_schema_names_the_migrate_command(dramatiq_pg_url: str, fresh_schema: str) -> None:
    broker = PostgresBroker(dramatiq_pg_url, schema=fresh_schema)
    try:
        broker.declare_queue("default")
        message = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
        with pytest.raises(SchemaError, match="dramatiq-pg-fenced migrate") as info:
            broker.enqueue(message)
        assert f"--schema {fresh_schema}" in str(info.value)
        with pytest.raises(SchemaError):
            broker.inspect(message.message_id)
    finally:
        broker.close()
    with psycopg.connect(dramatiq_pg_url) as conn:  # checking created nothing
        found = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [fresh_schema]).fetchall()
    assert found == []


def test_newer_schema_asks_for_an_upgrade(dramatiq_pg_url: str, fresh_schema: str) -> None:
    broker = PostgresBroker(dramatiq_pg_url, schema=fresh_schema)
    try:
        broker.migrate()
        query(broker, "INSERT INTO {schema}.schema_version (version, name) VALUES (999, '999_future.sql')")
    finally:
        broker.close()
    broker = PostgresBroker(dramatiq_pg_url, schema=fresh_schema)
    try:
        with pytest.raises(SchemaError, match="upgrade"):
            broker.stats()
    finally:
        broker.close()


# -- operations -------------------------------------------------------------------------------
def test_cancel_a_queued_message(broker: PostgresBroker) -> None:
    ran = []

    @dramatiq.actor
    def job(n: int) -> None:
        ran.append(n)

    doomed = job.send(1)
    assert broker.cancel(doomed.message_id) == CancelOutcome.QUEUED
    assert broker.cancel(doomed.message_id) == CancelOutcome.ALREADY_CANCELLED
    assert broker.is_cancelled(doomed.message_id)
    info = broker.inspect(doomed.message_id)
    assert info is not None and info["state"] == "cancelled" and info["finished_at"] is not None

    job.send(2)
    with running_worker(broker):
        broker.join(job.queue_name, timeout=30_000)
    assert ran == [2]
    assert broker.cancel(str(uuid.uuid4())) == CancelOutcome.NOT_FOUND


def test_cancel_a_message_waiting_for_its_retry(broker: PostgresBroker) -> None:
    calls = []

    @dramatiq.actor(max_retries=3, min_backoff=3_600_000, max_backoff=7_200_000)
    def fails_once() -> None:
        calls.append(1)
        raise RuntimeError("first try fails")

    with running_worker(broker):
        message = fails_once.send()

        def backing_off() -> bool:
            info = broker.inspect(message.message_id)
            return info is not None and info["state"] == "queued" and info["attempt"] == 1

        wait_for(backing_off, what="the retry to be queued")
        assert broker.cancel(message.message_id) == CancelOutcome.QUEUED
    info = broker.inspect(message.message_id)
    assert info is not None and info["state"] == "cancelled" and info["attempt"] == 1
    assert calls == [1]


def test_inspect_an_unknown_id(dramatiq_pg_broker: PostgresBroker) -> None:
    assert dramatiq_pg_broker.inspect(str(uuid.uuid4())) is None


def test_inspect_a_queued_message(dramatiq_pg_broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name="inspected", priority=5)
    def look(a: int, *, b: str) -> None:
        pass

    message = look.send(1, b="two")
    info = dramatiq_pg_broker.inspect(message.message_id)
    assert info is not None
    assert info["message_id"] == message.message_id
    assert (info["queue_name"], info["actor_name"], info["priority"]) == ("inspected", "look", 5)
    assert (info["state"], info["attempt"], info["retries"]) == ("queued", 0, 0)
    assert (info["args"], info["kwargs"]) == ((1,), {"b": "two"})


def test_join_fail_fast_sees_a_dead_letter_written_between_its_reads(broker: PostgresBroker) -> None:
    """join reads how many are pending and which are dead: a message dead-lettered between the two
    reads must raise, not return on the now empty queue (the writer does it on its own thread)."""

    @dramatiq.actor(max_retries=0)
    def doomed() -> None:
        pass

    message = doomed.send()
    real_run = broker.database.run
    reads = []

    def run_then_dead_letter(fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = real_run(fn, *args, **kwargs)
        if not reads:  # the outcome is written right after join's first read
            real_run(
                lambda conn: conn.execute(
                    sql.SQL(
                        "UPDATE {}.message SET state = 'dead', last_error = 'kaboom', finished_at = now()"
                        " WHERE message_id = %s"
                    ).format(sql.Identifier(broker.schema)),
                    [message.message_id],
                )
            )
        reads.append(fn)
        return result

    broker.database.run = run_then_dead_letter  # type: ignore[method-assign]
    try:
        with pytest.raises(DeadLetterError, match="kaboom"):
            broker.join(doomed.queue_name, fail_fast=True, timeout=5_000)
    finally:
        del broker.database.run
