"""A refused write at shutdown says why it was refused, read from the row as it is now (issue 41, point 4)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from dramatiq.message import Message
from helpers import wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker


def _delivered(broker: PostgresBroker) -> tuple[Any, Any]:
    broker.declare_queue("words")
    broker.enqueue(Message(queue_name="words", actor_name="nobody", args=(), kwargs={}, options={}))
    consumer = broker.consume("words", prefetch=1, timeout=100)
    return consumer, wait_for(lambda: next(consumer), 30, "a delivery")


def test_a_requeue_at_shutdown_of_a_message_its_own_delivery_acked_says_the_row_is_finished_not_another_attempt(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    dramatiq_pg_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a message that ran once, under attempt 1, and whose ack was written, I expect a requeue of
    that delivery at shutdown to be refused with words that do not blame another attempt."""
    broker = dramatiq_pg_broker_factory()
    consumer, proxy = _delivered(broker)
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:  # its ack, written by its writer meanwhile
        conn.execute(
            sql.SQL("DELETE FROM {}.message WHERE message_id = %s").format(sql.Identifier(broker.schema)),
            [proxy.message_id],
        )
    with caplog.at_level(logging.WARNING):
        consumer.requeue([proxy])
    text = " ".join(r.getMessage() for r in caplog.records if "Stale requeue" in r.getMessage())
    assert text, caplog.text
    assert "another attempt" not in text
    assert "the row is gone: the message is finished" in text


def test_a_requeue_at_shutdown_of_a_message_redelivered_elsewhere_names_the_attempt_that_holds_it(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    dramatiq_pg_url: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Given a delivery whose message was since delivered again elsewhere (attempt 2, another token), I
    expect its requeue at shutdown to say the message was redelivered and which attempt holds it."""
    broker = dramatiq_pg_broker_factory()
    consumer, proxy = _delivered(broker)
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.message SET attempt = attempt + 1, delivery = gen_random_uuid() WHERE message_id = %s"
            ).format(sql.Identifier(broker.schema)),
            [proxy.message_id],
        )
    with caplog.at_level(logging.WARNING):
        consumer.requeue([proxy])
    text = " ".join(r.getMessage() for r in caplog.records if "Stale requeue" in r.getMessage())
    assert "redelivered: attempt 2 holds it now ('running')" in text, caplog.text
