"""An app with a one-second schedule, for ``dramatiq-pg-fenced scheduler tests.apps.schedule_app``
(and ``dramatiq tests.apps.schedule_app``).

The broker comes from ``DRAMATIQ_PG_URL`` and ``DRAMATIQ_PG_SCHEMA``.  ``beat``
writes one ledger row per delivery (the tick it was sent for) when the test
created ``{schema}.ledger``; the scheduler processes never run it.
``SCHEDULE_LABEL``: a ``label`` keyword argument in the schedule's messages (two
labels: two versions of the code, as in a rolling deploy).
"""

import os

import dramatiq
from dramatiq.middleware import CurrentMessage
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.features.schedules import schedule

SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
INSERT = sql.SQL("INSERT INTO {}.ledger (tick, pid) VALUES (%s, %s)").format(sql.Identifier(SCHEMA))

# SCHEDULE_IN_WORKERS=0: the ``dramatiq`` workers of this app only consume (the soak runs standalone schedulers).
broker = PostgresBroker(
    os.environ["DRAMATIQ_PG_URL"],
    schema=SCHEMA,
    poll_interval=0.2,
    run_schedules=os.environ.get("SCHEDULE_IN_WORKERS", "1") == "1",
)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)


LABEL = os.environ.get("SCHEDULE_LABEL")


@schedule(every=float(os.environ.get("SCHEDULE_EVERY", "1")), kwargs={"label": LABEL} if LABEL else None)
@dramatiq.actor(max_retries=0)
def beat(label: str = "") -> None:
    message = CurrentMessage.get_current_message()
    with broker.database.connection() as conn:
        conn.execute(INSERT, [message.options["tick"], os.getpid()])
