"""Unique messages (issue 12): one message per actor and key while the key is held, on a real database.

Deliveries are claimed and settled through the broker's own consumer (as a
worker would, without its threads), so each test sees every state a keyed
row passes through.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import group, pipeline
from dramatiq.results import Results
from helpers import expire_and_rescue, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy
from dramatiq_pg_fenced.errors import key_taken_meanwhile, worth_retrying
from dramatiq_pg_fenced.features.results import PostgresBackend
from dramatiq_pg_fenced.sending.unique import MAX_KEY_BYTES

Q = "uq"


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> Iterator[PostgresBroker]:
    broker = dramatiq_pg_broker_factory(lease_seconds=30, rescue_interval=3600, poll_interval=0.05)
    dramatiq.set_broker(broker)
    broker.declare_queue(Q)
    yield broker


def rows(broker: PostgresBroker, key: str | None = None) -> list[tuple[str, str | None, str]]:
    """(id, unique_key, state) of the queue's rows, in send order; with *key*: the rows carrying it."""
    found = query(broker, "SELECT message_id::text, unique_key, state FROM {schema}.message ORDER BY seq")
    return [r for r in found if key is None or r[1] == key]


def holder(broker: PostgresBroker, key: str) -> list[str]:
    """The rows holding *key* now (at most one, by the index)."""
    return [
        str(r[0])
        for r in query(
            broker,
            "SELECT message_id FROM {schema}.message WHERE unique_key = %s"
            " AND (state = 'queued' OR (state = 'running' AND unique_until = 'finished'))",
            [key],
        )
    ]


class Claimer:
    """Claims the next due message of the queue, as a worker's consumer does; settles through it."""

    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.consumer = broker.consume(Q, prefetch=4, timeout=20)

    def __call__(self) -> PostgresMessageProxy:
        proxy = wait_for(lambda: next(self.consumer), 10, "a claim")
        assert isinstance(proxy, PostgresMessageProxy)
        return proxy

    def ack(self, proxy: PostgresMessageProxy) -> None:
        self.consumer.ack(proxy)
        assert self.broker.flush_outcomes(10)

    def nack(self, proxy: PostgresMessageProxy) -> None:
        self.consumer.nack(proxy)
        assert self.broker.flush_outcomes(10)


@pytest.fixture
def claim(broker: PostgresBroker) -> Claimer:
    return Claimer(broker)


def retry(broker: PostgresBroker, proxy: PostgresMessageProxy, delay: int = 0) -> None:
    """Dramatiq's Retries: the same proxy back to the broker."""
    broker.enqueue(proxy, delay=delay)
    assert broker.flush_outcomes(10)


# -- the key and what a send gets back ---------------------------------------------------


def test_a_second_send_with_a_held_key_is_not_inserted_and_gets_the_first_id(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name=Q, unique_key=lambda user, **_: f"user:{user}")
    def refresh(user: int, note: str = "") -> None: ...

    first = refresh.send(1)
    again = refresh.send_with_options(args=(1,), kwargs={"note": "other args, same key"})
    other = refresh.send(2)
    assert again.message_id == first.message_id
    assert other.message_id != first.message_id
    assert [(r[1], r[2]) for r in rows(broker)] == [("user:1", "queued"), ("user:2", "queued")]
    # A message option wins over the actor's; None sends without a key.
    own = refresh.send_with_options(args=(1,), unique_key="mine")
    plain = [refresh.send_with_options(args=(1,), unique_key=None) for _ in range(2)]
    assert own.message_id not in (first.message_id, other.message_id)
    assert plain[0].message_id != plain[1].message_id
    assert len(rows(broker)) == 5
    # The returned copy is the holder as far as Dramatiq is concerned: its id, the caller's actor and queue.
    assert (again.actor_name, again.queue_name) == (first.actor_name, first.queue_name)
    info = broker.inspect(first.message_id)
    assert info is not None and (info["unique_key"], info["unique_until"]) == ("user:1", "started")


def test_keys_are_per_actor_and_a_static_key_makes_the_actor_a_singleton(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="nightly")
    def report() -> None: ...

    @dramatiq.actor(queue_name=Q)
    def other() -> None: ...

    ids = {report.send().message_id for _ in range(3)}
    theirs = other.send_with_options(unique_key="nightly")
    assert len(ids) == 1
    assert theirs.message_id not in ids
    assert len(rows(broker, "nightly")) == 2


def test_bulk_enqueue_dedupes_within_the_batch_and_against_the_table_and_inserts_the_rest(
    broker: PostgresBroker,
) -> None:
    @dramatiq.actor(queue_name=Q)
    def job(n: int) -> None: ...

    held = job.send_with_options(args=(0,), unique_key="a")
    batch = [
        job.message_with_options(args=(1,), unique_key="a"),  # held in the table
        job.message_with_options(args=(2,), unique_key="b"),  # new
        job.message(3),  # no key
        job.message_with_options(args=(4,), unique_key="b"),  # held by an earlier send of this batch
        job.message(5),
    ]
    sent = broker.enqueue_many(batch)
    assert [m.message_id for m in sent] == [
        held.message_id,
        batch[1].message_id,
        batch[2].message_id,
        batch[1].message_id,
        batch[4].message_id,
    ]
    assert [m.args for m in sent] == [m.args for m in batch]
    assert sorted(r[0] for r in rows(broker)) == sorted(
        [held.message_id, batch[1].message_id, batch[2].message_id, batch[4].message_id]
    )
    assert broker.stats()["process"]["duplicate_sends"] == 0  # deduplication is not a duplicate id


def test_a_key_held_in_the_callers_transaction_holds_until_it_rolls_back(
    broker: PostgresBroker, dramatiq_pg_url: str
) -> None:
    @dramatiq.actor(queue_name=Q)
    def job() -> None: ...

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            first = job.send_with_options(unique_key="tx")
            assert job.send_with_options(unique_key="tx").message_id == first.message_id
        conn.rollback()
    assert rows(broker) == []
    after = job.send_with_options(unique_key="tx")
    assert after.message_id != first.message_id
    assert holder(broker, "tx") == [after.message_id]


def test_a_resend_of_the_same_id_is_reported_as_before_not_as_deduplicated(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name=Q)
    def job() -> None: ...

    m = job.message_with_options(unique_key="same")
    broker.enqueue(m)
    assert broker.enqueue(m).message_id == m.message_id
    assert broker.stats()["process"]["duplicate_sends"] == 1


# -- when the key frees, and when it stays held ------------------------------------------------


def test_the_key_frees_on_ack(broker: PostgresBroker, claim: Claimer) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k", unique_until="finished")
    def job() -> None: ...

    first = job.send()
    proxy = claim()
    assert job.send().message_id == first.message_id  # 'finished': held while running
    claim.ack(proxy)
    assert rows(broker) == []
    assert job.send().message_id != first.message_id


def test_the_key_frees_on_dead_letter(broker: PostgresBroker, claim: Claimer) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k", unique_until="finished")
    def job() -> None: ...

    first = job.send()
    claim.nack(claim())
    assert rows(broker) == [(first.message_id, "k", "dead")]
    second = job.send()
    assert second.message_id != first.message_id
    assert holder(broker, "k") == [second.message_id]


def test_the_key_frees_when_a_worker_dead_letters_the_message(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="boom", max_retries=0)
    def job() -> None:
        raise RuntimeError("boom")

    first = job.send()
    with running_worker(broker, threads=1):
        wait_for(lambda: rows(broker) == [(first.message_id, "boom", "dead")], 30, "the dead letter")
    assert job.send().message_id != first.message_id


def test_the_key_frees_on_cancel_queued_or_running(broker: PostgresBroker, claim: Claimer) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k", unique_until="finished")
    def job() -> None: ...

    first = job.send()
    broker.cancel(first.message_id)
    second = job.send()
    assert second.message_id != first.message_id
    proxy = claim()
    assert proxy.message_id == second.message_id
    assert job.send().message_id == second.message_id
    broker.cancel(second.message_id)
    third = job.send()
    assert third.message_id not in (first.message_id, second.message_id)
    claim.ack(proxy)  # the cancelled delivery's ack: fenced out, frees nothing more
    assert holder(broker, "k") == [third.message_id]


@pytest.mark.parametrize("until", ["started", "finished"])
def test_a_retry_waiting_for_its_backoff_keeps_the_key(broker: PostgresBroker, claim: Claimer, until: str) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k", unique_until=until)
    def job() -> None: ...

    first = job.send()
    proxy = claim()
    retry(broker, proxy, delay=60_000)
    assert rows(broker) == [(first.message_id, "k", "queued")]
    assert job.send().message_id == first.message_id


def test_started_frees_the_key_when_a_worker_starts_the_message(broker: PostgresBroker, claim: Claimer) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k")  # unique_until="started", the default
    def job() -> None: ...

    first = job.send()
    proxy = claim()
    second = job.send()
    assert second.message_id != first.message_id
    assert job.send().message_id == second.message_id
    claim.ack(proxy)
    assert holder(broker, "k") == [second.message_id]


def test_a_started_message_retried_while_a_newer_one_holds_its_key_goes_back_without_it(
    broker: PostgresBroker, claim: Claimer
) -> None:
    """Given A running (its 'started' key free) and B queued with the key, when A is retried,
    then A goes back to the queue without its key, B keeps it, and both run."""

    @dramatiq.actor(queue_name=Q, unique_key="k")
    def job() -> None: ...

    a = job.send()
    proxy_a = claim()
    b = job.send()
    retry(broker, proxy_a)
    assert rows(broker) == [(a.message_id, None, "queued"), (b.message_id, "k", "queued")]
    assert job.send().message_id == b.message_id
    # Both run: A (first in line) and B; then the key is free.
    claimed = [claim(), claim()]
    assert {p.message_id for p in claimed} == {a.message_id, b.message_id}
    for p in claimed:
        claim.ack(p)
    assert job.send().message_id not in (a.message_id, b.message_id)


def test_two_started_messages_with_one_key_retried_together_both_go_back_without_it(
    broker: PostgresBroker, claim: Claimer
) -> None:
    """A and B both running with key k ('started'), retried in one batch: neither takes the key
    (each sees the other), and the batch is written, not refused."""

    @dramatiq.actor(queue_name=Q, unique_key="k")
    def job() -> None: ...

    a = job.send()
    proxy_a = claim()
    b = job.send()
    proxy_b = claim()
    assert proxy_b.message_id == b.message_id
    writer = broker.parts.writer
    with writer._cond:  # hold the writer so both retries land in one batch
        broker.enqueue(proxy_a, delay=0)
        broker.enqueue(proxy_b, delay=0)
    assert broker.flush_outcomes(10)
    assert rows(broker) == [(a.message_id, None, "queued"), (b.message_id, None, "queued")]
    c = job.send()
    assert holder(broker, "k") == [c.message_id]


def test_a_retry_alone_takes_its_key_back_after_a_release_and_a_rescue(broker: PostgresBroker, claim: Claimer) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k")
    def job() -> None: ...

    first = job.send()
    claim.consumer.requeue([claim()])  # released at shutdown, unstarted
    assert holder(broker, "k") == [first.message_id]
    claim()
    assert expire_and_rescue(broker) == 1
    assert holder(broker, "k") == [first.message_id]
    # Rescued while a newer message holds the key: back without it.
    claim()
    newer = job.send()
    assert expire_and_rescue(broker) == 1
    assert rows(broker) == [(first.message_id, None, "queued"), (newer.message_id, "k", "queued")]


def test_a_redrive_takes_the_key_back_only_if_no_other_message_carries_it(
    broker: PostgresBroker, claim: Claimer
) -> None:
    @dramatiq.actor(queue_name=Q, unique_key="k", unique_until="finished")
    def job() -> None: ...

    first = job.send()
    claim.nack(claim())
    second = job.send()
    assert broker.redrive(first.message_id)
    assert rows(broker) == [(first.message_id, None, "queued"), (second.message_id, "k", "queued")]
    broker.cancel(second.message_id)
    assert broker.redrive(second.message_id)  # the first no longer carries the key
    assert holder(broker, "k") == [second.message_id]


def test_a_retry_that_meets_a_send_committing_the_key_meanwhile_is_written_again_without_it(
    broker: PostgresBroker, claim: Claimer, dramatiq_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The one race the retry's probe cannot see: a send of the key still uncommitted when the
    retry's statement starts.  The writer waits for it, is refused (unique violation), writes
    again, and the row goes back without its key."""

    @dramatiq.actor(queue_name=Q, unique_key="k")
    def job() -> None: ...

    first = job.send()
    proxy = claim()
    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            newer = job.send()  # holds the key, uncommitted
        broker.enqueue(proxy, delay=0)  # the writer's retry waits on the uncommitted index entry
        wait_for(
            lambda: query(
                broker,
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                [f"%UPDATE \"{broker.schema}\".message AS m SET state = 'queued', payload%"],  # the retry
            ),
            10,
            "the retry waiting for the send",
        )
        with caplog.at_level(logging.INFO):
            conn.commit()
            assert broker.flush_outcomes(10)
    assert rows(broker) == [(first.message_id, None, "queued"), (newer.message_id, "k", "queued")]
    assert "took the unique key of a message going back to the queue" in caplog.text


def test_the_unique_violation_of_a_key_taken_meanwhile_is_worth_writing_again(
    broker: PostgresBroker, dramatiq_pg_url: str
) -> None:
    query(
        broker,
        "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload, unique_key, unique_until)"
        " VALUES (gen_random_uuid(), 'uq', 'a', '', 'k', 'started')",
    )
    with pytest.raises(psycopg.errors.UniqueViolation) as taken:
        query(
            broker,
            "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload, unique_key, unique_until)"
            " VALUES (gen_random_uuid(), 'uq', 'a', '', 'k', 'started')",
        )
    assert key_taken_meanwhile(taken.value) and worth_retrying(taken.value)
    with pytest.raises(psycopg.errors.UniqueViolation) as other:
        query(broker, "INSERT INTO {schema}.counter (name) VALUES ('x'), ('x')")
    assert not key_taken_meanwhile(other.value) and not worth_retrying(other.value)


def test_a_send_whose_holder_commits_during_its_insert_learns_the_holder_or_inserts_once_it_is_gone(
    broker: PostgresBroker, dramatiq_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The insert waits for a holder still uncommitted, so its snapshot cannot show it: the holder
    is read again (a second round trip).  Here the holder is acked in between (deleted), so the send
    is tried again and inserted."""

    @dramatiq.actor(queue_name=Q, unique_key="k")
    def job() -> None: ...

    reads: list[bytes] = []
    real = psycopg.Connection.execute

    def execute(conn: psycopg.Connection, statement: Any, *args: Any, **kwargs: Any) -> Any:
        if statement is broker.statements.unique_holders:
            reads.append(statement)
            query(broker, "DELETE FROM {schema}.message WHERE message_id = %s", [held.message_id])
        return real(conn, statement, *args, **kwargs)

    got: list[str] = []
    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            held = job.send()  # uncommitted
        monkeypatch.setattr(psycopg.Connection, "execute", execute)
        sender = threading.Thread(target=lambda: got.append(job.send().message_id))
        sender.start()
        wait_for(
            lambda: query(
                broker,
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
                [f'WITH m AS MATERIALIZED%"{broker.schema}"%'],
            ),
            10,
            "the send waiting for the holder",
        )
        conn.commit()
        sender.join(10)
    assert len(reads) == 1
    assert got[0] != held.message_id
    assert rows(broker) == [(got[0], "k", "queued")]


# -- many senders at once ---------------------------------------------------------------------------


def test_many_threads_sending_one_key_at_once_make_one_message(broker: PostgresBroker) -> None:
    @dramatiq.actor(queue_name=Q)
    def job(n: int) -> None: ...

    threads, rounds = 16, 5
    for r in range(rounds):
        key = f"round-{r}"
        gate = threading.Barrier(threads)
        got: list[str] = []

        def send(n: int, key: str = key, gate: threading.Barrier = gate, got: list[str] = got) -> None:
            gate.wait()
            got.append(job.send_with_options(args=(n,), unique_key=key).message_id)

        workers = [threading.Thread(target=send, args=(n,)) for n in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        stored = rows(broker, key)
        assert len(stored) == 1, stored
        assert got == [stored[0][0]] * threads  # every sender learned the one id


SENDER = textwrap.dedent(
    """
    import json, sys, threading, time
    import dramatiq
    from dramatiq_pg_fenced import PostgresBroker

    url, schema, go, threads, sends = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    broker = PostgresBroker(url, schema=schema, pool_max_size=threads)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="uq", unique_key=lambda key, n: key, unique_until="finished")
    def job(key, n): ...

    with broker.database.connection():  # connected before the start
        pass
    got = []
    def send(t):
        for i in range(sends):
            got.append(job.send(f"k{i}", t).message_id)
    workers = [threading.Thread(target=send, args=(t,)) for t in range(threads)]
    time.sleep(max(go - time.time(), 0))
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print(json.dumps(got))
    broker.close()
    """
)


def test_several_processes_sending_the_same_keys_at_once_make_one_message_per_key(
    broker: PostgresBroker, dramatiq_pg_url: str, tmp_path: Path
) -> None:
    processes, threads, keys = 4, 4, 10
    script = tmp_path / "sender.py"
    script.write_text(SENDER)
    go = time.time() + 3.0  # every process imports and connects before then
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), dramatiq_pg_url, broker.schema, str(go), str(threads), str(keys)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)),
        )
        for _ in range(processes)
    ]
    got: list[str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-2000:]
        got += json.loads(out)
    stored = {key: [r[0] for r in found] for key in (f"k{i}" for i in range(keys)) if (found := rows(broker, key))}
    assert {key: len(ids) for key, ids in stored.items()} == {f"k{i}": 1 for i in range(keys)}
    assert len(rows(broker)) == keys
    assert set(got) == {ids[0] for ids in stored.values()}  # every sender learned one of those ids
    assert len(got) == processes * threads * keys


# -- strange keys and options ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "error", "match"),
    [
        ("", ValueError, "empty"),
        (42, TypeError, "must be a str"),
        (b"bytes", TypeError, "must be a str"),
        ("nul\x00inside", ValueError, "NUL"),
        ("lone \ud800 surrogate", ValueError, "not valid Unicode"),
        ("x" * (MAX_KEY_BYTES + 1), ValueError, "over 1000"),
        ("é" * (MAX_KEY_BYTES // 2 + 1), ValueError, "over 1000"),
    ],
)
def test_a_key_the_database_cannot_hold_is_refused_at_send_saying_why(
    broker: PostgresBroker, key: Any, error: type[Exception], match: str
) -> None:
    @dramatiq.actor(queue_name=Q)
    def job() -> None: ...

    with pytest.raises(error, match=match):
        job.send_with_options(unique_key=key)
    assert rows(broker) == []


@pytest.mark.parametrize(
    "key",
    [
        "x" * MAX_KEY_BYTES,
        "'; DROP TABLE message; --",
        "  spaces  \t\n",
        "emoji 🎉 and RTL \u202e and zero-width \u200b",
        "%s %(name)s {schema}",
    ],
)
def test_odd_keys_within_the_limit_work(broker: PostgresBroker, key: str) -> None:
    @dramatiq.actor(queue_name=Q)
    def job() -> None: ...

    first = job.send_with_options(unique_key=key)
    assert job.send_with_options(unique_key=key).message_id == first.message_id
    assert rows(broker) == [(first.message_id, key, "queued")]


def test_bad_options_are_refused_when_declared_or_sent(broker: PostgresBroker) -> None:
    with pytest.raises(ValueError, match="empty"):
        dramatiq.actor(lambda: None, actor_name="a1", queue_name=Q, unique_key="")
    with pytest.raises(ValueError, match="'started' or 'finished'"):
        dramatiq.actor(lambda: None, actor_name="a2", queue_name=Q, unique_key="k", unique_until="running")

    @dramatiq.actor(queue_name=Q, unique_key=lambda n: n)
    def job(n: Any) -> None: ...

    with pytest.raises(TypeError, match="returned by the unique_key function"):
        job.send(7)
    with pytest.raises(ValueError, match="'started' or 'finished'"):
        job.send_with_options(args=("k",), unique_until="forever")
    assert job.send(None) is not None  # a function may return None: no key
    assert rows(broker)[0][1] is None


# -- composition -----------------------------------------------------------------------------------


def test_a_deduplicated_send_gets_the_holders_result(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> None:
    broker = dramatiq_pg_broker_factory(poll_interval=0.05)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name=Q, store_results=True, unique_key=lambda x: "sum")
    def add(x: int) -> int:
        return x + 1

    first, again = add.send(1), add.send(41)  # the second's args never run
    assert again.message_id == first.message_id
    with running_worker(broker, threads=1):
        assert again.get_result(block=True, timeout=20_000) == 2
    backend.close()


def test_pipelines_and_groups_with_keys_run(broker: PostgresBroker) -> None:
    """A deduplicated group member or pipeline step is not sent twice; the rest runs, and a
    pipeline ends where its next step was deduplicated (the holder runs on its own)."""
    ran: list[str] = []

    @dramatiq.actor(queue_name=Q, unique_key=lambda name: name)
    def step(name: str) -> str:
        ran.append(name)
        return name

    @dramatiq.actor(queue_name=Q)
    def tail(value: Any = None) -> None:
        ran.append("tail")

    waiting = step.send_with_options(args=("next",), delay=3_600_000)  # holds "next" while it waits
    pipeline([step.message("first"), step.message("next"), tail.message()]).run()
    group([step.message("g"), step.message("g"), step.message("h")]).run()
    assert [r[1] for r in rows(broker)] == ["next", "first", "g", "h"]
    with running_worker(broker, threads=2):
        wait_for(lambda: sorted(ran) == ["first", "g", "h"], 30, "the pipeline's first step and the group")
        wait_for(lambda: rows(broker) == [(waiting.message_id, "next", "queued")], 30, "the acks")
    assert broker.cancel(waiting.message_id).value == "cancelled_queued"
