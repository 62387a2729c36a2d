"""A tiny app for ``dramatiq tests.apps.basic_app``.

The broker comes from ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA`` (the test
migrates the schema and creates the ledger table).  ``record`` writes one
ledger row per message with the worker's pid and the delivery's attempt, so
the test can see which processes did the work.
"""

import os

import dramatiq
from dramatiq.middleware import CurrentMessage
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
INSERT = sql.SQL("INSERT INTO {}.ledger (n, pid, attempt) VALUES (%s, %s, %s)").format(sql.Identifier(SCHEMA))

broker = PostgresBroker(os.environ["DRAMATIQ_PG_URL"], schema=SCHEMA, poll_interval=0.2)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0)
def record(n: int) -> None:
    message = CurrentMessage.get_current_message()
    with broker.database.connection() as conn:
        conn.execute(INSERT, [n, os.getpid(), message.options["attempt"]])


@dramatiq.actor(max_retries=0)
def hold(n: int, seconds: float) -> None:
    """Record the start, then take *seconds* (a long task the worker is busy with)."""
    import time

    record.fn(n)
    time.sleep(seconds)
