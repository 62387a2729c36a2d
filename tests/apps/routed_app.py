"""The app of the routed-broker fault test: ``dramatiq tests.apps.routed_app``.

Two databases from the environment (``ROUTED_URL_A``, ``ROUTED_URL_B``, schema ``ROUTED_SCHEMA``):
queue ``qb`` lives in ``b``, every other queue in ``a``.  Each actor adds its message's key to
``done`` in its own database inside ``broker.fenced_transaction()`` (``n`` counts the times it
applied); ``hop`` sends ``work_b`` inside ``with_ack()``: a follow-up written in ``a`` and relayed.
"""

import os

import dramatiq
from psycopg import sql

from dramatiq_pg_fenced.routing.router import RoutedBroker

SCHEMA = os.environ["ROUTED_SCHEMA"]
broker = RoutedBroker(
    {"a": os.environ["ROUTED_URL_A"], "b": os.environ["ROUTED_URL_B"]},
    routes={"qb": "b"},
    default="a",
    schema=SCHEMA,
    lease_seconds=5,
    rescue_interval=0.5,
    poll_interval=0.5,
    relay_poll=1.0,
)
dramatiq.set_broker(broker)

DONE = sql.SQL(
    "INSERT INTO {}.done (key) VALUES (%s) ON CONFLICT (key) DO UPDATE SET n = done.n + 1"
).format(sql.Identifier(SCHEMA))


def record(key: str) -> None:
    with broker.fenced_transaction() as conn:
        conn.execute(DONE, [key])


@dramatiq.actor(queue_name="qa", max_retries=100, min_backoff=200, max_backoff=1000)
def work_a(key: str) -> None:
    record(key)


@dramatiq.actor(queue_name="qb", max_retries=100, min_backoff=200, max_backoff=1000)
def work_b(key: str) -> None:
    record(key)


@dramatiq.actor(queue_name="qa", max_retries=100, min_backoff=200, max_backoff=1000)
def hop(key: str) -> None:
    with broker.with_ack():
        work_b.send(f"hop {key}")
    record(key)
