"""The fenced transaction's cost (issue 28.6): drain N messages whose actor adds 1 to a row, in its
own transaction on a pooled connection ("plain") or inside ``broker.fenced_transaction()``
("fenced"), with one in-process worker of 1 and of 8 threads; alternated, best of *rounds*, ratios
within one run.  Per message also: the CPU of the worker process and of the database's server
processes (read from /proc: run it on the server's host), and the WAL written.

    python benchmarks/fenced_transaction.py postgresql://postgres@127.0.0.1:5432/db [n] [rounds]

What the block adds, by construction: no round trip (its ``BEGIN`` and the row's lock are one
simple query, where a psycopg transaction sends its ``BEGIN`` alone; the ack rides the
``COMMIT``'s round trip), and on the server the ack written for one message in the actor's
transaction instead of in the outcome writer's batch of many, with a ``committed`` row that the
writer deletes later in a batch.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
import time
import uuid

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker


class Meter:
    """CPU seconds of this process and of the database's server processes, and WAL bytes, so far."""

    def __init__(self, url: str) -> None:
        self.probe = psycopg.connect(url, autocommit=True)

    def read(self) -> tuple[float, float, float]:
        pids = [r[0] for r in self.probe.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")]
        server = 0.0
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
                server += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        wal = self.probe.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        assert wal is not None
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime, server, float(wal[0])


def run(url: str, threads: int, n: int, rounds: int) -> None:
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

    worker = dramatiq.Worker(broker, worker_threads=threads, worker_timeout=100)
    worker.start()
    meter = Meter(url)
    best: dict[str, float] = {}
    costs: dict[str, list[tuple[float, ...]]] = {}
    try:
        for _ in range(rounds):
            for actor in (plain, fenced):
                broker.enqueue_many([actor.message(i) for i in range(n)])
                before = meter.read()
                t0 = time.monotonic()
                broker.join(actor.queue_name, timeout=600_000)
                broker.flush_outcomes(60)
                best[actor.actor_name] = min(best.get(actor.actor_name, 1e9), time.monotonic() - t0)
                after = meter.read()
                costs.setdefault(actor.actor_name, []).append(tuple((b - a) / n for a, b in zip(before, after, strict=True)))
    finally:
        worker.stop()
        with psycopg.connect(url, autocommit=True) as c:
            c.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
        broker.close()
        meter.probe.close()
    print(f"{threads} worker thread(s), {n} messages, best of {rounds}:")
    for name, seconds in best.items():
        client, server, wal = (min(c[i] for c in costs[name]) for i in range(3))
        print(
            f"  {name:7s} {n / seconds:6.0f} messages/s ({seconds:.2f} s); per message (least of the rounds): "
            f"{client * 1e6:4.0f} us CPU in the worker, {server * 1e6:4.0f} us in its server processes, "
            f"{wal:5.0f} WAL bytes"
        )
    print(f"  fenced / plain time: {best['fenced'] / best['plain']:.2f}")


def main(url: str, n: int = 2000, rounds: int = 3) -> None:
    for threads in (1, 8):
        run(url, threads, n, rounds)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
