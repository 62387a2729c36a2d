"""Exactly-once effects in the broker's database (issue 28): ``broker.fenced_transaction()``.

An actor's own writes commit with its delivery's ack, under its fence, or not at all.  These tests
run an in-process worker; ``tests/test_faults.py`` (section 6) runs real worker processes under
SIGSTOP and SIGKILL.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.errors import QueueJoinTimeout
from dramatiq.results import Results
from helpers import Factory, expire_and_rescue, query, running_worker, wait_for

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import maintenance as maintenance_module
from dramatiq_pg_fenced.errors import DeliveryLost, FencedTransactionError, NestedSendError
from dramatiq_pg_fenced.features.results import PostgresBackend
from dramatiq_pg_fenced.ops.admin import CancelOutcome


def with_counter(broker: PostgresBroker) -> None:
    query(broker, "CREATE TABLE {schema}.counter_rows (id text PRIMARY KEY, n int NOT NULL)")


def add_one(conn: psycopg.Connection, schema: str, key: str) -> None:
    conn.execute(
        f'INSERT INTO "{schema}".counter_rows (id, n) VALUES (%s, 1) ON CONFLICT (id) DO UPDATE SET n = counter_rows.n + 1',
        [key],
    )


def counts(broker: PostgresBroker) -> dict[str, int]:
    return dict(query(broker, "SELECT id, n FROM {schema}.counter_rows"))  # type: ignore[arg-type]


def left(broker: PostgresBroker) -> list[tuple]:
    return query(broker, "SELECT state, count(*) FROM {schema}.message GROUP BY state")


def stale(broker: PostgresBroker) -> int:
    return int(broker.stats()["totals"].get("stale_writes", 0))


def test_the_actors_write_commits_with_its_ack_on_the_brokers_connection(dramatiq_pg_broker_factory: Factory) -> None:
    """Given an actor that adds 1 inside the block and sends a message there, I expect the row, the
    ack and the message in one transaction: the counter at 1, the message gone (kept in history), the
    sent message delivered, nothing left to write, no stale write."""
    broker = dramatiq_pg_broker_factory(keep_finished=3600)
    with_counter(broker)
    seen: list[str] = []

    @dramatiq.actor(broker=broker)
    def receipt(key: str) -> None:
        seen.append(key)

    @dramatiq.actor(broker=broker)
    def pay(key: str) -> None:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
            receipt.send(key)  # a row of the block's transaction

    with running_worker(broker, threads=2):
        for i in range(5):
            pay.send(f"k{i}")
        broker.join(pay.queue_name, timeout=30_000)
        wait_for(lambda: len(seen) == 5, 30, "the receipts")
        assert broker.flush_outcomes(10)
    assert counts(broker) == {f"k{i}": 1 for i in range(5)}
    assert left(broker) == []
    assert query(broker, "SELECT count(*) FROM {schema}.history WHERE actor_name = 'pay'") == [(5,)]
    assert query(broker, "SELECT count(*) FROM {schema}.message WHERE state = 'committed'") == [
        (0,)
    ]  # every row finished
    assert stale(broker) == 0


def test_the_block_runs_on_a_psycopg_connection_of_the_callers(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    """Given the actor's own psycopg connection (autocommit or not), I expect the same: its write and
    the ack commit together, and the connection is idle again after the block."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    states: list[Any] = []

    @dramatiq.actor(broker=broker)
    def pay(key: str, autocommit: bool) -> None:
        with psycopg.connect(dramatiq_pg_url, autocommit=autocommit) as mine:
            with broker.fenced_transaction(mine) as conn:
                assert conn is mine
                add_one(conn, broker.schema, key)
            states.append(mine.info.transaction_status)

    with running_worker(broker, threads=2):
        pay.send("auto", True)
        pay.send("manual", False)
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert counts(broker) == {"auto": 1, "manual": 1}
    assert left(broker) == []
    assert states == [psycopg.pq.TransactionStatus.IDLE] * 2


def test_an_exception_inside_the_block_rolls_back_and_the_message_is_retried(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given an actor whose first attempt fails inside the block after its write, I expect that write
    rolled back and the retry to apply it: the counter at 1 after two attempts."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    attempts: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=10)
    def pay(key: str) -> None:
        attempts.append(1)
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
            if len(attempts) == 1:
                raise RuntimeError("fails inside the block")

    with running_worker(broker, threads=1):
        pay.send("k")
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert len(attempts) == 2
    assert counts(broker) == {"k": 1}
    assert left(broker) == []
    assert stale(broker) == 0


@pytest.mark.parametrize("max_retries", [0, 3])
def test_an_exception_after_the_block_is_logged_and_neither_retried_nor_dead_lettered(
    dramatiq_pg_broker_factory: Factory, caplog: pytest.LogCaptureFixture, max_retries: int
) -> None:
    """Given an actor that raises after its block committed, I expect the message done (acked, not
    retried, not dead-lettered), the write applied once, one error line saying so, no stale write."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=max_retries, min_backoff=10, max_backoff=10)
    def pay(key: str) -> None:
        runs.append(1)
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        raise RuntimeError("fails after the block")

    with caplog.at_level(logging.ERROR), running_worker(broker, threads=1):
        message = pay.send("k")
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert runs == [1]
    assert counts(broker) == {"k": 1}
    assert left(broker) == []
    assert stale(broker) == 0
    said = [r for r in caplog.records if "after its fenced transaction committed" in r.getMessage()]
    assert len(said) == 1 and message.message_id in said[0].getMessage()
    assert "fails after the block" in said[0].getMessage()


def test_a_delivery_that_lost_its_message_writes_nothing(dramatiq_pg_broker_factory: Factory) -> None:
    """Given a delivery whose lease lapsed and whose message went back to the queue before its block
    began, I expect DeliveryLost at the block's start, nothing of its body run or written, one stale
    write counted, and the redelivery to apply the write: the counter at 1."""
    broker = dramatiq_pg_broker_factory(lease_seconds=30)
    with_counter(broker)
    started, go = threading.Event(), threading.Event()
    raised: list[BaseException] = []
    bodies: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=10)
    def pay(key: str) -> None:
        attempt = dramatiq.middleware.CurrentMessage.get_current_message().options["attempt"]  # type: ignore[union-attr]
        if attempt == 1:
            started.set()
            go.wait(30)
        try:
            with broker.fenced_transaction() as conn:
                bodies.append(attempt)
                add_one(conn, broker.schema, key)
        except DeliveryLost as e:
            raised.append(e)
            raise

    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    with running_worker(broker, threads=2):
        pay.send("k")
        wait_for(started.is_set, 30, "attempt 1 to start")
        # Its worker "pauses" past its lease: the rescuer puts the message back, another thread takes it.
        assert expire_and_rescue(broker) == 1
        wait_for(lambda: counts(broker) == {"k": 1}, 30, "attempt 2's write")
        go.set()
        wait_for(lambda: raised, 30, "attempt 1's DeliveryLost")
        assert broker.flush_outcomes(10)
        wait_for(lambda: stale(broker) == 1, 10, "the stale ack counted")
    assert bodies == [2]
    assert counts(broker) == {"k": 1}
    assert left(broker) == []


def test_a_rescue_leaves_a_row_locked_by_an_open_block_alone(dramatiq_pg_broker_factory: Factory) -> None:
    """Given a block that outlives its lease (the keeper cannot extend a row the block has locked), I
    expect the rescuer to skip it, not wait for it, and the block's commit to apply: the counter at 1,
    one run, nothing redelivered."""
    # Rescue only by hand: the process's own (every second) could take the row back between the actor's
    # expiry below and its block's lock, and the block would then fail as lost.
    broker = dramatiq_pg_broker_factory(lease_seconds=30, rescue_interval=3600)
    with_counter(broker)
    inside, go = threading.Event(), threading.Event()
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> None:
        runs.append(1)
        # The lease lapses (as while the block runs past it): set before the block locks the row.
        query(broker, "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 second'")
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
            inside.set()
            go.wait(30)

    with running_worker(broker, threads=1):
        pay.send("k")
        wait_for(inside.is_set, 30, "the block to begin")
        t0 = time.monotonic()
        assert broker.parts.maintenance.rescue() == 0  # skipped, not waited for
        assert time.monotonic() - t0 < 5
        go.set()
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert runs == [1]
    assert counts(broker) == {"k": 1}
    assert left(broker) == []
    assert stale(broker) == 0


def test_a_committed_message_is_never_delivered_again_and_maintenance_finishes_a_dead_workers(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a block that committed and a process that then stops extending its lease before its
    outcome writer finishes the row (as if it died), its lease long past, I expect the rescue to leave it alone (it is done,
    not lost), a cancel to find it finished, maintenance to finish it into the history (without what
    the delivery caused after its block), and the worker's late outcome, when it comes, to write
    nothing and break nothing: the write applied once."""
    broker = dramatiq_pg_broker_factory(lease_seconds=30)
    with_counter(broker)
    committed, go = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, max_retries=3)
    def pay(key: str) -> None:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        committed.set()
        go.wait(30)

    with running_worker(broker, threads=1):
        message = pay.send("k")
        wait_for(committed.is_set, 30, "the block to commit")
        assert left(broker) == [("committed", 1)]
        broker.parts.keeper.stop()  # as if its process died: nothing extends the committed row's lease
        query(broker, "UPDATE {schema}.message SET lease_expires_at = now() - interval '2 hours'")
        # The rescue finishes committed rows once per lease at most: the worker's own rescue, run by its
        # maintenance thread before the lease was set two hours back above, would leave this finish for later
        # (CI: the row still committed).  It is due now.
        monkeypatch.setattr(broker.parts.maintenance, "_last_finish", -math.inf)
        assert broker.parts.maintenance.rescue() == 0
        assert broker.cancel(message.message_id).value == "not_found"
        broker.parts.maintenance.purge()
        assert left(broker) == []
        assert broker.inspect(message.message_id)["state"] == "done"  # type: ignore[index]
        go.set()
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert counts(broker) == {"k": 1}
    assert left(broker) == []


def test_what_the_delivery_causes_after_the_block_is_written_once(dramatiq_pg_broker_factory: Factory) -> None:
    """Given an actor with a stored result, a pipeline's next step and an on_success callback, I expect
    each written once after its block committed the ack: the result readable, the next step and the
    callback run once."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend, store_results=True))
    after: list[str] = []

    @dramatiq.actor(broker=broker)
    def pay(key: str) -> str:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        return f"paid {key}"

    @dramatiq.actor(broker=broker)
    def then(previous: str) -> None:
        after.append(previous)

    @dramatiq.actor(broker=broker)
    def on_paid(message: dict, result: str) -> None:
        after.append(f"callback {result}")

    with running_worker(broker, threads=2):
        first = pay.send_with_options(args=("a",), on_success=on_paid)
        pipe = dramatiq.pipeline([pay.message("b"), then.message()], broker=broker).run()
        assert backend.get_result(first, block=True, timeout=10_000) == "paid a"
        pipe.get_result(block=True, timeout=10_000)
        wait_for(lambda: len(after) == 2, 30, "the next step and the callback")
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert sorted(after) == ["callback paid a", "paid b"]
    assert counts(broker) == {"a": 1, "b": 1}
    assert left(broker) == []
    assert query(broker, "SELECT count(*) FROM {schema}.message WHERE state = 'committed'") == [(0,)]
    assert stale(broker) == 0


def test_the_block_refuses_what_it_cannot_keep(dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str) -> None:
    """Outside an actor, on a connection in a transaction, or a second time in one delivery:
    FencedTransactionError, and nothing is written."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    errors: list[str] = []

    with pytest.raises(FencedTransactionError, match="outside an actor"), broker.fenced_transaction():
        pass

    @dramatiq.actor(broker=broker, max_retries=0)
    def twice(key: str) -> None:
        with psycopg.connect(dramatiq_pg_url) as busy:
            busy.execute("SELECT 1")  # an implicit transaction is open
            try:
                with broker.fenced_transaction(busy):
                    pass
            except FencedTransactionError as e:
                errors.append(str(e))
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        try:
            with broker.fenced_transaction():
                pass
        except FencedTransactionError as e:
            errors.append(str(e))

    with running_worker(broker, threads=1):
        twice.send("k")
        broker.join(twice.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert len(errors) == 2 and "in a transaction already" in errors[0] and "committed already" in errors[1]
    assert counts(broker) == {"k": 1}
    assert left(broker) == []


def test_with_ack_inside_the_block_is_refused_naming_the_block(dramatiq_pg_broker_factory: Factory) -> None:
    """with_ack() inside fenced_transaction(): NestedSendError, naming the block the actor opened (not
    broker.transaction(conn), which it never called); the block rolls back."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    errors: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> None:
        try:
            with broker.fenced_transaction() as conn:
                add_one(conn, broker.schema, key)
                with broker.with_ack():
                    pass
        except NestedSendError as e:
            errors.append(str(e))

    with running_worker(broker, threads=1):
        pay.send("k")
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert len(errors) == 1 and errors[0].startswith("with_ack() inside fenced_transaction():"), errors
    assert "broker.transaction" not in errors[0]
    assert counts(broker) == {}


def test_a_cancel_of_a_message_inside_its_block_answers_at_once_and_changes_nothing(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given an actor whose block is open (its row locked, as when its process is stopped inside it), I
    expect cancel() not to wait for the block: it answers that the message is inside a fenced
    transaction and changes nothing; the block then commits (the counter at 1, the message done), and a
    cancel after it finds nothing to cancel."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    inside, go = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> None:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
            inside.set()
            go.wait(30)

    with running_worker(broker, threads=1):
        message = pay.send("k")
        wait_for(inside.is_set, 30, "the block to begin")
        try:
            assert broker.cancel(message.message_id) is CancelOutcome.IN_FENCED_TRANSACTION
            assert query(broker, "SELECT state FROM {schema}.message") == [("running",)]
        finally:
            go.set()
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert counts(broker) == {"k": 1}
    assert left(broker) == []
    assert broker.cancel(message.message_id) is CancelOutcome.NOT_FOUND


def test_join_waits_for_an_actor_still_running_after_its_block_committed(dramatiq_pg_broker_factory: Factory) -> None:
    """The block's commit moves the row to ``committed``; the actor is still running (its code after
    the block, a broken reply to the commit being read again).  ``join()`` waits for it, as for any
    running message: it returned at the commit, and a Django scenario asserted on what the actor
    had not yet done (CI)."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    after, done = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> None:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        after.wait(30)  # the actor goes on after its block
        done.set()

    with running_worker(broker, threads=1):
        pay.send("k")
        wait_for(lambda: counts(broker) == {"k": 1}, 30, "the block to commit")
        joined = threading.Event()
        joiner = threading.Thread(target=lambda: (broker.join(pay.queue_name, timeout=30_000), joined.set()))
        joiner.start()
        try:
            assert not joined.wait(1.0), "join() returned while the actor was still running"
        finally:
            after.set()
        joiner.join(30)
        assert joined.is_set() and done.is_set()


def test_join_waits_for_a_dead_workers_committed_row_until_maintenance_finishes_it(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A committed row whose worker died is not a finished message until maintenance finishes it
    (ten leases after its lease): ``join()`` times out on it meanwhile, and returns once it is done."""
    broker = dramatiq_pg_broker_factory(lease_seconds=30)
    broker.declare_queue("q")
    broker.enqueue(dramatiq.Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={}))
    consumer = broker.consume("q", prefetch=1, timeout=1000)
    try:
        assert next(consumer) is not None
    finally:
        consumer.close()  # its writer gone: as a worker that died after its block committed
    broker.parts.keeper.stop()  # and its lease keeper: nothing extends the committed row's lease
    # Its lease ran out, but not ten leases ago: no rescue finishes it yet (this process's own included).
    query(broker, "UPDATE {schema}.message SET state = 'committed', lease_expires_at = now() - interval '1 minute'")
    with pytest.raises(QueueJoinTimeout):
        broker.join("q", timeout=300)
    query(broker, "UPDATE {schema}.message SET lease_expires_at = now() - interval '2 hours'")
    monkeypatch.setattr(broker.parts.maintenance, "_last_finish", -math.inf)
    assert broker.parts.maintenance.rescue() == 0  # finished, not taken back
    broker.join("q", timeout=5_000)
    assert left(broker) == []


def finish_passes(broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the passes of the process's own maintenance that tried to finish committed rows (at most
    one per lease); returns the list the count is kept in (its length)."""
    maintenance = broker.parts.maintenance
    passes: list[int] = []
    rescue = maintenance.rescue

    def counted(full: bool = True) -> int:
        before = maintenance._last_finish
        taken = rescue(full=full)
        if maintenance._last_finish != before:
            passes.append(1)
        return taken

    monkeypatch.setattr(maintenance, "rescue", counted)
    return passes


def test_an_actor_that_runs_on_for_leases_after_its_block_keeps_its_row_and_what_it_causes(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a pipeline whose first step commits its block and then runs on for several leases (its
    process alive, its maintenance running every pass meanwhile, a grace of one lease), I expect its
    lease keeper to keep the committed row, ``join()`` to wait for it, and, once the actor returns,
    its result stored, the next step run with it, and the row finished by its own outcome: no
    stale write, no maintenance finish."""
    monkeypatch.setattr(maintenance_module, "COMMITTED_GRACE_LEASES", 1)  # ten leases: a test of 12 s
    broker = dramatiq_pg_broker_factory(lease_seconds=1, rescue_interval=0.2)
    with_counter(broker)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend, store_results=True))
    passes = finish_passes(broker, monkeypatch)
    committed, go = threading.Event(), threading.Event()
    after: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> str:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        committed.set()
        assert go.wait(60), "the test never let the actor return"
        return f"paid {key}"

    @dramatiq.actor(broker=broker, max_retries=0)
    def then(previous: str) -> str:
        after.append(previous)
        return f"then {previous}"

    with running_worker(broker, threads=2):
        first = pay.message("k")
        pipe = dramatiq.pipeline([first, then.message()], broker=broker).run()
        wait_for(committed.is_set, 30, "the block to commit")
        seen = len(passes)
        # A pass is one lease at least after the one before: past the commit's lease and its grace.
        wait_for(lambda: len(passes) >= seen + 4, 60, "four finish passes of maintenance")
        try:
            assert left(broker) == [("committed", 1)]
            with pytest.raises(QueueJoinTimeout):
                broker.join(pay.queue_name, timeout=300)
        finally:
            go.set()
        assert pipe.get_result(block=True, timeout=30_000) == "then paid k"
        assert backend.get_result(first, block=True, timeout=10_000) == "paid k"
        broker.join(pay.queue_name, timeout=30_000)
        broker.join(then.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert after == ["paid k"]
    assert counts(broker) == {"k": 1}
    assert left(broker) == []
    assert stale(broker) == 0


def test_a_committed_row_whose_process_stopped_extending_it_is_finished_by_maintenance(
    dramatiq_pg_broker_factory: Factory, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given an actor that commits its block and runs on while its process's lease keeper stops (as in
    a process stopped or cut off from the database), I expect maintenance to finish the committed row
    a grace after its lease lapsed, saying so (the lease lapsed: its process stopped extending it),
    and the actor's outcome afterwards to write nothing: no result, no next step, the write once."""
    monkeypatch.setattr(maintenance_module, "COMMITTED_GRACE_LEASES", 1)
    broker = dramatiq_pg_broker_factory(lease_seconds=1, rescue_interval=0.2)
    with_counter(broker)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend, store_results=True))
    committed, go = threading.Event(), threading.Event()
    after: list[str] = []

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> str:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        committed.set()
        assert go.wait(60), "the test never let the actor return"
        return f"paid {key}"

    @dramatiq.actor(broker=broker, max_retries=0)
    def then(previous: str) -> None:
        after.append(previous)

    caplog.set_level(logging.WARNING)
    with running_worker(broker, threads=2):
        first = pay.message("k")
        dramatiq.pipeline([first, then.message()], broker=broker).run()
        wait_for(committed.is_set, 30, "the block to commit")
        broker.parts.keeper.stop()  # it extends nothing more
        try:
            wait_for(lambda: left(broker) == [], 60, "maintenance to finish the committed row")
        finally:
            go.set()
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
        assert broker.inspect(first.message_id)["state"] == "done"  # type: ignore[index]
        said = [r.getMessage() for r in caplog.records if "fenced transaction committed" in r.getMessage()]
        assert [s for s in said if first.message_id in s and "the lease of its committed row lapsed" in s], said
        assert all("its process stopped extending it" in s for s in said), said
        with pytest.raises(dramatiq.results.ResultMissing):
            backend.get_result(first)
    assert after == []
    assert counts(broker) == {"k": 1}


def test_an_actor_running_on_after_its_block_counts_as_busy_and_holds_its_slot(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given one worker thread with a prefetch of one whose actor runs on after its block committed,
    and a second message waiting, I expect the process to count that actor busy (what its heartbeat
    writes for operators), and not to claim the second message while it runs: the block settled the
    delivery, freeing its slot and calling the thread idle, as if the actor had returned."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    committed, go = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> None:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        if key == "a":
            committed.set()
            assert go.wait(60), "the test never let the actor return"

    with running_worker(broker, threads=1, prefetch=1):
        first = pay.send("a")
        wait_for(committed.is_set, 30, "the block to commit")
        second = pay.send("b")
        try:
            leases = broker.parts.leases
            assert leases.running() == [first.message_id]
            assert leases.activity() == {pay.queue_name: (1, 0)}
            # The consumer polls for room every moment; a free slot would claim the second message now.
            assert leases.wait_for_capacity(pay.queue_name, 1, 0.5) is False
            assert query(broker, "SELECT state FROM {schema}.message WHERE message_id = %s", [second.message_id]) == [
                ("queued",)
            ]
        finally:
            go.set()
        broker.join(pay.queue_name, timeout=30_000)
        assert broker.flush_outcomes(10)
    assert counts(broker) == {"a": 1, "b": 1}
    assert left(broker) == []


def test_a_results_backend_of_its_own_stores_the_result_of_an_actor_whose_block_committed(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    """Given a results backend with a pool of its own on the broker's schema (no ``broker=``: it
    writes at once, fenced on the delivery's row), and an actor that returns a value, or raises, after
    its block committed, I expect the value stored, and the error stored as its failure: the row is
    this delivery's, ``committed``; no stale write (it was fenced on ``running`` only, and refused)."""
    broker = dramatiq_pg_broker_factory()
    with_counter(broker)
    backend = PostgresBackend(dramatiq_pg_url, schema=broker.schema)
    broker.add_middleware(Results(backend=backend, store_results=True))

    @dramatiq.actor(broker=broker, max_retries=0)
    def pay(key: str) -> str:
        with broker.fenced_transaction() as conn:
            add_one(conn, broker.schema, key)
        if key == "b":
            raise ValueError("after the block")
        return f"paid {key}"

    try:
        with running_worker(broker, threads=2):
            good, bad = pay.send("a"), pay.send("b")
            assert backend.get_result(good, block=True, timeout=10_000) == "paid a"
            with pytest.raises(dramatiq.results.ResultFailure, match="after the block"):
                backend.get_result(bad, block=True, timeout=10_000)
            broker.join(pay.queue_name, timeout=30_000)
            assert broker.flush_outcomes(10)
    finally:
        backend.close()
    assert counts(broker) == {"a": 1, "b": 1}
    assert left(broker) == []
    assert stale(broker) == 0
