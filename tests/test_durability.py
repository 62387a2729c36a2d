"""Only the enqueue waits for the disk: claims, acks, nacks, retries, lease extensions and
shutdown releases commit with ``synchronous_commit = off`` for their own transaction, unless
``durable_outcomes=True``; nothing is left on a pooled connection.

What a database crash then does (messages run again, no message lost, no stale delivery
finalizes) is tested with a real server crash in ``test_faults.py`` (section 5), where the
WAL flushes are also counted.
"""

from __future__ import annotations

from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from helpers import Factory, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.config import DEFAULT_DURABLE_OUTCOMES
from dramatiq_pg_fenced.core.floor import HEAD

FROM_HEAD = {"from_priority": HEAD[0], "from_at": HEAD[1], "from_seq": HEAD[2], "channel": "", "took": None}


def test_claims_and_outcomes_are_relaxed_by_default() -> None:
    assert DEFAULT_DURABLE_OUTCOMES is False
    assert PostgresBroker("", schema="units").durable_outcomes is False
    assert PostgresBroker("", schema="units", durable_outcomes=True).settings.durable_outcomes is True


@pytest.mark.parametrize("durable", [False, True])
def test_the_claim_extension_and_lone_ack_set_synchronous_commit_for_their_own_transaction(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str, durable: bool
) -> None:
    """Run inside an explicit transaction, the statements the consumer, the lease keeper and the
    outcome writer's lone acks use leave synchronous_commit off (relaxed) or as it was (durable);
    the enqueue leaves it on."""
    broker = dramatiq_pg_broker_factory(durable_outcomes=durable)
    broker.declare_queue("q")
    message: Message[Any] = Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={})
    broker.enqueue(message)
    stmts = broker.statements
    claim = stmts.claim if durable else stmts.claim_relaxed
    extend = stmts.extend if durable else stmts.extend_relaxed
    expected = ("on",) if durable else ("off",)
    with psycopg.connect(dramatiq_pg_url) as conn:
        row = conn.execute(claim, {"queue": "q", "limit": 1, "lease": 30, "consumer": "test", **FROM_HEAD}).fetchone()
        assert row is not None and str(row[0]) == message.message_id
        assert conn.execute("SHOW synchronous_commit").fetchone() == expected
        conn.rollback()
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
        claimed = conn.execute(
            claim, {"queue": "q", "limit": 1, "lease": 30, "consumer": "test", **FROM_HEAD}
        ).fetchone()
        conn.commit()
        assert claimed is not None
        assert conn.execute(extend, {"ids": [claimed[0]], "deliveries": [claimed[2]], "lease": 30}).fetchall()
        assert conn.execute("SHOW synchronous_commit").fetchone() == expected
        conn.rollback()
        for ack in (stmts.ack, stmts.ack_keep) if durable else (stmts.ack_relaxed, stmts.ack_keep_relaxed):
            params = {"ids": [claimed[0]], "deliveries": [claimed[2]], "writer": "test"}
            assert conn.execute(ack, params).fetchall() == [(claimed[0], claimed[2])]
            assert conn.execute("SHOW synchronous_commit").fetchone() == expected
            conn.rollback()


@pytest.mark.parametrize("durable", [False, True])
def test_nothing_is_left_on_the_pooled_connection(dramatiq_pg_broker_factory: Factory, durable: bool) -> None:
    """One pooled connection does the enqueue, the claim, the extension, the ack, a nack, a retry
    and a shutdown release; afterwards its session setting is what it was."""
    broker = dramatiq_pg_broker_factory(durable_outcomes=durable, pool_max_size=1, poll_interval=0.05)
    seen: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=1, min_backoff=10, max_backoff=10)
    def work(n: int) -> None:
        seen.append(n)
        if n == 1 and seen.count(1) == 1:
            raise RuntimeError("retried once")
        if n == 2:
            raise ValueError("retried, then dead-lettered")

    for n in range(3):
        work.send(n)
    with running_worker(broker, threads=2):
        wait_for(lambda: sorted(seen) == [0, 1, 1, 2, 2] and broker.flush_outcomes(5), 30, "the outcomes")
        broker.parts.keeper.extend()
    consumer = broker.consume(work.queue_name, prefetch=1, timeout=100)
    work.send(3)
    proxy = wait_for(lambda: next(consumer), 30, "a delivery")
    consumer.requeue([proxy])
    consumer.close()
    with broker.database.connection() as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
    assert broker.inspect(proxy.message_id)["state"] == "queued"  # type: ignore[index]


@pytest.mark.parametrize("keep_finished", [0, 60])
def test_a_batch_of_acks_alone_is_one_fenced_statement(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch, keep_finished: int
) -> None:
    """The outcome writer writes acks without results or follow-ups as the ack statement alone (one
    round trip, its own transaction); an ack of a delivery fenced out meanwhile is counted as stale,
    after it, and the others apply."""
    from dramatiq_pg_fenced.core.delivery import Outcome
    from dramatiq_pg_fenced.core.fencing import Write

    broker = dramatiq_pg_broker_factory(keep_finished=keep_finished)
    broker.declare_queue("q")
    for _ in range(3):
        broker.enqueue(Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={}))
    consumer = broker.consume("q", prefetch=3, timeout=1000)
    try:
        proxies = [wait_for(lambda: next(consumer), 10, "a delivery") for _ in range(3)]
        stale = proxies[0]
        query(  # redelivered meanwhile: another delivery holds it now
            broker,
            "UPDATE {schema}.message SET delivery = gen_random_uuid() WHERE message_id = %s",
            [stale.message_id],
        )
        statements: list[str] = []
        execute = psycopg.Connection.execute

        def counted(self: psycopg.Connection, statement: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append(statement.decode() if isinstance(statement, bytes) else str(statement))
            return execute(self, statement, *args, **kwargs)

        before = broker.stats()["process"]["stale_writes"]
        monkeypatch.setattr(psycopg.Connection, "execute", counted)
        broker.parts.writer.write(
            [Outcome(Write.ACK, p.message_id, p.attempt, p.delivery, queue_name="q") for p in proxies]
        )
        monkeypatch.undo()
    finally:
        consumer.close()
    ack = broker.statements.ack_keep_relaxed if keep_finished else broker.statements.ack_relaxed
    assert statements[0] == ack.decode()
    assert not any(s.split()[0].upper() in ("BEGIN", "COMMIT") for s in statements)
    assert broker.stats()["process"]["stale_writes"] == before + 1
    infos = [broker.inspect(p.message_id) for p in proxies[1:]]
    if keep_finished:
        assert [i and i["state"] for i in infos] == ["done", "done"]  # moved to the history table
    else:
        assert infos == [None, None]
    held = broker.inspect(stale.message_id)
    assert held is not None and held["state"] == "running"


def test_a_lone_ack_batch_whose_stale_count_fails_is_not_written_again(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The acks of a batch of acks alone commit before the fenced-out ones are counted: if counting
    fails, the batch is done (a retry would find the applied acks gone and call them stale)."""
    from dramatiq_pg_fenced.core.delivery import Outcome
    from dramatiq_pg_fenced.core.fencing import Write

    broker = dramatiq_pg_broker_factory(keep_finished=0)
    broker.declare_queue("q")
    for _ in range(2):
        broker.enqueue(Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={}))
    consumer = broker.consume("q", prefetch=2, timeout=1000)
    try:
        current, stale = [wait_for(lambda: next(consumer), 10, "a delivery") for _ in range(2)]
        query(
            broker, "UPDATE {schema}.message SET delivery = gen_random_uuid() WHERE message_id = %s", [stale.message_id]
        )

        def report(*args: Any, **kwargs: Any) -> None:
            raise psycopg.OperationalError("the server went away while counting")

        monkeypatch.setattr(broker.parts.writer.stale, "report", report)
        broker.parts.writer.write(
            [Outcome(Write.ACK, p.message_id, p.attempt, p.delivery, queue_name="q") for p in (current, stale)]
        )
    finally:
        consumer.close()
    assert broker.inspect(current.message_id) is None  # acked (no history kept)
    info = broker.inspect(stale.message_id)
    assert info is not None and info["state"] == "running"  # the other delivery's, untouched
    assert "Could not finish counting 1 fenced-out ack(s)" in caplog.text


def test_a_lone_ack_batch_whose_reply_is_lost_is_written_again_without_a_stale_count(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ack statement commits, then the connection breaks before its reply arrives: the writer
    writes the batch again, finds the rows gone as its own ack left them, and counts nothing stale."""
    from dramatiq_pg_fenced.core.delivery import Outcome
    from dramatiq_pg_fenced.core.fencing import Write

    broker = dramatiq_pg_broker_factory(keep_finished=0)
    broker.declare_queue("q")
    for _ in range(2):
        broker.enqueue(Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={}))
    consumer = broker.consume("q", prefetch=2, timeout=1000)
    try:
        proxies = [wait_for(lambda: next(consumer), 10, "a delivery") for _ in range(2)]
    finally:
        consumer.close()
    writer, ack = broker.parts.writer, broker.statements.ack_relaxed
    execute = psycopg.Connection.execute

    def reply_lost(self: psycopg.Connection, statement: Any, *args: Any, **kwargs: Any) -> Any:
        cursor = execute(self, statement, *args, **kwargs)
        if statement == ack:
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return cursor

    batch = [Outcome(Write.ACK, p.message_id, p.attempt, p.delivery, queue_name="q") for p in proxies]
    before = broker.stats()["process"]["stale_writes"]
    monkeypatch.setattr(psycopg.Connection, "execute", reply_lost)
    again = writer._write_all(batch, 0.01)
    monkeypatch.undo()
    assert again == batch  # committed, but the writer cannot know: written again
    assert all(broker.inspect(p.message_id) is None for p in proxies)
    assert writer._write_all(again, 0.01) == []
    assert broker.stats()["process"]["stale_writes"] == before
    assert all(broker.parts.leases.held(p.message_id) is None for p in proxies)
