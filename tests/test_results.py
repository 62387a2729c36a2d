"""The PostgreSQL results backend: Dramatiq's documented behaviour, TTLs, NOTIFY, fencing."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from dramatiq.message import Message
from dramatiq.results import ResultFailure, ResultMissing, Results, ResultTimeout
from helpers import Factory, acked, expire_and_rescue, listening, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy
from dramatiq_pg_fenced.features.results import PostgresBackend

# -- helpers ------------------------------------------------------------------


def missing(backend: PostgresBackend, message: Any) -> bool:
    try:
        backend.get_result(message)
    except ResultMissing:
        return True
    return False


@pytest.fixture(params=["shared", "own-pool"])
def results(request: pytest.FixtureRequest, dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> Iterator:
    """(broker, backend): the backend shares the broker (results ride with acks) or has its own pool."""
    broker = dramatiq_pg_broker_factory()
    if request.param == "shared":
        backend = PostgresBackend(broker=broker)
    else:
        backend = PostgresBackend(dramatiq_pg_url, schema=broker.schema)
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)
    yield broker, backend
    backend.close()


# -- Dramatiq's documented behaviour ------------------------------------------------
def test_results_of_successful_actors(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True)
    def add(x: int, y: int) -> int:
        return x + y

    @dramatiq.actor(store_results=True)
    def nothing() -> None:
        return None

    with running_worker(broker):
        messages = [add.send(i, i) for i in range(10)]
        assert [m.get_result(block=True, timeout=20_000) for m in messages] == [2 * i for i in range(10)]
        none = nothing.send()
        assert none.get_result(block=True, timeout=20_000) is None
    # Non-blocking reads after the fact, through the message and the backend.
    assert messages[3].get_result() == 6
    assert backend.get_result(messages[4]) == 8


def test_failed_actor_raises_result_failure(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True, max_retries=0)
    def fail() -> None:
        raise ValueError("it broke")

    with running_worker(broker):
        message = fail.send()
        with pytest.raises(ResultFailure) as info:
            message.get_result(block=True, timeout=20_000)
    assert info.value.orig_exc_type == "ValueError"
    assert info.value.orig_exc_msg == "it broke"
    assert str(info.value) == "actor raised ValueError: it broke"
    assert broker.inspect(message.message_id)["state"] == "dead"  # the exception landed with the nack
    with pytest.raises(ResultFailure):
        backend.get_result(message)


def test_failed_actor_with_retries_left_stores_nothing(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results
    calls: list[int] = []

    @dramatiq.actor(store_results=True, max_retries=1, min_backoff=60_000, max_backoff=60_000)
    def flaky() -> None:
        calls.append(1)
        raise ValueError("not yet")

    with running_worker(broker):
        message = flaky.send()
        wait_for(lambda: (broker.inspect(message.message_id) or {}).get("retries") == 1, what="the retry")
        assert broker.inspect(message.message_id)["state"] == "queued"
        assert missing(backend, message)  # Dramatiq stores exceptions only once retries are exhausted
    assert calls == [1]


def test_retried_actor_stores_the_result_of_the_attempt_that_succeeded(
    results: tuple[PostgresBroker, PostgresBackend],
) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True, max_retries=3, min_backoff=10, max_backoff=20)
    def second_time_lucky() -> int:
        attempt = dramatiq.middleware.CurrentMessage.get_current_message()
        if attempt is None:  # pragma: no cover - CurrentMessage is added below
            raise RuntimeError("no current message")
        if attempt.options.get("retries", 0) == 0:
            raise ValueError("first try fails")
        return attempt.options["attempt"]

    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    with running_worker(broker):
        message = second_time_lucky.send()
        assert message.get_result(block=True, timeout=20_000) == 2
    row = query(broker, "SELECT attempt FROM {schema}.result WHERE key = %s", [backend.build_message_key(message)])
    assert row == [(2,)]


def test_result_timeout_and_missing(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True)
    def never_runs() -> int:  # pragma: no cover - no worker
        return 1

    message = never_runs.send()
    with pytest.raises(ResultMissing):
        message.get_result()
    with pytest.raises(ResultTimeout):
        message.get_result(block=True, timeout=300)
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=0)


def test_results_expire_after_their_ttl(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True, result_ttl=300)
    def short_lived() -> str:
        return "soon gone"

    with running_worker(broker):
        message = short_lived.send()
        assert message.get_result(block=True, timeout=20_000) == "soon gone"
    key = backend.build_message_key(message)
    wait_for(lambda: missing(backend, message), what="the result to expire")
    # Reading an expired result deletes it.
    assert query(broker, "SELECT count(*) FROM {schema}.result WHERE key = %s", [key]) == [(0,)]


def test_purge_deletes_only_expired_results(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results
    backend._store("kept", "a", 600_000)
    for i in range(5):
        backend._store(f"gone-{i}", i, 1)
    wait_for(lambda: query(broker, "SELECT count(*) FROM {schema}.result WHERE expires_at <= now()") == [(5,)])
    assert backend.purge() == 5
    assert query(broker, "SELECT key FROM {schema}.result") == [("kept",)]


def test_encoder_round_trip_of_structured_results(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = results

    @dramatiq.actor(store_results=True)
    def structured() -> dict[str, Any]:
        return {"list": [1, 2, 3], "nested": {"x": None, "ok": True}, "text": "é" * 10_000}

    with running_worker(broker):
        message = structured.send()
        assert message.get_result(block=True, timeout=20_000) == structured.fn()


# -- waiting ---------------------------------------------------------------------------
def test_blocking_get_is_woken_by_notify(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    """The reader polls only once an hour: only the NOTIFY can end its wait early."""
    broker = dramatiq_pg_broker_factory()
    reader = PostgresBackend(dramatiq_pg_url, schema=broker.schema, poll_interval=3600)
    writer = PostgresBackend(dramatiq_pg_url, schema=broker.schema)
    message = Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={})
    key = reader.build_message_key(message)
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(reader.get_result(message, block=True, timeout=60_000)))
    thread.start()
    try:
        wait_for(lambda: listening(reader, key), what="the waiter")
        time.sleep(0.2)  # let the listener connect; if it has not, its connect wakes the reader anyway
        writer.store_result(message, {"answer": 42}, 60_000)
        thread.join(timeout=30)  # half the reader's own timeout
        assert not thread.is_alive(), "the blocking reader was not woken by the notification"
        assert got == [{"answer": 42}]
    finally:
        thread.join()
        reader.close()
        writer.close()


def test_blocking_get_polls_without_listen(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    broker = dramatiq_pg_broker_factory()
    reader = PostgresBackend(dramatiq_pg_url, schema=broker.schema, listen=False, poll_interval=0.05)
    message = Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={})
    threading.Timer(0.3, lambda: reader.store_result(message, "polled", 60_000)).start()
    assert reader.get_result(message, block=True, timeout=30_000) == "polled"
    assert reader.database.started_doorbell(reader.channel) is None
    reader.close()


def test_long_keys_still_wake_waiters(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    """Readable keys longer than a NOTIFY payload are announced as '*'."""
    broker = dramatiq_pg_broker_factory()
    reader = PostgresBackend(dramatiq_pg_url, schema=broker.schema, poll_interval=3600, use_namespace_prefix_keys=True)
    message = Message(queue_name="default", actor_name="a" * 9000, args=(), kwargs={}, options={})
    key = reader.build_message_key(message)
    assert len(key) > 8000
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(reader.get_result(message, block=True, timeout=60_000)))
    thread.start()
    try:
        wait_for(lambda: listening(reader, key), what="the waiter")
        time.sleep(0.2)
        reader.store_result(message, "long", 60_000)
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert got == ["long"]
    finally:
        thread.join()
        reader.close()


# -- fencing -----------------------------------------------------------------------------
def _two_deliveries(factory: Factory) -> tuple[Any, ...]:
    """One message delivered twice: attempt 1 to broker A (lease then expired), attempt 2 to broker B.

    A and B are two brokers on one schema, as two worker processes would be.
    """
    a = factory()
    b = factory(schema=a.schema)
    backend_a, backend_b = PostgresBackend(broker=a), PostgresBackend(broker=b)
    a.add_middleware(Results(backend=backend_a))
    b.add_middleware(Results(backend=backend_b))

    @dramatiq.actor(broker=a, store_results=True)
    def work() -> None:  # pragma: no cover - run by hand below
        pass

    b.declare_queue("default")
    message = work.send()
    consumer_a = a.consume("default", prefetch=1, timeout=5000)
    stale = next(consumer_a)
    assert isinstance(stale, PostgresMessageProxy) and stale.attempt == 1
    # Attempt 1 stalls past its lease: it expires and is rescued, attempt 2 runs in B.
    assert expire_and_rescue(a) == 1
    consumer_b = b.consume("default", prefetch=1, timeout=5000)
    current = wait_for(lambda: next(consumer_b), what="the second delivery")
    assert current.attempt == 2
    return a, b, backend_a, backend_b, message, consumer_a, stale, consumer_b, current


def test_stale_attempt_cannot_replace_the_current_result(dramatiq_pg_broker_factory: Factory) -> None:
    a, b, backend_a, backend_b, message, consumer_a, stale, consumer_b, current = _two_deliveries(
        dramatiq_pg_broker_factory
    )
    # The current attempt finishes first.
    backend_b.store_result(current, "current", 60_000)
    consumer_b.ack(current)
    assert b.flush_outcomes(timeout=10)
    assert backend_b.get_result(message) == "current"
    stale_before = a.stats()["totals"].get("stale_writes", 0)

    # The stale attempt comes back: its result rides with its ack, which is fenced out.
    backend_a.store_result(stale, "stale", 60_000)
    consumer_a.ack(stale)
    assert a.flush_outcomes(timeout=10)
    assert backend_a.get_result(message) == "current"

    # Written directly (a backend without the broker), it is fenced on the message row.
    direct = PostgresBackend(a.url, schema=a.schema)
    direct.store_result(stale, "stale again", 60_000)
    copy = Message(**{**message.asdict(), "options": {**message.options, "attempt": 1}})
    direct.store_result(copy, "stale copy", 60_000)
    assert direct.get_result(message) == "current"
    direct.close()
    assert a.stats()["totals"]["stale_writes"] >= stale_before + 3


def test_stale_attempt_result_is_never_visible(dramatiq_pg_broker_factory: Factory) -> None:
    """The stale attempt finishes while the current one still runs: nothing of it shows."""
    a, b, backend_a, backend_b, message, consumer_a, stale, consumer_b, current = _two_deliveries(
        dramatiq_pg_broker_factory
    )
    backend_a.store_result(stale, "stale", 60_000)
    consumer_a.ack(stale)
    assert a.flush_outcomes(timeout=10)
    assert missing(backend_a, message)
    # A stale stored exception (after a stale nack) is fenced out too.
    consumer_a.nack(stale)
    backend_a.store_exception(stale, ValueError("stale failure"), 60_000)
    assert a.flush_outcomes(timeout=10)
    assert missing(backend_a, message)
    assert b.inspect(message.message_id)["state"] == "running"
    assert b.inspect(message.message_id)["attempt"] == 2

    backend_b.store_result(current, "current", 60_000)
    consumer_b.ack(current)
    assert b.flush_outcomes(timeout=10)
    assert backend_a.get_result(message) == "current"


def _one_delivery(factory: Factory) -> tuple[PostgresBroker, PostgresBackend, Message, Any, Any]:
    """A broker with the backend, one message sent and delivered (by hand): broker, backend, message,
    consumer, delivery."""
    broker = factory()
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))

    @dramatiq.actor(broker=broker, store_results=True)
    def work() -> None:  # pragma: no cover - run by hand below
        pass

    message = work.send()
    consumer = broker.consume("default", prefetch=1, timeout=5000)
    proxy = wait_for(lambda: next(consumer), what="the delivery")
    return broker, backend, message, consumer, proxy


def test_result_commits_with_the_ack(dramatiq_pg_broker_factory: Factory) -> None:
    """With broker=, the result waits for the ack of its attempt and lands in the same transaction."""
    broker, backend, message, consumer, proxy = _one_delivery(dramatiq_pg_broker_factory)
    backend.store_result(proxy, "done", 60_000)
    assert missing(backend, message)  # not before the ack...
    assert broker.inspect(message.message_id)["state"] == "running"
    consumer.ack(proxy)
    assert broker.flush_outcomes(timeout=10)
    assert acked(broker, message.message_id)  # ...and with it
    assert backend.get_result(message) == "done"


def test_cancelled_running_message_stores_no_result(dramatiq_pg_broker_factory: Factory) -> None:
    broker, backend, message, consumer, proxy = _one_delivery(dramatiq_pg_broker_factory)
    broker.cancel(message.message_id)  # the row keeps attempt 1, in state 'cancelled'
    backend.store_result(proxy, "too late", 60_000)
    consumer.ack(proxy)
    assert broker.flush_outcomes(timeout=10)
    direct = PostgresBackend(broker.url, schema=broker.schema)
    direct.store_result(proxy, "too late, directly", 60_000)
    direct.store_exception(proxy, ValueError("too late"), 60_000)
    assert query(broker, "SELECT count(*) FROM {schema}.result") == [(0,)]
    for reader in (backend, direct):  # nothing stored; a reader is told the message was cancelled
        with pytest.raises(ResultFailure) as failure:
            reader.get_result(message)
        assert failure.value.orig_exc_type == "MessageCancelled"
    direct.close()


def test_follow_up_messages_find_the_result(results: tuple[PostgresBroker, PostgresBackend]) -> None:
    """Dramatiq stores the result before on_success is enqueued; the callback can read it at once."""
    broker, backend = results
    seen: list[Any] = []

    @dramatiq.actor(store_results=True)
    def square(x: int) -> int:
        return x * x

    @dramatiq.actor
    def check(message_data: dict[str, Any], result: int) -> None:
        try:
            stored = Message(**message_data).get_result(backend=backend)  # no blocking
        except ResultMissing:
            stored = "missing"
        seen.append((result, stored))

    with running_worker(broker):
        for i in range(20):
            square.send_with_options(args=(i,), on_success=check)
        wait_for(lambda: len(seen) == 20, what="the callbacks")
    assert sorted(seen) == [(i * i, i * i) for i in range(20)]


# -- processes ----------------------------------------------------------------------------
def _read_in_child(backend: PostgresBackend, message: Message, out: Any) -> None:
    try:
        out.put(("ok", backend.get_result(message, block=True, timeout=20_000)))
    except BaseException as e:  # pragma: no cover - reported to the parent
        out.put(("error", repr(e)))


def test_backend_survives_fork(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    """Pool and listener are made again in a forked child (as under the dramatiq CLI or a preloading server)."""
    broker = dramatiq_pg_broker_factory()
    backend = PostgresBackend(dramatiq_pg_url, schema=broker.schema)
    message = Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={})
    backend.store_result(message, "from the parent", 60_000)
    assert backend.get_result(message, block=True) == "from the parent"  # the parent's pool and listener exist
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(backend, message, out))
    child.start()
    try:
        assert out.get(timeout=30) == ("ok", "from the parent")
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert backend.get_result(message) == "from the parent"  # the parent's connections still work
    backend.close()


def test_schema_must_match_the_broker(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory()
    with pytest.raises(ValueError, match="schema"):
        PostgresBackend(broker=broker, schema="elsewhere")


def test_closing_the_broker_stops_the_listener_of_a_backend_on_its_pool(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory()
    backend = PostgresBackend(broker=broker)
    broker.declare_queue("default")
    message = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
    with pytest.raises(ResultTimeout):
        backend.get_result(message, block=True, timeout=200)  # starts the backend's LISTEN thread

    def listening() -> bool:
        return any(t.name == f"dramatiq-pg-{backend.channel}" for t in threading.enumerate())

    assert listening()
    broker.close()
    wait_for(lambda: not listening(), 10, "the backend's listener to stop")
