"""Groups over several databases (issue 27, item 2): one home for the barriers, countdowns relayed.

As in test_routing.py, two schemas of the test database stand for two databases (each its own
tables, pool, doorbell and threads; nothing is written across them in one transaction).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from dramatiq.results import ResultMissing, Results
from helpers import Factory
from psycopg import sql
from test_routing import relayed, rows

from dramatiq_pg_fenced.core import delivery
from dramatiq_pg_fenced.features import rate_limits
from dramatiq_pg_fenced.features.rate_limits import FencedGroupCallbacks
from dramatiq_pg_fenced.routing.groups import COUNTDOWN_QUEUE
from dramatiq_pg_fenced.routing.router import RoutedBroker, RoutedResultBackend

TIMEOUT = 30_000


@pytest.fixture
def grouped(dramatiq_pg_broker_factory: Factory) -> Iterator[tuple[RoutedBroker, RoutedResultBackend]]:
    """A router over two databases (queue "b" in "second", every other one in "first"), the groups'
    home in "first", results in each message's database."""
    first, second = dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()
    router = RoutedBroker(brokers={"first": first, "second": second}, routes={"b": "second"}, default="first")
    backend = RoutedResultBackend(router)
    router.add_middleware(FencedGroupCallbacks(rate_limits.PostgresBackend(broker=first)))
    router.add_middleware(Results(backend=backend))  # after GroupCallbacks, as results.setup() does
    try:
        yield router, backend
    finally:
        router.close()
        backend.close()


def test_the_groups_home_is_the_database_of_the_rate_limiter_backend(
    grouped: tuple[RoutedBroker, RoutedResultBackend],
) -> None:
    router, _ = grouped
    assert router.group_home == "first"
    assert router.database_of(COUNTDOWN_QUEUE) == "first"
    assert COUNTDOWN_QUEUE in router.foreign_queues("second") and COUNTDOWN_QUEUE not in router.foreign_queues("first")


def test_a_group_over_two_databases_completes_once_with_every_result(
    grouped: tuple[RoutedBroker, RoutedResultBackend],
) -> None:
    """Given a group whose members live in both databases (one of the second's failing once and
    retried, another whose first delivery is fenced out: its lease taken back while it runs, as a
    rescue does) and a completion callback in the second, I expect the callback to run once, after
    every member (none while the last, held back, has not finished: the fenced-out delivery did
    not count), and to read every member's result; group.get_results to read them in each
    member's database; and each member of the second to count down once (one countdown row moved
    home per member, none left)."""
    router, backend = grouped
    second = router.shards["second"]
    tries: Counter[str] = Counter()
    calls: list[list[Any]] = []
    lock = threading.Lock()

    @dramatiq.actor(queue_name="a", broker=router, store_results=True)
    def square(x: int) -> int:
        return x * x

    gate = threading.Event()

    @dramatiq.actor(queue_name="a", broker=router, store_results=True)
    def last(x: int) -> int:
        assert gate.wait(60), "the test never opened the gate"
        return x

    @dramatiq.actor(queue_name="b", broker=router, store_results=True)
    def cube(x: int) -> int:
        return x**3

    @dramatiq.actor(queue_name="b", broker=router, store_results=True, max_retries=3, min_backoff=50, max_backoff=100)
    def flaky(x: int) -> int:
        with lock:
            tries["flaky"] += 1
            first_try = tries["flaky"] == 1
        if first_try:
            raise RuntimeError("first try fails")
        return -x

    @dramatiq.actor(queue_name="b", broker=router, store_results=True)
    def fenced_once(x: int) -> int:
        with lock:
            tries["fenced"] += 1
            first_try = tries["fenced"] == 1
        if first_try:  # the row goes back to the queue under this delivery: its ack will be fenced out
            running = delivery.running()
            assert running is not None
            with psycopg.connect(second.url, autocommit=True) as c:
                c.execute(
                    sql.SQL(
                        "UPDATE {}.message SET state = 'queued', delivery = NULL, lease_expires_at = NULL, "
                        "consumer_id = NULL, available_at = now() WHERE message_id = %s"
                    ).format(sql.Identifier(second.schema)),
                    [running.message_id],
                )
        return 100 + x

    @dramatiq.actor(queue_name="b", broker=router)
    def collect(children: list[dict[str, Any]]) -> None:
        found = []
        for child in children:
            try:
                found.append(Message(**child).get_result(backend=backend))
            except ResultMissing:
                found.append("missing")
        with lock:
            calls.append(found)

    members = [square.message(i) for i in range(3)] + [cube.message(2), flaky.message(5), fenced_once.message(7)]
    members.append(last.message(9))
    expected = [0, 1, 4, 8, -5, 107, 9]
    g = dramatiq.group(members, broker=router)
    g.add_completion_callback(collect.message([m.asdict() for m in members]))
    g.run()
    worker = dramatiq.Worker(router, worker_timeout=100, worker_threads=4)
    worker.start()
    try:
        for m in members[:-1]:
            backend.get_result(m, block=True, timeout=TIMEOUT)
        assert tries == Counter({"flaky": 2, "fenced": 2})
        router.join("b", timeout=TIMEOUT)  # waits for the countdown rows to move home and what they caused
        assert router._outbox("second", [COUNTDOWN_QUEUE]) == 0
        assert calls == []  # a completion, had the fenced-out delivery counted, ran by now
        gate.set()
        assert list(g.get_results(block=True, timeout=TIMEOUT)) == expected
        router.join("a", timeout=TIMEOUT)
        router.join("b", timeout=TIMEOUT)  # the last countdown row moved home, the completion ran
        assert len(calls) == 1
    finally:
        worker.stop()
    assert tries == Counter({"flaky": 2, "fenced": 2})
    assert calls == [expected]
    # Home: a countdown row of each member of the second, each moved once; there, the callback.
    assert relayed(router.shards["first"]) == 3 and relayed(second) == 1
    assert rows(router.shards["first"]) == [] and rows(second) == []


def test_a_countdown_row_moved_twice_counts_once(grouped: tuple[RoutedBroker, RoutedResultBackend]) -> None:
    """Given a member's countdown row moved home whose removal from its outbox did not commit (the
    relay died in between), I expect the next move to apply nothing: a barrier of two parties with
    one member counted is not cleared, and no completion is written."""
    router, _ = grouped
    first, second = router.shards["first"], router.shards["second"]

    @dramatiq.actor(queue_name="a", broker=router)
    def done() -> None:
        pass

    from dramatiq.rate_limits import Barrier

    from dramatiq_pg_fenced.routing.groups import count_down_at_home, countdown_message

    barrier = Barrier(rate_limits.PostgresBackend(broker=first), "g-twice", ttl=60_000)
    barrier.create(2)
    member = done.message()
    second.enqueue(countdown_message(member, "g-twice", 60_000, [done.message()]))
    with second.database.connection() as conn:
        looked = RoutedBroker._look(conn, second, [COUNTDOWN_QUEUE], 10)
        with conn.transaction():
            taken = RoutedBroker._take(conn, second, [COUNTDOWN_QUEUE], looked)
            assert count_down_at_home(first, "second", taken) == (1, [])
            raise psycopg.Rollback()  # ... and the relay dies before this commit
    assert router.relay("second") == 1  # moved again: nothing applied
    assert rows(second) == [] and rows(first) == []  # not cleared: no completion
    with psycopg.connect(first.url, autocommit=True) as c:
        value = c.execute(
            sql.SQL("SELECT value FROM {}.rate_limit WHERE key = 'g-twice'").format(sql.Identifier(first.schema))
        ).fetchone()
    assert value == (1,)  # one party counted of two


@pytest.mark.parametrize(
    "payload",
    [b"\xff not json", b'{"queue_name": "x"}', b"[]", None],
    ids=["undecodable", "not-a-message", "a-list", "no-barrier"],
)
def test_a_countdown_row_that_is_none_is_dead_lettered_in_its_outbox_and_the_rest_moves(
    grouped: tuple[RoutedBroker, RoutedResultBackend], payload: bytes | None, caplog: pytest.LogCaptureFixture
) -> None:
    """Given, in the second database's outbox, a countdown row whose payload is no countdown (a
    strange byte, a message without a barrier), then a good countdown row and a message for the
    first database, I expect one relay to move the good ones (the barrier counts, the message is
    queued in the first) and to leave the bad row dead in the second, its error saying why, counted
    with the relay conflicts and logged: a relay that failed on it would fail at every turn and hold
    up every row behind it."""
    import logging

    from dramatiq.rate_limits import Barrier

    from dramatiq_pg_fenced.routing.groups import countdown_message

    router, _ = grouped
    first, second = router.shards["first"], router.shards["second"]

    @dramatiq.actor(queue_name="a", broker=router)
    def done() -> None:
        pass

    barrier = Barrier(rate_limits.PostgresBackend(broker=first), "g-bad", ttl=60_000)
    barrier.create(2)
    bad = countdown_message(done.message(), "g-bad", 60_000, [])
    if payload is None:
        bad = bad._replace(options={k: v for k, v in bad.options.items() if k != "barrier"})
    second.enqueue(bad)
    if payload is not None:
        with psycopg.connect(second.url, autocommit=True) as c:
            c.execute(
                sql.SQL("UPDATE {}.message SET payload = %s WHERE message_id = %s").format(
                    sql.Identifier(second.schema)
                ),
                (payload, bad.message_id),
            )
    second.enqueue(countdown_message(done.message(), "g-bad", 60_000, []))
    second.enqueue(done.message())  # an outbox row for the first database
    with caplog.at_level(logging.ERROR, logger="dramatiq_pg_fenced"):
        assert router.relay("second") == 3
    assert rows(first) == [("a", "queued")]
    assert rows(second) == [(COUNTDOWN_QUEUE, "dead")]
    with psycopg.connect(second.url, autocommit=True) as c:
        (error,) = c.execute(
            sql.SQL("SELECT last_error FROM {}.message WHERE message_id = %s").format(sql.Identifier(second.schema)),
            (bad.message_id,),
        ).fetchone()
    assert error.startswith("not a group countdown:")
    assert bad.message_id in caplog.text
    with psycopg.connect(first.url, autocommit=True) as c:
        value = c.execute(
            sql.SQL("SELECT value FROM {}.rate_limit WHERE key = 'g-bad'").format(sql.Identifier(first.schema))
        ).fetchone()
    assert value == (1,)  # the good one counted, the bad one not
    figures = router.stats()
    assert figures["databases"]["second"]["relay_conflicts"] == 1
    assert figures["process"]["relay_conflicts"] == 1
    assert router.relay("second") == 0  # nothing left to move, nothing failing
