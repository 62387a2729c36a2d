"""Fencing under real faults: real ``dramatiq`` processes, real signals, real broken connections.

Workers run ``dramatiq tests.apps.fault_app`` (see that module).  Its actors
write an independent ledger (message id, attempt, pid, event) in their own
transactions; the assertions check it as well as the broker's rows.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from helpers import acked, wait_for
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.consumer import PostgresConsumer

APP = "tests.apps.fault_app"


class Entry(NamedTuple):
    message_id: str
    attempt: int
    pid: int
    event: str
    at: dt.datetime | None = None  # the database's clock_timestamp() when it was written


class Ledger:
    """The actors' own record of what ran where, read on a connection of the test's."""

    def __init__(self, url: str, schema: str) -> None:
        self.app_name = f"faulttest_{schema}"  # the workers' brokers (see fault_app)
        self.schema = sql.Identifier(schema)
        self.conn = psycopg.connect(url, autocommit=True)
        self.conn.execute(
            sql.SQL(
                "CREATE TABLE {}.ledger (message_id uuid NOT NULL, attempt int NOT NULL, pid int NOT NULL,"
                " event text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
            ).format(self.schema)
        )

    def entries(self, message_id: str | None = None) -> list[Entry]:
        query = sql.SQL("SELECT message_id, attempt, pid, event, at FROM {}.ledger").format(self.schema)
        if message_id is None:
            rows = self.conn.execute(query + sql.SQL(" ORDER BY at")).fetchall()
        else:
            rows = self.conn.execute(query + sql.SQL(" WHERE message_id = %s ORDER BY at"), [message_id]).fetchall()
        return [Entry(str(r[0]), r[1], r[2], r[3], r[4]) for r in rows]

    def find(self, message_id: str, attempt: int, event: str) -> Entry | None:
        for entry in self.entries(message_id):
            if entry.attempt == attempt and entry.event == event:
                return entry
        return None

    def release(self, message_id: str, attempt: int) -> None:
        """Let the ``hold`` actor's delivery *attempt* of *message_id* finish."""
        self.conn.execute(
            sql.SQL("INSERT INTO {}.ledger (message_id, attempt, pid, event) VALUES (%s, %s, %s, 'release')").format(
                self.schema
            ),
            [message_id, attempt, os.getpid()],
        )

    def count(self, event: str) -> int:
        query = sql.SQL("SELECT count(*) FROM {}.ledger WHERE event = %s").format(self.schema)
        row = self.conn.execute(query, [event]).fetchone()
        return row[0] if row else 0

    def rows_by_state(self) -> dict[str, int]:
        query = sql.SQL("SELECT state, count(*) FROM {}.message GROUP BY state").format(self.schema)
        return dict(self.conn.execute(query).fetchall())

    def now(self) -> Any:
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    def terminate_broker_connections(self) -> int:
        """pg_terminate_backend every connection of the workers' brokers (not the ledger's, not ours)."""
        rows = self.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s AND pid <> pg_backend_pid()",
            [self.app_name],
        ).fetchall()
        return sum(1 for (ok,) in rows if ok)


class Workers:
    """Real ``dramatiq`` CLI processes (one worker process each, in a process group of their own)."""

    def __init__(self, cli: Callable[..., subprocess.Popen], broker: PostgresBroker, threads: int) -> None:
        self.cli = cli
        self.broker = broker
        self.threads = threads
        self.procs: list[subprocess.Popen] = []

    def start(self) -> subprocess.Popen:
        proc = self.cli(
            self.broker,
            APP,
            "--processes",
            "1",
            "--threads",
            str(self.threads),
            "--worker-shutdown-timeout",
            "5000",
        )
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop_all(self) -> None:
        """SIGTERM every CLI at once (each forwards it); SIGKILL a group that does not stop in time."""
        running = [p for p in self.procs if p.poll() is None]
        for proc in running:
            try:
                os.killpg(proc.pid, signal.SIGCONT)  # a paused worker must be able to hear it
                proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


class Env(NamedTuple):
    broker: PostgresBroker
    ledger: Ledger
    workers: Workers


@pytest.fixture
def fault_env(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    dramatiq_pg_url: str,
    dramatiq_cli: Callable[..., subprocess.Popen],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Callable[..., Env]]:
    """``make(lease_seconds=2, threads=4, broker_url=None)``: a schema with a ledger, and a way to start workers."""
    made: list[Env] = []

    def make(lease_seconds: float = 2, threads: int = 4, broker_url: str | None = None) -> Env:
        monkeypatch.setenv("FAULT_LEASE_SECONDS", str(lease_seconds))
        if broker_url:
            monkeypatch.setenv("FAULT_BROKER_URL", broker_url)
        broker = dramatiq_pg_broker_factory(lease_seconds=lease_seconds, rescue_interval=0.2, poll_interval=0.2)
        env = Env(broker, Ledger(dramatiq_pg_url, broker.schema), Workers(dramatiq_cli, broker, threads))
        made.append(env)
        return env

    yield make
    for env in made:
        env.workers.stop_all()
        env.ledger.conn.close()


def process_tree(pid: int) -> list[int]:
    """*pid* and its descendants (Linux ``/proc``)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except OSError:
        children = []
    return [pid] + [d for c in children for d in process_tree(c)]


def stale_total(broker: PostgresBroker) -> int:
    return int(broker.stats()["totals"].get("stale_writes", 0))


def work_messages(n: int, seconds: float) -> list[Message]:
    return [Message(queue_name="work", actor_name="work", args=(seconds,), kwargs={}, options={}) for _ in range(n)]


# -- 1. a worker paused past its lease ------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("outcome", ["ack", "nack", "retry"])
def test_paused_worker_cannot_finalize_after_takeover(fault_env: Callable[..., Env], outcome: str) -> None:
    """SIGSTOP a worker mid-actor past its lease; a second worker redelivers the message; the first
    is resumed and writes its ack / nack / retry while attempt 2 runs: fenced out (counted, logged,
    no effect).  Attempt 2 then acks: one terminal outcome, and no third run."""
    broker, ledger, workers = fault_env(lease_seconds=2)
    options: dict[str, Any] = {"max_retries": 0} if outcome == "nack" else {}
    message: Message[Any] = Message(queue_name="pause", actor_name="hold", args=(outcome,), kwargs={}, options=options)
    mid = message.message_id
    stale_before = stale_total(broker)

    a = workers.start()
    broker.enqueue(message)
    pid_a = wait_for(lambda: ledger.find(mid, 1, "start"), 60, "attempt 1 to start").pid
    os.kill(pid_a, signal.SIGSTOP)
    try:
        workers.start()
        pid_b = wait_for(lambda: ledger.find(mid, 2, "start"), 60, "attempt 2 to start in the second worker").pid
        assert pid_b != pid_a
        ledger.release(mid, 1)
    finally:
        os.kill(pid_a, signal.SIGCONT)

    # The resumed attempt finishes its actor and writes its outcome while attempt 2 holds the row.
    wait_for(lambda: ledger.find(mid, 1, "finish"), 30, "attempt 1 to finish after SIGCONT")
    wait_for(lambda: stale_total(broker) > stale_before, 30, "the stale counter to rise")
    info = broker.inspect(mid)
    assert info is not None and (info["state"], info["attempt"]) == ("running", 2), info
    wait_for(
        lambda: f"Stale {outcome} of message {mid} by attempt 1 ignored" in a.log_path.read_text(),  # type: ignore[attr-defined]
        30,
        "the stale write's warning in worker A's log",
    )

    ledger.release(mid, 2)
    wait_for(lambda: acked(broker, mid, attempt=2), 30, "attempt 2's ack")
    # A write that slipped through would be followed by a redelivery within a
    # poll interval (re-queue) or a lease (anything still held): wait past both.
    time.sleep(broker.lease_seconds + 2)
    entries = ledger.entries(mid)
    runs = {(e.attempt, e.pid) for e in entries if e.event == "start"}
    assert runs == {(1, pid_a), (2, pid_b)}, entries
    assert ledger.find(mid, 2, "finish") is not None
    assert ledger.rows_by_state() == {}  # acked: not dead-lettered, not re-queued
    assert stale_total(broker) == stale_before + 1


# -- 2. SIGKILL storm ----------------------------------------------------------------------------
@pytest.mark.slow
def test_sigkill_storm_loses_nothing(fault_env: Callable[..., Env]) -> None:
    """2000 messages while two worker processes are SIGKILLed and restarted, one every 1-2 s, and at
    least at every 15% of progress (so a fast run still sees its kills)."""
    broker, ledger, workers = fault_env(lease_seconds=2, threads=4)
    messages = work_messages(2000, 0.01)
    for i in range(0, len(messages), 500):
        broker.enqueue_many(messages[i : i + 500])
    procs = [workers.start(), workers.start()]
    rng = random.Random()
    kills = 0
    deadline = time.monotonic() + 180
    milestones = [len(messages) * p // 100 for p in (10, 25, 40, 55, 70, 85)]
    killed_at: dict[int, dt.datetime] = {}
    next_kill = time.monotonic() + rng.uniform(1.0, 2.0)

    def pending() -> int:
        states = ledger.rows_by_state()
        return states.get("queued", 0) + states.get("running", 0)

    while left := pending():
        assert time.monotonic() < deadline, f"not done after {kills} kills: {ledger.rows_by_state()}"
        done = len(messages) - left
        if time.monotonic() >= next_kill or (milestones and done >= milestones[0]):
            while milestones and done >= milestones[0]:
                milestones.pop(0)
            i = kills % len(procs)  # the one that has run longest, so it holds messages
            for pid in process_tree(procs[i].pid):  # the CLI and its worker process
                killed_at[pid] = dt.datetime.now(dt.timezone.utc)
            workers.kill(procs[i])
            procs[i] = workers.start()
            kills += 1
            next_kill = time.monotonic() + rng.uniform(1.0, 2.0)
        time.sleep(0.05)
    workers.stop_all()

    assert kills >= 3, "the storm was too short to mean anything; make the messages slower"
    assert ledger.rows_by_state() == {}  # every message acked: none queued, running, dead or cancelled
    entries = ledger.entries()
    finished = {e.message_id for e in entries if e.event == "finish"}
    assert finished == {m.message_id for m in messages}
    # Each delivery (message, attempt) ran at most once: attempt numbers are never handed out twice.
    starts = Counter((e.message_id, e.attempt) for e in entries if e.event == "start")
    assert max(starts.values()) == 1
    assert max(attempt for _, attempt in starts) > 1, "no message was redelivered after a SIGKILL"
    # Redelivery within lease + rescue + poll interval of the kill (plus slack for this shared machine):
    # a rescued message goes back to its old place in the queue, not behind the backlog.
    started = {(e.message_id, e.attempt): e for e in entries if e.event == "start"}
    waits = [
        (e.at - killed_at[before.pid]).total_seconds()
        for (mid, attempt), e in started.items()
        if (before := started.get((mid, attempt - 1))) is not None and before.pid in killed_at and e.at is not None
    ]
    assert waits, "no redelivery of a started message to measure"
    bound = broker.lease_seconds + broker.rescue_interval + broker.poll_interval + 2.0
    print(f"redelivery after SIGKILL: {len(waits)} messages, max {max(waits):.2f} s, bound {bound:.1f} s")
    assert max(waits) <= bound, sorted(waits)[-10:]


# -- 3. broken connections --------------------------------------------------------------------
def assert_each_ran_once(ledger: Ledger, messages: list[Message]) -> list[Entry]:
    """Every message finished, and ran exactly once: no lease lapsed, so nothing was run again."""
    assert ledger.rows_by_state() == {}
    entries = ledger.entries()
    runs: defaultdict[str, list[Entry]] = defaultdict(list)
    for entry in entries:
        if entry.event == "start":
            runs[entry.message_id].append(entry)
    assert set(runs) == {m.message_id for m in messages}
    twice = {mid: r for mid, r in runs.items() if len(r) > 1}
    assert not twice, f"{len(twice)} message(s) ran more than once, e.g. {next(iter(twice.items()))}"
    assert ledger.count("finish") == len(messages)
    return entries


@pytest.mark.slow
def test_terminated_connections_recover_without_rerunning(fault_env: Callable[..., Env]) -> None:
    """pg_terminate_backend on every broker connection, three times, while actors run."""
    broker, ledger, workers = fault_env(lease_seconds=10, threads=4)
    stale_before = stale_total(broker)
    messages = work_messages(300, 0.1)
    broker.enqueue_many(messages)
    workers.start()
    workers.start()
    wait_for(lambda: ledger.count("finish") >= 30, 60, "work to get going")
    terminated = []
    for _ in range(3):
        terminated.append(ledger.terminate_broker_connections())
        time.sleep(1.0)
    assert terminated[0] > 0, "no broker connection was found to terminate"
    assert ledger.count("finish") < len(messages), "the work ended before the faults; make it longer"
    wait_for(lambda: not ledger.rows_by_state(), 120, "all messages to be acked")
    workers.stop_all()
    assert_each_ran_once(ledger, messages)
    # No lease lapsed, so no write was stale: an outcome whose first try committed just
    # before its connection broke, and was written again, is not a stale write.
    assert stale_total(broker) == stale_before


class Proxy:
    """A TCP relay to PostgreSQL that the test can cut, as if the server went away."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)  # a directory for host means a Unix socket there
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.up = True
        self.lock = threading.Lock()
        self.socks: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.up:
                client.close()  # the server is "down": the connection is refused at once
                continue
            try:
                upstream = self._connect()
            except OSError:
                client.close()
                continue
            with self.lock:
                self.socks |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _connect(self) -> socket.socket:
        host, port = self.target
        if not host.startswith("/"):
            return socket.create_connection(self.target)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.connect(f"{host}/.s.PGSQL.{port}")
        return upstream

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            self._drop(s)

    def _drop(self, s: socket.socket) -> None:
        with self.lock:
            self.socks.discard(s)
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def cut(self) -> None:
        """Break every relayed connection and refuse new ones."""
        self.up = False
        with self.lock:
            socks = list(self.socks)
        for s in socks:
            self._drop(s)

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self.cut()
        self.listener.close()


@pytest.fixture
def proxy(dramatiq_pg_url: str) -> Iterator[tuple[Proxy, str]]:
    """A cuttable relay to the test database, and the conninfo that goes through it.

    Request it before ``fault_env`` so the workers are stopped before the relay closes."""
    info = conninfo_to_dict(dramatiq_pg_url)
    host = str(info.get("host") or "localhost")
    if "," in host:
        pytest.skip("more than one database host")
    relay = Proxy(host, int(info.get("port") or 5432))
    try:
        yield relay, make_conninfo(dramatiq_pg_url, host="127.0.0.1", port=str(relay.port))
    finally:
        relay.close()


@pytest.mark.slow
def test_database_outage_shorter_than_lease(proxy: tuple[Proxy, str], fault_env: Callable[..., Env]) -> None:
    """PostgreSQL unreachable for a few seconds (cut at the network) while actors run: outcomes
    computed during the outage are written when it ends, nothing runs twice, nothing is lost."""
    relay, via_proxy = proxy
    broker, ledger, workers = fault_env(lease_seconds=15, threads=4, broker_url=via_proxy)
    stale_before = stale_total(broker)
    messages = work_messages(200, 0.1)
    broker.enqueue_many(messages)
    workers.start()
    workers.start()
    wait_for(lambda: ledger.count("finish") >= 30, 60, "work to get going")
    cut_at = ledger.now()
    relay.cut()
    time.sleep(3)
    restored_at = ledger.now()
    relay.restore()
    wait_for(lambda: not ledger.rows_by_state(), 120, "all messages to be acked")
    workers.stop_all()
    assert_each_ran_once(ledger, messages)
    # The scenario happened: actors finished while their outcomes could not be written.
    during = ledger.conn.execute(
        sql.SQL("SELECT count(*) FROM {}.ledger WHERE event = 'finish' AND at > %s AND at < %s").format(ledger.schema),
        [cut_at, restored_at],
    ).fetchone()
    assert during is not None and during[0] > 0
    assert stale_total(broker) == stale_before


@pytest.mark.slow
def test_partition_past_lease_fences_the_late_retry(
    proxy: tuple[Proxy, str], fault_env: Callable[..., Env], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Worker A loses the database past its lease while its actor runs; worker B (direct) takes
    the message over.  A's retry, computed during the partition and written after it while B
    runs attempt 2, is fenced out: the message is not put back, B's ack finishes it."""
    relay, via_proxy = proxy
    broker, ledger, workers = fault_env(lease_seconds=2, broker_url=via_proxy)
    message: Message[Any] = Message(queue_name="pause", actor_name="hold", args=("retry",), kwargs={}, options={})
    mid = message.message_id
    stale_before = stale_total(broker)

    a = workers.start()
    broker.enqueue(message)
    pid_a = wait_for(lambda: ledger.find(mid, 1, "start"), 60, "attempt 1 to start").pid
    relay.cut()
    try:
        monkeypatch.delenv("FAULT_BROKER_URL")  # B connects directly
        workers.start()
        pid_b = wait_for(lambda: ledger.find(mid, 2, "start"), 60, "attempt 2 to start in the second worker").pid
        assert pid_b != pid_a
        ledger.release(mid, 1)  # A's actor (its ledger is reachable) now fails: a retry it cannot write
        wait_for(lambda: ledger.find(mid, 1, "finish"), 30, "attempt 1 to finish during the partition")
        wait_for(lambda: "Could not write" in a.log_path.read_text(), 60, "A to fail writing its retry")  # type: ignore[attr-defined]
    finally:
        relay.restore()
    wait_for(lambda: stale_total(broker) > stale_before, 60, "A's retry to be written and fenced out")
    info = broker.inspect(mid)
    assert info is not None and (info["state"], info["attempt"]) == ("running", 2), info
    ledger.release(mid, 2)
    wait_for(lambda: acked(broker, mid, attempt=2), 30, "attempt 2's ack")
    time.sleep(broker.lease_seconds + 2)
    runs = {(e.attempt, e.pid) for e in ledger.entries(mid) if e.event == "start"}
    assert runs == {(1, pid_a), (2, pid_b)}
    assert ledger.rows_by_state() == {}


# -- attempt numbers only grow (no processes) -----------------------------------------------
def test_attempt_numbers_only_grow(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> None:
    """Across shutdown release, lease expiry and retry, the attempt never goes down, and each
    older attempt's writes are fenced out."""
    broker = dramatiq_pg_broker_factory(lease_seconds=1, rescue_interval=0.2, poll_interval=0.1)
    broker.declare_queue("grow")
    message: Message[Any] = Message(queue_name="grow", actor_name="nobody", args=(), kwargs={}, options={})
    mid = message.message_id
    broker.enqueue(message)
    seen: list[int] = []

    def claim(b: PostgresBroker) -> Any:
        consumer = b.consume("grow", prefetch=1, timeout=100)
        proxy = wait_for(lambda: next(consumer), 30, "a delivery")
        assert proxy.message_id == mid
        assert proxy.options["attempt"] == proxy.attempt
        seen.append(proxy.attempt)
        return consumer, proxy

    # Shutdown release: the row goes back to the queue with its attempt unchanged.
    consumer, first = claim(broker)
    consumer.requeue([first])
    info = broker.inspect(mid)
    assert info is not None and (info["state"], info["attempt"]) == ("queued", first.attempt)

    # Lease expiry: a holder that stops extending (its process "died") loses the message.
    holder = dramatiq_pg_broker_factory(schema=broker.schema, lease_seconds=1, rescue_interval=0.2)
    holder.declare_queue("grow")
    _, second = claim(holder)
    holder.close()  # stops its lease keeper without releasing anything
    info = wait_for(
        lambda: (broker.inspect(mid) or {}).get("state") == "queued" and broker.inspect(mid), 30, "the lease to expire"
    )
    assert info["attempt"] == second.attempt

    # Retry: Dramatiq's Retries middleware sends the same proxy back.
    consumer, third = claim(broker)
    broker.enqueue(third, delay=0)
    consumer.ack(third)  # the ack after a retry is a quiet no-op
    broker.flush_outcomes(timeout=10)
    info = broker.inspect(mid)
    assert info is not None and (info["state"], info["attempt"]) == ("queued", third.attempt)

    consumer, fourth = claim(broker)
    assert seen == sorted(set(seen)) and len(seen) == 4  # strictly increasing

    # Every older attempt's ack is fenced out and counted; the current one finishes the message.
    stale_before = stale_total(broker)
    for old in (first, second, third):
        old.settled = False
        consumer.ack(old)
    broker.flush_outcomes(timeout=10)
    assert stale_total(broker) == stale_before + 3
    assert not acked(broker, mid)
    consumer.ack(fourth)
    broker.flush_outcomes(timeout=10)
    assert acked(broker, mid, attempt=4)


# -- a claim whose response is lost ------------------------------------------------------------
def test_claim_with_lost_response_is_released_at_the_next_claim(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The claim commits but its response never arrives (the connection breaks in between).  The rows
    it leased must not wait for their lease (60 s here): the next claim of the queue puts them back,
    and they are delivered at once with a higher attempt.  What the process still holds stays held."""
    broker = dramatiq_pg_broker_factory(lease_seconds=60, poll_interval=0.1)
    broker.declare_queue("lost")

    def message() -> Message[Any]:
        return Message(queue_name="lost", actor_name="nobody", args=(), kwargs={}, options={})

    held, lost = message(), message()
    broker.enqueue(held)
    consumer = broker.consume("lost", prefetch=4, timeout=100)
    first = wait_for(lambda: next(consumer), 30, "the first delivery")
    assert first.message_id == held.message_id

    real = PostgresConsumer._claim_rows
    calls = 0

    def claim_then_lose_the_response(self: PostgresConsumer, conn: psycopg.Connection, limit: int) -> list[tuple]:
        nonlocal calls
        calls += 1
        rows = real(self, conn, limit)
        if calls == 1:
            assert [str(r[0]) for r in rows] == [lost.message_id]  # the claim committed
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return rows

    monkeypatch.setattr(PostgresConsumer, "_claim_rows", claim_then_lose_the_response)
    broker.enqueue(lost)
    with pytest.raises(ConnectionClosed):
        while next(consumer) is None:
            pass
    info = broker.inspect(lost.message_id)
    assert info is not None and (info["state"], info["attempt"]) == ("running", 1)

    consumer = broker.consume("lost", prefetch=4, timeout=100)  # as Dramatiq's worker does after an error
    start = time.monotonic()
    with caplog.at_level("WARNING"):
        again = wait_for(lambda: next(consumer), 30, "the lost message's redelivery")
    assert time.monotonic() - start < 10  # not the 60 s lease
    assert (again.message_id, again.attempt) == (lost.message_id, 2)
    assert "leased by a claim whose response was lost" in caplog.text
    info = broker.inspect(held.message_id)
    assert info is not None and (info["state"], info["attempt"]) == ("running", 1)  # still ours, untouched
    consumer.ack(first)
    consumer.ack(again)
    broker.flush_outcomes(timeout=10)
    assert acked(broker, held.message_id) and acked(broker, lost.message_id)


def test_redelivered_messages_keep_their_place_in_the_queue(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
) -> None:
    """A message released at shutdown, or whose lease expired, goes back where it was in the queue,
    not behind everything enqueued since (a long backlog would otherwise delay its redelivery)."""
    broker = dramatiq_pg_broker_factory(lease_seconds=1, rescue_interval=0.2, poll_interval=0.1)
    broker.declare_queue("place")

    def message() -> Message[Any]:
        return Message(queue_name="place", actor_name="nobody", args=(), kwargs={}, options={})

    def first_delivery(b: PostgresBroker) -> Any:
        consumer = b.consume("place", prefetch=1, timeout=100)
        return consumer, wait_for(lambda: next(consumer), 30, "a delivery")

    early = message()
    broker.enqueue(early)
    consumer, delivered = first_delivery(broker)
    assert delivered.message_id == early.message_id
    broker.enqueue_many([message() for _ in range(3)])
    consumer.requeue([delivered])  # shutdown release
    consumer.close()
    consumer, delivered = first_delivery(broker)
    assert (delivered.message_id, delivered.attempt) == (early.message_id, 2)

    consumer.ack(delivered)
    consumer.close()
    holder = dramatiq_pg_broker_factory(schema=broker.schema, lease_seconds=1, rescue_interval=0.2)
    holder.declare_queue("place")
    _, held = first_delivery(holder)  # the oldest of the three
    held_id = held.message_id
    holder.close()  # stops extending without releasing: the lease expires
    broker.enqueue_many([message() for _ in range(3)])
    wait_for(lambda: (broker.inspect(held_id) or {}).get("state") == "queued", 30, "the lease to expire")
    consumer, delivered = first_delivery(broker)
    assert delivered.message_id == held_id and delivered.attempt == held.attempt + 1
