"""``async def`` actors keep the promises of the others.

Dramatiq runs every coroutine of a worker on one event loop thread.  What the
broker keeps per delivery (the delivery itself, what ``with_ack()`` ties to it)
and per caller (an open ``batch()`` or ``transaction(conn)``) is per thread and
per asyncio task (``ContextVar``): a coroutine sees its worker thread's delivery,
and two coroutines on the loop never share an open block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.middleware.asyncio import AsyncIO
from helpers import Factory, ever_stored, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.routing import RoutedBroker


async def until(event: threading.Event, what: str) -> None:
    """Await *event*, set by another coroutine or thread, without blocking the loop."""
    for _ in range(3000):
        if event.is_set():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {what} within 30 s")


@pytest.fixture(params=["one database", "routed"])
def brokers(request: pytest.FixtureRequest, dramatiq_pg_broker_factory: Factory) -> Iterator[tuple[Any, PostgresBroker]]:
    """(the broker actors and the worker use, the database the test reads), with Dramatiq's AsyncIO."""
    if request.param == "one database":
        broker = dramatiq_pg_broker_factory()
        broker.add_middleware(AsyncIO())
        yield broker, broker
        return
    router = RoutedBroker(
        brokers={"first": dramatiq_pg_broker_factory(), "second": dramatiq_pg_broker_factory()},
        routes={"elsewhere": "second"},
        default="first",
    )
    router.add_middleware(AsyncIO())
    try:
        yield router, router.shards["first"]
    finally:
        router.close()


def test_with_ack_in_an_async_actor_sends_only_with_its_ack(brokers: tuple[Any, PostgresBroker]) -> None:
    """Given an async actor that sends inside with_ack() and fails at its first attempt, then
    succeeds, I expect the message sent once, by the attempt that was acked, and the failed
    attempt's copy dropped and counted (before: the coroutine did not see its delivery, and both
    were sent at once)."""
    broker, db = brokers
    attempts: list[int] = []

    @dramatiq.actor(broker=broker)
    def child() -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=20)
    async def flaky() -> None:
        attempts.append(1)
        with broker.with_ack():
            child.send()
        await asyncio.sleep(0)
        if len(attempts) < 2:
            raise ValueError("not yet")

    with running_worker(broker, threads=1):
        flaky.send()
        wait_for(lambda: len(attempts) >= 2, 30, "the retry")
        broker.join("default", timeout=30_000)
        assert db.flush_outcomes(10)
    assert ever_stored(db, "child") == 1
    assert db.stats()["process"]["dropped_effects"] == 1


@pytest.mark.parametrize("block", ["batch", "transaction that rolls back"])
def test_a_block_open_in_one_async_actor_never_takes_another_ones_sends(
    brokers: tuple[Any, PostgresBroker], dramatiq_pg_url: str, block: str
) -> None:
    """Given two async actors running at once on the worker's event loop, the first inside an open
    batch() or transaction(conn) (which it rolls back) while it awaits, the second sending meanwhile:
    I expect the second's message written at once and kept (before: it joined the first's block,
    in the loop thread's state, and was lost with its rollback)."""
    broker, db = brokers
    opened, sent = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}

    @dramatiq.actor(broker=broker)
    def child(who: str) -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=0)
    async def holds_a_block() -> None:
        if block == "batch":
            with broker.batch():
                child.send("first")
                opened.set()
                await until(sent, "send of the other actor")
            return
        with psycopg.connect(dramatiq_pg_url) as conn:
            with broker.transaction(conn, **({"database": "first"} if db is not broker else {})):
                child.send("first")
                opened.set()
                await until(sent, "send of the other actor")
            conn.rollback()

    @dramatiq.actor(broker=broker, max_retries=0)
    async def sends_meanwhile() -> None:
        await until(opened, "block of the other actor")
        message = child.send("second")
        seen["written at once"] = query(
            db, "SELECT count(*) FROM {schema}.message WHERE message_id = %s", [message.message_id]
        ) == [(1,)]
        sent.set()

    with running_worker(broker, threads=2):
        holds_a_block.send()
        sends_meanwhile.send()
        broker.join("default", timeout=60_000)
    assert seen == {"written at once": True}
    payloads = [
        bytes(p)
        for (p,) in query(
            db,
            "SELECT payload FROM {schema}.message WHERE actor_name = 'child'"
            " UNION ALL SELECT payload FROM {schema}.history WHERE actor_name = 'child'",
        )
    ]
    kept = sorted("first" if b'"first"' in p else "second" for p in payloads)
    assert kept == (["first", "second"] if block == "batch" else ["second"])


def test_a_fenced_transaction_in_an_async_actor_commits_with_its_ack(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given an async actor whose fenced transaction writes a row, I expect the row and the ack
    committed together (before: FencedTransactionError, no delivery seen from the coroutine)."""
    broker = dramatiq_pg_broker_factory(keep_finished=3600)
    broker.add_middleware(AsyncIO())
    query(broker, "CREATE TABLE {schema}.paid (id text PRIMARY KEY)")
    errors: list[BaseException] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    async def pay(key: str) -> None:
        try:
            with broker.fenced_transaction() as conn:
                conn.execute(f'INSERT INTO "{broker.schema}".paid VALUES (%s)', [key])
        except BaseException as e:
            errors.append(e)
            raise

    with running_worker(broker, threads=1):
        pay.send("k1")
        broker.join("default", timeout=30_000)
        assert broker.flush_outcomes(10)
    assert errors == []
    assert query(broker, "SELECT id FROM {schema}.paid") == [("k1",)]
    assert query(broker, "SELECT count(*) FROM {schema}.message") == [(0,)]
    assert query(broker, "SELECT attempt FROM {schema}.history WHERE actor_name = 'pay'") == [(1,)]


def test_an_interruptible_actor_called_from_a_coroutine_runs_as_a_plain_function(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given an async actor that calls, as a function, a thread actor declared with
    interrupt_on_cancel, I expect that call not registered for interrupts (it would be registered on
    the event loop's thread, where an interrupt lands in whichever coroutine runs), and both to run."""
    broker = dramatiq_pg_broker_factory()
    broker.add_middleware(AsyncIO())
    seen: dict[str, Any] = {}

    @dramatiq.actor(broker=broker, interrupt_on_cancel=True)
    def helper() -> str:
        here = threading.get_ident()
        seen["registered here"] = [e for e in broker.parts.interrupter._running.values() if e.thread_id == here]
        return "done"

    @dramatiq.actor(broker=broker, max_retries=0)
    async def outer() -> None:
        seen["result"] = helper()

    with running_worker(broker, threads=1):
        outer.send()
        broker.join("default", timeout=30_000)
    assert seen == {"registered here": [], "result": "done"}
