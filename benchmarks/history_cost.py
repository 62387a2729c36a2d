"""What keeping history costs: the ack statement alone, with and without history.

    python -m benchmarks.history_cost [--url URL] [--rows 20000] [--batch 64] [--rounds 5]

Each round fills a fresh schema with N running rows (the payload of a small
Dramatiq message) and acks them in batches of ``--batch`` (as the outcome
writer does), one transaction per batch, timing the acks only.  Three ack
statements take turns in every round, so load from other jobs falls on all
three alike:

- ``plain``: the ack before history (a fenced ``DELETE``), for reference;
- ``ack``: ``keep_finished=0`` (the delete and the per-minute tally);
- ``ack_keep``: the default (the delete, the tally, the row into ``history``).

It prints the median time per message of each, their ratios, the size of
the history table per kept message (heap, indexes and TOAST), and what the
maintenance loop's purge of those rows costs per message (off the hot path:
``purge_history`` in batches of ``HISTORY_BATCH``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced.core.maintenance import HISTORY_BATCH
from dramatiq_pg_fenced.db import migrations
from dramatiq_pg_fenced.db.statements import bind, statements

PLAIN = """
    DELETE FROM {schema}.message AS m
     USING unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS o(id, attempt)
     WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
    RETURNING m.message_id
"""


def fill(conn: psycopg.Connection, schema: str, n: int) -> list[str]:
    payload = dramatiq.Message(queue_name="default", actor_name="noop", args=(1,), kwargs={}, options={}).encode()
    ids = [str(uuid.uuid4()) for _ in range(n)]
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.message (message_id, queue_name, actor_name, state, attempt, payload, claimed_at,"
            " consumer_id, lease_expires_at) SELECT id, 'default', 'noop', 'running', 1, %s, now(), 'host:1:ab/default/1',"
            " now() + interval '30 s' FROM unnest(%s::uuid[]) AS id"
        ).format(sql.Identifier(schema)),
        [payload, ids],
    )
    conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(sql.Identifier(schema)))
    return ids


def ack_all(conn: psycopg.Connection, statement: bytes, ids: list[str], batch: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(ids), batch):
        chunk = ids[i : i + batch]
        with conn.transaction():
            rows = conn.execute(statement, {"ids": chunk, "attempts": [1] * len(chunk), "writer": "bench"}).fetchall()
        assert len(rows) == len(chunk)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"plain": [], "ack": [], "ack_keep": []}
    per_row = 0.0
    purge: list[float] = []
    with psycopg.connect(args.url, autocommit=True) as conn:
        for _ in range(args.rounds):
            for kind in times:
                schema = f"hc_{uuid.uuid4().hex[:10]}"
                migrations.migrate(conn, schema)
                try:
                    stmts = statements(schema)
                    quoted = sql.Identifier(schema).as_string(None)
                    text = bind(PLAIN, quoted) if kind == "plain" else getattr(stmts, kind)
                    ids = fill(conn, schema, args.rows)
                    times[kind].append(ack_all(conn, text, ids, args.batch) / args.rows)
                    if kind == "ack_keep":
                        row = conn.execute(
                            "SELECT pg_total_relation_size(%s::regclass)", [f'"{schema}".history']
                        ).fetchone()
                        per_row = row[0] / args.rows if row else 0.0
                        conn.execute(
                            sql.SQL("UPDATE {}.history SET finished_at = finished_at - interval '2 h'").format(
                                sql.Identifier(schema)
                            )
                        )
                        conn.execute(sql.SQL("VACUUM ANALYZE {}.history").format(sql.Identifier(schema)))
                        started = time.perf_counter()
                        while conn.execute(stmts.purge_history, [3600, HISTORY_BATCH]).rowcount == HISTORY_BATCH:
                            pass
                        purge.append((time.perf_counter() - started) / args.rows)
                finally:
                    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
    median = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    print(f"{args.rows} acks in batches of {args.batch}, median of {args.rounds} rounds (µs per message):")
    for kind, us in median.items():
        print(f"  {kind:9s} {us:7.1f} µs   {us / median['plain']:.2f}x plain   all: "
              + ", ".join(f"{t * 1e6:.1f}" for t in times[kind]))  # fmt: skip
    print(f"history: {per_row:.0f} bytes per kept message (heap + 3 indexes)")
    print(
        f"purge: {statistics.median(purge) * 1e6:.1f} µs per message (batches of {HISTORY_BATCH}, maintenance thread)"
    )


if __name__ == "__main__":
    main()
