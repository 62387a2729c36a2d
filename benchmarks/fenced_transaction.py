"""The fenced transaction's cost (issue 28.6): drain N messages whose actor adds 1 to a row, in its
own transaction on a pooled connection ("plain") or inside ``broker.fenced_transaction()``
("fenced"), with one in-process worker; alternated, best of *rounds*, ratios within one run.

    python benchmarks/fenced_transaction.py postgresql://postgres@127.0.0.1:5432/db [n] [rounds]
"""

from __future__ import annotations

import sys
import time
import uuid

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker


def main(url: str, n: int = 2000, rounds: int = 3) -> None:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(url, schema=schema)
    broker.migrate()
    dramatiq.set_broker(broker)
    add = sql.SQL("UPDATE {}.tally SET n = n + 1 WHERE id = %s").format(sql.Identifier(schema))
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(sql.SQL("CREATE TABLE {}.tally (id int PRIMARY KEY, n int NOT NULL)").format(sql.Identifier(schema)))
        c.execute(sql.SQL("INSERT INTO {}.tally SELECT g, 0 FROM generate_series(0, 99) g").format(sql.Identifier(schema)))

    @dramatiq.actor(queue_name="plain")
    def plain(i: int) -> None:
        with broker.database.connection() as conn, conn.transaction():
            conn.execute(add, [i % 100])

    @dramatiq.actor(queue_name="fenced")
    def fenced(i: int) -> None:
        with broker.fenced_transaction() as conn:
            conn.execute(add, [i % 100])

    worker = dramatiq.Worker(broker, worker_threads=int(__import__("os").environ.get("THREADS", "8")), worker_timeout=100)
    worker.start()
    best: dict[str, float] = {}
    try:
        for _ in range(rounds):
            for actor in (plain, fenced):
                broker.enqueue_many([actor.message(i) for i in range(n)])
                t0 = time.monotonic()
                broker.join(actor.queue_name, timeout=600_000)
                broker.flush_outcomes(60)
                best[actor.actor_name] = min(best.get(actor.actor_name, 1e9), time.monotonic() - t0)
    finally:
        worker.stop()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        broker.close()
    for name, seconds in best.items():
        print(f"{name:7s} {n / seconds:8.0f} messages/s ({seconds:.2f} s for {n})")
    print(f"fenced / plain time: {best['fenced'] / best['plain']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
