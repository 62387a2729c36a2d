"""One claim under a pinned xmin: from the head of the claim index, and from a floor.

    python -m benchmarks.dead_head [--claimed 36000]

Another session holds a ``REPEATABLE READ`` snapshot while ``--claimed``
messages are enqueued, claimed and acked (as 300 messages/s do in two
minutes), so their old row versions stay in the claim index, dead to
everyone but that snapshot.  Then one message is enqueued, and the broker's
own claim statement takes it, rolled back and repeated: once starting at the
head (``consumer.HEAD``) and once from a floor a quarter second before the
claim (what ``consumer.Floor`` gives a consumer that saw its queue drained).
Medians of ``--repeat`` timings, and the buffers one claim touched.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import psycopg
from dramatiq.message import Message
from psycopg import sql

from benchmarks import apps
from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core.consumer import HEAD


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claimed", type=int, default=36_000)
    parser.add_argument("--repeat", type=int, default=21)
    args = parser.parse_args(argv)
    url = os.environ.get("BENCH_PG_URL") or apps.PG_URL
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(url, schema=schema)
    broker.migrate()
    broker.declare_queue("q")
    pin = psycopg.connect(url)
    try:
        pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pin.execute("SELECT 1").fetchone()  # the snapshot is taken: the xmin is pinned
        stmts = broker.statements
        with psycopg.connect(url, autocommit=True) as conn:
            ident = sql.Identifier(schema)
            for i in range(0, args.claimed, 2000):
                n = min(2000, args.claimed - i)
                broker.enqueue_many(
                    [Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}) for _ in range(n)]
                )
                params = {"queue": "q", "limit": n, "lease": 30, "consumer": "bench", **_start(HEAD)}
                rows = conn.execute(stmts.claim_relaxed, params).fetchall()
                conn.execute(
                    sql.SQL("DELETE FROM {}.message WHERE message_id = ANY(%s)").format(ident), [[r[0] for r in rows]]
                )
            time.sleep(0.3)
            broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
            floor_at = conn.execute("SELECT now() - interval '250 milliseconds'").fetchone()[0]  # type: ignore[index]
            print(f"{args.claimed:,} messages claimed and acked under a pinned xmin; one claim of the next one:")
            for name, start in (("from the head", HEAD), ("from a floor", (0, floor_at, HEAD[2]))):
                params = {"queue": "q", "limit": 1, "lease": 30, "consumer": "bench", **_start(start)}
                times = []
                for _ in range(args.repeat):
                    with conn.transaction(force_rollback=True):
                        t = time.perf_counter()
                        assert len(conn.execute(stmts.claim_relaxed, params).fetchall()) == 1
                        times.append((time.perf_counter() - t) * 1000)
                with conn.transaction(force_rollback=True):
                    plan = conn.execute(
                        b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + stmts.claim_relaxed, params
                    ).fetchone()[0]  # type: ignore[index]
                buffers = plan[0]["Plan"].get("Shared Hit Blocks", 0) + plan[0]["Plan"].get("Shared Read Blocks", 0)
                print(f"  {name:<14} {statistics.median(times):8.3f} ms (median of {args.repeat}), {buffers:,} buffers")
    finally:
        pin.rollback()
        pin.close()
        broker.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    return 0


def _start(start: tuple) -> dict:
    return {"from_priority": start[0], "from_at": start[1], "from_seq": start[2], "channel": "", "took": None}


if __name__ == "__main__":
    raise SystemExit(main())
