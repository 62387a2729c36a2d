"""Sends inside a routed broker's transactions (issue 36): a send to a queue of another database made
inside ``fenced_transaction()``, ``transaction(conn)`` or a framework's outbox is a row of that
transaction (an outbox row of the foreign queue, in the transaction's database), so it exists if
and only if the transaction commits, and arrives once in its own database after the relay.

The fenced blocks run under a worker of the first database alone (``worker_of(first)``): no relay
runs, and the test moves the outbox by hand (``router.relay(name)``), so it sees what waits where.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import Factory, wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.routing.router import RoutedBroker, RouteError


def rows(broker: PostgresBroker, what: str = "queue_name, state") -> list[tuple[Any, ...]]:
    with psycopg.connect(broker.url, autocommit=True) as c:
        return c.execute(
            sql.SQL("SELECT {} FROM {}.message ORDER BY 1, 2").format(sql.SQL(what), sql.Identifier(broker.schema))
        ).fetchall()


@pytest.fixture
def two(dramatiq_pg_broker_factory: Factory) -> Iterator[RoutedBroker]:
    """A router over two databases (two schemas of the test database): queue "b" in "second", every
    other queue in "first"."""
    router = RoutedBroker(
        brokers={"first": dramatiq_pg_broker_factory(), "second": dramatiq_pg_broker_factory()},
        routes={"b": "second"},
        default="first",
    )
    try:
        yield router
    finally:
        router.close()


@pytest.fixture(params=["one schema name", "two schema names"])
def apart(request: pytest.FixtureRequest, dramatiq_pg_url: str) -> Iterator[RoutedBroker]:
    """A router over two databases of the test server (not two schemas of one), their tables in
    schemas of one name (as two deployments of the default schema) or of two: queue "b" in "second"."""
    names = [f"rt_{uuid.uuid4().hex[:10]}" for _ in range(2)]
    schema = f"t_{uuid.uuid4().hex[:10]}"
    schemas = [schema, schema] if request.param == "one schema name" else [schema, f"{schema}_b"]
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as c:
        for name in names:
            c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    brokers = {
        key: PostgresBroker(make_conninfo(dramatiq_pg_url, dbname=name), schema=s, middleware=[])
        for key, name, s in zip(["first", "second"], names, schemas, strict=True)
    }
    router = None
    try:
        for broker in brokers.values():
            broker.migrate()
        router = RoutedBroker(brokers=brokers, routes={"b": "second"}, default="first")
        yield router
    finally:
        if router is not None:
            router.close()
        for broker in brokers.values():
            broker.close()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as c:
            for name in names:
                c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def worker_of() -> Iterator[Any]:
    workers: list[dramatiq.Worker] = []

    def start(broker: dramatiq.Broker, threads: int = 2) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=threads)
        worker.start()
        workers.append(worker)
        return worker

    yield start
    for worker in workers:
        worker.stop()


def delays(broker: PostgresBroker) -> list[tuple[Any, ...]]:
    """(priority, whether it is delayed by more than 50 s) of each queued row, by its first argument."""
    return rows(broker, "priority, available_at > now() + interval '50 seconds'")


# -- fenced_transaction() -----------------------------------------------------------------------------
def test_a_send_to_another_database_in_a_fenced_block_that_raises_is_sent_once_by_the_retry_that_commits(
    two: RoutedBroker, worker_of: Any
) -> None:
    """Given an actor of the first database whose fenced block sends to a queue of the second (a
    plain send, enqueue_many, a batch, a delayed send and a unique one sent twice) and raises at its
    first attempt, and which sent one more inside with_ack() before the block, I expect, once its
    retry committed, nothing in the second database before the relay, one outbox row per send of
    the attempt that committed in the first, and after the relay each message once in the second,
    the delayed one still delayed and every one with its actor's priority; a second relay moves
    nothing."""
    first, second = two.shards["first"], two.shards["second"]
    attempts: Counter[int] = Counter()

    @dramatiq.actor(queue_name="b", broker=two, priority=7)
    def receipt(what: str) -> None:
        pass

    @dramatiq.actor(queue_name="a", broker=two, max_retries=3, min_backoff=1, max_backoff=1)
    def pay(order: int) -> None:
        attempts[order] += 1
        with two.with_ack():
            receipt.send("with the ack")
        with two.fenced_transaction():
            receipt.send("plain")
            two.enqueue_many([receipt.message("many 1"), receipt.message("many 2")])
            with two.batch():
                receipt.send("batched")
            receipt.send_with_options(args=("later",), delay=120_000)
            receipt.send_with_options(args=("unique",), unique_key="receipt-1")
            receipt.send_with_options(args=("unique",), unique_key="receipt-1")
            if attempts[order] == 1:
                raise ValueError("declined, this time")

    pay.send(1)
    worker_of(first)
    wait_for(lambda: attempts[1] == 2, 30, "the retry")
    first.join("a", timeout=30_000)
    assert rows(second) == []  # nothing escaped the blocks
    assert rows(first) == [("b", "queued")] * 7  # the outbox: the sends of the attempt that committed
    assert two.relay("first") == 7
    assert rows(first) == [] and rows(second) == [("b", "queued")] * 7
    assert sorted(delays(second)) == [(7, False)] * 6 + [(7, True)]
    assert two.relay("first") == 0 and len(rows(second)) == 7


def test_a_send_to_another_database_in_a_fenced_block_is_nowhere_while_it_is_open_nor_after_it_rolls_back(
    two: RoutedBroker, worker_of: Any
) -> None:
    """Given an actor of the first database whose fenced block sends to the second and waits, then
    raises (no retries), I expect no message in either database while the block is open, none after
    it rolled back (the delivery dead-lettered), and nothing for the relay to move."""
    first, second = two.shards["first"], two.shards["second"]
    inside, release = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="b", broker=two)
    def receipt() -> None:
        pass

    @dramatiq.actor(queue_name="a", broker=two, max_retries=0)
    def pay() -> None:
        with two.fenced_transaction():
            receipt.send()
            inside.set()
            release.wait(30)
            raise ValueError("declined")

    pay.send()
    worker_of(first)
    assert inside.wait(30), "the block did not open"
    try:
        assert rows(second) == []
        assert rows(first) == [("a", "running")]
    finally:
        release.set()
    first.join("a", timeout=30_000, fail_fast=False)
    assert rows(second) == [] and rows(first) == [("a", "dead")]
    assert two.relay("first") == 0 and rows(second) == []


def test_a_fenced_blocks_send_to_another_database_wakes_the_relay_as_the_block_commits(
    two: RoutedBroker, worker_of: Any
) -> None:
    """Given a router's worker whose relays look only every 10 minutes unless their doorbell rings, I
    expect a message sent to the second database inside a fenced block of the first to run promptly
    all the same, once: the commit of its outbox row rings the relay."""
    two.relay_poll = 600.0
    ran: Counter[str] = Counter()
    done = threading.Event()

    @dramatiq.actor(queue_name="b", broker=two)
    def receipt() -> None:
        ran["receipt"] += 1
        done.set()

    @dramatiq.actor(queue_name="a", broker=two)
    def pay() -> None:
        with two.fenced_transaction():
            receipt.send()

    worker_of(two)
    wait_for(lambda: two._relays and all(r.alive() for r in two._relays.values()), 10, "the relays to start")
    pay.send()
    assert done.wait(30), "the relayed message did not run within 30 s"
    two.join("b", timeout=30_000)
    assert ran == Counter({"receipt": 1})


# -- transaction(conn) -----------------------------------------------------------------------------------
def test_sends_in_a_routed_transaction_are_rows_of_it_and_are_relayed_once(apart: RoutedBroker) -> None:
    """Given two databases and a connection to the first, I expect a send to a queue of the second
    made inside router.transaction(conn) to vanish with a rolled-back transaction; and, in one that
    commits, every send (plain, enqueue_many, a batch, delayed, unique twice) to be a row of it in
    the first (none in the second before the relay, none visible before the commit), each moved
    once by the relay, with its delay and priority; the first's own queue's rows stay there."""
    first, second = apart.shards["first"], apart.shards["second"]

    @dramatiq.actor(queue_name="b", broker=apart, priority=3)
    def there(what: str) -> None:
        pass

    @dramatiq.actor(queue_name="a", broker=apart)
    def here(what: str) -> None:
        pass

    with psycopg.connect(first.url) as conn:
        with conn.transaction():
            with apart.transaction(conn):
                there.send("rolled back")
                here.send("rolled back")
            raise psycopg.Rollback()
        assert rows(first) == [] and rows(second) == []
        with conn.transaction(), apart.transaction(conn):
            there.send("plain")
            apart.enqueue_many([there.message("many"), here.message("many")])
            with apart.batch():
                there.send("batched")
                here.send("batched")
            there.send_with_options(args=("later",), delay=120_000)
            there.send_with_options(args=("unique",), unique_key="k")
            there.send_with_options(args=("unique",), unique_key="k")
            assert rows(first) == [] and rows(second) == []  # not before the commit
    assert rows(second) == []
    assert rows(first) == [("a", "queued")] * 2 + [("b", "queued")] * 5
    assert apart.relay("first") == 5
    assert rows(first) == [("a", "queued")] * 2 and rows(second) == [("b", "queued")] * 5
    assert sorted(delays(second)) == [(3, False)] * 4 + [(3, True)]
    assert apart.relay("first") == 0 and len(rows(second)) == 5


def test_a_routed_transaction_on_a_connection_to_none_of_its_databases_is_refused(
    two: RoutedBroker, dramatiq_pg_url: str
) -> None:
    """Given a connection to a database where none of the router's schemas is, I expect
    router.transaction(conn) to refuse it (RouteError), before anything is sent."""
    name = f"rt_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        with psycopg.connect(make_conninfo(dramatiq_pg_url, dbname=name)) as conn:
            with pytest.raises(RouteError, match="none of this broker's databases"):
                with two.transaction(conn):
                    pass
    finally:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# -- the framework integrations on a RoutedBroker ----------------------------------------------------------
def test_sqlalchemys_outbox_on_a_routed_broker_sends_to_another_database_with_the_sessions_commit(
    apart: RoutedBroker,
) -> None:
    """Given a SQLAlchemy session on the first of two databases, I expect a send to a queue of the
    second inside outbox(session, router) to vanish with a rolled-back session, and with one that
    commits to be an outbox row of it in the first, moved once to the second by the relay."""
    pytest.importorskip("sqlalchemy")
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from dramatiq_pg_fenced.integrations.sqlalchemy import outbox

    first, second = apart.shards["first"], apart.shards["second"]

    @dramatiq.actor(queue_name="b", broker=apart)
    def there(what: str) -> None:
        pass

    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(first.url))
    try:
        with Session(engine) as session:
            with outbox(session, apart):
                there.send("rolled back")
            session.rollback()
        assert rows(first) == [] and rows(second) == []
        with Session(engine) as session, session.begin():
            with outbox(session, apart):
                there.send("committed")
            assert rows(first) == []
    finally:
        engine.dispose()
    assert rows(first) == [("b", "queued")] and rows(second) == []
    assert apart.relay("first") == 1
    assert rows(first) == [] and rows(second) == [("b", "queued")]


def test_sqlalchemys_fenced_transaction_on_a_routed_broker_sends_to_another_database_once(
    two: RoutedBroker, worker_of: Any, dramatiq_pg_url: str
) -> None:
    """Given an actor of the first database whose SQLAlchemy fenced_transaction(session, router) sends
    to a queue of the second and raises at its first attempt, I expect, once its retry committed,
    one outbox row in the first and nothing in the second, then one message there after the relay."""
    pytest.importorskip("sqlalchemy")
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from dramatiq_pg_fenced.integrations.sqlalchemy import fenced_transaction

    first, second = two.shards["first"], two.shards["second"]
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dramatiq_pg_url))
    attempts: Counter[int] = Counter()

    @dramatiq.actor(queue_name="b", broker=two)
    def receipt(order: int) -> None:
        pass

    @dramatiq.actor(queue_name="a", broker=two, max_retries=3, min_backoff=1, max_backoff=1)
    def pay(order: int) -> None:
        attempts[order] += 1
        with Session(engine) as session, fenced_transaction(session, two):
            receipt.send(order)
            if attempts[order] == 1:
                raise ValueError("declined, this time")

    try:
        pay.send(1)
        worker_of(first)
        wait_for(lambda: attempts[1] == 2, 30, "the retry")
        first.join("a", timeout=30_000)
    finally:
        engine.dispose()
    assert rows(second) == [] and rows(first) == [("b", "queued")]
    assert two.relay("first") == 1
    assert rows(first) == [] and rows(second) == [("b", "queued")]


def test_djangos_outbox_and_fenced_atomic_on_a_routed_broker_send_to_another_database_with_their_commit(
    apart: RoutedBroker,
) -> None:
    """Given a Django process whose connection is on the first of two databases and whose broker is a
    RoutedBroker (tests/apps/routed_django.py), I expect a send to a queue of the second inside
    outbox() to vanish when its block raises and to be an outbox row of the first when it commits,
    and one inside fenced_atomic() in an actor that raises at its first attempt to be there once,
    from the retry that committed; nothing in the second before the relay, each once after it."""
    pytest.importorskip("django")
    import os
    import subprocess
    import sys

    first, second = apart.shards["first"], apart.shards["second"]
    env = dict(os.environ, ROUTED_URL_FIRST=first.url, ROUTED_URL_SECOND=second.url,
               ROUTED_SCHEMA_FIRST=first.schema, ROUTED_SCHEMA_SECOND=second.schema)  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "tests.apps.routed_django"],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and "done 2" in run.stdout, run.stdout + run.stderr[-4000:]
    assert rows(second) == [] and rows(first) == [("b", "queued")] * 2
    assert apart.relay("first") == 2
    assert rows(first) == [] and rows(second) == [("b", "queued")] * 2
