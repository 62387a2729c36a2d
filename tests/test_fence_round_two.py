"""The fence holds, round two (issue 21): what a hostile review broke, each as a test.

- a fenced-out delivery's exception never becomes the message's stored result;
- what the actor sends inside ``with broker.with_ack():`` is sent only with an ack:
  a retry or a dead letter drops it (counted);
- the innermost explicit transaction decides: a send inside ``broker.transaction(conn)``
  commits or rolls back with *conn*, whatever block it sits in.
"""

from __future__ import annotations

import threading
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.results import ResultFailure, Results
from helpers import Factory, ever_stored, expire_and_rescue, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.features.results import PostgresBackend


def with_results(broker: PostgresBroker) -> PostgresBackend:
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend, store_results=True))
    return backend



# -- 1. a stale delivery's error is not the message's result ------------------------------------------


def test_a_fenced_out_deliverys_error_never_becomes_the_result_of_a_message_the_rescuer_dead_lettered(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given a worker paused past its lease and a rescuer that dead-letters the message (max_deliveries=1),
    when the late worker fails and its nack is fenced out, I expect no stored exception of its own:
    get_result raises the rescuer's reason, not the stale worker's error."""
    broker = dramatiq_pg_broker_factory(max_deliveries=1, keep_finished=3600)
    backend = with_results(broker)
    started, go = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, max_retries=0)
    def slow() -> None:
        started.set()
        go.wait(30)
        raise ValueError("the stale worker's error")

    with running_worker(broker, threads=1):
        message = slow.send()
        wait_for(started.is_set, 30, "the actor to start")
        # The worker "pauses" past its lease: the rescuer finds it expired and, at max_deliveries, dead-letters it.
        assert expire_and_rescue(broker) == 1
        go.set()  # the late worker fails; its nack is fenced out
        wait_for(lambda: broker.stats()["totals"].get("stale_writes", 0) >= 1, 30, "the stale nack")
        assert broker.flush_outcomes(10)
    state, error = query(broker, "SELECT state, last_error FROM {schema}.message")[0]
    assert state == "dead" and "max_deliveries=1" in error and "stale worker" not in error
    with pytest.raises(ResultFailure) as failure:
        backend.get_result(message)
    assert "stale worker" not in str(failure.value)
    assert "max_deliveries" in str(failure.value)  # the rescuer's own reason
    assert query(broker, "SELECT count(*) FROM {schema}.result") == [(0,)]


def test_the_stored_exception_rides_with_the_nack_that_dead_letters_the_message(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given an actor that always fails, I expect its exception stored in the nack's own transaction:
    a reader that sees the message dead sees its exception, never a gap."""
    broker = dramatiq_pg_broker_factory()
    backend = with_results(broker)

    @dramatiq.actor(broker=broker, max_retries=0)
    def fails() -> None:
        raise ValueError("boom")

    submitted: list[Any] = []
    writer_submit = broker.parts.writer.submit
    broker.parts.writer.submit = lambda o: (submitted.append(o), writer_submit(o))[1]  # type: ignore[method-assign]
    with running_worker(broker, threads=1):
        message = fails.send()
        broker.join("default", timeout=10_000, fail_fast=False)
        assert broker.flush_outcomes(10)
    assert [o.kind.value for o in submitted] == ["nack"]  # one outcome, the exception with it
    assert submitted[0].result is not None
    with pytest.raises(ResultFailure) as failure:
        backend.get_result(message)
    assert (failure.value.orig_exc_type, failure.value.orig_exc_msg) == ("ValueError", "boom")
    assert query(broker, "SELECT count(*) FROM {schema}.result") == [(1,)]


# -- 2. with_ack() sends wait for an ack, not for any outcome ------------------------------------------


def test_with_ack_sends_ride_only_the_ack_not_the_retries_before_it(dramatiq_pg_broker_factory: Factory) -> None:
    """Given an actor that fails twice, then succeeds, sending a message inside with_ack() on each attempt,
    I expect that message sent once (with the ack) and the two retries' copies dropped and counted."""
    broker = dramatiq_pg_broker_factory()
    attempts: list[int] = []

    @dramatiq.actor(broker=broker)
    def child() -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=5, min_backoff=10, max_backoff=20)
    def flaky() -> None:
        attempts.append(1)
        with broker.with_ack():
            child.send()
        if len(attempts) < 3:
            raise ValueError("not yet")

    with running_worker(broker, threads=1):
        flaky.send()
        wait_for(lambda: len(attempts) >= 3, 30, "three attempts")
        broker.join("default", timeout=10_000)
        assert broker.flush_outcomes(10)
    assert ever_stored(broker, "child") == 1
    assert broker.stats()["process"]["dropped_effects"] == 2


def test_with_ack_sends_of_a_dead_lettered_delivery_are_dropped(dramatiq_pg_broker_factory: Factory) -> None:
    """Given an actor that always fails and is never acked, I expect nothing it sent inside with_ack()."""
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def child() -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=0)
    def doomed() -> None:
        with broker.with_ack():
            child.send()
        raise ValueError("never acked")

    with running_worker(broker, threads=1):
        doomed.send()
        broker.join("default", timeout=10_000, fail_fast=False)
        assert broker.flush_outcomes(10)
    assert ever_stored(broker, "child") == 0
    assert query(broker, "SELECT state FROM {schema}.message WHERE actor_name = 'doomed'") == [("dead",)]
    assert broker.stats()["process"]["dropped_effects"] == 1


def test_the_middlewares_effects_still_ride_any_outcome(dramatiq_pg_broker_factory: Factory) -> None:
    """An on_failure callback (Dramatiq's way to send on failure) is still written with the dead letter."""
    broker = dramatiq_pg_broker_factory()  # Dramatiq's Callbacks middleware is among the defaults

    @dramatiq.actor(broker=broker)
    def on_failure(message: Any, error: Any) -> None:
        pass

    @dramatiq.actor(broker=broker, max_retries=0, on_failure="on_failure")
    def doomed() -> None:
        raise ValueError("dead")

    with running_worker(broker, threads=1):
        doomed.send()
        broker.join("default", timeout=10_000, fail_fast=False)
        assert broker.flush_outcomes(10)
    assert ever_stored(broker, "on_failure") == 1
    assert broker.stats()["process"]["dropped_effects"] == 0


# -- 3. the innermost explicit transaction decides ------------------------------------------------------


def test_a_rolled_back_outbox_inside_with_ack_sends_nothing(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    """Given with_ack() around broker.transaction(conn) whose caller rolls back, I expect no message, ever."""
    broker = dramatiq_pg_broker_factory()
    done = threading.Event()

    @dramatiq.actor(broker=broker)
    def child(tag: str) -> None:
        pass

    @dramatiq.actor(broker=broker)
    def parent() -> None:
        with broker.with_ack(), psycopg.connect(dramatiq_pg_url) as conn:
            with broker.transaction(conn):
                child.send("rolled back")
            conn.rollback()
            with broker.transaction(conn):
                child.send("committed")
            conn.commit()
        done.set()

    with running_worker(broker, threads=1):
        parent.send()
        wait_for(done.is_set, 30, "the parent")
        broker.join("default", timeout=10_000)
        assert broker.flush_outcomes(10)
    assert ever_stored(broker, "child") == 1
    tags = query(broker, "SELECT payload FROM {schema}.history WHERE actor_name = 'child'")
    assert b"committed" in bytes(tags[0][0])


def test_a_batch_around_an_outbox_does_not_take_its_sends_out_of_the_callers_transaction(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job(tag: str) -> None:
        pass

    with broker.batch(), psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            job.send("rolled back")
        conn.rollback()
    assert ever_stored(broker, "job") == 0


def test_with_ack_inside_an_outbox_transaction_is_refused(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    """with_ack() inside broker.transaction(conn) would send with the ack whatever the caller's transaction
    does: refused with a clear error, before anything is sent."""
    from dramatiq_pg_fenced.errors import NestedSendError

    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    with psycopg.connect(dramatiq_pg_url) as conn, broker.transaction(conn):
        with pytest.raises(NestedSendError, match="transaction"), broker.with_ack():
            job.send()
    assert ever_stored(broker, "job") == 0


def test_an_exception_whose_text_no_column_takes_still_rides_its_nack(dramatiq_pg_broker_factory: Factory) -> None:
    """One more hostile input than the issue named: a NUL byte and a lone surrogate in the exception
    that rides the dead letter.  The nack applies, the message is dead, and get_result raises it."""
    broker = dramatiq_pg_broker_factory()
    backend = with_results(broker)

    @dramatiq.actor(broker=broker, max_retries=0)
    def nasty() -> None:
        raise ValueError("nul \x00 and a lone \ud800 surrogate")

    with running_worker(broker, threads=1):
        message = nasty.send()
        broker.join("default", timeout=10_000, fail_fast=False)
        assert broker.flush_outcomes(10)
    assert query(broker, "SELECT state FROM {schema}.message") == [("dead",)]
    with pytest.raises(ResultFailure) as failure:
        backend.get_result(message)
    assert failure.value.orig_exc_type == "ValueError" and "surrogate" in failure.value.orig_exc_msg
