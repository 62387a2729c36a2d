"""A message that kills its worker does not loop forever (issue 9, point 9).

Deliveries that end without any outcome (the worker crashed, or lost its
lease; a claim whose response was lost) are counted in the row's
``lost_deliveries``; at ``max_deliveries`` the message is dead-lettered with
the reason instead of being queued again.  Retries and shutdown releases are
outcomes, not lost deliveries.  Here the crashes are played by hand (leases
expired and rescued, claims whose response is lost); the real-process test
with SIGKILL is in test_faults.py.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from dramatiq.message import Message
from helpers import Factory, query, wait_for

from dramatiq_pg_fenced import DeadLetterError, PostgresBroker
from dramatiq_pg_fenced.config import DEFAULT_MAX_DELIVERIES
from dramatiq_pg_fenced.core.consumer import PostgresConsumer


def message(queue: str = "crash") -> Message[Any]:
    return Message(queue_name=queue, actor_name="nobody", args=(), kwargs={}, options={})


def row(broker: PostgresBroker, message_id: str) -> tuple[str, int, int, str | None]:
    """(state, attempt, lost_deliveries, last_error)."""
    found = query(
        broker, "SELECT state, attempt, lost_deliveries, last_error FROM {schema}.message WHERE message_id = %s",
        [message_id],
    )  # fmt: skip
    assert found, "the row is gone"
    return found[0]


def deliver(broker: PostgresBroker, consumer: PostgresConsumer) -> Any:
    return wait_for(lambda: next(consumer), 10, "a delivery")


def crash(broker: PostgresBroker, delivery: Any) -> int:
    """The worker holding *delivery* dies: its lease runs out and maintenance rescues the row."""
    broker.parts.leases.release(delivery.message_id, delivery.delivery)  # this "process" is gone
    query(
        broker,
        "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 second' WHERE message_id = %s",
        [delivery.message_id],
    )
    return broker.parts.maintenance.rescue()


#: Rescue is driven by hand here: the maintenance thread's own runs must not race it.
NO_RESCUE = {"lease_seconds": 60, "rescue_interval": 3600, "poll_interval": 0.1}


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory(**NO_RESCUE, max_deliveries=3)
    broker.declare_queue("crash")
    return broker


def test_a_message_lost_max_deliveries_times_is_dead_lettered(broker: PostgresBroker) -> None:
    sent = message()
    broker.enqueue(sent)
    consumer = broker.consume("crash", prefetch=1, timeout=100)
    for n in (1, 2):
        delivery = deliver(broker, consumer)
        assert delivery.attempt == n
        assert crash(broker, delivery) == 1
        assert row(broker, sent.message_id)[:3] == ("queued", n, n)

    delivery = deliver(broker, consumer)
    assert delivery.attempt == 3
    crash(broker, delivery)
    state, attempt, lost, error = row(broker, sent.message_id)
    assert (state, attempt, lost) == ("dead", 3, 3)
    assert error == (
        "dead-lettered after 3 deliveries without an outcome (the worker crashed or lost its lease each time; "
        "max_deliveries=3)"
    )
    assert next(consumer) is None  # never delivered again
    with pytest.raises(DeadLetterError, match="3 deliveries without an outcome"):
        broker.join("crash", fail_fast=True)
    info = broker.inspect(sent.message_id)
    assert info is not None and info["lost_deliveries"] == 3 and info["finished_at"] is not None


def test_retries_and_shutdown_releases_are_not_lost_deliveries(broker: PostgresBroker) -> None:
    """max_deliveries=3: a retry and a release at shutdown do not count; the third lost delivery
    (the sixth delivery) dead-letters the message, keeping the error of its earlier retry."""
    sent = message()
    broker.enqueue(sent)
    consumer = broker.consume("crash", prefetch=1, timeout=100)

    first = deliver(broker, consumer)
    first.stuff_exception(RuntimeError("first attempt failed"))
    first.options["traceback"] = "Traceback ...\nRuntimeError: first attempt failed"
    broker.enqueue(first, delay=0)  # Dramatiq's Retries middleware
    consumer.ack(first)
    assert broker.flush_outcomes(10)
    second = deliver(broker, consumer)
    consumer.requeue([second])  # shutdown release
    assert row(broker, sent.message_id)[:3] == ("queued", 2, 0)

    for n in (3, 4):
        crash(broker, deliver(broker, consumer))
        assert row(broker, sent.message_id)[:3] == ("queued", n, n - 2)
    crash(broker, deliver(broker, consumer))
    state, attempt, lost, error = row(broker, sent.message_id)
    assert (state, attempt, lost) == ("dead", 5, 3)
    assert error is not None and error.startswith("dead-lettered after 3 deliveries without an outcome")
    assert error.endswith("\nthe error before that: Traceback ...\nRuntimeError: first attempt failed")


def test_a_claim_whose_response_was_lost_counts_as_a_lost_delivery(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """release_unseen puts back what a claim leased unseen: that delivery ended without an outcome
    too.  With max_deliveries=1 the message is dead-lettered there, not queued."""
    broker = dramatiq_pg_broker_factory(**NO_RESCUE, max_deliveries=1)
    broker.declare_queue("crash")
    real = PostgresConsumer._claim_rows
    calls = 0

    def claim_then_lose_the_response(self: PostgresConsumer, conn: psycopg.Connection, limit: int) -> list[tuple]:
        nonlocal calls
        calls += 1
        rows = real(self, conn, limit)
        if calls == 1:
            assert rows  # the claim committed
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(PostgresConsumer, "_claim_rows", claim_then_lose_the_response)
    sent = message()
    broker.enqueue(sent)
    consumer = broker.consume("crash", prefetch=1, timeout=100)
    assert next(consumer) is None  # tried again at once on a fresh connection: it puts back what was lost
    state, attempt, lost, error = row(broker, sent.message_id)
    assert (state, attempt, lost) == ("dead", 1, 1)
    assert error is not None and error.startswith("dead-lettered after 1 delivery without an outcome")


def test_max_deliveries_none_never_dead_letters(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(**NO_RESCUE, max_deliveries=None)
    broker.declare_queue("crash")
    sent = message()
    broker.enqueue(sent)
    consumer = broker.consume("crash", prefetch=1, timeout=100)
    for n in range(1, DEFAULT_MAX_DELIVERIES + 2):
        crash(broker, deliver(broker, consumer))
        assert row(broker, sent.message_id)[:3] == ("queued", n, n)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "3"])
def test_max_deliveries_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_deliveries"):
        PostgresBroker("postgresql://nobody@127.0.0.1:1/none", max_deliveries=bad)


def test_max_deliveries_default() -> None:
    broker = PostgresBroker("postgresql://nobody@127.0.0.1:1/none")
    assert broker.max_deliveries == DEFAULT_MAX_DELIVERIES == 10
