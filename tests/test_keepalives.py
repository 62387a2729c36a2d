"""TCP keepalives and a TCP user timeout on every connection the package makes (``reconnect.TCP_DEFAULTS``),
unless the URL sets them: a server that stops answering without closing the socket fails the statement
waiting on it within seconds, not after the operating system's two hours (or 15 minutes)."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from cluster import IsolatedServer
from dramatiq.errors import ConnectionClosed
from dramatiq.message import Message
from helpers import Factory, running_worker, wait_for
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.db import reconnect

OPTIONS = {
    "keepalives": (socket.SOL_SOCKET, socket.SO_KEEPALIVE),
    "keepalives_idle": (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
    "keepalives_interval": (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
    "keepalives_count": (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
    "tcp_user_timeout": (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18)),
}


def tcp_options(conn: psycopg.Connection) -> dict[str, int] | None:
    """The socket options libpq set on *conn*'s socket (``None`` for a Unix socket)."""
    sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
    try:
        if sock.family == socket.AF_UNIX:
            return None
        return {name: sock.getsockopt(level, option) for name, (level, option) in OPTIONS.items()}
    finally:
        sock.close()


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, int] | None]:
    """The socket options of every connection the package makes from now on."""
    seen: list[dict[str, int] | None] = []
    connect = reconnect.PacedConnection.connect.__func__  # type: ignore[attr-defined]

    def recording(cls: Any, conninfo: str = "", **kwargs: Any) -> Any:
        conn = connect(cls, conninfo, **kwargs)
        seen.append(tcp_options(conn))
        return conn

    monkeypatch.setattr(reconnect.PacedConnection, "connect", classmethod(recording))
    return seen


def test_every_connection_the_package_makes_has_keepalives_and_a_user_timeout(
    dramatiq_pg_url: str, dramatiq_pg_broker_factory: Factory, made: list[dict[str, int] | None]
) -> None:
    """The pool's, the lease keeper's, the doorbell's and the replica reader's connections."""
    broker = dramatiq_pg_broker_factory(read_url=dramatiq_pg_url, lease_seconds=3)
    broker.declare_queue("q")
    with running_worker(broker, threads=1):
        broker.enqueue(Message(queue_name="q", actor_name="nobody", args=(), kwargs={}, options={}))
        wait_for(lambda: broker.database.started_doorbell(broker.channel) is not None and len(made) >= 3, 10)
        with broker.database.connect() as conn:  # as the lease keeper makes its own
            conn.execute("SELECT 1")
        broker.queue_overview()  # the reader's pool
        time.sleep(0.2)
    if any(options is None for options in made):
        pytest.skip("the test server is reached over a Unix socket: no TCP options")
    assert len(made) >= 4
    wanted = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
    wanted["tcp_user_timeout"] = 10000
    assert all(options == wanted for options in made), made


def test_the_url_settings_win(dramatiq_pg_url: str, made: list[dict[str, int] | None]) -> None:
    url = make_conninfo(dramatiq_pg_url, keepalives_idle="30", tcp_user_timeout="0")
    database = PostgresBroker(url, schema="nothing_here").database
    try:
        with database.connect() as conn:
            options = tcp_options(conn)
    finally:
        database.close()
    if options is None:
        pytest.skip("the test server is reached over a Unix socket: no TCP options")
    assert options == {
        "keepalives": 1,
        "keepalives_idle": 30,  # the URL's
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": 0,  # the URL's: the system's own
    }
    assert reconnect.tcp_defaults("host=db keepalives=0") == {
        "keepalives_idle": "5",
        "keepalives_interval": "2",
        "keepalives_count": "3",
        "tcp_user_timeout": "10000",
    }


@pytest.fixture
def isolated() -> Iterator[IsolatedServer]:
    server = IsolatedServer()
    try:
        yield server
    finally:
        server.close()


# ~16 s: the promise's own bounds (10.5 s and 11 s of dropped packets before each statement fails).
@pytest.mark.slow
def test_a_statement_on_a_blackholed_connection_fails_within_seconds(isolated: IsolatedServer) -> None:
    """Given a broker on a server in a network namespace, when every packet between the two is dropped
    (sockets open, nothing answers) while a statement waits for its reply on a pooled connection and
    another is sent on the lease keeper's kind of connection, then the send fails within 15 s (10.5 s
    here) and the waiting statement as ``ConnectionClosed`` within 20 s (11 s, then its one retry on a
    new connection, which cannot connect within ``connect_timeout``: 15 s here); once packets flow
    again, the next statement works (failed before: both still waited after 40 s)."""
    broker = PostgresBroker(isolated.url, schema="bh", connect_timeout=2)
    try:
        broker.migrate()
        own = broker.database.connect()
        failed: dict[str, tuple[float, BaseException]] = {}

        def run(name: str, work: Any) -> None:
            start = time.monotonic()
            try:
                work()
            except (ConnectionClosed, psycopg.OperationalError) as e:
                failed[name] = (time.monotonic() - start, e)

        waiting = threading.Thread(
            target=run, args=("reply", lambda: broker.database.run(lambda c: c.execute("SELECT pg_sleep(2)")))
        )
        waiting.start()
        time.sleep(0.5)
        isolated.blackhole()
        sending = threading.Thread(target=run, args=("send", lambda: own.execute("SELECT 1")))
        sending.start()
        waiting.join(30)
        sending.join(30)
        assert not waiting.is_alive() and not sending.is_alive(), "a statement still waits after 30 s"
        assert set(failed) == {"reply", "send"}, failed
        assert isinstance(failed["reply"][1], ConnectionClosed), failed
        assert failed["reply"][0] < 20 and failed["send"][0] < 15, failed
        isolated.blackhole(False)
        deadline = time.monotonic() + 10
        while True:
            try:
                assert broker.database.run(lambda c: c.execute("SELECT 1").fetchone()) == (1,)
                break
            except ConnectionClosed:
                assert time.monotonic() < deadline
                time.sleep(0.2)
        own.close()
        print(f"\nfailed after: {', '.join(f'{k} {v[0]:.1f} s' for k, v in failed.items())}")
    finally:
        broker.close()
