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

import logging
import os
import pwd
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import dramatiq
import psycopg
import pytest
import test_faults
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from helpers import acked, running_worker, wait_for
from psycopg import sql
from test_faults import Env, OwnedServer

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.errors import ServerUnwritable, describe_failure, lost_connection, refusal, worth_retrying
from dramatiq_pg_fenced.reconnect import Server, connect_failure, where

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
    with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced.reconnect"):
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


class ReadOnlyServer(OwnedServer):
    """An :class:`OwnedServer` that can stop and resume taking writes without closing a socket."""

    def read_only(self, on: bool) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            if on:
                conn.execute("ALTER SYSTEM SET default_transaction_read_only = on")
            else:
                conn.execute("ALTER SYSTEM RESET default_transaction_read_only")
            conn.execute("SELECT pg_reload_conf()")
        time.sleep(0.1)  # the backends take the reload at their next statement; give the signal time


@pytest.fixture
def read_only_server() -> Iterator[ReadOnlyServer]:
    server = ReadOnlyServer()
    try:
        yield server
    finally:
        server.close()


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
    once; and after, a send runs within 2 s without a restart, woken by LISTEN on a new
    connection."""
    url = read_only_server.url
    broker = PostgresBroker(url, schema="ro", connect_timeout=2, rescue_interval=0.2, lease_seconds=1.5)
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
                wait_for(lambda: 2 in ran, 10, "a job after the server takes writes again")
                took = time.monotonic() - start
            assert took < 2.0, took
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


class Standby(OwnedServer):
    """A hot standby of *primary*, made with ``pg_basebackup -R`` (streaming from it), on a port of its own."""

    def __init__(self, primary: OwnedServer) -> None:  # not OwnedServer's: no initdb
        self.bin, self.user = primary.bin, primary.user
        if not os.path.exists(os.path.join(self.bin, "pg_basebackup")):
            pytest.skip(f"no pg_basebackup in {self.bin} for a standby of the test's own")
        # Not the primary's synchronous_standby_names: once promoted, it would wait for a standby forever.
        self.settings = {k: v for k, v in primary.settings.items() if k != "synchronous_standby_names"}
        self.datadir = tempfile.mkdtemp(prefix="dramatiq-pg-standby-")
        if self.user is not None:
            os.chown(self.datadir, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._pg(
            "pg_basebackup", "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
            "-D", self.datadir, "-R", "-X", "stream", "--no-sync", "-c", "fast",
        )  # fmt: skip
        self.start()

    def promote(self) -> float:
        """``pg_ctl promote -w``; returns (``time.time()``) when the promotion is complete."""
        self._pg("pg_ctl", "promote", "-w", "-D", self.datadir)
        return time.time()


class Pair(NamedTuple):
    primary: ReadOnlyServer
    standby: Standby
    url: str  #: both, in one libpq URL, with target_session_attrs=read-write


@pytest.fixture
def pair() -> Iterator[Callable[..., Pair]]:
    """``make(synchronous)``: a primary and its streaming standby (synchronous: the primary's commits wait
    for the standby's flush)."""
    made: list[OwnedServer] = []

    def make(synchronous: bool) -> Pair:
        settings = {"synchronous_standby_names": "*"} if synchronous else {}
        primary = ReadOnlyServer(**settings)
        made.append(primary)
        standby = Standby(primary)
        made.append(standby)
        url = (
            f"postgresql://postgres@127.0.0.1:{primary.port},127.0.0.1:{standby.port}/postgres"
            "?target_session_attrs=read-write&connect_timeout=2"
        )
        return Pair(primary, standby, url)

    yield make
    for server in reversed(made):
        server.close()


class Producer:
    """A thread that sends ``work`` messages on *url*, one every 10 ms; a send that raises is sent again
    with the same message id until it returns (what the README asks of a caller mid-failover)."""

    def __init__(self, url: str, schema: str) -> None:
        self.broker = PostgresBroker(url, schema=schema, connect_timeout=2)
        self.returned: list[tuple[str, float]] = []  # (message id, time.time() when its send returned)
        self.raised = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = Message(queue_name="work", actor_name="work", args=(0.01,), kwargs={}, options={})
            while not self._stop.is_set():
                try:
                    self.broker.enqueue(message)
                    self.returned.append((message.message_id, time.time()))
                    break
                except ConnectionClosed:
                    self.raised += 1
                    time.sleep(0.05)
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.broker.close()


def failover_run(
    pair: Callable[..., Pair], fault_env: Callable[..., Env], *, synchronous: bool, fault: str
) -> dict[str, Any]:
    """Two worker processes and a producer on a primary and its standby; *fault* the primary, then
    promote the standby; returns what the ledger and the new primary say."""
    servers = pair(synchronous)
    env = fault_env(lease_seconds=2, threads=4, broker_url=servers.url)
    PostgresBroker(servers.primary.url, schema=env.broker.schema).migrate()
    workers = [env.workers.start(), env.workers.start()]
    producer = Producer(servers.url, env.broker.schema)
    try:
        wait_for(lambda: env.ledger.count("finish") >= 20, 30, "work before the fault")
        if fault == "kill":
            servers.primary.stop("immediate")
            time.sleep(1.0)  # nothing accepts writes meanwhile
        else:  # read-only with every socket open, as Aurora and some proxies demote a primary
            servers.primary.read_only(True)
            time.sleep(1.0)
        promoted = servers.standby.promote()
        time.sleep(4.0)
    finally:
        producer.stop()
    sent = dict(producer.returned)
    new_primary = psycopg.connect(servers.standby.url, autocommit=True)

    def finished() -> bool:
        done = {e.message_id for e in env.ledger.entries() if e.event == "finish"}
        return all(mid in done for mid, at in producer.returned if at > promoted)

    wait_for(finished, 30, "every message sent after the promotion to run")
    time.sleep(1.0)  # lets the outcomes of the last ones be written
    entries = env.ledger.entries()
    starts = Counter(e.message_id for e in entries if e.event == "start")
    first_after = min(e.at.timestamp() for e in entries if e.event == "start" and e.at.timestamp() > promoted)
    in_db = sql.SQL("SELECT state, count(*) FROM {}.message GROUP BY state").format(sql.Identifier(env.broker.schema))
    states = dict(new_primary.execute(in_db).fetchall())
    new_primary.close()
    logs = "\n".join(Path(w.log_path).read_text() for w in workers)  # type: ignore[attr-defined]
    figures = {
        "first job after promotion (s)": round(first_after - promoted, 2),
        "sends returned": len(sent),
        "sends raised (sent again)": producer.raised,
        "lost (returned, never ran)": sum(1 for mid in sent if mid not in starts),
        "ran twice": sum(1 for n in starts.values() if n > 1),
        "dead": states.get("dead", 0),
        "workers restarted": sum(1 for w in workers if w.poll() is not None),
    }
    print(f"\n{fault} (synchronous standby: {synchronous}):", figures)
    return {**figures, "logs": logs}


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
    assert run["first job after promotion (s)"] < 2.0
    assert run["lost (returned, never ran)"] == 0
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
    assert run["first job after promotion (s)"] < 2.0
    assert run["lost (returned, never ran)"] == 0
    assert run["dead"] == 0
    assert " ERROR " not in run["logs"] and "CRITICAL" not in run["logs"] and "Traceback" not in run["logs"]
