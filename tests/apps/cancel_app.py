"""An app for ``dramatiq tests.apps.cancel_app``: actors that a cancel stops (``interrupt_on_cancel``).

The broker comes from ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``; the test
creates ``ledger (message_id, event, at)``.  Each actor writes ``started`` as
it starts and ``stopped`` when ``MessageCancelled`` reaches it, with the wall
clock (``time.time()``), so a benchmark can measure from ``cancel()`` to the stop.
"""

import os
import time

import dramatiq
from dramatiq.middleware import CurrentMessage
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import interrupt
from dramatiq_pg_fenced.core.interrupt import MessageCancelled

SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
INSERT = sql.SQL("INSERT INTO {}.ledger (message_id, event, at) VALUES (%s, %s, %s)").format(sql.Identifier(SCHEMA))

broker = PostgresBroker(
    os.environ["DRAMATIQ_PG_URL"],
    schema=SCHEMA,
    lease_seconds=120,  # the lease keeper (the fallback for a lost notification) reads every 40 s
    poll_interval=float(os.environ.get("DRAMATIQ_PG_POLL_INTERVAL", "0.2")),
    listen=os.environ.get("DRAMATIQ_PG_LISTEN", "1") == "1",
)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


def note(event: str) -> None:
    at = time.time()
    message = CurrentMessage.get_current_message()
    with broker.database.connection() as conn:
        conn.execute(INSERT, [message.message_id, event, at])


@dramatiq.actor(max_retries=0, interrupt_on_cancel=True)
def spin(seconds: float | None = None) -> None:
    """Pure Python, for *seconds* (``None``: until cancelled)."""
    deadline = None if seconds is None else time.monotonic() + seconds
    try:
        note("started")  # in the try: a cancel may land before note() has returned
        n = 0
        while deadline is None or time.monotonic() < deadline:
            n += 1
    except MessageCancelled:
        note("stopped")
        raise


@dramatiq.actor(max_retries=0, interrupt_on_cancel=True)
def nap(step: float = 0.05, cancellable: bool = False) -> None:
    """Sleeps in steps of *step* seconds until cancelled: ``time.sleep`` (a C call: the interrupt
    lands as it returns), or with *cancellable* ``interrupt.sleep`` (a cancel ends it at once)."""
    pause = interrupt.sleep if cancellable else time.sleep
    try:
        note("started")
        while True:
            pause(step)
    except MessageCancelled:
        note("stopped")
        raise
