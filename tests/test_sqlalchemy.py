"""SQLAlchemy 2 on psycopg 3: sends in a Session's (or a Connection's) transaction exist if and
only if it commits, and then run like any other message."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from helpers import Factory, acked, expire_and_rescue, running_worker

sqlalchemy = pytest.importorskip("sqlalchemy")

from sqlalchemy import Engine, create_engine, text  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from dramatiq_pg_fenced import PostgresBroker  # noqa: E402
from dramatiq_pg_fenced.core import delivery  # noqa: E402
from dramatiq_pg_fenced.errors import DeliveryLost, FencedTransactionError, NestedSendError  # noqa: E402
from dramatiq_pg_fenced.integrations.sqlalchemy import fenced_transaction, outbox  # noqa: E402


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory(poll_interval=0.2)
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def engine(dramatiq_pg_url: str, broker: PostgresBroker) -> Iterator[Engine]:
    """An engine on the postgresql+psycopg driver, with an orders table in the broker's schema."""
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dramatiq_pg_url))
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE \"{broker.schema}\".orders (id int PRIMARY KEY, status text DEFAULT 'new')"))
    yield engine
    engine.dispose()


def place(session: Session, broker: PostgresBroker, order_id: int) -> None:
    session.execute(text(f'INSERT INTO "{broker.schema}".orders (id) VALUES (:id)'), {"id": order_id})


def status(engine: Engine, broker: PostgresBroker, order_id: int) -> str | None:
    with engine.connect() as conn:
        return conn.execute(text(f'SELECT status FROM "{broker.schema}".orders WHERE id = :id'),
                            {"id": order_id}).scalar()  # fmt: skip


@pytest.fixture
def confirm(broker: PostgresBroker, engine: Engine) -> dramatiq.Actor:
    @dramatiq.actor(broker=broker, queue_name="orders", max_retries=0)
    def confirm_order(order_id: int) -> None:
        with engine.begin() as conn:
            done = conn.execute(text(f'UPDATE "{broker.schema}".orders SET status = \'confirmed\' WHERE id = :id'),
                                {"id": order_id}).rowcount  # fmt: skip
        if not done:
            raise LookupError(f"order {order_id} is not there")

    return confirm_order


def test_a_send_in_a_committed_session_runs_and_finds_its_row(
    broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor
) -> None:
    # Given an order and its confirmation sent in one session transaction
    with Session(engine) as session, session.begin():
        with outbox(session):
            place(session, broker, 1)
            message = confirm.send(1)
        # not visible before the commit
        assert broker.inspect(message.message_id) is None
    # When a worker runs, I expect the actor to find the order
    with running_worker(broker):
        broker.join("orders", timeout=30_000)
    assert status(engine, broker, 1) == "confirmed"
    info = broker.inspect(message.message_id)
    assert info is not None and (info["state"], info["attempt"]) == ("done", 1)


def test_a_rolled_back_session_leaves_neither_row_nor_message(
    broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor
) -> None:
    with pytest.raises(ValueError), Session(engine) as session, session.begin(), outbox(session):
        place(session, broker, 2)
        message = confirm.send(2)
        raise ValueError("refused")
    assert broker.inspect(message.message_id) is None and status(engine, broker, 2) is None
    with Session(engine) as session:  # session.rollback() the same
        with outbox(session):
            place(session, broker, 3)
            message = confirm.send(3)
        session.rollback()
    assert broker.inspect(message.message_id) is None and status(engine, broker, 3) is None


def test_a_savepoint_rolled_back_takes_only_its_messages(
    broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor
) -> None:
    with Session(engine) as session:
        with outbox(session):
            place(session, broker, 4)
            kept = confirm.send(4)
            try:
                with session.begin_nested():
                    place(session, broker, 5)
                    dropped = confirm.send(5)
                    raise ValueError
            except ValueError:
                pass
        session.commit()
    assert broker.inspect(kept.message_id) is not None and status(engine, broker, 4) == "new"
    assert broker.inspect(dropped.message_id) is None and status(engine, broker, 5) is None


def test_a_commit_inside_the_block_is_refused_and_sends_nothing(
    broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor
) -> None:
    with pytest.raises(NestedSendError, match="end the block first"), Session(engine) as session, session.begin():
        with outbox(session):
            place(session, broker, 6)
            message = confirm.send(6)
            session.commit()
    assert broker.inspect(message.message_id) is None and status(engine, broker, 6) is None
    # the session is usable again: commit after the block
    with Session(engine) as session:
        with outbox(session):
            place(session, broker, 7)
            message = confirm.send(7)
        session.commit()
    assert broker.inspect(message.message_id) is not None


def test_a_core_connection_works_the_same(broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor) -> None:
    with engine.begin() as conn, outbox(conn):
        committed = confirm.send(8)
    with engine.connect() as conn:
        with outbox(conn):
            rolled_back = confirm.send(9)
        conn.rollback()
    with pytest.raises(NestedSendError), engine.connect() as conn, outbox(conn):
        confirm.send(10)
        conn.commit()
    assert broker.inspect(committed.message_id) is not None
    assert broker.inspect(rolled_back.message_id) is None


def test_a_send_under_an_id_already_queued_is_reported_and_counted(
    broker: PostgresBroker, engine: Engine, confirm: dramatiq.Actor
) -> None:
    message = confirm.message(11)
    before = broker.stats()["process"]["duplicate_sends"]
    for _ in range(2):
        with Session(engine) as session, session.begin(), outbox(session):
            broker.enqueue(message)
    assert broker.stats()["process"]["duplicate_sends"] == before + 1


# The fenced transaction on a Session or a Connection: the actor's writes commit with its ack.


def counted(engine: Engine, broker: PostgresBroker) -> dict[int, int]:
    with engine.connect() as conn:
        return dict(conn.execute(text(f'SELECT id, n FROM "{broker.schema}".counts')).all())  # type: ignore[arg-type]


@pytest.fixture
def count(broker: PostgresBroker, engine: Engine) -> Iterator[tuple[dramatiq.Actor, list[tuple]]]:
    """An actor adding 1 to a row of ``counts`` inside fenced_transaction(), on a Session or a Connection,
    and what it saw: ("body", attempt), ("after", state), ("lost", attempt), ("refused", text)...

    *how*: ``hold`` waits inside the block for the test's event, then reads the message's state after
    it; ``fail_first`` raises inside the block on attempt 1; ``lose_first`` lets attempt 1's lease
    lapse and its message be rescued before the block begins; ``in_a_transaction`` opens the
    session's transaction first; ``commit_inside`` commits inside the body."""
    with engine.begin() as conn:
        conn.execute(text(f'CREATE TABLE "{broker.schema}".counts (id int PRIMARY KEY, n int NOT NULL)'))
    seen: list[tuple] = []
    inside, hold = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker, queue_name="fenced", max_retries=3, min_backoff=10, max_backoff=10)
    def add_one(key: int, on: str = "session", how: str = "") -> None:
        attempt = delivery.running().attempt  # type: ignore[union-attr]
        if how == "lose_first" and attempt == 1:
            seen.append(("rescued", expire_and_rescue(broker)))
        write = text(
            f'INSERT INTO "{broker.schema}".counts (id, n) VALUES (:id, 1) '
            "ON CONFLICT (id) DO UPDATE SET n = counts.n + 1"
        )
        with Session(engine) if on == "session" else engine.connect() as session:
            if how == "in_a_transaction":
                session.execute(text("SELECT 1"))
            try:
                with fenced_transaction(session) as conn:
                    seen.append(("body", attempt))
                    session.execute(write, {"id": key})
                    if how == "hold":
                        inside.set()
                        hold.wait(30)
                    if how == "fail_first" and attempt == 1:
                        raise RuntimeError("fails inside the block")
                    if how == "commit_inside":
                        session.commit()
                    if how == "broken_commit":  # the COMMIT applies, then its connection breaks
                        real = conn.commit

                        def broken() -> None:
                            conn.commit = real  # type: ignore[method-assign]  # once
                            real()
                            raise psycopg.OperationalError("server closed the connection unexpectedly")

                        conn.commit = broken  # type: ignore[method-assign]
            except DeliveryLost:
                seen.append(("lost", attempt))
                raise
            except (FencedTransactionError, NestedSendError) as e:
                seen.append(("refused", str(e)))
        if how == "hold":
            info = broker.inspect(delivery.running().message_id)  # type: ignore[union-attr]
            seen.append(("after", info and info["state"]))

    add_one.inside, add_one.hold = inside, hold  # type: ignore[attr-defined]
    yield add_one, seen


@pytest.mark.parametrize("on", ["session", "connection"])
def test_the_sessions_write_commits_with_the_ack_and_not_before(
    broker: PostgresBroker, engine: Engine, count: tuple[dramatiq.Actor, list[tuple]], on: str
) -> None:
    add_one, seen = count
    with running_worker(broker):
        # Given an actor held inside its block after its write
        message = add_one.send(1, on, "hold")
        assert add_one.inside.wait(30)  # type: ignore[attr-defined]
        # I expect neither the write nor the ack visible while it is open
        assert counted(engine, broker) == {}
        assert broker.inspect(message.message_id)["state"] == "running"  # type: ignore[index]
        # and both once it ends, before the actor returns
        add_one.hold.set()  # type: ignore[attr-defined]
        broker.join("fenced", timeout=30_000)
        assert broker.flush_outcomes(10)
    assert seen == [("body", 1), ("after", "done")]
    assert counted(engine, broker) == {1: 1}
    assert acked(broker, message.message_id, attempt=1)


def test_a_delivery_that_lost_its_message_writes_nothing_and_raises_DeliveryLost(
    broker: PostgresBroker, engine: Engine, count: tuple[dramatiq.Actor, list[tuple]]
) -> None:
    add_one, seen = count
    with running_worker(broker):
        message = add_one.send(2, "session", "lose_first")
        broker.join("fenced", timeout=30_000)
        assert broker.flush_outcomes(10)
    assert sorted(seen, key=str) == sorted([("rescued", 1), ("lost", 1), ("body", 2)], key=str)
    assert counted(engine, broker) == {2: 1}
    assert acked(broker, message.message_id, attempt=2)


def test_an_exception_in_the_body_rolls_back_and_the_retry_writes(
    broker: PostgresBroker, engine: Engine, count: tuple[dramatiq.Actor, list[tuple]]
) -> None:
    add_one, seen = count
    with running_worker(broker):
        message = add_one.send(3, "connection", "fail_first")
        broker.join("fenced", timeout=30_000)
        assert broker.flush_outcomes(10)
    assert seen == [("body", 1), ("body", 2)]
    assert counted(engine, broker) == {3: 1}  # the first attempt's write rolled back
    assert acked(broker, message.message_id, attempt=2)


def test_it_is_refused_in_a_transaction_already_on_a_commit_inside_and_outside_an_actor(
    broker: PostgresBroker, engine: Engine, count: tuple[dramatiq.Actor, list[tuple]]
) -> None:
    add_one, seen = count
    with pytest.raises(FencedTransactionError, match="outside an actor"), Session(engine) as session:
        with fenced_transaction(session):
            pass
    with running_worker(broker):
        add_one.send(4, "session", "in_a_transaction")
        add_one.send(5, "session", "commit_inside")
        add_one.send(6, "connection", "commit_inside")
        broker.join("fenced", timeout=30_000)
        assert broker.flush_outcomes(10)
    refused = sorted(e for kind, e in seen if kind == "refused")
    assert len(refused) == 3, seen
    assert "in a transaction already" in refused[2]
    assert all("commit inside fenced_transaction()" in e for e in refused[:2])
    assert counted(engine, broker) == {}  # nothing of the refused blocks written


@pytest.mark.parametrize("on", ["session", "connection"])
def test_a_commit_whose_connection_broke_after_it_applied_counts_as_committed(
    broker: PostgresBroker, engine: Engine, count: tuple[dramatiq.Actor, list[tuple]], on: str
) -> None:
    """Given a block whose COMMIT applies but whose connection breaks before the reply, I expect the block
    to find that it committed (the actor goes on, nothing is retried), the write applied once, and the
    message acked by that delivery with no stale write."""
    add_one, seen = count
    with running_worker(broker):
        message = add_one.send(7, on, "broken_commit")
        broker.join("fenced", timeout=30_000)
        assert broker.flush_outcomes(10)
    assert seen == [("body", 1)]
    assert counted(engine, broker) == {7: 1}
    assert acked(broker, message.message_id, attempt=1)
    assert broker.stats()["process"]["stale_writes"] == 0
