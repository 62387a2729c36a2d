"""Shared test helpers.  The broker and worker fixtures come from the package's
own pytest plugin (``dramatiq_pg_fenced.testing``), as they would for users."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import dramatiq
import dramatiq.broker
import psycopg
import pytest
from failure_report import on_failure, process_log, schema_rows, sections
from pgbouncer import PgBouncer
from pgbouncer import binary as pgbouncer_binary
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config: pytest.Config) -> None:
    """Tests stop the CLI processes they start with SIGINT, as Ctrl-C does.  A suite started in the
    background by a shell without job control (``cmd &`` in a script, ``nohup``) inherits SIGINT
    ignored, and an ignored signal stays ignored in every process it starts: the dashboard, the
    metrics server and the quickstart then never stopped, and 7 tests failed (seen in a fresh run
    started so).  A handler here is reset to the default in each child at its exec, so Python
    children turn SIGINT into KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests marked ``slow`` (seconds each: worker processes, outages, the model runs) first, the
    others in their order after them: pytest-xdist hands tests out in this order, so the long ones
    start at once and the short ones fill the workers' ends, rather than one long test starting last
    and the run waiting for it alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failing test's report gets the sections its fixtures registered (failure_report.on_failure):
    the logs of the worker processes, the rows of their schemas, read before the teardown."""
    report = yield
    if report.failed:
        for title, text in sections(item):
            report.sections.append((f"on failure: {title}", text))
    # A pytest-xdist worker sends its reports as UTF-8: a lone surrogate in a captured log (the bad
    # outcomes tests log error texts PostgreSQL cannot store) crashed the worker, and the run.
    report.sections = [(name, _utf8(text)) for name, text in report.sections]
    return report


def _utf8(text: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode(errors="backslashreplace").decode()
    return text


@pytest.fixture(autouse=True)
def _restore_dramatiq_globals() -> Iterator[None]:
    """Tests set the global broker and encoder; put them back afterwards."""
    broker, encoder = dramatiq.broker.global_broker, dramatiq.get_encoder()
    yield
    dramatiq.broker.global_broker = broker
    dramatiq.set_encoder(encoder)


@pytest.fixture
def dramatiq_cli(
    dramatiq_pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., subprocess.Popen]]:
    """``start(broker, module, *args)``: the real ``dramatiq`` CLI on *broker*'s schema.

    The app module reads ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``.  Output
    goes to ``proc.log_path`` (a file, so a chatty worker never blocks on a
    pipe).  The CLI runs in its own process group, killed at teardown if the
    test left it running.  If the test fails, its report shows each CLI's log
    and the rows of each schema a CLI ran on.
    """
    started: list[subprocess.Popen] = []
    schemas: set[str] = set()

    def start(broker: PostgresBroker, module: str, *args: str) -> subprocess.Popen:
        env = dict(os.environ, DRAMATIQ_PG_URL=dramatiq_pg_url, DRAMATIQ_PG_SCHEMA=broker.schema, PYTHONUNBUFFERED="1")
        log_path = tmp_path / f"dramatiq-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", module, *args],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log_path  # type: ignore[attr-defined]
        started.append(proc)
        on_failure(
            request.node, f"log of dramatiq {module} {' '.join(args)} ({log_path.name})", process_log(proc, log_path)
        )
        if broker.schema not in schemas:
            schemas.add(broker.schema)
            on_failure(request.node, f"rows of schema {broker.schema}", schema_rows(dramatiq_pg_url, broker.schema))
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def pgbouncer(dramatiq_pg_url: str) -> Iterator[PgBouncer]:
    """A real PgBouncer (system package) in transaction pooling in front of the test database."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed (apt-get install pgbouncer; .ci/run installs it)")
    bouncer = PgBouncer(dramatiq_pg_url).start()
    yield bouncer
    bouncer.stop()


def readme_permissions() -> list[str]:
    """The SQL blocks of the documentation's Permissions page (docs/permissions.md), in order."""
    text = (REPO / "docs" / "permissions.md").read_text()
    return re.findall(r"```sql\n(.*?)```", text, flags=re.S)


class LeastPrivilege(NamedTuple):
    """Roles set up exactly as the Permissions page (docs/permissions.md) says."""

    schema: str
    owner: str  #: owns the schema (and, once migrated, its tables); no CREATE on the database
    app: str  #: owns nothing; only the Permissions page's grants
    password: str
    grant: Callable[[], None]  #: the page's second block, run as the owner


@pytest.fixture
def least_privilege(dramatiq_pg_url: str, pgbouncer: PgBouncer) -> Iterator[LeastPrivilege]:
    """A schema owned by a migrating role, an application role, both let through PgBouncer.

    The Permissions page's first block runs here (as the superuser); the test runs
    ``migrate`` and ``grant()`` (the second block, as the owner) when it wants.
    """
    suffix = uuid.uuid4().hex[:8]
    schema, owner, app = f"lp_{suffix}", f"lp_owner_{suffix}", f"lp_app_{suffix}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        dbname = conn.info.dbname
    names = {"jobs_owner": owner, "jobs_app": app, "dramatiq": schema, "mydb": dbname}

    def bind(block: str) -> list[str]:
        for word, name in names.items():
            block = re.sub(rf"\b{word}\b", sql.Identifier(name).as_string(None), block)
        return [s.strip() for s in block.split(";") if s.strip() and not s.strip().startswith("--")]

    blocks = readme_permissions()
    assert len(blocks) == 2, "docs/permissions.md has two SQL blocks: the superuser's, the owner's"
    password = re.search(r"PASSWORD '([^']*)'", blocks[0])
    assert password is not None
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        for statement in bind(blocks[0]):
            conn.execute(statement.encode())
    for role in (owner, app):
        pgbouncer.add_user(role, password.group(1))

    def grant() -> None:
        with psycopg.connect(pgbouncer.url(owner), autocommit=True, prepare_threshold=None) as conn:
            for statement in bind(blocks[1]):
                conn.execute(statement.encode())

    try:
        yield LeastPrivilege(schema, owner, app, password.group(1), grant)
    finally:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)", [[owner, app]]
            )
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            for role in (app, owner):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


class OwnData(NamedTuple):
    """A database as a developer's ``DATABASE_URL`` points at: their own data in it."""

    url: str
    dbname: str
    admin_url: str  #: the test server's database, to watch this one from outside


@pytest.fixture
def own_data(dramatiq_pg_url: str) -> Iterator[OwnData]:
    """A database of its own whose default schema (``dramatiq``) is migrated and whose ``default``
    queue holds three messages, as a developer's working database would; dropped afterwards."""
    dbname = f"own_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    url = make_conninfo(dramatiq_pg_url, dbname=dbname)
    broker = PostgresBroker(url, listen=False)
    try:
        broker.migrate()
        broker.declare_queue("default")
        broker.enqueue_many(
            dramatiq.Message(queue_name="default", actor_name="theirs", args=(n,), kwargs={}, options={})
            for n in range(3)
        )
    finally:
        broker.close()
    try:
        yield OwnData(url, dbname, dramatiq_pg_url)
    finally:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
