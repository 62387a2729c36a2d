"""The app of the PgBouncer workload test: ``dramatiq tests.apps.pgbouncer_app``.

The broker is the PgBouncer set-up of docs/pgbouncer.md, ``results.setup(url, listen=False)``
(a ``PostgresBroker(url, listen=False)`` with results and group callbacks),
with ``url`` = ``PGB_BROKER_URL``: PgBouncer in transaction pooling, as the
role the test chose.  Every execution of an actor writes one row to an
independent ledger (``<schema>.ledger``) on a direct connection of its own
(``DRAMATIQ_PG_URL``), so the test counts executions without believing the
broker.  The test process calls :func:`build` too, to send the same actors.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import dramatiq
import psycopg
from dramatiq.middleware import CurrentMessage
from dramatiq.rate_limits import ConcurrentRateLimiter
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker, rate_limits, results

LEDGER_COLUMNS = "message_id, kind, arg, attempt, retries, pid, at"
LEDGER_TABLE = (
    "CREATE TABLE {}.ledger (message_id text NOT NULL, kind text NOT NULL, arg text, attempt int, retries int,"
    " pid int NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())"
)


class Busy(Exception):
    """The mutex is taken: Dramatiq retries the message."""


class Ledger:
    """One autocommit connection per thread, straight to PostgreSQL (not through PgBouncer)."""

    def __init__(self, url: str, schema: str) -> None:
        self.url = make_conninfo(url, application_name="pgb_ledger")
        self.insert = sql.SQL(
            "INSERT INTO {}.ledger (message_id, kind, arg, attempt, retries, pid) VALUES (%s, %s, %s, %s, %s, %s)"
        ).format(sql.Identifier(schema))
        self.local = threading.local()

    def record(self, kind: str, arg: Any = None) -> None:
        message = CurrentMessage.get_current_message()
        assert message is not None
        conn = getattr(self.local, "conn", None)
        if conn is None or conn.closed:
            conn = self.local.conn = psycopg.connect(self.url, autocommit=True)
        conn.execute(
            self.insert,
            [
                message.message_id,
                kind,
                None if arg is None else str(arg),
                message.options.get("attempt"),
                message.options.get("retries", 0),
                os.getpid(),
            ],
        )


def build(
    broker_url: str, schema: str, ledger_url: str
) -> tuple[PostgresBroker, results.PostgresBackend, dict[str, Any]]:
    """The broker (the PgBouncer set-up of docs/pgbouncer.md), its results backend, and the actors by name."""
    broker, backend = results.setup(broker_url, schema=schema, listen=False)
    broker.add_middleware(CurrentMessage())
    mutex_backend = rate_limits.PostgresBackend(broker=broker)
    mutex = ConcurrentRateLimiter(mutex_backend, "pgb-mutex", limit=1, ttl=10_000)
    ledger = Ledger(ledger_url, schema)

    def plain(n: int) -> None:
        ledger.record("plain", n)

    def later(n: int, due: float) -> None:
        ledger.record("later", f"{n}:{time.time() - due:.4f}")

    def flaky(n: int) -> None:
        ledger.record("flaky", n)
        message = CurrentMessage.get_current_message()
        assert message is not None
        if message.options.get("retries", 0) < 2:
            raise RuntimeError(f"flaky {n} fails on purpose")

    def add(x: int, y: int = 0) -> int:
        ledger.record("add", f"{x}+{y}")
        return x + y

    def group_done(tag: str) -> None:
        ledger.record("group_done", tag)

    def exclusive(n: int) -> None:
        with mutex.acquire(raise_on_failure=False) as acquired:
            if not acquired:
                raise Busy(n)
            ledger.record("enter", n)
            time.sleep(0.01)
            ledger.record("exit", n)

    actors = {
        "plain": dramatiq.actor(plain, broker=broker, max_retries=0),
        "later": dramatiq.actor(later, broker=broker, max_retries=0),
        "flaky": dramatiq.actor(flaky, broker=broker, max_retries=5, min_backoff=10, max_backoff=100),
        "add": dramatiq.actor(add, broker=broker, max_retries=0, store_results=True),
        "group_done": dramatiq.actor(group_done, broker=broker, max_retries=0),
        "exclusive": dramatiq.actor(exclusive, broker=broker, max_retries=200, min_backoff=20, max_backoff=200),
    }
    return broker, backend, actors


if os.environ.get("PGB_BROKER_URL"):  # the dramatiq CLI's worker processes
    broker, backend, actors = build(
        os.environ["PGB_BROKER_URL"], os.environ["DRAMATIQ_PG_SCHEMA"], os.environ["DRAMATIQ_PG_URL"]
    )
    dramatiq.set_broker(broker)
