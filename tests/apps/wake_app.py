"""A tiny app for ``dramatiq tests.apps.wake_app``: wake one, not all (turns.py).

The broker comes from ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``; its
connections are named ``wake-<pid>`` (so the test can tell which worker
process holds a queue's door), its idle polls are an hour apart (only a ring
delivers promptly), and the turns are read every half second (a stuck door
holder is seen within seconds).  ``WAKE_QUEUES`` (comma-separated) names the
queues this process consumes: ``record_<queue>`` writes one ledger row per
message with the worker's pid.
"""

import os

import dramatiq
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import turns

turns.REFRESH_EVERY = 0.5

SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
INSERT = sql.SQL("INSERT INTO {}.ledger (n, pid) VALUES (%s, %s)").format(sql.Identifier(SCHEMA))
info = conninfo_to_dict(os.environ["DRAMATIQ_PG_URL"])
info["application_name"] = f"wake-{os.getpid()}"

broker = PostgresBroker(make_conninfo(**info), schema=SCHEMA, poll_interval=3600)  # type: ignore[arg-type]
dramatiq.set_broker(broker)


def record(n: int) -> None:
    with broker.database.connection() as conn:
        conn.execute(INSERT, [n, os.getpid()])


for queue in os.environ.get("WAKE_QUEUES", "default").split(","):
    dramatiq.actor(record, actor_name=f"record_{queue}", queue_name=queue, max_retries=0)  # type: ignore[call-overload]
