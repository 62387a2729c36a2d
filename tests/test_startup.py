"""Start-up: a configuration that can never work is an error at once; a server that cannot be reached
is an outage, waited out.

A ``dramatiq`` worker whose role, password, database or schema is wrong exits within seconds, non-zero,
after one line saying why (it said "ready for action" and waited forever before).  One that cannot
reach its server starts and waits for it, as after a good start (the outage after a good start, and a
worker started during one: test_faults.py, test_work_resumes_within_seconds_of_the_database_return).
Commands and send() that do not retry never say "trying again".  The metrics and dashboard servers
start while the database is away and report it, as they do once started.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import dramatiq
import psycopg
import pytest
from dramatiq.errors import ConnectionClosed
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker, StartupError
from dramatiq_pg_fenced.db import migrations, reconnect
from dramatiq_pg_fenced.db.database import connection_kwargs
from dramatiq_pg_fenced.db.reconnect import PacedConnection
from dramatiq_pg_fenced.db.startup import refused_for_good

REPO = Path(__file__).resolve().parent.parent
#: Dramatiq's exit code for a broker that failed at worker start-up (dramatiq.cli.RET_CONNECT).
RET_CONNECT = 3


def closed_port() -> int:
    """A port of 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Run(NamedTuple):
    code: int | None  #: None: still running when the time was up (then stopped with SIGTERM)
    seconds: float
    log: str
    stopped: int | None = None  #: the exit code after SIGTERM, when it had to be stopped


def dramatiq_worker(url: str, schema: str, tmp_path: Path, *, within: float) -> Run:
    """The stock ``dramatiq`` CLI on tests.apps.basic_app (one process, one thread), given *within* seconds
    to exit on its own."""
    log_path = tmp_path / f"worker-{uuid.uuid4().hex[:6]}.log"
    env = dict(os.environ, DRAMATIQ_PG_URL=url, DRAMATIQ_PG_SCHEMA=schema, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "tests.apps.basic_app", "--processes", "1", "--threads", "1"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        code = proc.wait(within)
        return Run(code, time.monotonic() - start, log_path.read_text())
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        stopped = proc.wait(30)
        return Run(None, time.monotonic() - start, log_path.read_text(), stopped)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def lines(log: str, level: str) -> list[str]:
    return [line for line in log.splitlines() if f"[{level}]" in line]


@pytest.fixture
def schema(dramatiq_pg_url: str) -> Iterator[str]:
    name = f"st_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def migrated(url: str, schema: str) -> None:
    broker = PostgresBroker(url, schema=schema)
    try:
        broker.migrate()
    finally:
        broker.close()


def schema_version(url: str, schema: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL(statement).format(sql.Identifier(schema, "schema_version")))


# -- a worker whose configuration can never work -------------------------------------------------
FAULTS = ["unknown role", "missing database", "unmigrated schema", "schema too old", "schema newer than the package"]


def configured(fault: str, url: str, schema: str) -> tuple[str, str]:
    """The worker's URL for *fault* (the schema set up for it), and the cause its line must name."""
    if fault == "unknown role":
        return make_conninfo(url, user="no_such_role_23"), 'role "no_such_role_23" does not exist'
    if fault == "missing database":
        return make_conninfo(url, dbname="no_such_db_23"), 'database "no_such_db_23" does not exist'
    if fault == "unmigrated schema":
        return url, "has no dramatiq-pg-fenced schema. Run: dramatiq-pg-fenced migrate"
    migrated(url, schema)
    if fault == "schema too old":
        schema_version(url, schema, "DELETE FROM {0} WHERE version = (SELECT max(version) FROM {0})")
        return url, "lacks migration(s)"
    schema_version(url, schema, "INSERT INTO {0} (version, name) VALUES (999, '999_future.sql')")
    return url, "upgrade the package"


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_a_worker_whose_configuration_can_never_work_exits_at_once_saying_why(
    fault: str, dramatiq_pg_url: str, schema: str, tmp_path: Path
) -> None:
    """Given a worker's URL naming a role or database that does not exist, or a schema missing, older or
    newer than the package, when `dramatiq app` starts, then it exits with Dramatiq's code for a broker
    that failed at start-up (3) within seconds, after one error line naming the cause; it never says it
    is ready, nor that it tries again."""
    url, cause = configured(fault, dramatiq_pg_url, schema)

    run = dramatiq_worker(url, schema, tmp_path, within=30)

    assert run.code == RET_CONNECT, run.log  # exited by itself, within the 30 s it was given (no retrying)
    errors = lines(run.log, "ERROR")
    assert len(errors) == 1 and cause in errors[0], run.log
    assert "Traceback" not in run.log and "ready for action" not in run.log
    assert "Trying again" not in run.log and "work resumes" not in run.log


@pytest.fixture
def password_server() -> Iterator[str]:
    """A server of the test's own that asks role `app` for its password (scram-sha-256): a URL with a
    wrong one."""
    from test_faults import OwnedServer

    server = OwnedServer()
    try:
        hba = Path(server.datadir) / "pg_hba.conf"
        hba.write_text(
            "local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        )
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE ROLE app LOGIN PASSWORD 'right-pw-23'")
            conn.execute("SELECT pg_reload_conf()")
        yield f"postgresql://app:wrong-pw-23@127.0.0.1:{server.port}/postgres"
    finally:
        server.close()


@pytest.mark.slow
def test_a_worker_with_a_wrong_password_exits_at_once_saying_why(password_server: str, tmp_path: Path) -> None:
    run = dramatiq_worker(password_server, "dramatiq", tmp_path, within=30)

    assert run.code == RET_CONNECT, run.log  # exited by itself, within the 30 s it was given (no retrying)
    errors = lines(run.log, "ERROR")
    assert len(errors) == 1 and 'password authentication failed for user "app"' in errors[0], run.log
    assert "wrong-pw-23" not in run.log
    assert "Traceback" not in run.log and "ready for action" not in run.log


@pytest.mark.slow
def test_a_worker_that_cannot_reach_its_server_starts_and_waits_for_it(tmp_path: Path) -> None:
    """At start-up a refused connection may be a server restarting during a deploy: the worker starts,
    says once that it cannot connect and tries again, and stops cleanly when told."""
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/away"

    run = dramatiq_worker(url, "dramatiq", tmp_path, within=6)

    assert run.code is None, run.log  # still up
    assert run.stopped == 0, run.log
    warnings = lines(run.log, "WARNING")
    assert len(warnings) == 1 and "Cannot connect to PostgreSQL" in warnings[0], run.log
    assert "Trying again every" in warnings[0] and not lines(run.log, "ERROR"), run.log


def test_a_worker_started_in_process_on_an_unmigrated_schema_raises(dramatiq_pg_url: str, schema: str) -> None:
    broker = PostgresBroker(dramatiq_pg_url, schema=schema)
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=1)
    try:
        with pytest.raises(StartupError, match="has no dramatiq-pg-fenced schema"):
            worker.start()
    finally:
        broker.close()


# -- a good start: one connection fewer, the schema checked once -------------------------------------
def test_a_worker_start_checks_the_schema_once_and_its_pool_keeps_the_checks_connection(
    dramatiq_pg_url: str, schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The start-up check's connection becomes the pool's first (a connection fewer to wait for before
    the first claim), and the pool takes the check as its own: the schema is read once per process.
    (Before, the check's connection was closed and the pool's first connection checked the schema again.)"""
    migrated(dramatiq_pg_url, schema)
    checked: list[int] = []
    check = migrations.check

    def counted(conn: psycopg.Connection, *args: object, **kwargs: object) -> None:
        checked.append(conn.info.backend_pid)
        check(conn, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(migrations, "check", counted)
    sender = PostgresBroker(dramatiq_pg_url, schema=schema)
    dramatiq.actor(lambda: None, actor_name="go", broker=sender, queue_name="boot").send()
    sender.close()
    checked.clear()  # the sender's own pool checked it: another process, as far as the worker goes
    broker = PostgresBroker(dramatiq_pg_url, schema=schema)
    ran: list[int] = []
    dramatiq.actor(lambda: ran.append(1), actor_name="go", broker=broker, queue_name="boot")
    worker = dramatiq.Worker(broker, worker_timeout=100, worker_threads=2)
    try:
        worker.start()
        broker.join("boot", timeout=10_000)
        assert ran == [1]
        assert len(checked) == 1, checked
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            alive = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [checked[0]]).fetchone()
        assert alive == (1,), "the start-up check's connection was closed, not kept by the pool"
    finally:
        worker.stop()
        broker.close()


def test_a_seeded_connection_stands_for_a_new_one_only_if_made_alike_idle_and_fresh(
    dramatiq_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the check leaves for the pool is taken only by a connection to the same URL with the same
    settings, while it is idle and within ``SEED_WAIT``; otherwise it is closed and a new one made."""
    kwargs = connection_kwargs(5)

    def seeded(url: str = dramatiq_pg_url) -> PacedConnection:
        conn = PacedConnection.connect_once(url, **kwargs)
        reconnect.seed(conn, url, kwargs)
        return conn

    made: list[psycopg.Connection] = []
    try:
        first = seeded()
        made.append(PacedConnection.connect(dramatiq_pg_url, **kwargs))
        assert made[-1] is first and not first.closed

        other_settings = seeded()  # a pool without prepared statements (PgBouncer) wants its own
        made.append(PacedConnection.connect(dramatiq_pg_url, **connection_kwargs(5, prepare=False)))
        assert made[-1] is not other_settings and other_settings.closed

        busy = seeded()
        busy.execute("BEGIN")
        made.append(PacedConnection.connect(dramatiq_pg_url, **kwargs))
        assert made[-1] is not busy and busy.closed

        monkeypatch.setattr(reconnect, "SEED_WAIT", 0.0)
        late = seeded()
        time.sleep(0.01)
        made.append(PacedConnection.connect(dramatiq_pg_url, **kwargs))
        assert made[-1] is not late and late.closed
        monkeypatch.undo()

        elsewhere = seeded(make_conninfo(dramatiq_pg_url, application_name="another"))
        made.append(elsewhere)
        made.append(PacedConnection.connect(dramatiq_pg_url, **kwargs))
        assert made[-1] is not elsewhere and not elsewhere.closed
    finally:
        for conn in made:
            conn.close()
        reconnect._seeds.clear()


def test_a_forked_child_neither_takes_nor_closes_its_parents_seed(dramatiq_pg_url: str) -> None:
    """A seed shares its socket with a child forked before the pool took it: the child makes a
    connection of its own, and leaves the seed alone (closing it there would end the parent's session)."""
    kwargs = connection_kwargs(5)
    seeded = PacedConnection.connect_once(dramatiq_pg_url, **kwargs)
    reconnect.seed(seeded, dramatiq_pg_url, kwargs)
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit code 0 only if it got a connection of its own and left the seed
            code = 1
            try:
                with PacedConnection.connect(dramatiq_pg_url, **kwargs) as own:
                    reconnect.seed(PacedConnection.connect_once(dramatiq_pg_url, **kwargs), dramatiq_pg_url, kwargs)
                    reconnect.unseed(dramatiq_pg_url)  # its own seed: closed; the parent's: untouched
                    code = 0 if own is not seeded and own.execute("SELECT 1").fetchone() == (1,) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        taken = PacedConnection.connect(dramatiq_pg_url, **kwargs)
        assert taken is seeded and taken.execute("SELECT 1").fetchone() == (1,)
    finally:
        seeded.close()
        reconnect._seeds.clear()


MULTI_HOST = (
    'connection failed: connection to server at "db2", port 5432 failed: FATAL:  role "app" does not exist\n'
    "Multiple connection attempts failed. All failures were:\n"
    "- host: 'db1', port: '5432', hostaddr: '10.0.0.1': connection failed: connection to server at \"db1\" "
    "(10.0.0.1), port 5432 failed: {}\n"
    "- host: 'db2', port: '5432', hostaddr: '10.0.0.2': connection failed: connection to server at \"db2\" "
    "(10.0.0.2), port 5432 failed: {}"
)


@pytest.mark.parametrize(
    ("text", "for_good"),
    [
        ('connection to server at "db" (10.0.0.5), port 5432 failed: FATAL:  password authentication failed for user "app"', True),
        ('connection to server at "db", port 5432 failed: FATAL:  role "app" does not exist', True),
        ('connection to server at "db", port 5432 failed: FATAL:  database "app" does not exist', True),
        ('connection to server at "db", port 5432 failed: FATAL:  no pg_hba.conf entry for host "10.0.0.9", user "app", database "app", no encryption', True),
        ('connection to server at "db", port 5432 failed: FATAL:  permission denied for database "app"', True),
        ('connection to server at "db", port 5432 failed: FATAL:  role "app" is not permitted to log in', True),
        ('connection to server at "db", port 5432 failed: fe_sendauth: no password supplied', True),
        ('connection to server at "db", port 5432 failed: Connection refused', False),
        ('connection to server at "db", port 5432 failed: timeout expired', False),
        ('connection to server at "db", port 5432 failed: FATAL:  the database system is starting up', False),
        ('connection to server at "db", port 5432 failed: FATAL:  the database system is shutting down', False),
        ('connection to server at "db", port 5432 failed: FATAL:  sorry, too many clients already', False),
        ('connection to server at "db", port 5432 failed: FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute', False),
        ('could not translate host name "db" to address: Name or service not known', False),
        ('connection to server at "db", port 5432 failed: server is in hot standby mode', False),
        (MULTI_HOST.format("Connection refused", 'FATAL:  role "app" does not exist'), False),
        (MULTI_HOST.format('FATAL:  role "app" does not exist', 'FATAL:  role "app" does not exist'), True),
        ('connection to server at "db1" (10.0.0.1), port 5432 failed: server is in hot standby mode\n'
         'connection to server at "db2" (10.0.0.2), port 5432 failed: FATAL:  role "app" does not exist', False),
    ],
)  # fmt: skip
def test_which_connection_failures_can_never_work(text: str, for_good: bool) -> None:
    """A refusal that names the configuration (role, password, database, pg_hba.conf) is for good; a
    server that cannot be reached, or is starting, stopping, full or a standby, may answer later (an
    unknown host name too: DNS during a deploy).  With several hosts, only if every one refused for good."""
    assert refused_for_good(psycopg.OperationalError(text)) is for_good


# -- commands and sends that do not retry never say they do -------------------------------------------
@pytest.mark.parametrize("user", ["postgres", "no_such_role_23"])
def test_a_command_that_fails_to_connect_says_so_in_one_line(dramatiq_pg_url: str, user: str) -> None:
    url = (
        f"postgresql://{user}@127.0.0.1:{closed_port()}/away"
        if user == "postgres"
        else make_conninfo(dramatiq_pg_url, user=user)
    )
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "stats"], capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith("error: "), done.stderr


def test_a_send_to_an_unreachable_database_raises_without_saying_it_tries_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = PostgresBroker(f"postgresql://postgres@127.0.0.1:{closed_port()}/away", connect_timeout=1)
    broker.declare_queue("default")
    message = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(2):
                with pytest.raises(ConnectionClosed, match="cannot reach PostgreSQL"):
                    broker.enqueue(message)
    finally:
        broker.close()
    assert not [r for r in caplog.records if "work resumes" in r.getMessage() or "Trying again" in r.getMessage()]


# -- the metrics and dashboard servers start while the database is away ------------------------------
@contextmanager
def server_command(url: str, *args: str) -> Iterator[tuple[str, list[str]]]:
    """``dramatiq-pg-fenced ARGS --port 0`` until it says where it listens: (its address, stderr lines)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, *args, "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    seen: list[str] = []
    try:
        assert proc.stderr is not None
        while " on http://" not in (seen[-1] if seen else ""):
            line = proc.stderr.readline()
            assert line, f"it ended (exit code {proc.wait()}): {seen}"
            seen.append(line)
        yield seen[-1].rsplit(" ", 1)[-1].strip(), seen
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def get(address: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(address, timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_metrics_start_while_the_database_is_away_and_say_up_0() -> None:
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/away"
    with server_command(url, "metrics") as (address, seen):
        status, body = get(address)
        assert status == 200 and "dramatiq_pg_up 0.0" in body, body
    assert any("cannot reach PostgreSQL" in line for line in seen), seen


def test_the_dashboard_starts_while_the_database_is_away_and_answers_503() -> None:
    url = f"postgresql://postgres@127.0.0.1:{closed_port()}/away"
    with server_command(url, "dashboard") as (address, seen):
        status, body = get(address)
        assert status == 503 and "could not answer" in body, body
    assert any("cannot reach PostgreSQL" in line for line in seen), seen


@pytest.mark.parametrize("command", ["metrics", "dashboard"])
def test_metrics_and_dashboard_refuse_a_configuration_that_can_never_work(command: str, dramatiq_pg_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", make_conninfo(dramatiq_pg_url, user="no_such_role_23"),
         command, "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == done.stderr.strip().splitlines()[0], done.stderr
    assert 'role "no_such_role_23" does not exist' in done.stderr
