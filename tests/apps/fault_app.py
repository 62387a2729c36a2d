"""The app the fault tests run with ``dramatiq tests.apps.fault_app``.

Configured from the environment: ``DRAMATIQ_PG_URL``, ``DRAMATIQ_PG_SCHEMA``,
``FAULT_LEASE_SECONDS`` and, optionally, ``FAULT_BROKER_URL`` (the broker's
own connections only, e.g. through a proxy the test can cut, or another server),
``FAULT_POLL_INTERVAL`` / ``FAULT_RESCUE_INTERVAL`` (0.2 s unless set),
``FAULT_MAX_DELIVERIES`` and ``FAULT_DURABLE_OUTCOMES`` (``1``: claims and
outcomes wait for the WAL flush, as enqueues do).  The broker's
connections carry ``application_name = faulttest_<schema>`` so a test can
terminate exactly them.

Actors write an independent ledger (``<schema>.ledger``, created by the test)
on connections of their own, one committed row per event (with the delivery's
attempt and fence token), so the tests do not have to believe the broker's
rows alone.
"""

import os
import signal
import threading
import time

import dramatiq
import psycopg
from dramatiq.middleware import CurrentMessage
from psycopg import sql
from psycopg.conninfo import make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.config import DEFAULT_MAX_DELIVERIES
from dramatiq_pg_fenced.errors import DeliveryLost

URL = os.environ["DRAMATIQ_PG_URL"]
SCHEMA = os.environ["DRAMATIQ_PG_SCHEMA"]
APP_NAME = f"faulttest_{SCHEMA}"

broker = PostgresBroker(
    make_conninfo(os.environ.get("FAULT_BROKER_URL") or URL, application_name=APP_NAME),
    schema=SCHEMA,
    lease_seconds=float(os.environ.get("FAULT_LEASE_SECONDS", "2")),
    rescue_interval=float(os.environ.get("FAULT_RESCUE_INTERVAL", "0.2")),
    poll_interval=float(os.environ.get("FAULT_POLL_INTERVAL", "0.2")),
    max_deliveries=int(os.environ.get("FAULT_MAX_DELIVERIES", DEFAULT_MAX_DELIVERIES)),
    durable_outcomes=os.environ.get("FAULT_DURABLE_OUTCOMES") == "1",
)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)

_INSERT = sql.SQL(
    "INSERT INTO {}.ledger (message_id, attempt, delivery, pid, event) VALUES (%s, %s, %s, %s, %s)"
).format(sql.Identifier(SCHEMA))
_RELEASED = sql.SQL("SELECT 1 FROM {}.ledger WHERE message_id = %s AND attempt = %s AND event = 'release'").format(
    sql.Identifier(SCHEMA)
)
_local = threading.local()


def _ledger(query: sql.Composed, params: list) -> list:
    """Run one autocommit statement on this thread's ledger connection, reconnecting as needed."""
    for tries in range(50):
        conn = getattr(_local, "conn", None)
        try:
            if conn is None or conn.closed:
                conn = _local.conn = psycopg.connect(
                    make_conninfo(URL, application_name=f"faultledger_{SCHEMA}"), autocommit=True
                )
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []
        except psycopg.OperationalError:
            _local.conn = None
            time.sleep(min(0.05 * (tries + 1), 1.0))
    raise RuntimeError("ledger unreachable")


def record(event: str) -> tuple[str, int]:
    message = CurrentMessage.get_current_message()
    assert message is not None
    attempt = message.options["attempt"]
    _ledger(_INSERT, [message.message_id, attempt, getattr(message, "delivery", None), os.getpid(), event])
    return message.message_id, attempt


@dramatiq.actor(queue_name="pause", max_retries=3, min_backoff=100)
def hold(outcome: str) -> None:
    """Each attempt waits for the test's 'release' row; then attempt 1 acks, fails or retries as told, later ones ack."""
    message_id, attempt = record("start")
    while not _ledger(_RELEASED, [message_id, attempt]):
        time.sleep(0.05)
    record("finish")
    if attempt == 1 and outcome != "ack":
        raise RuntimeError(f"attempt 1 fails on purpose ({outcome})")


@dramatiq.actor(queue_name="work", max_retries=0)
def work(seconds: float) -> None:
    record("start")
    time.sleep(seconds)
    record("finish")


@dramatiq.actor(queue_name="crash", max_retries=0)
def crash() -> None:
    """Kills its own worker process (as a segfault or the OOM killer would): no outcome, ever.

    Not in the first half second of the process: Dramatiq's CLI (2.2.1) waits for a worker process's
    boot on a ``multiprocessing.Event``, which the process sets just after its worker threads start.
    Killed while it held the event's lock, it leaves the CLI waiting on that lock forever: no log,
    no exit, nothing restarts it (seen here once in eight runs: py-spy showed the CLI's main thread
    in ``Condition.wait``).  That is Dramatiq's hang, not the broker's, and not what this tests."""
    record("start")
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGKILL)


_ADD_ONE = sql.SQL(
    "INSERT INTO {}.tally (message_id, n) VALUES (%s, 1) ON CONFLICT (message_id) DO UPDATE SET n = tally.n + 1"
).format(sql.Identifier(SCHEMA))


@dramatiq.actor(queue_name="exact", max_retries=20, min_backoff=50, max_backoff=200)
def add_one(seconds: float) -> None:
    """Adds 1 to its message's row of ``<schema>.tally`` inside a fenced transaction (issue 28), with
    *seconds* spent half before the block and half inside it (where a signal often lands)."""
    message_id, _ = record("start")
    time.sleep(seconds / 2)
    try:
        with broker.fenced_transaction() as conn:
            conn.execute(_ADD_ONE, [message_id])
            time.sleep(seconds / 2)
    except DeliveryLost:
        record("lost")
        raise
    record("finish")
