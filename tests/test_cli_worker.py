"""The stock ``dramatiq`` CLI, with worker processes, consuming from the broker."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable

import dramatiq
import pytest
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

pytestmark = pytest.mark.slow


def ledger_table(broker: PostgresBroker) -> sql.Identifier:
    """The ledger basic_app's actors write (one row per start: n, pid, attempt); returns the schema."""
    schema = sql.Identifier(broker.schema)
    with broker.database.connection() as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.ledger (n integer NOT NULL, pid integer NOT NULL, attempt integer NOT NULL)"
            ).format(schema)
        )
    return schema


def test_dramatiq_cli_worker_processes(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_cli: Callable[..., subprocess.Popen]
) -> None:
    broker = dramatiq_pg_broker_factory()
    schema = ledger_table(broker)

    cli = dramatiq_cli(broker, "tests.apps.basic_app", "--processes", "2", "--threads", "2")
    broker.declare_queue("default")
    total = 80
    broker.enqueue_many(
        dramatiq.Message(queue_name="default", actor_name="record", args=(n,), kwargs={}, options={})
        for n in range(total)
    )

    def ledger() -> list[tuple[int, int, int]]:
        with broker.database.connection() as conn:
            return conn.execute(sql.SQL("SELECT n, pid, attempt FROM {}.ledger").format(schema)).fetchall()

    deadline = time.monotonic() + 60
    while len(ledger()) < total:
        assert cli.poll() is None, cli.log_path.read_text()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, f"only {len(ledger())} of {total} done"
        time.sleep(0.1)
    broker.join("default", timeout=30_000)  # every outcome written

    cli.send_signal(signal.SIGTERM)
    try:
        code = cli.wait(60)
    except subprocess.TimeoutExpired:
        pytest.fail("the dramatiq CLI did not stop on SIGTERM")
    log = cli.log_path.read_text()  # type: ignore[attr-defined]
    assert code == 0, log

    done = ledger()
    assert sorted(n for n, _, _ in done) == list(range(total))  # each once
    assert {attempt for _, _, attempt in done} == {1}
    pids = {pid for _, pid, _ in done}
    assert cli.pid not in pids  # the work ran in the CLI's worker processes
    with broker.database.connection() as conn:
        left = conn.execute(sql.SQL("SELECT count(*) FROM {}.message").format(schema)).fetchone()
    assert left == (0,)
    assert "Traceback" not in log, log


def test_on_sigterm_prefetched_messages_go_back_at_once(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_cli: Callable[..., subprocess.Popen]
) -> None:
    """A worker busy with a long task holds the next ones in its prefetch.  On SIGTERM they go back
    to the queue at once (for other workers), not when the long task is done, and never start here."""
    import signal

    broker = dramatiq_pg_broker_factory()
    schema = ledger_table(broker)
    cli = dramatiq_cli(broker, "tests.apps.basic_app", "--processes", "1", "--threads", "1")
    broker.declare_queue("default")
    messages = [
        dramatiq.Message(queue_name="default", actor_name="hold", args=(n, 8.0), kwargs={}, options={})
        for n in range(3)
    ]
    broker.enqueue_many(messages)

    def states() -> dict[str, str]:
        with broker.database.connection() as conn:
            rows = conn.execute(sql.SQL("SELECT message_id::text, state FROM {}.message").format(schema)).fetchall()
        return dict(rows)

    def started() -> list[int]:
        with broker.database.connection() as conn:
            return [r[0] for r in conn.execute(sql.SQL("SELECT n FROM {}.ledger").format(schema)).fetchall()]

    deadline = time.monotonic() + 30
    while not (started() == [0] and list(states().values()).count("running") >= 2):
        assert cli.poll() is None, cli.log_path.read_text()  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, (started(), states())
        time.sleep(0.05)

    cli.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    waiting = [m.message_id for m in messages[1:]]
    while not all(states().get(mid) == "queued" for mid in waiting):
        assert time.monotonic() - sent < 5, f"prefetched messages not released: {states()}"  # the task takes 8 s
        time.sleep(0.05)
    assert started() == [0]  # they never started here
    cli.wait(30)
    assert started() == [0]
    info = broker.inspect(messages[1].message_id)
    assert info is not None and info["state"] == "queued" and info["attempt"] == 1  # the attempt stays
