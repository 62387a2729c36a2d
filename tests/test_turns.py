"""Turns (turns.py): the listening processes share the idle chores and answer a ring one at a time.

Given several processes listening on one schema, I expect each window of a
chore (a queue's idle poll, the rescue) to be one process's; an idle queue
polled by one process per window, not by every process; a notification to
lead to one claim, not one per process; and an idle worker process to hold
at most two server connections (its pool's one and its LISTEN one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any, cast

import dramatiq
import psycopg
import pytest
from helpers import clear_of_idle_polls, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import turns
from dramatiq_pg_fenced.core.consumer import PostgresConsumer
from dramatiq_pg_fenced.core.turns import RING_STEP, Turns
from dramatiq_pg_fenced.db import database, doorbell
from dramatiq_pg_fenced.db import statements as sql


def seated(rank: int, count: int, group: str = "") -> Turns:
    t = Turns(sql.statements("dramatiq"), "dramatiq")
    t._seats, t._read_at = {group: (rank, count)}, time.monotonic()
    return t


# -- pure ----------------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2, 3, 7])
def test_each_window_of_a_chore_is_one_process_s(count: int) -> None:
    processes = [seated(rank, count) for rank in range(count)]
    for key in ("poll q0", "poll q1", "rescue"):
        for step in range(50):
            at = 1_700_000_000.0 + step * 0.37
            assert sum(p.mine(key, 1.0, at) for p in processes) == 1
        for p in processes:
            wait = p.until_mine(key, 1.0, 1_700_000_000.0)
            assert 0 < wait <= count * 1.0
            assert p.mine(key, 1.0, 1_700_000_000.0 + wait + 1e-6)


@pytest.mark.parametrize("count", [1, 3])
def test_the_process_on_duty_does_a_chore_every_interval_and_no_other_does(count: int) -> None:
    processes = [seated(rank, count) for rank in range(count)]
    start, runs = 1_700_000_000.0, []
    for p in processes:
        at = start
        while at < start + 100:
            at += p.next_turn("poll q", 1.0, at)
            runs.append((at, p))
    runs = [(at, p) for at, p in runs if at < start + 100]
    for at, p in runs:
        assert p.on_duty(1.0, at + 1e-6)
    assert 98 <= len(runs) <= 101  # one run a second in all, whoever is on duty
    assert {id(p) for _, p in runs} == {id(p) for p in processes}  # each takes its turn


def test_a_process_s_idle_polls_and_rescue_never_fall_together() -> None:
    t = Turns(sql.statements("dramatiq"), "dramatiq")
    queues = [f"q{i}" for i in range(5)]
    for q in queues:
        t.join(q)
    at = 1_700_000_000.3
    points = sorted(
        [at + t.next_turn(f"poll {q}", 1.0, at, group=q) for q in queues] + [at + t.until_grid("rescue", 1.0, at)]
    )
    assert all(b - a >= 1 / 6 - 1e-6 for a, b in zip(points, points[1:], strict=False))  # the rescue's too


def test_unknown_turns_make_every_chore_ours() -> None:
    t = Turns(sql.statements("dramatiq"), "dramatiq")
    assert t.seat() is None
    assert t.mine("rescue", 1.0) and t.until_mine("poll q", 2.0) == 2.0 and t.ring_delay("q") == 0.0
    t._seats, t._read_at = {"": (1, 2)}, time.monotonic() - turns.STALE_AFTER - 1
    assert t.seat() is None  # read too long ago: unknown


def test_only_the_process_on_duty_tries_the_charts_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given eight idle worker processes with known turns, I expect the minute's sample for the charts tried
    by the process on duty only (each try is a transaction, and off duty a connection check before it: the
    eight tried every 15 s each), and by every process while its turns are unknown."""
    from contextlib import nullcontext

    from dramatiq_pg_fenced.config import Settings
    from dramatiq_pg_fenced.core import maintenance, samples
    from dramatiq_pg_fenced.core.leases import Leases

    class Beating:
        active = True

        def due(self) -> bool:
            return False

    class Pool:
        def connection(self, raw: bool = False) -> Any:
            return nullcontext()

    log = logging.getLogger("test.turns")
    tried: list[int] = []
    monkeypatch.setattr(samples, "take_sample", lambda conn, statements: tried.append(1) or True)

    def tries(t: Turns | None) -> int:
        pool, beating = cast(Any, Pool()), cast(Any, Beating())
        m = maintenance.Maintenance(
            Leases(), pool, sql.statements("dramatiq"), Settings(), log, heartbeat=beating, turns=t
        )
        m.rescue = lambda full=True: 0  # type: ignore[method-assign]
        m.purge = m.purge_history = lambda: 0  # type: ignore[method-assign]
        tried.clear()
        m.tick()
        return len(tried)

    now = time.time()
    monkeypatch.setattr(turns, "time", SimpleNamespace(time=lambda: now, monotonic=time.monotonic))  # one window
    processes = [seated(rank, 8) for rank in range(8)]
    assert sorted(tries(p) for p in processes) == [0] * 7 + [1]  # the one on duty now
    assert tries(None) == 1  # turns unknown: every process does every chore


def test_one_process_answers_a_ring_at_once_the_others_one_step_apart() -> None:
    for count in (1, 2, 5):
        delays = sorted(seated(rank, count, "q").ring_delay("q", 1_700_000_000.0) for rank in range(count))
        assert delays == [k * RING_STEP for k in range(count)]


# -- with a database -----------------------------------------------------------
@pytest.fixture
def quick_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listeners read who holds a seat every 0.2 s (not every 10 s)."""
    monkeypatch.setattr(doorbell, "CHECK_EVERY", 0.1)
    monkeypatch.setattr(turns, "REFRESH_EVERY", 0.2)
    monkeypatch.setattr(turns, "DUTY", 0.5)


def test_listening_sessions_take_distinct_seats_and_a_closed_one_frees_its_own(dramatiq_pg_url: str) -> None:
    statements = sql.statements("seats_test")
    conns = [psycopg.connect(dramatiq_pg_url, autocommit=True) for _ in range(3)]
    try:
        seats = [Turns(statements, "seats_test") for _ in conns]
        seats[0].join("q")
        seats[2].join("q")  # the second consumes other queues only
        for t, conn in zip(seats, conns, strict=True):
            t.listening(conn)
        for t, conn in zip(seats, conns, strict=True):
            t.refresh(conn)
        assert sorted(t.seat() for t in seats) == [(0, 3), (1, 3), (2, 3)]  # type: ignore[type-var]
        assert [t.seat("q") for t in seats] == [(0, 2), None, (1, 2)]  # a queue's turns: its consumers only
        conns[1].close()

        def two_left() -> bool:
            for t, conn in ((seats[0], conns[0]), (seats[2], conns[2])):
                t.refresh(conn)
            return [seats[0].seat(), seats[2].seat()] == [(0, 2), (1, 2)]

        wait_for(two_left, 10, "the closed session's seat to be freed")
    finally:
        for conn in conns:
            conn.close()


def consumers_of(brokers: list[PostgresBroker], queue: str, **consume: Any) -> list[PostgresConsumer]:
    out = [b.consume(queue, **consume) for b in brokers]
    wait_for(
        lambda: all(
            b.parts.turns.seat(queue) is not None and b.parts.turns.seat(queue)[1] == len(brokers) for b in brokers
        ),  # type: ignore[index]
        15,
        "every process to see the others' seats",
    )
    return out


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, float, int]]]:
    """Every claim of the test: (consumer id, wall-clock time it started, rows it took)."""
    seen: list[tuple[str, float, int]] = []
    real = PostgresConsumer._claim_rows

    def claim_rows(self: PostgresConsumer, conn: psycopg.Connection, limit: int) -> list[tuple]:
        at = time.time()
        rows = real(self, conn, limit)
        seen.append((self.consumer_id, at, len(rows)))
        return rows

    monkeypatch.setattr(PostgresConsumer, "_claim_rows", claim_rows)
    yield seen


def run(consumer: PostgresConsumer, until: threading.Event, delivered: list[str]) -> None:
    while not until.is_set():
        message = next(consumer)
        if message is not None:
            delivered.append(message.message_id)
            consumer.ack(message)


def test_an_idle_queue_is_polled_by_one_process_per_window(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    quick_turns: None,
    claims: list[tuple[str, float, int]],
) -> None:
    first = dramatiq_pg_broker_factory(poll_interval=0.2, rescue_interval=3600)
    brokers = [first, dramatiq_pg_broker_factory(schema=first.schema, poll_interval=0.2, rescue_interval=3600)]
    for b in brokers:
        b.declare_queue("idle")
    consumers = consumers_of(brokers, "idle", prefetch=2, timeout=100)
    stop, delivered = threading.Event(), []
    threads = [threading.Thread(target=run, args=(c, stop, delivered)) for c in consumers]
    for t in threads:
        t.start()
    # The claims after the doorbells connected (every process claims once: turns were unknown) come at once
    # after one of them holds the door and hears; wait for that, then for them.
    wait_for(lambda: any(b.parts.turns.hearing() is not None for b in brokers), 30, "a process to hear")
    time.sleep(0.6)
    since = time.time()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    polls = [(cid, at) for cid, at, _ in claims if at >= since]
    assert len(polls) >= 5  # the queue was polled all along
    by_id = {c.consumer_id: b.parts.turns for b, c in zip(brokers, consumers, strict=True)}
    for cid, at in polls:
        t = by_id[cid]
        # Each poll in a window of the poller's (a poll starts at its window's start, a little late at worst).
        assert t.on_duty(0.2, at, group="idle") or t.on_duty(0.2, at - 0.05, group="idle"), (cid, at, polls)


def test_a_notification_leads_to_one_claim(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    quick_turns: None,
    claims: list[tuple[str, float, int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns, "RING_STEP", 0.5)  # a claim's "!took" arrives well within a step
    # A starved test process (CI's second pass: 6.8 s between two sends) made its door's holder look
    # stuck after quick_turns' 2.6 s, so the waiters listened too and each claimed once from the head:
    # that is the stuck-holder rule (test_wake_one), not this test's.
    monkeypatch.setattr(turns, "stuck_after", lambda: 60.0)
    first = dramatiq_pg_broker_factory(poll_interval=3600, rescue_interval=3600)
    brokers = [first] + [
        dramatiq_pg_broker_factory(schema=first.schema, poll_interval=3600, rescue_interval=3600) for _ in range(2)
    ]
    for b in brokers:
        b.declare_queue("rung")
    consumers = consumers_of(brokers, "rung", prefetch=2, timeout=100)
    stop, delivered = threading.Event(), []
    threads = [threading.Thread(target=run, args=(c, stop, delivered)) for c in consumers]
    for t in threads:
        t.start()
    wait_for(lambda: any(b.parts.turns.hearing() is not None for b in brokers), 30, "a process to hear")
    time.sleep(1.0)  # the claims after the doorbells connected (at once after the door's holder hears)
    clear_of_idle_polls(first, "rung", 3600, 6 * 3 * 0.5 + 10)  # an hourly poll is a claim too
    claims.clear()
    for n in range(6):
        message = dramatiq.Message(queue_name="rung", actor_name="nobody", args=(n,), kwargs={}, options={})
        first.enqueue(message)
        wait_for(lambda m=message: m.message_id in delivered, 10, "the message to be delivered")  # type: ignore[misc]
        time.sleep(3 * 0.5)  # every rank's turn to answer has passed
    stop.set()
    for t in threads:
        t.join()
    assert sorted(delivered) == sorted(set(delivered)) and len(delivered) == 6
    assert [rows for _, _, rows in claims] == [1] * 6  # one claim per notification, and it took the message


def test_an_idle_worker_process_holds_at_most_two_connections(
    dramatiq_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(database, "POOL_MAX_IDLE", 0.5)
    name = f"conn-budget-{time.monotonic_ns()}"
    info = conninfo_to_dict(dramatiq_pg_url)
    info["application_name"] = name
    broker = PostgresBroker(make_conninfo(**info), schema=f"t_{name.replace('-', '_')}", lease_seconds=1.5)  # type: ignore[arg-type]
    broker.migrate()
    done: list[int] = []
    peaks: list[int] = []

    def busy(n: int) -> None:
        """Runs past a lease extension, on a pooled connection while the others hold theirs: the
        keeper connects, the pool grows to four."""
        with broker.database.connection():
            time.sleep(1.0)
            peaks.append(connections())
        done.append(n)

    for i in range(4):
        dramatiq.actor(busy, broker=broker, actor_name=f"a{i}", queue_name=f"q{i}")

    def connections() -> int:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", [name])
            return int(row.fetchone()[0])  # type: ignore[index]

    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=100)
    worker.start()
    try:
        for i in range(4):
            broker.get_actor(f"a{i}").send(i)
        wait_for(lambda: len(done) == 4, 15, "the messages to run")
        assert max(peaks) > 2  # busy, it held more

        wait_for(lambda: connections() <= 2, 15, "an idle worker to hold at most two connections")
    finally:
        worker.stop()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{broker.schema}" CASCADE')
        broker.close()


def test_the_pool_closes_every_connection_it_left_unused_over_its_idle_period(dramatiq_pg_url: str) -> None:
    pool = database.new_pool(dramatiq_pg_url, max_size=5, connect_timeout=5, name="shrink-test")
    try:
        pool.wait()
        pool._shrink_pool()  # a period begins
        held = [pool.getconn() for _ in range(4)]  # a worker's start: every consumer's first claim at once
        for conn in held:
            pool.putconn(conn)
        assert pool.get_stats()["pool_size"] == 4
        pool._shrink_pool()  # the period in which all four were used: none goes
        assert pool.get_stats()["pool_size"] == 4
        pool._shrink_pool()  # a period in which three were never used: all three go, not one
        assert pool.get_stats()["pool_size"] == 1
    finally:
        pool.close()


def test_after_a_full_claim_the_next_comes_when_there_is_room_rung_or_not(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], quick_turns: None
) -> None:
    """Given a consumer whose idle poll is far off (it went quiet after a short claim), when one ring
    announces two messages and its prefetch takes one, I expect the second claimed as soon as the first
    is acked, without another ring (a process that waits for its queues' door hears none)."""
    broker = dramatiq_pg_broker_factory(poll_interval=3600, rescue_interval=3600)
    broker.declare_queue("q")
    c = broker.consume("q", prefetch=1, timeout=100)
    try:
        wait_for(lambda: broker.parts.turns.hearing() is not None, 10, "the process to listen")
        assert next(c) is None  # a short claim: quiet until its next poll, an hour away
        messages = [dramatiq.Message(queue_name="q", actor_name="x", args=(n,), kwargs={}, options={}) for n in (1, 2)]
        broker.enqueue_many(messages)  # one ring for both
        first = wait_for(lambda: next(c), 10, "the first message")
        c.ack(first)
        second = wait_for(lambda: next(c), 10, "the second message, once there is room")
        assert {first.message_id, second.message_id} == {m.message_id for m in messages}
        c.ack(second)
    finally:
        c.close()
