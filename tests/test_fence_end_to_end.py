"""The fence holds end to end: tokens unique per delivery, effects tied to the ack,
cancel before start, eta, re-sends, close and join (issue "The fence holds end to end")."""

from __future__ import annotations

from typing import Any

import dramatiq
import pytest
from helpers import Factory, query, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.delivery import PostgresMessageProxy


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


def expire_and_rescue(broker: PostgresBroker) -> None:
    query(broker, "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 second' WHERE state = 'running'")
    assert broker.parts.maintenance.rescue() >= 1


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
    assert b.flush_outcomes(10) and b.inspect(first.message_id) is None

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
    assert b.flush_outcomes(10) and b.inspect(first.message_id) is None
