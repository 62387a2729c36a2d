"""A Django process on a RoutedBroker (tests/test_routing_transactions.py): ``outbox()`` and
``fenced_atomic()`` sending to a queue of the second of two databases, Django's own connection on the
first.  Settings come from the environment: ``ROUTED_URL_FIRST``, ``ROUTED_URL_SECOND`` and their
schemas ``ROUTED_SCHEMA_FIRST``, ``ROUTED_SCHEMA_SECOND``.  Prints ``done`` once every block ran."""

from __future__ import annotations

import os
import threading
from collections import Counter

import django
import dramatiq
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

first_url = os.environ["ROUTED_URL_FIRST"]
params = conninfo_to_dict(first_url)
settings.configure(
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": params["dbname"],
            "USER": params.get("user", ""),
            "PASSWORD": params.get("password", ""),
            "HOST": params.get("host", ""),
            "PORT": params.get("port", ""),
        }
    },
    INSTALLED_APPS=[],
    USE_TZ=True,
)
django.setup()

from django.db import connections  # noqa: E402

from dramatiq_pg_fenced import PostgresBroker  # noqa: E402
from dramatiq_pg_fenced.integrations.django import fenced_atomic, outbox  # noqa: E402
from dramatiq_pg_fenced.routing.router import RoutedBroker  # noqa: E402

router = RoutedBroker(
    brokers={
        "first": PostgresBroker(first_url, schema=os.environ["ROUTED_SCHEMA_FIRST"], middleware=[]),
        "second": PostgresBroker(
            os.environ["ROUTED_URL_SECOND"], schema=os.environ["ROUTED_SCHEMA_SECOND"], middleware=[]
        ),
    },
    routes={"b": "second"},
    default="first",
)
dramatiq.set_broker(router)
attempts: Counter[int] = Counter()
done = threading.Event()


@dramatiq.actor(queue_name="b")
def receipt(what: str) -> None:
    pass


@dramatiq.actor(queue_name="a", max_retries=3, min_backoff=1, max_backoff=1)
def pay(order: int) -> None:
    attempts[order] += 1
    try:
        with fenced_atomic():
            receipt.send(f"fenced {order}")
            if attempts[order] == 1:
                raise ValueError("declined, this time")
        done.set()
    finally:
        connections.close_all()


class Declined(Exception):
    pass


try:
    with outbox():
        receipt.send("rolled back")
        raise Declined()
except Declined:
    pass
with outbox():
    receipt.send("committed")

pay.send(1)
worker = dramatiq.Worker(router.shards["first"], worker_timeout=100, worker_threads=1)
worker.start()
try:
    assert done.wait(60), "the fenced block did not commit"
    router.shards["first"].join("a", timeout=30_000)
finally:
    worker.stop()
    router.close()
print("done", attempts[1])
