"""Queues over several databases (issue 27): :class:`RoutedBroker`.

Most tests here route between two schemas of the test database (each a database to the broker: its
own tables, pool, doorbell and threads); ``test_one_database_down_stops_only_its_queues`` runs two
PostgreSQL servers of its own and stops one under a running worker.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from helpers import Factory, once_reachable, wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.routing.router import RoutedBroker, RouteError


def rows(broker: PostgresBroker, what: str = "queue_name, state") -> list[tuple[Any, ...]]:
    with psycopg.connect(broker.url, autocommit=True) as c:
        return c.execute(
            sql.SQL("SELECT {} FROM {}.message ORDER BY 1").format(sql.SQL(what), sql.Identifier(broker.schema))
        ).fetchall()


def relayed(broker: PostgresBroker) -> int:
    with psycopg.connect(broker.url, autocommit=True) as c:
        row = c.execute(sql.SQL("SELECT count(*) FROM {}.relayed").format(sql.Identifier(broker.schema))).fetchone()
        return int(row[0]) if row else 0


@pytest.fixture
def two(dramatiq_pg_broker_factory: Factory) -> Iterator[RoutedBroker]:
    """A router over two databases: queue "b" in "second", every other queue in "first"."""
    router = RoutedBroker(
        brokers={"first": dramatiq_pg_broker_factory(), "second": dramatiq_pg_broker_factory()},
        routes={"b": "second"},
        default="first",
    )
    try:
        yield router
    finally:
        router.close()


@pytest.fixture
def worker_of() -> Iterator[Any]:
    workers: list[dramatiq.Worker] = []

    def start(broker: dramatiq.Broker, threads: int = 4) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=threads)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def test_a_route_to_no_database_or_a_queue_without_one_is_an_error_at_start_up(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given a route naming a database the broker does not have, or a default that is not one, I
    expect RouteError as the broker is made; given no default, an actor on a queue without a route
    is RouteError as it is declared (at import): never a silent default."""
    first = dramatiq_pg_broker_factory()
    with pytest.raises(RouteError, match="'elsewhere', which is not one of"):
        RoutedBroker(brokers={"first": first}, routes={"q": "elsewhere"})
    with pytest.raises(RouteError, match="default database 'nope'"):
        RoutedBroker(brokers={"first": first}, default="nope")
    router = RoutedBroker(brokers={"first": first}, routes={"known": "first"})
    dramatiq.actor(lambda: None, actor_name="fine", queue_name="known", broker=router)
    with pytest.raises(RouteError, match="queue 'unknown' has no route"):
        dramatiq.actor(lambda: None, actor_name="lost", queue_name="unknown", broker=router)
    assert router.get_declared_queues() == {"known"}


def test_each_queue_lives_in_its_database_only(two: RoutedBroker, worker_of: Any) -> None:
    """Given actors on a queue of each database, I expect each send's row in its queue's database only,
    and one worker of the router to run both, each once."""
    ran: Counter[str] = Counter()

    @dramatiq.actor(queue_name="a", broker=two)
    def on_a(i: int) -> None:
        ran[f"a{i}"] += 1

    @dramatiq.actor(queue_name="b", broker=two)
    def on_b(i: int) -> None:
        ran[f"b{i}"] += 1

    for i in range(5):
        on_a.send(i)
        on_b.send(i)
    two.enqueue_many([on_a.message(5), on_b.message(5)])
    assert rows(two.shards["first"]) == [("a", "queued")] * 6
    assert rows(two.shards["second"]) == [("b", "queued")] * 6
    worker_of(two)
    two.join("a", timeout=30_000)
    two.join("b", timeout=30_000)
    assert ran == Counter({f"{q}{i}": 1 for q in "ab" for i in range(6)})
    figures = two.stats()["databases"]
    assert figures["first"]["routes"] == ["a"] and figures["second"]["routes"] == ["b"]


def test_a_follow_up_in_another_database_is_relayed_once(two: RoutedBroker, worker_of: Any) -> None:
    """Given a pipeline whose second step lives in the other database, and an actor that sends there
    inside with_ack(), I expect each follow-up written with its ack in the delivery's database, relayed,
    and run once; the relayed table there remembers them; no row is left behind."""
    ran: Counter[str] = Counter()

    @dramatiq.actor(queue_name="a", broker=two)
    def first_step(x: int) -> int:
        ran["first"] += 1
        with two.with_ack():
            second_step.send(100)
        return x + 1

    @dramatiq.actor(queue_name="b", broker=two)
    def second_step(x: int) -> None:
        ran[f"second {x}"] += 1

    dramatiq.pipeline([first_step.message(1), second_step.message()], broker=two).run()
    worker_of(two)
    two.join("a", timeout=30_000)
    wait_for(lambda: ran["second 2"] == 1 and ran["second 100"] == 1, 30, "both follow-ups to run")
    two.join("b", timeout=30_000)
    assert ran == Counter({"first": 1, "second 2": 1, "second 100": 1})
    assert relayed(two.shards["second"]) == 2
    assert rows(two.shards["first"]) == [] and rows(two.shards["second"]) == []


def test_a_relay_that_dies_between_its_two_commits_moves_nothing_twice(two: RoutedBroker, worker_of: Any) -> None:
    """Given an outbox row moved to its database whose removal from the outbox did not commit (the
    relay died in between), and the message run there meanwhile, I expect the next relay to insert
    nothing and to clear the outbox: the message ran once."""
    ran: Counter[str] = Counter()

    @dramatiq.actor(queue_name="b", broker=two)
    def there(i: int) -> None:
        ran[str(i)] += 1

    first, second = two.shards["first"], two.shards["second"]
    first.enqueue(there.message(7))  # straight into first's table: a row of its outbox
    assert rows(first) == [("b", "queued")]
    with first.database.connection() as conn:
        looked = RoutedBroker._look(conn, first, ["b"], 10)
        with conn.transaction():
            taken = RoutedBroker._take(conn, first, ["b"], looked)
            RoutedBroker._put(second, "first", taken)
            raise psycopg.Rollback()  # ... and the relay dies before this commit
    assert rows(first) == [("b", "queued")] and rows(second) == [("b", "queued")]
    worker = worker_of(second)  # its database's worker alone: no relay runs yet
    wait_for(lambda: ran["7"] == 1 and rows(second) == [], 30, "the message to run in its database")
    worker.stop()
    assert two.relay("first") == 1  # the outbox row goes ...
    assert rows(first) == [] and rows(second) == []  # ... and nothing was inserted again
    assert ran == Counter({"7": 1})
    assert relayed(second) == 1


def test_a_routed_broker_keeps_a_fenced_transaction_in_the_deliverys_database(
    two: RoutedBroker, worker_of: Any
) -> None:
    """Given an actor of the second database writing inside broker.fenced_transaction(), I expect its
    write and its ack committed there, once."""
    second = two.shards["second"]
    table = sql.Identifier(second.schema, f"tally_{uuid.uuid4().hex[:6]}")
    with psycopg.connect(second.url, autocommit=True) as c:
        c.execute(sql.SQL("CREATE TABLE {} (n int NOT NULL)").format(table))
        c.execute(sql.SQL("INSERT INTO {} VALUES (0)").format(table))

    @dramatiq.actor(queue_name="b", broker=two)
    def add() -> None:
        with two.fenced_transaction() as conn:
            conn.execute(sql.SQL("UPDATE {} SET n = n + 1").format(table))

    for _ in range(10):
        add.send()
    worker_of(two)
    two.join("b", timeout=30_000)
    with psycopg.connect(second.url, autocommit=True) as c:
        assert c.execute(sql.SQL("SELECT n FROM {}").format(table)).fetchone() == (10,)


def test_a_routed_actor_running_on_after_its_block_keeps_its_row_and_its_follow_up_in_another_database(
    dramatiq_pg_broker_factory: Factory, worker_of: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a pipeline whose first step, in the second database, commits its block and runs on for
    several leases (that database's maintenance running every pass meanwhile, a grace of one lease),
    and whose next step lives in the first, I expect the second database's lease keeper to keep the
    committed row, and, once the actor returns, the next step relayed to the first database and run
    once: the shard's keeper is the one that holds the delivery."""
    from dramatiq_pg_fenced.core import maintenance

    monkeypatch.setattr(maintenance, "COMMITTED_GRACE_LEASES", 1)
    short = {"lease_seconds": 1, "rescue_interval": 0.2}
    router = RoutedBroker(
        brokers={"first": dramatiq_pg_broker_factory(**short), "second": dramatiq_pg_broker_factory(**short)},
        routes={"b": "second"},
        default="first",
    )
    second = router.shards["second"]
    passes: list[int] = []
    rescue = second.parts.maintenance.rescue

    def counted(full: bool = True) -> int:
        before = second.parts.maintenance._last_finish
        taken = rescue(full=full)
        if second.parts.maintenance._last_finish != before:
            passes.append(1)
        return taken

    monkeypatch.setattr(second.parts.maintenance, "rescue", counted)
    committed, go = threading.Event(), threading.Event()
    ran: Counter[str] = Counter()

    @dramatiq.actor(queue_name="b", broker=router, max_retries=0)
    def pay(x: int) -> int:
        with router.fenced_transaction() as conn:
            conn.execute("SELECT 1")
        committed.set()
        assert go.wait(60), "the test never let the actor return"
        return x + 1

    @dramatiq.actor(queue_name="a", broker=router, max_retries=0)
    def then(x: int) -> None:
        ran[str(x)] += 1

    try:
        dramatiq.pipeline([pay.message(1), then.message()], broker=router).run()
        worker_of(router)
        wait_for(committed.is_set, 30, "the block to commit")
        seen = len(passes)
        wait_for(lambda: len(passes) >= seen + 4, 60, "four finish passes of the second database's maintenance")
        try:
            assert rows(second, "queue_name, state") == [("b", "committed")]
        finally:
            go.set()
        wait_for(lambda: ran["2"] == 1, 30, "the next step in the first database")
        router.join("b", timeout=30_000)
        router.join("a", timeout=30_000)
        assert ran == Counter({"2": 1})
        assert rows(second) == [] and rows(router.shards["first"]) == []
    finally:
        go.set()
        router.close()


def test_cancel_and_inspect_find_a_message_in_any_database(two: RoutedBroker) -> None:
    @dramatiq.actor(queue_name="b", broker=two)
    def later() -> None:
        pass

    message = later.send_with_options(delay=60_000)
    assert two.inspect(message.message_id)["database"] == "second"  # type: ignore[index]
    assert two.cancel(message.message_id).value == "cancelled_queued"
    assert two.inspect(str(uuid.uuid4())) is None


def test_results_are_kept_and_read_in_their_queues_database(two: RoutedBroker, worker_of: Any) -> None:
    """Given a RoutedResultBackend, I expect each result stored in its message's queue's database (one
    of each, and a failure riding the nack in the second), and get_result to read each there."""
    from dramatiq.results import ResultFailure, Results

    from dramatiq_pg_fenced.routing.router import RoutedResultBackend

    backend = RoutedResultBackend(two)
    two.add_middleware(Results(backend=backend))

    @dramatiq.actor(queue_name="a", broker=two, store_results=True)
    def double(x: int) -> int:
        return 2 * x

    @dramatiq.actor(queue_name="b", broker=two, store_results=True)
    def triple(x: int) -> int:
        return 3 * x

    @dramatiq.actor(queue_name="b", broker=two, store_results=True, max_retries=0)
    def fails() -> None:
        raise ValueError("no")

    worker_of(two)
    a, b, f = double.send(2), triple.send(2), fails.send()
    assert backend.get_result(a, block=True, timeout=20_000) == 4
    assert backend.get_result(b, block=True, timeout=20_000) == 6
    with pytest.raises(ResultFailure, match="no"):
        backend.get_result(f, block=True, timeout=20_000)

    def stored(broker: PostgresBroker) -> int:
        with psycopg.connect(broker.url, autocommit=True) as c:
            row = c.execute(sql.SQL("SELECT count(*) FROM {}.result").format(sql.Identifier(broker.schema))).fetchone()
            return int(row[0]) if row else 0

    assert stored(two.shards["first"]) == 1 and stored(two.shards["second"]) == 2
    backend.close()


def test_metrics_of_every_database_carry_a_database_label(two: RoutedBroker) -> None:
    from dramatiq_pg_fenced.ops.metrics import exposition

    @dramatiq.actor(queue_name="a", broker=two)
    def here() -> None:
        pass

    @dramatiq.actor(queue_name="b", broker=two)
    def there() -> None:
        pass

    here.send()
    there.send()
    there.send()
    text = exposition(two.metrics_registry()).decode()
    assert 'dramatiq_pg_up{database="first"} 1.0' in text and 'dramatiq_pg_up{database="second"} 1.0' in text
    assert 'dramatiq_pg_messages{database="first",queue="a",state="queued"} 1.0' in text
    assert 'dramatiq_pg_messages{database="second",queue="b",state="queued"} 2.0' in text


def test_the_relay_is_woken_by_the_doorbell(two: RoutedBroker, worker_of: Any) -> None:
    """Given a relay that looks only every 10 minutes unless its doorbell rings, I expect an outbox row
    moved promptly all the same (the ring of its commit wakes it)."""
    two.relay_poll = 600.0
    done = threading.Event()

    @dramatiq.actor(queue_name="b", broker=two)
    def there() -> None:
        done.set()

    @dramatiq.actor(queue_name="a", broker=two)
    def here() -> None:
        with two.with_ack():
            there.send()

    worker_of(two)
    wait_for(lambda: two._relays and all(r.alive() for r in two._relays.values()), 10, "the relays to start")
    here.send()
    assert done.wait(30), "the relayed message did not run within 30 s"


def test_a_schedule_is_kept_and_ticks_in_its_queues_database(two: RoutedBroker, worker_of: Any) -> None:
    """Given a schedule of an actor of the second database (``@schedule`` on the router), I expect it
    stored in that database only, ticking there; a second declaration under its name refused."""
    from dramatiq_pg_fenced.features.schedules import schedule

    ticks: list[str] = []

    @schedule(every=1)
    @dramatiq.actor(queue_name="b", broker=two)
    def tick() -> None:
        ticks.append("tick")

    with pytest.raises(ValueError, match="declared twice"):
        two.schedules.add(tick, every=2)
    assert [s.name for s in two.shards["second"].schedules] == ["tick"] and len(two.shards["first"].schedules) == 0
    worker_of(two)
    wait_for(lambda: len(ticks) >= 2, 30, "two ticks")

    def stored(broker: PostgresBroker) -> list[tuple[Any, ...]]:
        with psycopg.connect(broker.url, autocommit=True) as c:
            table = sql.Identifier(broker.schema, "schedule")
            return c.execute(sql.SQL("SELECT name FROM {}").format(table)).fetchall()

    assert stored(two.shards["second"]) == [("tick",)] and stored(two.shards["first"]) == []


def test_moving_a_queue_to_another_database_loses_and_duplicates_nothing(
    dramatiq_pg_broker_factory: Factory, worker_of: Any
) -> None:
    """Given a queue with due and delayed messages in the first database and a worker of that
    configuration running, then processes of a new configuration that routes it to the second, I
    expect move_queue to leave nothing of it queued or running in the first, and every message to run
    exactly once (the old worker's in the first, the rest in the second), the delayed ones too."""
    first, second = dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()
    old = RoutedBroker(brokers={"first": first, "second": second}, routes={"m": "first"})
    new = RoutedBroker(
        brokers={
            "first": dramatiq_pg_broker_factory(schema=first.schema),
            "second": dramatiq_pg_broker_factory(schema=second.schema),
        },
        routes={"m": "second"},
    )
    ran: Counter[str] = Counter()
    where: Counter[str] = Counter()
    lock = threading.Lock()

    def body(config: str) -> Any:
        def work(key: str) -> None:
            time.sleep(0.02)
            with lock:
                ran[key] += 1
                where[config] += 1

        return work

    old_m = dramatiq.actor(body("old"), actor_name="work_m", queue_name="m", broker=old)
    dramatiq.actor(body("new"), actor_name="work_m", queue_name="m", broker=new)
    try:
        old.enqueue_many([old_m.message(f"k{i}") for i in range(80)])
        old.enqueue_many([old_m.message(f"d{i}") for i in range(10)], delay=1500)
        worker_of(old, threads=2)
        wait_for(lambda: where["old"] >= 5, 30, "the old configuration's worker to run some")
        worker_of(new, threads=4)
        new.move_queue("m", timeout=60)  # (the new workers' relays may have moved them all already)
        assert new._outbox("first", ["m"], running=True) == 0
        new.join("m", timeout=60_000)
        assert ran == Counter({**{f"k{i}": 1 for i in range(80)}, **{f"d{i}": 1 for i in range(10)}})
        assert where["old"] >= 5 and where["new"] > 0
        assert rows(first) == [] and rows(second) == []
    finally:
        old.close()
        new.close()


def test_a_relayed_message_refused_in_its_database_is_counted_and_logged(
    two: RoutedBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a message in the second database's queue and a row with its id in the first's outbox,
    and another holding a unique key there and a row with that key in the outbox, I expect the relay
    to move both rows (the outbox empties), the second to refuse them, and each refusal logged at
    warning with the message's id and counted: in stats (the database's, ever; this process's) and
    in the metrics, labelled with the database."""
    import logging

    from dramatiq_pg_fenced.ops.metrics import exposition

    @dramatiq.actor(queue_name="b", broker=two)
    def there() -> None:
        pass

    message = there.message()
    two.shards["second"].enqueue(message)
    two.shards["first"].enqueue(message)  # the same id, an outbox row in the first
    holder, keyed = (there.message_with_options(unique_key="k") for _ in range(2))
    two.shards["second"].enqueue(holder)
    two.shards["first"].enqueue(keyed)  # another id, the same key
    with caplog.at_level(logging.WARNING, logger="dramatiq_pg_fenced"):
        assert two.relay("first") == 2
    assert rows(two.shards["first"]) == [] and rows(two.shards["second"]) == [("b", "queued")] * 2
    assert message.message_id in caplog.text and keyed.message_id in caplog.text
    assert caplog.text.count("was not inserted in 'second'") == 2
    figures = two.stats()
    assert figures["databases"]["second"]["relay_conflicts"] == 2
    assert figures["databases"]["first"]["relay_conflicts"] == 0
    assert figures["process"]["relay_conflicts"] == 2
    text = exposition(two.metrics_registry()).decode()
    assert 'dramatiq_pg_relay_conflicts_total{database="second"} 2.0' in text
    assert 'dramatiq_pg_relay_conflicts_total{database="first"} 0.0' in text


def test_the_relays_idle_looks_are_taken_in_turns(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given two routers on the same two databases (as two worker processes: each its own pools,
    doorbells and turns) whose relays look every 0.2 s, I expect, once each knows the other, one
    relay of the first database looking per duty window, never both; and a row written to the
    outbox without a ring (a lost notification) moved all the same, by the look of the one on duty."""
    from dramatiq_pg_fenced.core import turns
    from dramatiq_pg_fenced.routing.relay import RELAY_GROUP

    monkeypatch.setattr(turns, "REFRESH_EVERY", 0.5)  # each learns of the other sooner
    first, second = dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()
    routers = [
        RoutedBroker(
            brokers={
                "first": dramatiq_pg_broker_factory(schema=first.schema),
                "second": dramatiq_pg_broker_factory(schema=second.schema),
            },
            routes={"b": "second"},
            default="first",
            relay_poll=0.2,
        )
        for _ in range(2)
    ]
    try:
        for router in routers:
            dramatiq.actor(lambda: None, actor_name="there", queue_name="b", broker=router)
            router.start_relays()
        relays = [router._relays["first"] for router in routers]

        def seated() -> bool:
            seats = [r._turns.seat(RELAY_GROUP) if r._turns is not None else None for r in relays]
            return all(s is not None and s[1] == 2 for s in seats)

        wait_for(seated, 30, "both relays to know their turns")
        for relay in relays:
            relay.looked_at.clear()
        wait_for(lambda: sum(len(r.looked_at) for r in relays) >= 10, 30, "ten idle looks")
        length = max(0.2, turns.DUTY)
        windows = [{turns.Turns.window("duty", length, at)[0] for at in list(r.looked_at)} for r in relays]
        assert windows[0].isdisjoint(windows[1]), windows

        # A row of the outbox whose commit rang nobody: found by the look on duty.
        row = first.row(Message(queue_name="b", actor_name="there", args=(), kwargs={}, options={}), None)
        with psycopg.connect(first.url, autocommit=True) as c:
            c.execute(first.statements.enqueue, [*[[v] for v in row[:6]], first.channel, False])
        # The move commits in the destination, then in the outbox, then the relay counts it: wait for all.
        wait_for(lambda: rows(second) == [("b", "queued")], 30, "the row to be moved without a ring")
        wait_for(lambda: rows(first) == [] and sum(r.moved for r in relays) >= 1, 10, "the move to end")
        assert sum(r.moved for r in relays) == 1
    finally:
        for router in routers:
            router.close()


# -- faults stay local: two servers of the test's own ----------------------------------------------
def _done(url: str, schema: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as c:
        return dict(c.execute(sql.SQL("SELECT key, n FROM {}.done").format(sql.Identifier(schema))).fetchall())


@pytest.mark.slow
def test_one_database_down_stops_only_its_queues(tmp_path: Any) -> None:
    """Given a worker process (the stock CLI) on two PostgreSQL servers of the test's own, queue qa in
    the first and qb in the second, and the second stopped (immediate: a crash) mid-run, I expect qa to
    drain all the same (its follow-ups for qb waiting in its outbox), and once the second is back
    everything done: every message's write applied exactly once in its own database, nothing lost."""
    import os
    import signal
    import subprocess
    import sys

    from test_faults import OwnedServer

    servers = [OwnedServer(), OwnedServer()]
    schema = f"r_{uuid.uuid4().hex[:10]}"
    proc: subprocess.Popen[bytes] | None = None
    router = RoutedBroker({"a": servers[0].url, "b": servers[1].url}, routes={"qb": "b"}, default="a", schema=schema)
    try:
        router.migrate()
        for server in servers:
            with psycopg.connect(server.url, autocommit=True) as c:
                c.execute(
                    sql.SQL("CREATE TABLE {}.done (key text PRIMARY KEY, n int NOT NULL DEFAULT 1)").format(
                        sql.Identifier(schema)
                    )
                )
        from dramatiq.message import Message

        def messages(actor: str, queue: str, keys: range, prefix: str) -> list[Message]:
            return [Message(queue_name=queue, actor_name=actor, args=(f"{prefix}{k}",), kwargs={}, options={}) for k in keys]

        router.declare_queue("qa")
        router.declare_queue("qb")
        router.enqueue_many(messages("work_a", "qa", range(200), "a") + messages("work_b", "qb", range(200), "b"))
        env = dict(os.environ, ROUTED_URL_A=servers[0].url, ROUTED_URL_B=servers[1].url, ROUTED_SCHEMA=schema)
        with open(tmp_path / "worker.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", "tests.apps.routed_app", "-p", "1", "-t", "4"],
                cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wait_for(lambda: len(_done(servers[1].url, schema)) >= 20, 60, "work on the second database")
        servers[1].stop("immediate")
        # The first database's queue drains while the second is down, its hops waiting in its outbox.
        router.enqueue_many(messages("work_a", "qa", range(200, 400), "a") + messages("hop", "qa", range(100), "h"))
        wait_for(lambda: len(_done(servers[0].url, schema)) == 500, 120, "qa to drain with the second database down")
        servers[1].start()
        want_b = {f"b{k}" for k in range(200)} | {f"hop h{k}" for k in range(100)}
        wait_for(lambda: set(_done(servers[1].url, schema)) == want_b, 120, "the second database's work after its return")
        done_a, done_b = _done(servers[0].url, schema), _done(servers[1].url, schema)
        assert set(done_a) == {f"a{k}" for k in range(400)} | {f"h{k}" for k in range(100)}
        assert set(done_b) == want_b
        assert [k for k, n in {**done_a, **done_b}.items() if n != 1] == []  # applied exactly once
        router.flush_outcomes(10)
        wait_for(lambda: router._outbox("a", ["qb"]) == 0, 30, "the outbox to empty")
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        router.close()
        for server in servers:
            server.close()


def test_a_moved_message_keeps_its_attempt_and_its_lost_deliveries(dramatiq_pg_broker_factory: Factory) -> None:
    """Given a message of queue m delivered twice in the first database (the first delivery retried
    with its error, the second lost: its worker died and the rescue put it back), then m routed to the
    second database and moved there, I expect the moved row to keep its attempt (2), its lost
    deliveries (1), its last error and when it was sent: its next delivery there is attempt 3, and
    with max_deliveries=2 one more lost delivery dead-letters it (the earlier one counts)."""
    from test_max_deliveries import NO_RESCUE, crash, deliver

    first = dramatiq_pg_broker_factory(**NO_RESCUE, max_deliveries=2)
    second = dramatiq_pg_broker_factory(**NO_RESCUE, max_deliveries=2)
    old = RoutedBroker(brokers={"first": first, "second": second}, routes={"m": "first"})
    there = dramatiq_pg_broker_factory(schema=second.schema, **NO_RESCUE, max_deliveries=2)
    new = RoutedBroker(
        brokers={"first": dramatiq_pg_broker_factory(schema=first.schema, **NO_RESCUE), "second": there},
        routes={"m": "second"},
    )
    try:
        old.declare_queue("m")
        new.declare_queue("m")
        sent = Message(queue_name="m", actor_name="nobody", args=(), kwargs={}, options={})
        old.enqueue(sent)
        consumer = first.consume("m", prefetch=1, timeout=100)
        retried = deliver(first, consumer)
        assert retried.attempt == 1
        retried.stuff_exception(RuntimeError("the first attempt failed"))
        retried.options["traceback"] = "Traceback ...\nRuntimeError: the first attempt failed"
        retried.options["retries"] = 1
        first.enqueue(retried, delay=0)  # Dramatiq's Retries middleware
        consumer.ack(retried)
        assert first.flush_outcomes(10)
        lost = deliver(first, consumer)
        assert lost.attempt == 2
        assert crash(first, lost) == 1
        consumer.close()
        what = "state, attempt, lost_deliveries, last_error, enqueued_at"
        before = rows(first, what)
        assert [r[:3] for r in before] == [("queued", 2, 1)]

        assert new.move_queue("m", timeout=30) == 1
        assert rows(first) == []
        assert rows(second, what) == before  # attempt, lost deliveries, last error and send time kept

        moved = there.consume("m", prefetch=1, timeout=100)
        again = deliver(there, moved)
        assert again.attempt == 3 and again.options["attempt"] == 3
        assert again.options["retries"] == 1
        crash(there, again)  # the second lost delivery: max_deliveries=2 counts the first one too
        state, attempt, lost_deliveries, error, _ = rows(second, what)[0]
        assert (state, attempt, lost_deliveries) == ("dead", 3, 2)
        assert error.startswith("dead-lettered after 2 deliveries without an outcome")
        assert error.endswith("RuntimeError: the first attempt failed")
        moved.close()
    finally:
        old.close()
        new.close()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["message", "countdown"])
def test_the_relay_moves_only_follow_ups_whose_commit_is_on_disk(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Given a source database of the test's own whose WAL writer is frozen, a follow-up (a message,
    or a group member's countdown row) written to its outbox by a commit that does not wait for the
    WAL flush (as a relaxed ack writes it), and the source crashed (every server process SIGKILLed)
    right after the relay applied the row in its database, before the relay's own commit in the
    source: I expect the row still in the outbox after the restart (the relay made its commit
    durable before moving it: one forced flush, counted), and moved once: one message there, or one
    party counted (before: the crash undid the commit whose row had been moved already; its delivery
    would run again and send the follow-up, or count the group down, a second time)."""
    import os
    import signal

    from dramatiq.errors import ConnectionClosed
    from dramatiq.rate_limits import Barrier
    from psycopg.conninfo import make_conninfo
    from test_faults import OwnedServer

    from dramatiq_pg_fenced.features import rate_limits
    from dramatiq_pg_fenced.routing import groups

    server = OwnedServer(autovacuum="off")
    schema = f"r_{uuid.uuid4().hex[:10]}"
    target = dramatiq_pg_broker_factory()

    def router_on(source: PostgresBroker) -> RoutedBroker:
        router = RoutedBroker(brokers={"src": source, "dst": target}, routes={"b": "dst"}, default="src")
        router.add_middleware(rate_limits.FencedGroupCallbacks(rate_limits.PostgresBackend(broker=target)))
        router.declare_queue("b")
        return router

    def outbox() -> list[tuple[Any, ...]]:
        with psycopg.connect(server.url, autocommit=True, connect_timeout=5) as c:
            return c.execute(sql.SQL("SELECT queue_name FROM {}.message").format(sql.Identifier(schema))).fetchall()

    def moved() -> list[tuple[Any, ...]]:
        """What the move left in the target: the message, or the barrier's count."""
        if kind == "message":
            return rows(target)
        with psycopg.connect(target.url, autocommit=True) as c:
            table = sql.Identifier(target.schema, "rate_limit")
            return c.execute(sql.SQL("SELECT value FROM {} WHERE key = 'g'").format(table)).fetchall()

    # Its sessions with synchronous_commit off by default (a common tuning): the relay's look sets it on.
    relaxed = make_conninfo(server.url, options="-c synchronous_commit=off")
    source = PostgresBroker(relaxed, schema=schema)
    router = router_on(source)
    again: RoutedBroker | None = None
    try:
        source.migrate()
        assert router.group_home == "dst"
        Barrier(rate_limits.PostgresBackend(broker=target), "g", ttl=60_000).create(2)
        completion = Message(queue_name="b", actor_name="done", args=(), kwargs={}, options={})
        follow_up = Message(queue_name="b", actor_name="next", args=(), kwargs={}, options={})
        if kind == "countdown":
            follow_up = groups.countdown_message(completion, "g", 60_000, [completion])
        with psycopg.connect(server.url, autocommit=True) as c:
            row = c.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walwriter'").fetchone()
            assert row is not None
            os.kill(row[0], signal.SIGSTOP)
            values = source.row(follow_up, None)[:6]
            c.execute(source.statements.enqueue_relaxed, [*[[v] for v in values], source.channel, False])
        once = moved()
        applied = RoutedBroker._put if kind == "message" else groups.count_down_at_home

        def apply_then_crash(*args: Any) -> Any:
            out = applied(*args)
            server.crash()  # before the relay's commit in the source
            return out

        if kind == "message":
            monkeypatch.setattr(RoutedBroker, "_put", staticmethod(apply_then_crash))
        else:
            monkeypatch.setattr(groups, "count_down_at_home", apply_then_crash)
        with pytest.raises((psycopg.Error, ConnectionClosed)):
            router.relay("src")
        server.start()
        applied_once = moved()
        assert applied_once != once  # moved ...
        assert outbox() == [(follow_up.queue_name,)]  # ... only once its commit was on disk: the crash kept it
        with psycopg.connect(server.url, autocommit=True) as c:
            table = sql.Identifier(schema, "counter")
            flushes = c.execute(sql.SQL("SELECT value FROM {} WHERE name = 'relay_flushes'").format(table)).fetchall()
        assert flushes == [(1,)]
        monkeypatch.undo()
        again = router_on(PostgresBroker(relaxed, schema=schema))
        assert once_reachable(lambda: again.relay("src")) == 1  # moved again: nothing applied twice
        assert outbox() == [] and moved() == applied_once
        assert relayed(target) == 1
    finally:
        if again is not None:
            again.shards["src"].close()
        source.close()
        server.close()


def test_the_relays_writes_in_the_target_wait_for_the_flush_whatever_the_defaults(two: RoutedBroker) -> None:
    """The relay deletes the rows in their outbox once the insert in their database (or the countdown
    at the groups' home) returns: that commit must be on disk.  Given sessions whose default is
    synchronous_commit off (a common tuning), I expect the relay's insert and its countdown marks to
    set it on for their own transaction."""
    from psycopg.conninfo import make_conninfo

    second = two.shards["second"]
    url = make_conninfo(second.url, options="-c synchronous_commit=off")
    message = Message(queue_name="b", actor_name="there", args=(), kwargs={}, options={})
    values = [*second.row(message, None)[:6], None, None, 1, 2, 1, "the error before", None]
    with psycopg.connect(url) as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        put = conn.execute(second.statements.relay_put, [*[[v] for v in values], "first", second.channel, False])
        assert put.fetchone()[0] == 1
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        conn.rollback()
        marked = conn.execute(second.statements.relay_mark, {"source": "first", "ids": [str(uuid.uuid4())], "seqs": [1]})
        assert len(marked.fetchall()) == 1
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        conn.rollback()
