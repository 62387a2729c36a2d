"""The app of ``benchmarks/routing.py``: a no-op actor on queues q0, q1, q2, routed over the
databases in ``ROUTED_URLS`` (comma-separated) as ``ROUTED_ROUTES`` says (``q0=db0,q1=db1,...``)."""

import os

import dramatiq

from dramatiq_pg_fenced.routing.router import RoutedBroker

urls = os.environ["ROUTED_URLS"].split(",")
broker = RoutedBroker(
    {f"db{i}": url for i, url in enumerate(urls)},
    routes=dict(pair.split("=") for pair in os.environ["ROUTED_ROUTES"].split(",")),
    schema=os.environ["ROUTED_SCHEMA"],
)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name="q0")
def noop0() -> None:
    pass


@dramatiq.actor(queue_name="q1")
def noop1() -> None:
    pass


@dramatiq.actor(queue_name="q2")
def noop2() -> None:
    pass
