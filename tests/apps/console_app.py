"""An app for ``dramatiq tests.apps.console_app``: actors that hold their thread until the test lets them go.

The broker comes from ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``; the test
creates ``gate (n integer)``.  ``wait`` runs until a row of ``gate`` holds its
``n`` (or 60 s pass).  Heartbeats come every second here (10 s by default), so a
test sees a process's counts, and its stale row, within a second or two.
"""

import os
import time

import dramatiq
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import processes

processes.HEARTBEAT_SECONDS = 1.0
SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
OPEN = sql.SQL("SELECT 1 FROM {}.gate WHERE n = %s").format(sql.Identifier(SCHEMA))

broker = PostgresBroker(os.environ["DRAMATIQ_PG_URL"], schema=SCHEMA, poll_interval=0.2, rescue_interval=0.2)
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=0, queue_name="gated")
def wait(n: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with broker.database.connection() as conn:
            if conn.execute(OPEN, [n]).fetchone():
                return
        time.sleep(0.05)
