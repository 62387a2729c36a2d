"""An application module as a project has one: its broker comes from ``DATABASE_URL`` when it is imported,
and its actors are declared on that broker.  ``examples/test_shop.py`` tests it without touching that
database (see docs/testing.md, "Testing your own code with it").

    pip install -e .                     # from a checkout: the package alone
    cd examples && DATABASE_URL=postgresql://app@db/app dramatiq shop
"""

import os

import dramatiq

from dramatiq_pg_fenced import PostgresBroker

broker = PostgresBroker(os.environ.get("DATABASE_URL"))  # None: libpq's defaults (PGHOST, PGDATABASE...)
dramatiq.set_broker(broker)

#: What was charged, (order, cents), in this process: a stand-in for the payment provider.
CHARGED: list[tuple[str, int]] = []


@dramatiq.actor(max_retries=0)
def charge(order_id: str, cents: int) -> None:
    if cents <= 0:
        raise ValueError(f"order {order_id}: nothing to charge ({cents} cents)")
    CHARGED.append((order_id, cents))


@dramatiq.actor(queue_name="mail")
def receipt(order_id: str) -> None:
    """Sends the next message from the actor: it goes to the test's broker too."""
    charge.send(order_id, 100)
