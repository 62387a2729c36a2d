"""Outcomes the database refuses, and retries that cannot be built: nothing is dropped, nothing loops.

A delivery's outcome (ack, nack, retry, result) whose text PostgreSQL cannot
store, or that the database refuses for any other reason, must not take the
other outcomes of its batch down, and must not leave its own message to be
redelivered forever.  Refusals are provoked with NUL bytes and lone
surrogates (which no text column takes) and with test triggers that raise.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage
from dramatiq.results import ResultFailure, Results
from helpers import Factory, acked, query, running_worker, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.features.results import PostgresBackend


def refuse(broker: PostgresBroker, table: str, when: str, events: str = "INSERT OR UPDATE") -> None:
    """A trigger that makes the database refuse writes of *table* rows matching *when*."""
    query(
        broker,
        "CREATE OR REPLACE FUNCTION {schema}.refuse() RETURNS trigger LANGUAGE plpgsql AS $$"
        " BEGIN RAISE EXCEPTION 'refused by a test trigger'; END $$",
    )
    query(
        broker,
        f"CREATE TRIGGER refuse BEFORE {events} ON {{schema}}.{table} FOR EACH ROW WHEN ({when})"
        " EXECUTE FUNCTION {schema}.refuse()",
    )


def state(broker: PostgresBroker, message_id: str) -> str | None:
    info = broker.inspect(message_id)
    return None if info is None else info["state"]


def settle_down(broker: PostgresBroker) -> None:
    """Wait past a lease and a rescue: a delivery whose outcome was lost would run again by then."""
    assert broker.flush_outcomes(10)
    time.sleep(broker.lease_seconds + broker.rescue_interval + 0.5)


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    """A short lease, so an outcome that was lost shows as a second run within the test."""
    broker = dramatiq_pg_broker_factory(lease_seconds=2, rescue_interval=0.2, poll_interval=0.1)
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    return broker


# -- text PostgreSQL cannot store ---------------------------------------------------------------
@pytest.mark.parametrize("bad", ["a NUL \x00 byte", "a lone \ud800 surrogate"], ids=["nul", "surrogate"])
def test_an_error_text_postgres_cannot_store_takes_nothing_down(broker: PostgresBroker, bad: str) -> None:
    """The failing actor's retries are counted (it runs 1 + max_retries times, then is dead), and
    the 30 other messages that shared its batches each run exactly once."""
    runs: Counter[Any] = Counter()

    @dramatiq.actor(max_retries=2, min_backoff=10, max_backoff=20)
    def poison() -> None:
        runs["poison"] += 1
        raise ValueError(f"bad text: {bad}")

    @dramatiq.actor
    def fine(n: int) -> None:
        time.sleep(0.005)
        runs[n] += 1

    poisoned = poison.send()
    for n in range(30):
        fine.send(n)
    with running_worker(broker, threads=4):
        wait_for(lambda: state(broker, poisoned.message_id) == "dead", 30, "the poisoned message to be dead")
        broker.join("default", timeout=30_000, fail_fast=False)
        settle_down(broker)
    assert runs["poison"] == 3
    assert {n: runs[n] for n in range(30)} == dict.fromkeys(range(30), 1)
    info = broker.inspect(poisoned.message_id)
    assert info is not None and info["attempt"] == 3
    assert "bad text: a " in info["last_error"] and "\ufffd" in info["last_error"]
    assert "\x00" not in info["last_error"]
    assert query(broker, "SELECT count(*) FROM {schema}.message WHERE state <> 'dead'") == [(0,)]


# -- outcomes the database refuses ----------------------------------------------------------------
def test_a_refused_nack_is_isolated_and_dead_lettered_with_a_reason(broker: PostgresBroker) -> None:
    """One batch: four acks and a nack whose error a trigger refuses.  The acks apply; the nack,
    written alone, is refused again, and its message is dead-lettered with a reason that says so."""
    refuse(broker, "message", "NEW.last_error LIKE '%refuse-me%'", events="UPDATE")
    broker.declare_queue("default")
    messages = [
        dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={}) for _ in range(5)
    ]
    broker.enqueue_many(messages)
    consumer = broker.consume("default", prefetch=5, timeout=100)
    delivered = []
    while len(delivered) < 5:
        delivered.append(wait_for(lambda: next(consumer), 10, "a delivery"))
    bad, *good = delivered
    bad.stuff_exception(RuntimeError("refuse-me, please"))
    writer = broker.parts.writer
    with writer._cond:  # hold the writer so that all five are one batch
        consumer.nack(bad)
        for proxy in good:
            consumer.ack(proxy)
    assert broker.flush_outcomes(10)
    for proxy in good:
        assert acked(broker, proxy.message_id)
    info = broker.inspect(bad.message_id)
    assert info is not None and info["state"] == "dead" and info["attempt"] == 1
    assert "could not be stored" in info["last_error"]
    assert "refused by a test trigger" in info["last_error"]
    assert broker.parts.leases.snapshot() == {}
    settle_down(broker)
    assert broker.inspect(bad.message_id)["state"] == "dead"  # type: ignore[index]


@pytest.mark.parametrize("part", ["payload", "error"])
def test_a_retry_the_database_refuses_is_dead_lettered_not_looped(broker: PostgresBroker, part: str) -> None:
    """A retry whose new payload (or error text) the database refuses: the message is dead-lettered
    with the reason after its one run; the messages around it run once each."""
    if part == "payload":
        when = "NEW.payload <> OLD.payload AND position(convert_to('refuse-retry', 'UTF8') in NEW.payload) > 0"
    else:
        when = "NEW.state = 'queued' AND NEW.last_error LIKE '%refuse-retry%'"
    refuse(broker, "message", when, events="UPDATE")
    runs: Counter[Any] = Counter()

    @dramatiq.actor(max_retries=3, min_backoff=10, max_backoff=20)
    def flaky(text: str) -> None:
        runs["flaky"] += 1
        raise RuntimeError(text)

    @dramatiq.actor
    def fine(n: int) -> None:
        runs[n] += 1

    retried = flaky.send("refuse-retry")
    for n in range(20):
        fine.send(n)
    with running_worker(broker, threads=4):
        wait_for(lambda: state(broker, retried.message_id) == "dead", 30, "the refused retry to be dead-lettered")
        broker.join("default", timeout=30_000, fail_fast=False)
        settle_down(broker)
    assert runs["flaky"] == 1
    assert {n: runs[n] for n in range(20)} == dict.fromkeys(range(20), 1)
    info = broker.inspect(retried.message_id)
    assert info is not None and info["attempt"] == 1
    assert info["last_error"].startswith("the retry of attempt 1 could not be stored")
    assert "refused by a test trigger" in info["last_error"]


def test_a_refused_dead_letter_is_written_again_not_dropped(broker: PostgresBroker) -> None:
    """While the database refuses every write of one row (its dead letter included), the writer
    keeps trying; the other messages flow; once the refusal ends, the dead letter lands."""
    broker.declare_queue("default")
    bad_message = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(bad_message)
    refuse(broker, "message", f"NEW.message_id = '{bad_message.message_id}' AND NEW.state <> 'running'", "UPDATE")
    consumer = broker.consume("default", prefetch=5, timeout=100)
    bad = wait_for(lambda: next(consumer), 10, "a delivery")
    bad.stuff_exception(RuntimeError("fails"))
    consumer.nack(bad)
    time.sleep(1.0)
    assert state(broker, bad_message.message_id) == "running"  # refused, and held: not redelivered
    others = [dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={}) for _ in range(3)]
    broker.enqueue_many(others)
    for _ in others:
        consumer.ack(wait_for(lambda: next(consumer), 10, "a delivery"))
    wait_for(lambda: all(acked(broker, m.message_id) for m in others), 10, "the other acks")
    time.sleep(broker.lease_seconds)  # the refused row's lease is kept while its outcome waits
    assert broker.inspect(bad_message.message_id)["attempt"] == 1  # type: ignore[index]
    query(broker, "DROP TRIGGER refuse ON {schema}.message")
    assert broker.flush_outcomes(15)
    info = broker.inspect(bad_message.message_id)
    assert info is not None and (info["state"], info["attempt"]) == ("dead", 1)
    assert "could not be stored" in info["last_error"]
    assert broker.parts.leases.snapshot() == {}


# -- results the database refuses ---------------------------------------------------------------
@pytest.mark.parametrize("outcome", ["result", "exception"])
def test_a_result_the_database_refuses_becomes_a_stored_failure(broker: PostgresBroker, outcome: str) -> None:
    """The ack (or nack) stands; in place of the refused result, get_result raises ResultFailure
    saying the result could not be stored.  The other results of the batch are stored."""
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    refuse(broker, "result", "position(convert_to('refuse-result', 'UTF8') in NEW.data) > 0")
    runs: Counter[Any] = Counter()

    @dramatiq.actor(store_results=True, max_retries=0)
    def answer(text: str) -> str:
        runs[text] += 1
        if text == "refuse-result" and outcome == "exception":
            raise RuntimeError(text)
        return text

    refused = answer.send("refuse-result")
    others = [answer.send(f"fine {n}") for n in range(10)]
    with running_worker(broker, threads=4):
        with pytest.raises(ResultFailure, match="could not be stored"):
            refused.get_result(block=True, timeout=20_000)
        assert [m.get_result(block=True, timeout=20_000) for m in others] == [f"fine {n}" for n in range(10)]
        settle_down(broker)
    assert runs == Counter({"refuse-result": 1, **{f"fine {n}": 1 for n in range(10)}})
    assert state(broker, refused.message_id) == ("done" if outcome == "result" else "dead")


# -- the retry path cannot strand a message (issue 9, point 7) --------------------------------------
def test_a_retry_that_cannot_be_encoded_is_dead_lettered(broker: PostgresBroker) -> None:
    """A middleware (here the actor) leaves something in the options the encoder cannot encode:
    the retry cannot be built.  The message is dead-lettered with the reason at once; it is not
    held (its lease extended) until the process exits, nor acked unrun."""

    @dramatiq.actor(max_retries=3, min_backoff=10, max_backoff=20)
    def unencodable() -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        message.options["handle"] = object()  # not JSON
        raise RuntimeError("fails, to be retried")

    sent = unencodable.send()
    with running_worker(broker, threads=2):
        wait_for(lambda: state(broker, sent.message_id) == "dead", 15, "the unencodable retry to be dead-lettered")
        assert broker.flush_outcomes(10)
        wait_for(lambda: broker.parts.leases.snapshot() == {}, 10, "the delivery to be released")
    info = broker.inspect(sent.message_id)
    assert info is not None and info["attempt"] == 1
    assert info["last_error"].startswith("the retry of attempt 1 could not be built: TypeError")
    assert "fails, to be retried" in info["last_error"]


# -- making text storable -----------------------------------------------------------------------
def test_storable_text_examples() -> None:
    from dramatiq_pg_fenced.core.outcomes import MAX_ERROR_BYTES, storable_text

    assert storable_text(None) is None
    assert storable_text("plain") == "plain"
    assert storable_text("a\x00b") == "a\ufffdb"
    assert storable_text("a\ud800b") == "a\ufffdb"
    assert storable_text("\ud83d\ude00") == "\U0001f600"  # a surrogate pair is one character
    long = "head " + "é" * MAX_ERROR_BYTES + " tail"
    cut = storable_text(long)
    assert cut is not None and len(cut.encode()) <= MAX_ERROR_BYTES
    assert cut.startswith("head ") and cut.endswith(" tail") and "bytes cut" in cut


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec=None), max_size=300), st.integers(min_value=64, max_value=400))
def test_storable_text_is_always_storable(text: str, limit: int) -> None:
    from dramatiq_pg_fenced.core.outcomes import storable_text

    out = storable_text(text, limit)
    assert out is not None
    encoded = out.encode("utf-8")  # no lone surrogates
    assert b"\x00" not in encoded and len(encoded) <= limit
    if "\x00" not in text and len(text.encode("utf-8", "surrogatepass")) <= limit:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            pass
        else:
            assert out == text  # storable text is left alone
