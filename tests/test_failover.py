"""Failover: a server that takes no writes is a lost connection, and workers follow a promotion.

- Without a server: which errors mean "this server takes no writes", and how an outage over several
  hosts is named.
- On a server of the test's own made read-only with its sockets open (``ALTER SYSTEM SET
  default_transaction_read_only = on`` and a reload, which every open session sees from its next
  statement on): the outcome writer keeps a succeeded job's ack and writes it when the server takes
  writes again; every part of a process waits quietly, says so once, and works again.
- With a primary and a streaming standby made here (``initdb``, ``pg_basebackup -R``, ``pg_ctl
  promote``), one multi-host URL with ``target_session_attrs=read-write``, real worker processes, a
  producer and a ledger: after a kill and a promotion, and after a read-only demotion and a
  promotion, the same processes go on on the new primary (see :class:`Pair`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import cluster
import dramatiq
import psycopg
import pytest
import test_faults
from cluster import Pair, ReadOnlyServer, make_pair
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from helpers import acked, running_worker, wait_for
from test_faults import Env

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.db.reconnect import Server, connect_failure, server_for, where
from dramatiq_pg_fenced.errors import ServerUnwritable, describe_failure, lost_connection, refusal, worth_retrying

# -- without a server ---------------------------------------------------------------------------


def test_a_read_only_answer_is_a_lost_connection_not_a_refusal() -> None:
    """SQLSTATE 25006 (a standby, or a primary made read-only) is worth writing again elsewhere, never
    a refusal of what was written (which would dead-letter the message)."""
    error = psycopg.errors.ReadOnlySqlTransaction("cannot execute UPDATE in a read-only transaction")
    assert lost_connection(error) and worth_retrying(error)
    recovery = psycopg.errors.ReadOnlySqlTransaction("cannot execute LISTEN during recovery")
    assert lost_connection(recovery) and worth_retrying(recovery)
    ours = ServerUnwritable("cannot execute INSERT in a read-only transaction")
    assert isinstance(ours, psycopg.OperationalError) and lost_connection(ours)
    assert describe_failure(error, "db:5432/app") == (
        "PostgreSQL at db:5432/app takes no writes (a standby, or a demoted primary):"
        " cannot execute UPDATE in a read-only transaction"
    )
    assert refusal(ours).startswith("ServerUnwritable (SQLSTATE 25006)")
    # A refusal stays a refusal.
    assert not worth_retrying(psycopg.errors.CheckViolation("new row violates check constraint"))


def test_an_outage_over_several_hosts_names_each_host_and_its_cause() -> None:
    psycopg_text = (
        'connection failed: connection to server at "10.0.0.2", port 5433 failed: Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?\n"
        "Multiple connection attempts failed. All failures were:\n"
        "- host: 'db1', port: '5432', hostaddr: '10.0.0.1': connection failed: connection to server at "
        '"10.0.0.1", port 5432 failed: session is read-only\n'
        "- host: 'db2', port: '5433', hostaddr: '10.0.0.2': connection failed: connection to server at "
        '"10.0.0.2", port 5433 failed: Connection refused\n'
        "\tIs the server running on that host and accepting TCP/IP connections?"
    )
    assert connect_failure(psycopg.OperationalError(psycopg_text)) == (
        "db1:5432: session is read-only; db2:5433: Connection refused"
    )
    libpq_text = (
        'connection to server at "db1" (10.0.0.1), port 5432 failed: server is in hot standby mode\n'
        'connection to server at "db2" (10.0.0.2), port 5432 failed: Connection refused'
    )
    assert connect_failure(psycopg.OperationalError(libpq_text)) == (
        "db1:5432: server is in hot standby mode; db2:5432: Connection refused"
    )
    one = 'connection to server at "db", port 5432 failed: Connection refused\n\tIs the server running?'
    assert connect_failure(psycopg.OperationalError(one)) == "Connection refused"
    assert where("postgresql://u:secret@db1:5432,db2:5433/app?target_session_attrs=read-write") == (
        "db1:5432,db2:5433/app"
    )
    assert where("host=db1,db2 port=6432 dbname=app") == "db1:6432,db2:6432/app"


def test_a_server_found_read_only_is_said_once_and_its_connections_dropped_once_per_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = Server("db1:5432,db2:5432/app")
    with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced.db.reconnect"):
        assert server.unwritable("cannot execute INSERT in a read-only transaction", made_in=0)
        # Parts that met it on connections of the same generation: no new generation, no new line.
        assert not server.unwritable("cannot execute UPDATE in a read-only transaction", made_in=0)
        assert server.generation == 1
        server.writable()
        server.writable()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith("PostgreSQL at db1:5432,db2:5432/app takes no writes (cannot execute INSERT")
    assert lines[1].startswith("PostgreSQL at db1:5432,db2:5432/app takes writes again")


# -- a server of the test's own, made read-only with its sockets open --------------------------------


@pytest.fixture
def read_only_server() -> Iterator[ReadOnlyServer]:
    server = ReadOnlyServer()
    try:
        yield server
    finally:
        server.close()


def test_the_end_of_a_read_only_spell_is_seen_on_a_connection_made_during_it(
    read_only_server: ReadOnlyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a pool that made its connection while the server took no writes, when the server takes
    writes again and that connection is handed out (its check asks the server again), I expect the
    spell to be over for the whole process, said once, not only once some part makes a new connection
    (seen: a send served on such a connection while the process still held the server read-only)."""
    broker = PostgresBroker(read_only_server.url, schema="ro_end", connect_timeout=2, pool_max_size=1)
    server = server_for(broker.database.conninfo)
    try:
        broker.migrate()
        broker.declare_queue("q")
        broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
        read_only_server.read_only(True)
        with pytest.raises(ConnectionClosed, match="takes no writes"):
            broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
        assert server.read_only is not None
        with contextlib.suppress(psycopg.Error), broker.database.connection(raw=True, timeout=0.2):
            pass  # the pool's connections made during the spell are refused at checkout; it makes others
        time.sleep(1.0)  # every attempt under way has ended
        wait_for(lambda: broker.database._here().pool.get_stats().get("pool_available", 0) == 1, 10, "a pooled connection")
        assert server.read_only is not None
        with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced"):
            read_only_server.read_only(False)
            with broker.database.connection(raw=True) as conn:  # the one made during the spell
                assert conn.execute("SELECT 1").fetchone() == (1,)
        assert server.read_only is None
        assert [r.getMessage() for r in caplog.records if "takes writes again" in r.getMessage()] != []
    finally:
        broker.close()


def dead_or_done(broker: PostgresBroker, message_id: str) -> str | None:
    info = broker.inspect(message_id)
    return None if info is None else str(info["state"])


def test_a_succeeded_job_is_acked_not_dead_lettered_when_its_server_turns_read_only(
    read_only_server: ReadOnlyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a message claimed by a consumer, when the server turns read-only with every socket open
    and the actor's ack is handed to the outcome writer, then nothing is dead-lettered or counted
    stale (it used to take the 25006 for a refusal of the ack, then of its dead letter, and to
    write the dead letter once the server took writes again); when the server takes writes again,
    the ack is written, by the same delivery."""
    broker = PostgresBroker(read_only_server.url, schema="ro", connect_timeout=2, keep_finished=3600)
    try:
        broker.migrate()
        broker.declare_queue("q")
        sent = broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
        consumer = broker.consume("q", prefetch=1, timeout=1000)
        message = wait_for(lambda: next(consumer), 10, "the claim")
        assert message.message_id == sent.message_id
        read_only_server.read_only(True)
        with caplog.at_level(logging.INFO):
            consumer.ack(message)
            time.sleep(2.0)  # the writer tries again and again meanwhile
            assert not broker.parts.writer.flush(0)  # still waiting, nothing dropped
            read_only_server.read_only(False)
            assert broker.parts.writer.flush(10)
        assert dead_or_done(broker, sent.message_id) == "done"
        assert acked(broker, sent.message_id, attempt=1)
        assert broker.parts.stale.stale == 0
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, errors
        assert not [r for r in caplog.records if "dead-letter" in r.getMessage() or "refused" in r.getMessage()]
        said = [r.getMessage() for r in caplog.records if "takes no writes" in r.getMessage()]
        assert len(said) == 1, said
    finally:
        broker.close()


def test_every_part_of_a_worker_waits_quietly_while_its_server_is_read_only_and_works_again_after(
    read_only_server: ReadOnlyServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a running worker (consumers, LISTEN, lease keeper, maintenance, outcome writer), when
    its server turns read-only for 3 s with every socket open, then a send fails fast with a
    connection error that says why, no part logs an error or a traceback, the condition is said
    once; and after, a send runs without a restart, woken by LISTEN on a new connection (its idle
    polls are an hour apart: only a ring brings it within the test's time)."""
    url = read_only_server.url
    broker = PostgresBroker(
        url, schema="ro", connect_timeout=2, rescue_interval=0.2, lease_seconds=1.5, poll_interval=3600
    )
    ran: list[int] = []

    @dramatiq.actor(broker=broker, queue_name="q")
    def job(n: int) -> None:
        ran.append(n)

    try:
        broker.migrate()
        with running_worker(broker, threads=2):
            job.send(0)
            wait_for(lambda: ran == [0], 10, "the first job")
            with caplog.at_level(logging.DEBUG, logger="dramatiq_pg_fenced"):
                read_only_server.read_only(True)
                with pytest.raises(ConnectionClosed, match="takes no writes"):
                    job.send(1)
                time.sleep(3.0)
                read_only_server.read_only(False)
                start = time.monotonic()
                while True:
                    try:
                        job.send(2)
                        break
                    except ConnectionClosed:
                        time.sleep(0.05)
                wait_for(lambda: 2 in ran, 30, "a job after the server takes writes again")
                took = time.monotonic() - start
            assert took < 30, took  # not an idle poll (an hour): the ring of the send, heard on a new LISTEN
            doorbell = broker.database.started_doorbell(broker.channel)
            assert doorbell is not None
        bad = [
            f"{r.name} {r.levelname}: {r.getMessage()}"
            for r in caplog.records
            if r.levelno >= logging.ERROR
            or r.exc_info
            or (r.levelno >= logging.WARNING and "could not" in r.getMessage())
        ]
        assert not bad, bad
        said = [r.getMessage() for r in caplog.records if "takes no writes (" in r.getMessage()]
        assert len(said) == 1, said
        assert any("takes writes again" in r.getMessage() for r in caplog.records), "\n".join(
            r.getMessage() for r in caplog.records if "DEBUG" != r.levelname
        )
        assert ran.count(0) == 1 and ran.count(2) == 1
    finally:
        broker.close()


# -- a primary and a streaming standby of the test's own -------------------------------------------

fault_env = test_faults.fault_env  # a schema with a ledger on the shared server, and real workers


@pytest.fixture
def pair() -> Iterator[Callable[..., Pair]]:
    """``make(synchronous)``: a primary and its streaming standby (synchronous: the primary's commits wait
    for the standby's flush)."""
    made: list[Pair] = []

    def make(synchronous: bool) -> Pair:
        made.append(make_pair("sync" if synchronous else "async"))
        return made[-1]

    yield make
    for servers in reversed(made):
        if servers.standby is not None:
            servers.standby.close()
        servers.primary.close()


def failover_run(
    pair: Callable[..., Pair], fault_env: Callable[..., Env], *, synchronous: bool, fault: str
) -> dict[str, Any]:
    """Two worker processes and a producer on a primary and its standby; *fault* the primary, then
    promote the standby (see :func:`cluster.failover_run`)."""
    servers = pair(synchronous)
    env = fault_env(lease_seconds=2, threads=4, broker_url=servers.url)
    run = cluster.failover_run(servers, env, fault=fault)
    print(f"\n{fault} (synchronous standby: {synchronous}):", {k: v for k, v in run.items() if k != "logs"})
    return run


@pytest.mark.slow
def test_after_the_primary_is_killed_and_the_standby_promoted_the_same_processes_go_on_there(
    pair: Callable[..., Pair], fault_env: Callable[..., Env]
) -> None:
    """Given two worker processes and a producer on a multi-host URL (target_session_attrs=read-write)
    over a primary and its synchronous standby, when the primary is killed and, a second later, the
    standby promoted, then without a restart the first job runs within 2 s of the promotion, no send
    that returned is lost, nothing is dead-lettered, and the workers' outage line names both hosts."""
    run = failover_run(pair, fault_env, synchronous=True, fault="kill")
    assert run["workers restarted"] == 0
    assert run["recovery (s)"] < 2.0
    assert run["lost"] == 0
    assert run["dead"] == 0
    outage = [line for line in run["logs"].splitlines() if "Cannot connect to PostgreSQL at" in line]
    assert outage and all(line.count("127.0.0.1:") >= 4 for line in outage), outage  # both hosts, each with its cause


@pytest.mark.slow
def test_after_the_primary_turns_read_only_and_the_standby_is_promoted_the_same_processes_go_on_there(
    pair: Callable[..., Pair], fault_env: Callable[..., Env]
) -> None:
    """Given the same, when the primary turns read-only with every socket open (a demotion as Aurora
    does it) and, a second later, the standby is promoted, then without a restart the first job runs
    within 2 s of the promotion, no succeeded job is dead-lettered, no send that returned is lost,
    and no worker logs an error."""
    run = failover_run(pair, fault_env, synchronous=True, fault="read-only")
    assert run["workers restarted"] == 0
    assert run["recovery (s)"] < 2.0
    assert run["lost"] == 0
    assert run["dead"] == 0
    assert " ERROR " not in run["logs"] and "CRITICAL" not in run["logs"] and "Traceback" not in run["logs"]
