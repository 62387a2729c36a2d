"""The quickstart's actors.  Workers load this module (the quickstart starts them)::

    pip install -e .                     # from a checkout: the package alone
    cd examples && DATABASE_URL=postgresql://app@db/app dramatiq tasks

The broker and the results backend both come from ``DATABASE_URL``, in the schema
``DRAMATIQ_PG_SCHEMA`` (the quickstart sets one of its own).
"""

import os
import time

import dramatiq
from dramatiq.middleware import CurrentMessage

from dramatiq_pg_fenced.results import setup

# One URL: the broker, the results backend and group callbacks, all on PostgreSQL.
broker, backend = setup(os.environ["DATABASE_URL"], schema=os.environ.get("DRAMATIQ_PG_SCHEMA", "dramatiq"))
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


@dramatiq.actor(store_results=True)
def add(x, y):
    return x + y


@dramatiq.actor(store_results=True)
def double(x):
    return 2 * x


@dramatiq.actor(store_results=True)
def whoami():
    """Which worker process ran me."""
    return os.getpid()


@dramatiq.actor(store_results=True, max_retries=3)
def flaky(n):
    """Asks for a retry on its first delivery: shows options["retries"] and ["attempt"]."""
    options = CurrentMessage.get_current_message().options
    if options.get("retries", 0) == 0:
        raise dramatiq.Retry("first delivery asks for a retry", delay=300)
    return {"n": n, "retries": options["retries"], "attempt": options["attempt"]}


@dramatiq.actor(store_results=True)
def delayed_now():
    return time.time()
