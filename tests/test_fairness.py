"""Fair shares between keys (issue 44): a queue whose actor declares ``fairness_key`` is claimed by
weighted round robin across keys, on a real database.

Claims are made through the broker's own consumer (its claim statement on a connection of the
broker's pool, as a worker's consumer makes them), so each test sees which rows a claim of a
given size takes.  No timings: only which rows, in which claims.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import pytest
from helpers import expire_and_rescue, query, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import floor as floors
from dramatiq_pg_fenced.core.consumer import PostgresConsumer
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy
from dramatiq_pg_fenced.core.floor import HEAD
from dramatiq_pg_fenced.errors import FairnessOptionError

Q = "fair"
PLAIN = "plain"


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> Iterator[PostgresBroker]:
    broker = dramatiq_pg_broker_factory(lease_seconds=30, rescue_interval=3600, poll_interval=0.05)
    dramatiq.set_broker(broker)
    yield broker


@pytest.fixture
def tenant_job(broker: PostgresBroker) -> dramatiq.Actor:
    @dramatiq.actor(queue_name=Q, fairness_key=lambda tenant, n=0: tenant)
    def tenant_job(tenant: str, n: int = 0) -> None:
        pass

    return tenant_job


def claim(consumer: PostgresConsumer, limit: int) -> list[str]:
    """The ids one claim of at most *limit* rows takes (the consumer's own claim statement)."""
    with consumer.database.connection(raw=True) as conn:
        return [r[0] for r in consumer._claim_rows(conn, limit)]


def keys_of(broker: PostgresBroker, ids: list[str]) -> list[str | None]:
    found = dict(
        query(
            broker,
            "SELECT message_id::text, fairness_key FROM {schema}.message WHERE message_id = ANY(%s::uuid[])",
            [ids],
        )
    )
    return [found[i] for i in ids]


def send(actor: dramatiq.Actor, tenant: str, count: int) -> None:
    with actor.broker.batch():
        for n in range(count):
            actor.send(tenant, n)


def test_a_flood_of_one_key_does_not_delay_the_others(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given key A flooding the queue with 1000 messages, then keys B..E sending 10 each, I expect the
    first claims to interleave B..E with A: a claim of 10 takes two of each, and the first 50 claimed
    rows hold all of B..E's 40 messages and only 10 of A's."""
    send(tenant_job, "A", 1000)
    for key in "BCDE":
        send(tenant_job, key, 10)
    consumer = broker.consume(Q)
    first = Counter(keys_of(broker, claim(consumer, 10)))
    assert first == {"A": 2, "B": 2, "C": 2, "D": 2, "E": 2}
    taken = Counter(first)
    for _ in range(4):
        taken.update(keys_of(broker, claim(consumer, 10)))
    assert taken == {"A": 10, "B": 10, "C": 10, "D": 10, "E": 10}
    # B..E are done: A alone gets whole claims (work-conserving).
    assert Counter(keys_of(broker, claim(consumer, 16))) == {"A": 16}


def test_weights_3_to_1_give_shares_of_3_to_1_over_claims(broker: PostgresBroker) -> None:
    """Given two busy keys of weights 3 (by the actor's callable) and 1 (the default), I expect every
    claim of 16 rows to give them 12 and 4, claim after claim, while both have rows due; and a weight
    from the queue's fairness_weight table to count as the callable's does."""

    @dramatiq.actor(
        queue_name=Q, fairness_key=lambda tenant, n=0: tenant, fairness_weight=lambda key: 3 if key == "big" else None
    )
    def weighted(tenant: str, n: int = 0) -> None:
        pass

    send(weighted, "big", 300)
    send(weighted, "small", 300)
    consumer = broker.consume(Q)
    for _ in range(5):
        assert Counter(keys_of(broker, claim(consumer, 16))) == {"big": 12, "small": 4}

    query(broker, "INSERT INTO {schema}.fairness_weight VALUES (%s, 'x', 3)", [Q])
    send(weighted, "x", 300)
    send(weighted, "y", 300)
    query(broker, "DELETE FROM {schema}.message WHERE fairness_key IN ('big', 'small')")
    for _ in range(5):
        assert Counter(keys_of(broker, claim(consumer, 16))) == {"x": 12, "y": 4}


def test_a_lone_key_gets_the_whole_queue_in_the_usual_order(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given one key alone, I expect every claim to be full, in send order (nothing kept for idle keys)."""
    send(tenant_job, "only", 40)
    sent = [r[0] for r in query(broker, "SELECT message_id::text FROM {schema}.message ORDER BY seq")]
    consumer = broker.consume(Q)
    assert [set(claim(consumer, n)) for n in (16, 16, 8)] == [set(sent[:16]), set(sent[16:32]), set(sent[32:])]


def test_an_idle_key_saves_up_no_credit(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given key B served 50 times long ago and key A flooding since, I expect B's next messages to
    share claims with A's from then on, not to take whole claims to catch up."""
    send(tenant_job, "B", 50)
    consumer = broker.consume(Q)
    for _ in range(5):
        claim(consumer, 10)
    send(tenant_job, "A", 500)
    for _ in range(10):
        claim(consumer, 10)
    send(tenant_job, "B", 20)
    assert Counter(keys_of(broker, claim(consumer, 10))) == {"A": 5, "B": 5}


def test_without_a_fair_actor_the_claim_is_todays(broker: PostgresBroker) -> None:
    """Given a queue whose actors declare no fairness_key, I expect its rows to carry no key nor tag,
    the usual claim statement, and claims in today's order (priority, then send order)."""

    @dramatiq.actor(queue_name=PLAIN)
    def plain(n: int) -> None:
        pass

    @dramatiq.actor(queue_name=PLAIN, priority=-5)
    def urgent(n: int) -> None:
        pass

    with broker.batch():
        for n in range(10):
            plain.send(n)
        for n in range(3):
            urgent.send(n)
    assert query(
        broker, "SELECT count(*) FROM {schema}.message WHERE fairness_key IS NOT NULL OR fair_tag IS NOT NULL"
    ) == [(0,)]
    sent = query(broker, "SELECT message_id::text FROM {schema}.message ORDER BY priority, seq")
    consumer = broker.consume(PLAIN)
    assert consumer.fair is False
    assert consumer._statement(fair=consumer.fair, telling=False) in (
        broker.statements.claim,
        broker.statements.claim_relaxed,
    )
    order = [r[0] for r in sent]
    assert [set(claim(consumer, n)) for n in (8, 8)] == [set(order[:8]), set(order[8:])]


def test_priorities_are_respected_within_a_key(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given key A's 20 low-priority messages, then its 3 urgent ones (an actor of priority -1 in the
    same queue, same key), and key B's 20, I expect A's urgent messages in the first claim, taking A's
    slots, not B's: the claim of 6 takes A's 3 urgent ones and 3 of B's."""

    @dramatiq.actor(queue_name=Q, priority=-1, fairness_key=lambda tenant, n=0: tenant)
    def urgent(tenant: str, n: int = 0) -> None:
        pass

    send(tenant_job, "A", 20)
    send(tenant_job, "B", 20)
    send(urgent, "A", 3)
    consumer = broker.consume(Q)
    ids = claim(consumer, 6)
    found = dict(
        query(
            broker,
            "SELECT message_id::text, (fairness_key, actor_name)::text FROM {schema}.message WHERE message_id = ANY(%s::uuid[])",
            [ids],
        )
    )
    assert Counter(found.values()) == {"(A,urgent)": 3, "(B,tenant_job)": 3}


def test_a_message_option_and_no_key_in_a_fair_queue(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given sends with the message option fairness_key (winning over the actor's), and an actor of the
    fair queue that returns None, I expect the option's key on the row, and the keyless messages to
    share the key "" (one key's share)."""

    @dramatiq.actor(queue_name=Q, fairness_key=None)
    def keyless(n: int) -> None:
        pass

    tenant_job.send_with_options(args=("A", 0), fairness_key="other")
    for n in range(3):
        keyless.send(n)
    assert sorted(r[0] for r in query(broker, "SELECT fairness_key FROM {schema}.message")) == ["", "", "", "other"]
    assert Counter(keys_of(broker, claim(broker.consume(Q), 2))) == {"": 1, "other": 1}


def test_bad_fairness_options_are_refused_at_declaration(broker: PostgresBroker) -> None:
    """Given an actor declared with a weight of 0 or a key that is no str, I expect FairnessOptionError."""
    with pytest.raises(FairnessOptionError, match="fairness_weight"):
        dramatiq.actor(lambda: None, actor_name="w0", queue_name=Q, fairness_key="k", fairness_weight=0)
    with pytest.raises(FairnessOptionError, match="must be a str"):
        dramatiq.actor(lambda: None, actor_name="k1", queue_name=Q, fairness_key=1)


def test_two_consumers_claiming_at_once_never_take_a_row_twice(
    broker: PostgresBroker, tenant_job: dramatiq.Actor
) -> None:
    """Given 5 keys of 100 messages and two consumers claiming 8 at a time from two threads until the
    queue is empty, I expect every message claimed exactly once (SKIP LOCKED), each at attempt 1."""
    for key in "ABCDE":
        send(tenant_job, key, 100)
    consumers = [broker.consume(Q), broker.consume(Q)]
    taken: list[list[str]] = [[], []]
    start = threading.Barrier(2)

    def drain(i: int) -> None:
        start.wait()
        while True:
            got = claim(consumers[i], 8)
            if not got and not query(broker, "SELECT 1 FROM {schema}.message WHERE state = 'queued' LIMIT 1"):
                return
            taken[i].extend(got)

    threads = [threading.Thread(target=drain, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    everything = taken[0] + taken[1]
    assert len(everything) == len(set(everything)) == 500
    assert query(broker, "SELECT attempt, state, count(*) FROM {schema}.message GROUP BY 1, 2") == [(1, "running", 500)]


def test_the_fence_holds_for_keyed_messages(broker: PostgresBroker, tenant_job: dramatiq.Actor) -> None:
    """Given keyed messages claimed by the worker's consumer, I expect an ack to delete its row, a retry
    to put its row back queued with its key (claimed again at attempt 2), a nack to dead-letter it, and
    a stale ack of an earlier delivery to be a no-op."""
    send(tenant_job, "A", 2)
    send(tenant_job, "B", 1)
    consumer = broker.consume(Q, prefetch=1, timeout=50)

    def next_one() -> PostgresMessageProxy:
        proxy = wait_for(lambda: next(consumer), 10, "a claim")
        assert isinstance(proxy, PostgresMessageProxy)
        return proxy

    first = next_one()
    consumer.ack(first)
    assert broker.flush_outcomes(10)
    assert query(broker, "SELECT count(*) FROM {schema}.message WHERE message_id = %s", [first.message_id]) == [(0,)]

    second = next_one()
    broker.enqueue(second, delay=0)  # Dramatiq's Retries: the same proxy back to the broker
    consumer.ack(second)  # the ack after a retry: an expected no-op
    assert broker.flush_outcomes(10)
    assert query(
        broker,
        "SELECT state, attempt, fairness_key IS NOT NULL, fair_tag IS NOT NULL"
        " FROM {schema}.message WHERE message_id = %s",
        [second.message_id],
    ) == [("queued", 1, True, True)]

    for _ in range(2):
        proxy = next_one()
        if proxy.message_id == second.message_id:
            assert proxy.attempt == 2
            consumer.ack(second)  # stale: the earlier delivery's
        consumer.nack(proxy)
        assert broker.flush_outcomes(10)
    assert sorted(r[0] for r in query(broker, "SELECT state FROM {schema}.message")) == ["dead", "dead"]


def test_claims_of_a_key_start_at_its_floor_and_a_row_put_back_behind_it_is_claimed_at_once(
    broker: PostgresBroker, tenant_job: dramatiq.Actor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a claim from the head took rows of a key, the key's next claims start at its first row
    (floor.KeyFloors: the entries its claimed rows left dead are not walked again), and a row of the
    key put back behind that floor (a rescue, which says "!back") is claimed by the next claim."""
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 3600.0)  # from the head only when told to
    send(tenant_job, "A", 12)
    c = broker.consume(Q, prefetch=4, timeout=200)
    try:
        wait_for(lambda: broker.parts.turns.hearing() is not None, 10, "the process to listen")
        c.floor.forget()
        first = claim(c, 4)  # from the head: the floor of A is its first row
        assert set(keys_of(broker, first)) == {"A"} and "A" in c.key_floors.at
        at_first = c.key_floors.at["A"]
        starts: list[Any] = []
        real = floors.Floor.start
        monkeypatch.setattr(floors.Floor, "start", lambda self: starts.append(real(self)) or starts[-1])
        second = claim(c, 4)
        assert len(second) == 4 and not set(second) & set(first)
        assert starts and all(s is not HEAD for s in starts), starts  # from A's floor, not its head
        assert c.key_floors.at["A"] > at_first  # moved to the second claim's first row
        # A row of A back behind that floor without a word (nothing says "!back"): the slots see it (the
        # lowest tag), but A's rows are taken from A's floor, past it.
        query(broker, "UPDATE {schema}.message SET state = 'queued' WHERE message_id = %s", [first[0]])
        third = claim(c, 4)
        assert starts[-1] is not HEAD and len(third) == 4 and first[0] not in third
        # The others of the first claim go back at their old place by a rescue, which says "!back".
        told = c.floor.look_back.count(Q)
        assert expire_and_rescue(broker, "message_id = ANY(%s::uuid[])", [first[1:]]) == 3
        wait_for(lambda: c.floor.look_back.count(Q) > told, 10, "the rescue's '!back' to be heard")
        starts.clear()
        again = claim(c, 4)
        assert starts == [HEAD] and sorted(again) == sorted(first)  # from the head: every row put back
    finally:
        c.close()
