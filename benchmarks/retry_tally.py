"""What counting retries costs the retry statement (issue 26's ``dramatiq_pg_retried_total``).

    python -m benchmarks.retry_tally [--url URL] [--batch 10] [--rounds 400]

The retry statement now upserts this minute's ``throughput`` row of its writer
(``retried``), as ack and nack do.  This times it, each in its own
transaction with its commit, against the same statement without the tally
(as it was before), on the same rows put back to running under new tokens
before each try, the two alternating, in one run; prints the medians (the
first 50 rounds left out) and their ratio.  The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.db import statements as statements_module


def untallied(schema: str) -> bytes:
    """The retry statement without its tally (before issue 26)."""
    text = f"""
        WITH o AS (SELECT * FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(payloads)s::bytea[],
                                        %(delays)s::bigint[], %(errors)s::text[])
                                 AS o(id, delivery, payload, delay_ms, error))
        UPDATE {{schema}}.message AS m
           SET state = 'queued', payload = o.payload, last_error = o.error,
               available_at = now() + o.delay_ms * interval '1 millisecond',
               lease_expires_at = NULL, consumer_id = NULL,
               {statements_module._retake("m", finished_too=False)}
          FROM o
         WHERE {statements_module._BY_IDS} AND m.message_id = o.id AND m.delivery = o.delivery
           AND m.state = 'running'
        RETURNING m.message_id, m.delivery
    """
    return statements_module.bind(text, sql.Identifier(schema))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    schema = f"retry_{uuid.uuid4().hex[:10]}"
    broker = PostgresBroker(args.url, schema=schema, listen=False)
    broker.migrate()
    ident = sql.Identifier(schema)
    variants = {"with the tally": broker.statements.retry, "without": untallied(schema)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        with psycopg.connect(args.url, autocommit=True) as conn:
            ids = [str(uuid.uuid4()) for _ in range(args.batch)]
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.message (message_id, queue_name, actor_name, payload)"
                    " SELECT unnest(%s::uuid[]), 'q', 'a', '\\x00'"
                ).format(ident),
                [ids],
            )
            hold = sql.SQL(
                "UPDATE {}.message SET state = 'running', delivery = t.d"
                " FROM unnest(%s::uuid[], %s::uuid[]) AS t(i, d) WHERE message_id = t.i"
            ).format(ident)
            for r in range(args.rounds):
                order = list(variants.items()) if r % 2 else list(reversed(variants.items()))
                for name, statement in order:
                    tokens = [str(uuid.uuid4()) for _ in ids]
                    conn.execute(hold, [ids, tokens])
                    params = {"ids": ids, "deliveries": tokens, "payloads": [b"\x00"] * len(ids),
                              "delays": [1000] * len(ids), "errors": [None] * len(ids), "writer": "bench"}  # fmt: skip
                    started = time.perf_counter()
                    with conn.transaction():
                        assert len(conn.execute(statement, params).fetchall()) == len(ids)
                    times[name].append((time.perf_counter() - started) * 1000)
    finally:
        broker.close()
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))
    medians = {name: statistics.median(t[50:]) for name, t in times.items()}
    for name, ms in medians.items():
        print(f"retry of {args.batch} rows {name:15} median {ms:.3f} ms")
    print(f"ratio with / without: {medians['with the tally'] / medians['without']:.2f}")


if __name__ == "__main__":
    main()
