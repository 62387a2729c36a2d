"""Reconnecting after an outage: paced attempts, one outage report, and every pool back within a second.

The worker-process view of the same promise is in test_faults.py (section 4)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from dramatiq.results import ResultMissing
from helpers import wait_for
from test_faults import OwnedServer

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.db import reconnect
from dramatiq_pg_fenced.features import rate_limits, results

REFUSED = psycopg.OperationalError('connection to server at "db", port 5432 failed: Connection refused')


def refuse() -> Any:
    raise REFUSED


def test_while_a_server_is_down_the_process_tries_it_at_a_steady_pace_and_says_so_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a server that refuses connections, when the parts of a process try to connect as fast as
    they can for a second, then about one attempt per 0.4 s reaches it (the others fail at once with
    the same cause), the outage is logged once plus reminders (every 0.3 s here, a minute by default),
    and its end once."""
    monkeypatch.setattr(reconnect, "REMINDER_INTERVAL", 0.3)
    server = reconnect.Server("db:5432/app")
    server.awaited = True  # a part of the process waits for it (a worker's consumer)
    real: list[float] = []

    def attempt() -> Any:
        real.append(time.monotonic())
        return refuse()

    answered_at_once = 0
    with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced.db.reconnect"):
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            with pytest.raises(psycopg.OperationalError, match="Connection refused") as failed:
                server.connect(attempt)
            answered_at_once += "not tried again yet" in str(failed.value)
            time.sleep(0.005)
        assert server.down
        time.sleep(0.4)  # the next real attempt finds the server back
        assert server.connect(lambda: "a connection") == "a connection"
        assert not server.down
    gaps = [b - a for a, b in zip(real, real[1:], strict=False)]
    assert 2 <= len(real) <= 4 and min(gaps) >= 0.4 - 0.01, gaps
    assert answered_at_once > 20
    lines = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert lines[0] == (
        "WARNING",
        "Cannot connect to PostgreSQL at db:5432/app: Connection refused. Trying again every 0.5 s;"
        " work resumes when it is back.",
    )
    reminders = [text for level, text in lines if "still unreachable" in text]
    assert 1 <= len(reminders) < len(real)
    assert lines[-1][0] == "INFO" and lines[-1][1].startswith("PostgreSQL at db:5432/app is reachable again")
    assert len(lines) == 2 + len(reminders)


def test_a_part_waiting_to_retry_wakes_when_another_part_connects() -> None:
    server = reconnect.Server("db:5432/app")
    with pytest.raises(psycopg.OperationalError):
        server.connect(refuse)
    waited: list[float] = []

    def wait() -> None:
        start = time.monotonic()
        server.pause(60)
        waited.append(time.monotonic() - start)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.45)  # past the pace: the next attempt is a real one
    server.connect(lambda: "a connection")
    waiter.join(40)
    assert waited and waited[0] < 30  # woken by the connection, not at the end of its 60 s pause


def closed_port() -> int:
    """A port of 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_consumer_waits_quietly_while_the_database_is_away(caplog: pytest.LogCaptureFixture) -> None:
    """It returns None about every timeout, as Dramatiq asks, instead of raising a connection error
    (the worker would log it and restart the consumer only 3 s later); one line says why."""
    broker = PostgresBroker(f"postgresql://postgres@127.0.0.1:{closed_port()}/away", schema="away", connect_timeout=1)
    try:
        broker.declare_queue("q")
        consumer = broker.consume("q", prefetch=1, timeout=300)
        with caplog.at_level(logging.WARNING):
            for _ in range(3):
                start = time.monotonic()
                assert next(consumer) is None
                assert time.monotonic() - start < 30  # it returns (about every timeout), it does not hang
        assert [r.getMessage().split(":")[0] for r in caplog.records if r.levelno >= logging.WARNING] == [
            "Cannot connect to PostgreSQL at 127.0.0.1"
        ]
    finally:
        broker.close()


@pytest.fixture
def owned_server() -> Iterator[OwnedServer]:
    server = OwnedServer()
    try:
        yield server
    finally:
        server.close()


@pytest.mark.slow
def test_the_pools_of_the_broker_and_both_backends_are_back_within_a_second(owned_server: OwnedServer) -> None:
    """Given a broker, a results backend and a rate-limit backend, each with a pool of its own, that
    were in use when PostgreSQL stopped for 10 s (past psycopg_pool's attempts at 1, 3 and 7 s; its
    next would come at 15 s), when it accepts connections again, then each of them works within a
    second (the pools try every 0.5 s at the longest), and no call fails on a connection broken by
    the outage."""
    url = owned_server.url
    broker = PostgresBroker(url, schema="back", connect_timeout=1)
    broker.migrate()
    broker.declare_queue("q")
    result_backend = results.PostgresBackend(url=url, schema="back", connect_timeout=1)
    limits = rate_limits.PostgresBackend(url=url, schema="back", connect_timeout=1)

    def result() -> None:
        with pytest.raises(ResultMissing):
            result_backend.get_result(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))

    uses: dict[str, Callable[[], Any]] = {
        "send": lambda: broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})),
        "get_result": result,
        "rate limit": lambda: limits.add(f"key-{time.monotonic()}", 1, 60_000),
    }
    try:
        for use in uses.values():
            use()
        stopped = time.monotonic()
        owned_server.stop("immediate")
        for use in uses.values():  # each pool finds its connections broken and starts reconnecting
            with pytest.raises(ConnectionClosed):
                use()
        time.sleep(max(stopped + 10 - time.monotonic(), 0))
        back = owned_server.start().timestamp()
        figures: dict[str, float] = {}
        failures: list[str] = []
        for name, use in uses.items():
            while True:
                try:
                    use()
                    break
                except ConnectionClosed as e:
                    failures.append(f"{name}: {e}")
                    time.sleep(0.01)
            figures[name] = time.time() - back
        print(
            "\n" + ", ".join(f"{name} works {s:.2f} s after the return" for name, s in figures.items()),
            f"({len(failures)} failed tries after it)",
        )
        assert max(figures.values()) < 1.5, figures
        # No stale connection was left in a pool to fail a call after the return; until the pool's next
        # attempt (within 0.5 s) a send is refused at once with the cause the process knew.
        assert [f for f in failures if not f.startswith("send: ") or "refused" not in f] == []
    finally:
        limits.close()
        result_backend.close()
        broker.close()


def test_a_send_while_the_server_is_known_unreachable_fails_at_once_without_asking_the_pool() -> None:
    """Given a broker whose server refuses connections, and whose pool has met that already (the
    process knows the server is unreachable, and the pool tries it again in the background), when
    the application sends, I expect Dramatiq's BrokerConnectionError naming the database and the
    cause, raised without the send waiting on the pool for a connection (a producer that also sends
    to healthy databases is not held up by the one that is down); the pool's own attempts go on."""
    broker = PostgresBroker(f"postgresql://postgres@127.0.0.1:{closed_port()}/away", schema="away", connect_timeout=5)
    try:
        broker.declare_queue("q")
        send = lambda: broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))  # noqa: E731
        with pytest.raises(ConnectionClosed):
            send()  # the first send learns that the server is away (as any part of the process may)
        local = broker.database._here()
        server = reconnect.server_for(broker.database.conninfo)
        assert server.down
        asked = local.pool.get_stats().get("requests_num", 0)
        with pytest.raises(ConnectionClosed, match=r"cannot reach PostgreSQL at 127\.0\.0\.1:\d+/away: .*refused"):
            send()
        assert local.pool.get_stats().get("requests_num", 0) == asked, "the send waited on the pool for a connection"
        tried = server._last_try
        wait_for(lambda: server._last_try != tried, 5, "the pool's next attempt in the background")
    finally:
        broker.close()


def test_a_send_while_nobody_tries_the_server_again_tries_it_itself() -> None:
    """Given a server known unreachable whose last attempt is older than the pools' pace (no part of
    the process tries it now: a pool that gave up), I expect a send to ask the pool (and so make an
    attempt) instead of failing on what the process knew: its return is found by the first caller."""
    broker = PostgresBroker(f"postgresql://postgres@127.0.0.1:{closed_port()}/away2", schema="away", connect_timeout=1)
    try:
        broker.declare_queue("q")
        send = lambda: broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))  # noqa: E731
        with pytest.raises(ConnectionClosed):
            send()
        local = broker.database._here()
        server = reconnect.server_for(broker.database.conninfo)
        server._last_try -= 10 * reconnect.RETRY_INTERVAL  # nobody tried it for a while
        asked = local.pool.get_stats().get("requests_num", 0)
        with pytest.raises(ConnectionClosed):
            send()
        assert local.pool.get_stats().get("requests_num", 0) > asked
    finally:
        broker.close()


@pytest.mark.slow
def test_a_checkout_that_meets_connections_broken_by_a_restart_tries_the_next_at_once(
    owned_server: OwnedServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a pool of four idle connections (a worker's, grown while its consumers claimed at once)
    and a server restarted under them, when a part of the worker (a consumer's claim, the outcome
    writer) asks for a connection, I expect each broken one to be dropped and the next tried at once:
    no pause of psycopg_pool's growing backoff (1, 2, 4 s... between failed checks, so seconds of no
    work after the server's return), only the pace of reconnect.py while none is ready."""
    import psycopg_pool.pool

    monkeypatch.setattr(reconnect, "CHECK_IDLE", 0.0)  # every checkout checks with a round trip
    pauses: list[float] = []
    real_sleep = time.sleep

    def pause(seconds: float) -> None:
        pauses.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(psycopg_pool.pool, "sleep", pause)
    monkeypatch.setattr(reconnect, "_pause", pause, raising=False)
    broker = PostgresBroker(owned_server.url, schema="stale", connect_timeout=5)
    try:
        broker.migrate()
        database = broker.database
        together = threading.Barrier(4)

        def hold() -> None:
            with database.connection(raw=True):
                together.wait(10)

        holders = [threading.Thread(target=hold) for _ in range(4)]
        for holder in holders:
            holder.start()
        for holder in holders:
            holder.join(10)
        pool = database._here().pool
        assert pool.get_stats()["pool_available"] == 4
        owned_server.stop("fast")
        owned_server.start()
        with database.connection(raw=True, timeout=30) as conn:
            conn.execute("SELECT 1")
        assert pauses == [], "paused between checks of connections that were ready"
    finally:
        broker.close()
