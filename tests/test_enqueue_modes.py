"""Enqueue modes: enqueue_many, batch(), transaction() (the outbox) and relaxed durability.

Correctness only: what gets stored, when it becomes visible, which NOTIFYs
are sent, and that no setting leaks.  Speed is the benchmark's business.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import group
from dramatiq.middleware import Middleware
from helpers import Factory, query, running_worker, wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PayloadTooLarge, PostgresBroker
from dramatiq_pg_fenced.sending.enqueue import CHUNK


# -- helpers ------------------------------------------------------------------
def stored(broker: PostgresBroker) -> list[str]:
    """Ids of the stored messages, in insertion order."""
    return [r[0] for r in query(broker, "SELECT message_id::text FROM {schema}.message ORDER BY seq")]


class Listener:
    """A LISTEN connection on the broker's doorbell channel."""

    def __init__(self, url: str, channel: str) -> None:
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

    def drain(self, quiet: float = 0.5, timeout: float = 10.0) -> list[str]:
        """Every payload received until *quiet* seconds pass without one."""
        got: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = [n.payload for n in self.conn.notifies(timeout=quiet)]
            if not batch:
                break
            got.extend(batch)
        return got

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def listener(dramatiq_pg_url: str) -> Iterator[Callable[[PostgresBroker], Listener]]:
    made: list[Listener] = []

    def listen(broker: PostgresBroker) -> Listener:
        made.append(Listener(dramatiq_pg_url, broker.channel))
        return made[-1]

    yield listen
    for listener in made:
        listener.close()


class Recorder(Middleware):
    """Counts the enqueue hooks, to check that bulk paths still run middleware."""

    def __init__(self) -> None:
        self.before: list[str] = []
        self.after: list[str] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.before.append(message.message_id)

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.after.append(message.message_id)


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory(poll_interval=0.1)
    dramatiq.set_broker(broker)
    return broker


# -- enqueue_many -------------------------------------------------------------
def test_enqueue_many_stores_all_in_order_and_runs_the_hooks(broker: PostgresBroker) -> None:
    recorder = Recorder()
    broker.add_middleware(recorder)

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    messages = [work.message(n) for n in range(200)]
    assert broker.enqueue_many(messages) == messages
    ids = [m.message_id for m in messages]
    assert stored(broker) == ids
    assert recorder.before == ids and recorder.after == ids
    assert broker.enqueue_many([]) == []


def test_enqueue_many_is_all_or_nothing(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(max_payload_bytes=2000)
    recorder = Recorder()
    broker.add_middleware(recorder)

    @dramatiq.actor(broker=broker)
    def work(data: str) -> None:
        pass

    messages = [work.message("x"), work.message("y" * 5000), work.message("z")]
    with pytest.raises(PayloadTooLarge):
        broker.enqueue_many(messages)
    assert stored(broker) == []
    assert recorder.after == []


def test_enqueue_many_again_is_a_no_op(broker: PostgresBroker) -> None:
    """Inserts are idempotent by message id (what makes a retry after a dropped connection safe)."""

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    messages = [work.message(n) for n in range(5)]
    broker.enqueue_many(messages)
    broker.enqueue_many(messages + [work.message(5)])
    assert len(stored(broker)) == 6


def test_enqueue_many_with_delay_waits_in_the_table(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def later(n: int) -> None:
        pass

    broker.enqueue_many([later.message(n) for n in range(3)], delay=60_000)
    [(early,)] = query(
        broker,
        "SELECT count(*) FROM {schema}.message WHERE available_at > now() + interval '50 seconds'",
    )
    assert early == 3


def test_a_messages_own_delay_option_is_honoured_by_every_send(broker: PostgresBroker) -> None:
    """Dramatiq keeps a message's delay in ``options["delay"]`` (``actor.message_with_options(delay=...)``,
    what pipelines read): it delays the message however it is sent; a larger ``delay=`` argument wins."""

    @dramatiq.actor(queue_name="own")
    def later(n: int) -> None:
        pass

    def waits(message: dramatiq.Message) -> float:
        info = broker.inspect(message.message_id)
        return (info["available_at"] - info["enqueued_at"]).total_seconds()

    (many,) = broker.enqueue_many([later.message_with_options(args=(1,), delay=60_000)])
    one = broker.enqueue(later.message_with_options(args=(2,), delay=60_000))
    with broker.batch():
        batched = later.message_with_options(args=(3,), delay=60_000)
        broker.enqueue(batched)
    longer = broker.enqueue(later.message_with_options(args=(4,), delay=60_000), delay=120_000)
    assert [round(waits(m)) for m in (many, one, batched, longer)] == [60, 60, 60, 120]
    assert broker.inspect(many.message_id)["options"]["delay"] == 60_000  # as shown: it happened
    # A delay that is no number of milliseconds is refused, saying why
    with pytest.raises(ValueError, match=r"options\['delay'\] must be a number of milliseconds"):
        broker.enqueue_many([later.message_with_options(args=(5,), delay="soon")])


def test_enqueue_many_rings_once_per_queue(
    broker: PostgresBroker, listener: Callable[[PostgresBroker], Listener]
) -> None:
    @dramatiq.actor(queue_name="alpha")
    def a(n: int) -> None:
        pass

    @dramatiq.actor(queue_name="beta")
    def b(n: int) -> None:
        pass

    @dramatiq.actor(queue_name="gamma")
    def c(n: int) -> None:
        pass

    bell = listener(broker)
    broker.enqueue_many([a.message(n) for n in range(20)] + [b.message(n) for n in range(20)])
    assert sorted(bell.drain()) == ["alpha", "beta"]  # coalesced: one NOTIFY per queue, not per row

    def wait_ms(payload: str) -> int:
        queue, tab, ms = payload.partition("\t")
        assert (queue, tab) == ("gamma", "\t"), payload
        return int(ms)

    # Delayed: one NOTIFY per queue saying when its earliest is due ("queue<TAB>ms"); the listener rings it then.
    broker.enqueue_many([c.message(1), c.message(2)], delay=60_000)
    (later,) = bell.drain()
    assert 59_000 < wait_ms(later) <= 60_000
    with broker.batch():  # one statement: one due now, two delayed
        c.send(3)
        for delay in (30_000, 20_000):
            c.send_with_options(args=(4,), delay=delay)
    now, later = sorted(bell.drain())
    assert now == "gamma" and 19_000 < wait_ms(later) <= 20_000

    c.send(5)
    assert bell.drain() == ["gamma"]


# -- enqueue_many in pipelined chunks (more than enqueue.CHUNK messages) ---------------
MANY = 2 * CHUNK + 234  # three chunks, the last one short


def xmins(broker: PostgresBroker) -> int:
    """How many transactions wrote the stored rows."""
    [(n,)] = query(broker, "SELECT count(DISTINCT xmin::text) FROM {schema}.message")
    return int(n)


def test_enqueue_many_in_chunks_stores_all_in_order_in_one_transaction(
    broker: PostgresBroker, listener: Callable[[PostgresBroker], Listener]
) -> None:
    recorder = Recorder()
    broker.add_middleware(recorder)

    @dramatiq.actor(queue_name="alpha")
    def work(n: int) -> None:
        pass

    bell = listener(broker)
    messages = [work.message(n) for n in range(MANY)]
    assert broker.enqueue_many(messages) == messages
    ids = [m.message_id for m in messages]
    assert stored(broker) == ids
    assert xmins(broker) == 1  # one commit for every chunk
    assert recorder.before == ids and recorder.after == ids
    assert bell.drain() == ["alpha"]  # one ring per queue, whatever the number of chunks
    [(payloads,)] = query(broker, "SELECT array_agg(payload ORDER BY seq) FROM {schema}.message")
    assert [dramatiq.Message.decode(bytes(p)).args for p in payloads] == [(n,) for n in range(MANY)]


def test_enqueue_many_in_chunks_is_all_or_nothing(dramatiq_pg_broker_factory: Factory) -> None:
    """The message that cannot be encoded is in the last chunk: the chunks before it were sent, not committed."""
    broker = dramatiq_pg_broker_factory(max_payload_bytes=2000, pool_max_size=1)  # the failed call's connection
    recorder = Recorder()
    broker.add_middleware(recorder)

    @dramatiq.actor(broker=broker)
    def work(data: str) -> None:
        pass

    messages = [work.message("x") for _ in range(MANY)]
    messages[-2] = work.message("y" * 5000)
    with pytest.raises(PayloadTooLarge):
        broker.enqueue_many(messages)
    assert stored(broker) == []
    assert recorder.after == []
    work.send("after")  # the connection is usable again, out of pipeline mode and transaction
    broker.enqueue_many(messages[:-2])
    assert len(stored(broker)) == MANY - 1


def test_enqueue_many_in_chunks_survives_its_connection_dying_between_chunks(
    broker: PostgresBroker, dramatiq_pg_url: str
) -> None:
    """The server ends the connection after the first chunk went in: the call starts again on a
    fresh one, and every message is stored once, by one transaction."""

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    encode = broker.enqueuer.row
    calls = 0

    def row(message: Any, delay: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == CHUNK + 10:  # encoding the second chunk: the first is on the server, uncommitted
            with psycopg.connect(dramatiq_pg_url, autocommit=True) as admin:
                [(killed,)] = admin.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    " AND state IN ('active', 'idle in transaction') AND query ILIKE '%%INSERT INTO%%message%%'"
                    " AND strpos(query, %s) > 0",  # this test's schema: other tests insert at the same time
                    [broker.schema],
                )
            assert killed == 1
        return encode(message, delay)

    broker.enqueuer.row = row  # type: ignore[method-assign]
    messages = [work.message(n) for n in range(MANY)]
    assert broker.enqueue_many(messages) == messages
    assert calls > MANY  # encoded again on the fresh connection
    assert stored(broker) == [m.message_id for m in messages]
    assert xmins(broker) == 1
    assert broker.stats()["process"]["duplicate_sends"] == 0


def test_enqueue_many_in_chunks_counts_the_ids_stored_already(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    messages = [work.message(n) for n in range(MANY)]
    broker.enqueue_many(messages[CHUNK - 50 : CHUNK + 50])  # straddles two chunks of the next call
    broker.enqueue_many(messages)
    assert sorted(stored(broker)) == sorted(m.message_id for m in messages)
    assert broker.stats()["process"]["duplicate_sends"] == 100


def test_enqueue_many_in_chunks_deduplicates_unique_keys_across_chunks(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def job(n: int) -> None:
        pass

    held = job.send_with_options(args=(-1,), unique_key="held")
    messages = [job.message(n) for n in range(MANY)]
    messages[10] = job.message_with_options(args=(10,), unique_key="k")  # first chunk
    messages[MANY - 5] = job.message_with_options(args=(MANY - 5,), unique_key="k")  # last chunk: deduplicated
    messages[CHUNK + 1] = job.message_with_options(args=(CHUNK + 1,), unique_key="held")  # held in the table
    sent = broker.enqueue_many(messages)
    expected = [m.message_id for m in messages]
    expected[MANY - 5] = messages[10].message_id
    expected[CHUNK + 1] = held.message_id
    assert [m.message_id for m in sent] == expected
    assert len(stored(broker)) == MANY - 2 + 1
    assert broker.stats()["process"]["duplicate_sends"] == 0


def test_no_notify_without_listen(
    dramatiq_pg_broker_factory: Factory, listener: Callable[[PostgresBroker], Listener]
) -> None:
    broker = dramatiq_pg_broker_factory(listen=False, poll_interval=0.1)

    @dramatiq.actor(broker=broker)
    def work(n: int) -> None:
        pass

    bell = listener(broker)
    broker.enqueue_many([work.message(n) for n in range(3)])
    work.send(4)
    assert bell.drain() == []
    assert len(stored(broker)) == 4


# -- batch() --------------------------------------------------------------------
def test_batch_runs_a_group_in_one_insert(broker: PostgresBroker) -> None:
    seen: list[int] = []

    @dramatiq.actor
    def member(n: int) -> None:
        seen.append(n)

    recorder = Recorder()
    broker.add_middleware(recorder)
    with broker.batch():
        group(member.message(n) for n in range(10)).run()
        assert stored(broker) == []
        assert len(recorder.before) == 10 and recorder.after == []  # after_enqueue waits for the write
    assert len(stored(broker)) == 10
    assert len(recorder.after) == 10
    with running_worker(broker, threads=2):
        broker.join(member.queue_name, timeout=30_000)
    assert sorted(seen) == list(range(10))


def test_batch_is_per_thread(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    with broker.batch():
        work.send(1)
        other = threading.Thread(target=work.send, args=(2,))
        other.start()
        other.join(30)
        assert len(stored(broker)) == 1  # the other thread was not inside the block
    assert len(stored(broker)) == 2


def test_batch_that_raises_enqueues_nothing(broker: PostgresBroker) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    recorder = Recorder()
    broker.add_middleware(recorder)
    with pytest.raises(KeyError), broker.batch():
        work.send(1)
        raise KeyError("abandon")
    assert stored(broker) == []
    assert recorder.after == []
    work.send(2)  # the block is over: sends go straight in again
    assert len(stored(broker)) == 1


# -- transaction() (the outbox) ---------------------------------------------------
@pytest.fixture
def orders(broker: PostgresBroker) -> Iterator[str]:
    """A business table next to the broker's tables."""
    name = f"{broker.schema}_orders"
    with broker.database.connection() as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, total int)").format(sql.Identifier(name)))
    yield name
    with broker.database.connection() as conn:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.Identifier(name)))


def test_outbox_commit_makes_row_and_message_visible_together(
    broker: PostgresBroker, orders: str, dramatiq_pg_url: str, listener: Callable[[PostgresBroker], Listener]
) -> None:
    found: list[Any] = []

    @dramatiq.actor
    def confirm(order_id: int) -> None:
        with psycopg.connect(dramatiq_pg_url) as conn:
            row = conn.execute(
                sql.SQL("SELECT total FROM {} WHERE id = %s").format(sql.Identifier(orders)), [order_id]
            ).fetchone()
        found.append(row[0] if row else None)

    bell = listener(broker)
    with psycopg.connect(dramatiq_pg_url) as conn:
        with conn.transaction(), broker.transaction(conn):
            conn.execute(sql.SQL("INSERT INTO {} VALUES (1, 42)").format(sql.Identifier(orders)))
            confirm.send(1)
            assert stored(broker) == []  # another connection sees nothing yet
            assert bell.drain(quiet=0.2) == []  # and the doorbell rings only at commit
        assert len(stored(broker)) == 1
        # "!back": the row's place in line is the transaction's start, behind consumers' floors
        assert bell.drain() == [f"!back {confirm.queue_name}", confirm.queue_name]
    with running_worker(broker, threads=2):
        broker.join(confirm.queue_name, timeout=30_000)
    assert found == [42]  # the actor saw the business row: they committed together


def test_outbox_rollback_drops_row_and_message(
    broker: PostgresBroker, orders: str, dramatiq_pg_url: str, listener: Callable[[PostgresBroker], Listener]
) -> None:
    @dramatiq.actor
    def confirm(order_id: int) -> None:
        pass

    bell = listener(broker)
    with psycopg.connect(dramatiq_pg_url) as conn:
        with pytest.raises(ZeroDivisionError), conn.transaction(), broker.transaction(conn):
            conn.execute(sql.SQL("INSERT INTO {} VALUES (2, 7)").format(sql.Identifier(orders)))
            confirm.send(2)
            confirm.send_with_options(args=(3,), delay=10_000)
            1 / 0  # noqa: B018 (the business logic fails)
        count = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(orders))).fetchone()
        assert count is not None and count[0] == 0
    assert stored(broker) == []
    assert bell.drain() == []  # a rolled-back NOTIFY is never delivered


def test_outbox_with_batch_writes_on_the_callers_connection(broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn), broker.batch():
            for n in range(5):
                work.send(n)
        assert stored(broker) == []  # written in the caller's still open transaction
        conn.rollback()
    assert stored(broker) == []

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn), broker.batch():
            for n in range(5):
                work.send(n)
        conn.commit()
    assert len(stored(broker)) == 5


def test_transaction_block_ends_with_the_block(broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            work.send(1)
        work.send(2)  # outside the block: the broker's own connection, committed at once
        assert len(stored(broker)) == 1
        conn.rollback()
    assert len(stored(broker)) == 1


# -- relaxed durability (synchronous_commit = off) ----------------------------------
def test_relaxed_mode_delivers(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(synchronous_commit=False, poll_interval=0.1)
    seen: list[int] = []

    @dramatiq.actor(broker=broker)
    def work(n: int) -> None:
        seen.append(n)

    for n in range(5):
        work.send(n)
    broker.enqueue_many([work.message(n) for n in range(5, 10)])
    with broker.batch():
        work.send(10)
    with running_worker(broker, threads=2):
        broker.join(work.queue_name, timeout=30_000)
    assert sorted(seen) == list(range(11))


@pytest.mark.parametrize("durable", [True, False])
def test_synchronous_commit_applies_to_the_enqueuing_transaction_only(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str, durable: bool
) -> None:
    """Relaxed mode turns synchronous_commit off for the enqueue's own transaction, never longer."""
    broker = dramatiq_pg_broker_factory(synchronous_commit=durable, pool_max_size=1)

    @dramatiq.actor(broker=broker)
    def work(n: int) -> None:
        pass

    with psycopg.connect(dramatiq_pg_url) as conn:
        with broker.transaction(conn):
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)
            work.send(1)
            assert conn.execute("SHOW synchronous_commit").fetchone() == ("on" if durable else "off",)
        conn.commit()
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)  # gone with the transaction

    work.send(2)  # on the broker's one pooled connection, in autocommit
    with broker.database.connection() as conn:
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("on",)  # nothing leaked to claims and acks
    assert len(stored(broker)) == 2


def test_durable_mode_keeps_the_callers_own_setting(dramatiq_pg_broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    @dramatiq.actor
    def work(n: int) -> None:
        pass

    with psycopg.connect(dramatiq_pg_url) as conn:
        conn.execute("SET LOCAL synchronous_commit = off")
        with dramatiq_pg_broker.transaction(conn):
            work.send(1)
        assert conn.execute("SHOW synchronous_commit").fetchone() == ("off",)
        conn.commit()
    assert len(stored(dramatiq_pg_broker)) == 1


# -- middleware hooks on the enqueue path ---------------------------------------------
def test_enqueue_hooks_keep_dramatiqs_order_and_error_handling(broker: PostgresBroker) -> None:
    """The broker skips inherited no-op hooks; what remains runs as Dramatiq runs it."""
    calls: list[str] = []

    class Tagged(Middleware):
        def __init__(self, tag: str, fail_after: bool = False) -> None:
            self.tag, self.fail_after = tag, fail_after

        def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            calls.append(f"before {self.tag}")

        def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
            calls.append(f"after {self.tag}")
            if self.fail_after:
                raise RuntimeError("a broken middleware")

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    broker.add_middleware(Tagged("a", fail_after=True))
    work.send(1)  # a failing after-hook is logged, as Dramatiq does, and the send still counts
    assert calls == ["before a", "after a"]
    broker.add_middleware(Tagged("b"))  # middleware added later take part at once
    calls.clear()
    work.send(2)
    assert calls == ["before a", "before b", "after b", "after a"]
    assert len(stored(broker)) == 2


# -- what a drained backlog leaves behind ---------------------------------------------
def test_consumers_vacuum_the_table_after_many_claims(broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims leave dead claim-index entries behind; the keeper vacuums after enough of them."""
    from dramatiq_pg_fenced.core import maintenance

    monkeypatch.setattr(maintenance, "VACUUM_AFTER_CLAIMS", 20)
    monkeypatch.setattr(maintenance, "VACUUM_MIN_INTERVAL", 0.0)

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    def vacuums() -> int:
        [(count,)] = query(
            broker,
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE schemaname = %s AND relname = 'message'",
            [broker.schema],
        )
        return int(count)

    assert vacuums() == 0
    broker.enqueue_many([work.message(n) for n in range(50)])
    with running_worker(broker, threads=2):
        broker.join(work.queue_name, timeout=30_000)
        wait_for(lambda: vacuums() > 0, what="a vacuum by the lease keeper")


def test_a_role_that_does_not_own_the_table_leaves_vacuum_to_autovacuum(
    broker: PostgresBroker, dramatiq_pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The owner vacuums; a role with only the privileges to work the queue does not try (VACUUM
    would only print a PostgreSQL warning every time) and says so once."""
    assert broker.parts.maintenance.vacuum()
    role = f"t_worker_{broker.schema}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            schema = sql.Identifier(broker.schema)
            admin.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, sql.Identifier(role)))
            grant = (
                "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}"  # ALL includes MAINTAIN (17+)
            )
            admin.execute(sql.SQL(grant).format(schema, sql.Identifier(role)))
            worker = PostgresBroker(make_conninfo(dramatiq_pg_url, user=role), schema=broker.schema)
            try:
                with caplog.at_level("INFO"):
                    assert not worker.parts.maintenance.vacuum()
                    assert not worker.parts.maintenance.vacuum()
                assert caplog.text.count("may not VACUUM") == 1
                worker.declare_queue("default")
                worker.enqueue(dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={}))
            finally:
                worker.close()
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert query(broker, "SELECT count(*) FROM {schema}.message")[0][0] == 1


def test_a_message_subclass_that_encodes_its_own_way_is_stored_its_way(broker: PostgresBroker) -> None:
    """The encoder's shortcut (no dataclass field lookup per message) leaves a subclass's own ``encode`` alone."""

    class Tagged(dramatiq.Message):  # type: ignore[type-arg]
        def encode(self) -> bytes:
            return b"tagged:" + super().encode()

    @dramatiq.actor
    def work(n: int) -> None:
        pass

    plain = work.message(1)
    tagged = Tagged(**plain.asdict())
    broker.enqueue_many([tagged] + [work.message(n) for n in range(MANY)])  # the chunked path
    broker.enqueue(Tagged(**work.message(2).asdict()))  # one statement
    payloads = [bytes(p) for (p,) in query(broker, "SELECT payload FROM {schema}.message ORDER BY seq")]
    assert payloads[0].startswith(b"tagged:") and payloads[-1].startswith(b"tagged:")
    assert not any(p.startswith(b"tagged:") for p in payloads[1:-1])
