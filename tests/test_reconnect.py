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
from test_faults import OwnedServer

from dramatiq_pg_fenced import PostgresBroker, rate_limits, reconnect, results

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
    with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced.reconnect"):
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
        server.pause(10)
        waited.append(time.monotonic() - start)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.45)  # past the pace: the next attempt is a real one
    server.connect(lambda: "a connection")
    waiter.join(5)
    assert waited and waited[0] < 1.0


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
                assert time.monotonic() - start < 1.5
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
        assert not failures  # no stale connection was left in a pool to fail a call after the return
    finally:
        limits.close()
        result_backend.close()
        broker.close()
