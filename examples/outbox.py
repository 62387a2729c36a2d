"""The outbox pattern: a business row and its message commit together, or not at all.

Run it against a local PostgreSQL::

    pip install -e .                     # from a checkout: the package alone
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test python examples/outbox.py

It creates its own schema (``outbox_demo``), places two orders (one of
which fails and rolls back), runs a worker until the queue is empty, and
shows that only the committed order was ever confirmed.
"""

from __future__ import annotations

import os

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
SCHEMA = "outbox_demo"

broker = PostgresBroker(URL, schema=SCHEMA)
dramatiq.set_broker(broker)


@dramatiq.actor
def confirm_order(order_id: int) -> None:
    """Runs only for orders whose transaction committed, and always finds their row."""
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.orders SET status = 'confirmed' WHERE id = %s").format(sql.Identifier(SCHEMA)),
            [order_id],
        )
    print(f"order {order_id} confirmed")


def place_order(conn: psycopg.Connection, order_id: int, total: int) -> None:
    """Insert the order and enqueue its confirmation in one transaction."""
    with conn.transaction(), broker.transaction(conn):
        conn.execute(
            sql.SQL("INSERT INTO {}.orders (id, total) VALUES (%s, %s)").format(sql.Identifier(SCHEMA)),
            [order_id, total],
        )
        confirm_order.send(order_id)  # written on conn: visible only if this transaction commits
        if total < 0:
            raise ValueError(f"order {order_id}: a negative total is refused")


def main() -> None:
    broker.migrate()  # creates the schema and the broker's tables (safe to run again)
    with psycopg.connect(URL) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.orders (id int PRIMARY KEY, total int, status text DEFAULT 'new')"
            ).format(sql.Identifier(SCHEMA))
        )
        conn.execute(sql.SQL("TRUNCATE {}.orders").format(sql.Identifier(SCHEMA)))
        conn.commit()

        place_order(conn, 1, 100)
        try:
            place_order(conn, 2, -5)
        except ValueError as e:
            print(f"rolled back: {e}")

    worker = dramatiq.Worker(broker, worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        broker.join(confirm_order.queue_name, timeout=30_000)
    finally:
        worker.stop()

    broker.close()
    with psycopg.connect(URL) as conn:
        rows = conn.execute(
            sql.SQL("SELECT id, total, status FROM {}.orders ORDER BY id").format(sql.Identifier(SCHEMA))
        )
        for order_id, total, status in rows:
            print(f"order {order_id}: total {total}, {status}")  # order 2 never existed, nor its message
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(SCHEMA)))


if __name__ == "__main__":
    main()
