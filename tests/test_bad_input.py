"""Bad input: garbage rows, unknown actors, oversized payloads, bad names, no database."""

from __future__ import annotations

import logging
import traceback
import uuid
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.errors import BrokerConnectionError, QueueNotFound
from helpers import Factory, query
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PayloadTooLarge, PostgresBroker


def count(broker: PostgresBroker) -> int:
    return query(broker, "SELECT count(*) FROM {schema}.message")[0][0]


def message_for(actor_name: str, queue_name: str = "default") -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue_name, actor_name=actor_name, args=(), kwargs={}, options={})


# -- message ids -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "message_id",
    ["ABCDEF12-3456-4789-8ABC-DEF012345678", "{abcdef12-3456-4789-8abc-def012345678}",
     "abcdef1234564789" + "8abcdef012345678", "urn:uuid:abcdef12-3456-4789-8abc-def012345678", "job-1", ""],
)  # fmt: skip
def test_a_message_id_that_is_no_canonical_uuid_is_refused_at_send(
    dramatiq_pg_broker_factory: Factory, message_id: str
) -> None:
    """Given a message whose id PostgreSQL would take as a UUID under another spelling (upper case,
    braces, no hyphens, a URN) or not at all, I expect send, enqueue_many and a batch to refuse it with
    a ValueError naming the id (and its canonical form when it has one), and nothing stored.  Before,
    the first kinds were stored and then skipped at every delivery: the worker knows its deliveries by
    the id as the row gives it back."""
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    message = job.message()._replace(message_id=message_id)
    for send in (broker.enqueue, lambda m: broker.enqueue_many([job.message(), m])):
        with pytest.raises(ValueError, match="not a UUID in canonical form") as raised:
            send(message)
        assert repr(message_id) in str(raised.value)
        if message_id.startswith(("ABC", "{", "abc", "urn")):
            assert "abcdef12-3456-4789-8abc-def012345678 is its canonical form" in str(raised.value)
    with pytest.raises(ValueError), broker.batch():
        job.send()
        broker.enqueue(message)
    assert count(broker) == 0


@pytest.mark.parametrize(
    "how",
    ["delay=1e20", "options delay nan", "options delay inf", "options eta far", "options eta nan", "priority 2**40"],
)
def test_a_delay_or_priority_out_of_range_is_refused_at_send(dramatiq_pg_broker_factory: Factory, how: str) -> None:
    """Given a send whose delay (argument, option or eta) is no finite number of milliseconds a timestamp
    can hold, or whose actor's priority is past a 32-bit integer, I expect a ValueError that says which,
    and nothing stored.  Before, each failed with the server's out-of-range error or Python's
    OverflowError from deep in the send."""
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    @dramatiq.actor(broker=broker, priority=2**40)
    def urgent() -> None:
        pass

    sends = {
        "delay=1e20": (lambda: job.send_with_options(delay=10**20), "delay of"),
        "options delay nan": (lambda: broker.enqueue(job.message_with_options(delay=float("nan"))), "delay'] of nan"),
        "options delay inf": (lambda: broker.enqueue(job.message_with_options(delay=float("inf"))), "delay'] of inf"),
        "options eta far": (lambda: broker.enqueue(job.message().copy(options={"eta": 10**20})), "eta'] of"),
        "options eta nan": (lambda: broker.enqueue(job.message().copy(options={"eta": float("nan")})), "eta'] of nan"),
        "priority 2**40": (lambda: urgent.send(), "32-bit"),
    }
    send, said = sends[how]
    with pytest.raises(ValueError, match="out of range|32-bit") as raised:
        send()
    assert said in str(raised.value)
    assert count(broker) == 0


def test_a_message_under_a_canonical_id_of_its_own_runs(dramatiq_pg_broker_factory: Factory) -> None:
    """An id of the caller's, in canonical form, is kept and its message runs under it."""
    from dramatiq.middleware import CurrentMessage
    from helpers import running_worker, wait_for

    broker = dramatiq_pg_broker_factory()
    broker.add_middleware(CurrentMessage())
    ran: list[str] = []

    @dramatiq.actor(broker=broker)
    def job() -> None:
        current = CurrentMessage.get_current_message()
        ran.append(current.message_id if current is not None else "")

    own = str(uuid.uuid4())
    broker.enqueue(job.message()._replace(message_id=own))
    with running_worker(broker):
        wait_for(lambda: ran == [own], 10, "the message under its own id")


# -- rows the worker cannot run -----------------------------------------------------
@pytest.mark.parametrize("payload", [b"\x00\xffnot a message", b'{"hello": "world"}', b"[1, 2, 3]", b""])
def test_undecodable_payload_is_dead_lettered_and_the_worker_goes_on(
    dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker, payload: bytes
) -> None:
    broker = dramatiq_pg_broker
    seen = []

    @dramatiq.actor
    def fine(n: int) -> None:
        seen.append(n)

    garbage = str(uuid.uuid4())
    query(
        broker,
        "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload) VALUES (%s, 'default', 'fine', %s)",
        [garbage, payload],
    )
    for n in range(5):
        fine.send(n)
    broker.join("default", timeout=30_000, fail_fast=False)

    assert sorted(seen) == list(range(5))
    info = broker.inspect(garbage)
    assert info is not None
    assert info["state"] == "dead" and info["attempt"] == 1
    assert info["last_error"].startswith("undecodable payload")
    assert "decode_error" in info  # inspect still describes the row
    assert broker.parts.leases.snapshot() == {}


def test_unknown_actor_is_dead_lettered_and_the_worker_goes_on(
    dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker
) -> None:
    broker = dramatiq_pg_broker
    seen = []

    @dramatiq.actor
    def known(n: int) -> None:
        seen.append(n)

    ghost = broker.enqueue(message_for("no_such_actor"))
    for n in range(3):
        known.send(n)
    broker.join("default", timeout=30_000, fail_fast=False)

    assert sorted(seen) == [0, 1, 2]
    info = broker.inspect(ghost.message_id)
    assert info is not None and info["state"] == "dead" and info["attempt"] == 1
    assert "no_such_actor" in info["last_error"]


# -- payload size ------------------------------------------------------------------------------
def test_oversized_payload_is_refused_and_nothing_is_inserted(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(max_payload_bytes=1000)
    dramatiq.set_broker(broker)

    @dramatiq.actor
    def take(data: str) -> None:
        pass

    with pytest.raises(PayloadTooLarge, match="max_payload_bytes=1000"):
        take.send("x" * 2000)
    assert count(broker) == 0

    with pytest.raises(PayloadTooLarge):
        broker.enqueue_many([take.message("small"), take.message("x" * 2000)])
    assert count(broker) == 0

    with pytest.raises(PayloadTooLarge), broker.batch():
        take.send("small")
        take.send("x" * 2000)
    assert count(broker) == 0

    assert issubclass(PayloadTooLarge, ValueError)
    take.send("small")
    assert count(broker) == 1


@pytest.mark.parametrize("slack, outcome", [(600, "retried"), (10, "dead")])
def test_retry_that_outgrows_the_payload_limit_is_not_stuck(
    dramatiq_pg_broker_factory: Factory, slack: int, outcome: str
) -> None:
    """A retry adds Dramatiq's traceback to the message: it is dropped from the
    payload (last_error keeps it); a retry that still does not fit is dead-lettered.
    Either way the row is never left held, and never acked unrun."""
    broker = dramatiq_pg_broker_factory(poll_interval=0.1)
    dramatiq.set_broker(broker)
    calls = []

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        raise RuntimeError("fails once, deep down " + "y" * 400)

    @dramatiq.actor(max_retries=3, min_backoff=10, max_backoff=20)
    def flaky(data: str) -> None:
        calls.append(1)
        if len(calls) == 1:
            deep(25)

    message = flaky.message("z" * 300)
    broker.max_payload_bytes = len(message.encode()) + slack
    broker.enqueue(message)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    worker.start()
    try:
        broker.join(flaky.queue_name, timeout=30_000, fail_fast=False)
    finally:
        worker.stop()
    assert broker.flush_outcomes(10)
    assert broker.parts.leases.snapshot() == {}
    info = broker.inspect(message.message_id)
    if outcome == "retried":
        assert info is not None and info["state"] == "done" and len(calls) == 2
    else:
        assert info is not None and info["state"] == "dead" and len(calls) == 1
        assert info["last_error"].startswith("retry refused:")
        assert "fails once, deep down" in info["last_error"]


# -- unreachable database ------------------------------------------------------------------------
UNREACHABLE = [
    "postgresql://alice:s3cr3t-pw@127.0.0.1:1/appdb",
    "host=127.0.0.1 port=1 user=alice password=s3cr3t-pw dbname=appdb",
]


def assert_safe(error: BaseException) -> None:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    assert "127.0.0.1" in str(error)
    assert "s3cr3t-pw" not in text


@pytest.mark.parametrize("url", UNREACHABLE)
def test_unreachable_database_on_enqueue(url: str) -> None:
    broker = PostgresBroker(url, connect_timeout=1, schema="app")
    broker.declare_queue("default")
    try:
        with pytest.raises(BrokerConnectionError) as info:
            broker.enqueue(message_for("x"))
        assert_safe(info.value)
    finally:
        broker.close()


def test_unreachable_database_on_consume_and_migrate(caplog: pytest.LogCaptureFixture) -> None:
    """A consumer waits for the database (None every timeout; raising would make Dramatiq restart it
    only 3 s later); what it logs never shows the password.  migrate() raises."""
    broker = PostgresBroker(UNREACHABLE[0], connect_timeout=1, listen=False)
    broker.declare_queue("default")
    consumer = broker.consume("default", timeout=100)
    try:
        with caplog.at_level(logging.DEBUG):
            assert next(consumer) is None
        assert "s3cr3t-pw" not in caplog.text
        with pytest.raises(BrokerConnectionError) as info:
            broker.migrate()
        assert_safe(info.value)
    finally:
        broker.close()


def test_a_lock_timeout_is_not_reported_as_unreachable(
    dramatiq_pg_broker_factory: Factory, dramatiq_pg_url: str
) -> None:
    """A live server refusing a statement (here: lock_timeout while another session locks the table)
    is reported as what it is, and loses nothing: the same enqueue works once the lock is gone."""
    broker = dramatiq_pg_broker_factory()
    impatient = PostgresBroker(make_conninfo(dramatiq_pg_url, options="-c lock_timeout=100"), schema=broker.schema)
    impatient.declare_queue("default")
    message = message_for("x")
    try:
        with psycopg.connect(dramatiq_pg_url) as locker:  # a transaction holding the lock until the block ends
            impatient.enqueue(message_for("warm-up"))  # the schema check and the pool are done
            locker.execute(
                sql.SQL("LOCK TABLE {}.message IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(broker.schema))
            )
            with pytest.raises(BrokerConnectionError) as info:
                impatient.enqueue(message)
        text = str(info.value)
        assert "cannot reach" not in text and "SQLSTATE 55P03" in text and "lock timeout" in text, text
        assert count(broker) == 1
        impatient.enqueue(message)
        assert count(broker) == 2
    finally:
        impatient.close()


# -- names --------------------------------------------------------------------------------------------
def test_consume_of_an_undeclared_queue(dramatiq_pg_broker: PostgresBroker) -> None:
    with pytest.raises(QueueNotFound):
        dramatiq_pg_broker.consume("never_declared")


BAD_NAMES = ['a"b', "a;b", "x; DROP TABLE message; --", "", "1abc", "a b", "sch\u00e9ma", "a\x00b", "a.b"]


@pytest.mark.parametrize("name", [*BAD_NAMES, "x" * 49, None])
def test_invalid_schema_names_are_refused(name: Any) -> None:
    with pytest.raises(ValueError, match="schema"):
        PostgresBroker("postgresql://nobody@127.0.0.1:1/x", schema=name)


@pytest.mark.parametrize("name", ["my_schema_1", "_x", "X" * 48])
def test_valid_schema_names(name: str) -> None:
    PostgresBroker("postgresql://nobody@127.0.0.1:1/x", schema=name).close()


@pytest.mark.parametrize("name", [n for n in BAD_NAMES if n != "a.b"] + ["x" * 201, "-x"])
def test_invalid_queue_names_are_refused(dramatiq_pg_broker: PostgresBroker, name: str) -> None:
    with pytest.raises(ValueError, match="queue"):
        dramatiq_pg_broker.declare_queue(name)
    assert name not in dramatiq_pg_broker.get_declared_queues()
    with pytest.raises(ValueError, match="queue"):
        dramatiq_pg_broker.enqueue(message_for("x", queue_name=name))
    assert count(dramatiq_pg_broker) == 0


@pytest.mark.parametrize("name", ["default", "a-b.c", "default.DQ", "q" * 200])
def test_valid_queue_names(dramatiq_pg_broker: PostgresBroker, name: str) -> None:
    dramatiq_pg_broker.declare_queue(name)
    dramatiq_pg_broker.enqueue(message_for("x", queue_name=name))
    assert query(dramatiq_pg_broker, "SELECT queue_name FROM {schema}.message") == [(name,)]


def test_declare_queue_does_no_io() -> None:
    broker = PostgresBroker("postgresql://nobody@127.0.0.1:1/x", connect_timeout=1)
    broker.declare_queue("anything")
    assert not broker.started  # no pool, no threads: nothing connected
    broker.close()
