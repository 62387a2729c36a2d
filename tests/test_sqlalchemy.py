"""SQLAlchemy 2 on psycopg 3: sends in a Session's (or a Connection's) transaction exist if and
only if it commits, and then run like any other message."""

from __future__ import annotations

from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from helpers import Factory, running_worker

sqlalchemy = pytest.importorskip("sqlalchemy")

from sqlalchemy import Engine, create_engine, text  # noqa: E402
from sqlalchemy.orm import Session  # noqa: E402

from dramatiq_pg_fenced import PostgresBroker  # noqa: E402
from dramatiq_pg_fenced.errors import NestedSendError  # noqa: E402
from dramatiq_pg_fenced.integrations.sqlalchemy import outbox  # noqa: E402


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
