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


def test_dramatiq_cli_worker_processes(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_cli: Callable[..., subprocess.Popen]
) -> None:
    broker = dramatiq_pg_broker_factory()
    schema = sql.Identifier(broker.schema)
    with broker.database.connection() as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.ledger (n integer NOT NULL, pid integer NOT NULL, attempt integer NOT NULL)"
            ).format(schema)
        )

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
