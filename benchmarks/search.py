"""The console's search on a million rows: how long a page takes, per filter (and the charts' sample).

    python -m benchmarks.search [--url URL] [--rows 1000000] [--history 200000] [--runs 5] [--json FILE]

Fills a schema of its own with ``--rows`` message rows (generate_series: JSON
payloads as Dramatiq encodes them, args ``[n]`` and kwargs ``{"user": n %
1000}``; 1% dead, 1% of them by a rare actor, the rest queued) and
``--history`` acked rows, then times pages of 50 through ``broker.search()``
(the statements and the decoding of the page's payloads), each ``--runs``
times, and prints the median in milliseconds and its ratio to the plain first
page of the same run (the machine is shared: compare ratios).  Deep pages
start from a cursor half-way through the keys.  Then it times the charts'
sample on the same rows (``samples.take_sample``: what one worker process's
maintenance loop does once a minute; exact counts).  The schema is dropped at
the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

# A Dramatiq JSON message per row (braces doubled: the text goes through sql.SQL.format).
_PAYLOAD = (
    "convert_to('{{\"queue_name\":\"' || q || '\",\"actor_name\":\"' || a || '\",\"args\":[' || g || '],"
    "\"kwargs\":{{\"user\":' || (g %% 1000) || '}},\"options\":{{}},\"message_id\":\"' || id || '\","
    "\"message_timestamp\":1700000000000}}', 'UTF8')"
)


def fill(conn: psycopg.Connection, ident: sql.Identifier, rows: int, history: int) -> None:
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.message (message_id, queue_name, actor_name, state, finished_at, last_error, payload)"
            " SELECT id, q, a, s, CASE WHEN s = 'dead' THEN now() END,"
            " CASE WHEN s = 'dead' THEN 'ValueError: boom' END, " + _PAYLOAD + " FROM ("
            "  SELECT gen_random_uuid() AS id, g, CASE WHEN g %% 2 = 0 THEN 'emails' ELSE 'reports' END AS q,"
            "   CASE WHEN g %% 10000 = 7 THEN 'rare' ELSE 'send' END AS a,"
            "   CASE WHEN g %% 100 = 7 THEN 'dead' ELSE 'queued' END AS s"
            "  FROM generate_series(1, %s) AS g) AS x"
        ).format(ident),
        [rows],
    )
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,"
            " claimed_at, finished_at, payload)"
            " SELECT id, g, q, a, 0, 1, now(), now(), now() - g * interval '10 ms', " + _PAYLOAD + " FROM ("
            "  SELECT gen_random_uuid() AS id, g + %s AS g, 'emails' AS q, 'send' AS a"
            "  FROM generate_series(1, %s) AS g) AS x"
        ).format(ident),
        [rows, history],
    )
    conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(ident))
    conn.execute(sql.SQL("VACUUM ANALYZE {}.history").format(ident))


def timed(broker: PostgresBroker, runs: int, **filters: Any) -> tuple[float, int, int | None]:
    times, page = [], None
    for _ in range(runs):
        started = time.perf_counter()
        page = broker.search(**filters)
        times.append((time.perf_counter() - started) * 1000)
    assert page is not None
    return statistics.median(times), len(page.rows), page.searched


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--history", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    schema = f"search_{uuid.uuid4().hex[:10]}"
    broker = PostgresBroker(args.url, schema=schema, listen=False)
    broker.migrate()
    ident = sql.Identifier(schema)
    try:
        with psycopg.connect(args.url, autocommit=True) as conn:
            started = time.perf_counter()
            fill(conn, ident, args.rows, args.history)
            print(f"filled {args.rows:,} message rows and {args.history:,} history rows in "
                  f"{time.perf_counter() - started:.1f} s")  # fmt: skip
            some = str(conn.execute(sql.SQL("SELECT message_id FROM {}.message OFFSET %s LIMIT 1").format(ident), [args.rows // 2])
                       .fetchone()[0])  # fmt: skip
            kept = str(conn.execute(sql.SQL("SELECT message_id FROM {}.history LIMIT 1").format(ident)).fetchone()[0])
        middle = f"{uuid.UUID(int=1 << 127)}|0|0"
        cases: list[tuple[str, dict[str, Any]]] = [
            ("first page, no filter", {}),
            ("deep page, no filter", {"after": middle}),
            ("by message id (message table)", {"message_id": some}),
            ("by message id (history)", {"message_id": kept}),
            ("queue", {"queue": "emails"}),
            ("state dead (1%)", {"state": "dead"}),
            ("state done (history)", {"state": "done"}),
            ("actor, rare (0.01%)", {"actor": "rare"}),
            ("args contain [n] (one row)", {"args": [123457]}),
            ("kwargs contain user (0.1%)", {"kwargs": {"user": 42}}),
            ("kwargs user + state dead (0.001%)", {"kwargs": {"user": 7}, "state": "dead"}),
            ("value, one row (typed 123457)", {"value": "123457"}),
            ("value, none (typed a word)", {"value": "nobody@example.com"}),
        ]
        base = None
        figures = []
        print(f"{'page of 50':40} {'median ms':>10} {'x first':>8} {'rows':>5} {'searched':>9}")
        for name, filters in cases:
            ms, n, searched = timed(broker, args.runs, limit=50, **filters)
            base = base or ms
            figures.append({"case": name, "filters": filters, "median_ms": round(ms, 2), "ratio": round(ms / base, 2),
                            "rows": n, "searched": searched})  # fmt: skip
            print(f"{name:40} {ms:10.1f} {ms / base:8.2f} {n:5} {searched if searched is not None else '':>9}")
        samples = []
        for _ in range(args.runs):
            with broker.database.connection() as conn:
                conn.execute(sql.SQL("DELETE FROM {}.queue_minute").format(ident))
                started = time.perf_counter()
                assert samples.take_sample(conn, broker.statements)
                samples.append((time.perf_counter() - started) * 1000)
        sample_ms = statistics.median(samples)
        print(f"{'charts sample (once a minute)':40} {sample_ms:10.1f} {sample_ms / base:8.2f}")
        figures.append({"case": "charts sample", "median_ms": round(sample_ms, 2), "ratio": round(sample_ms / base, 2)})
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": args.rows, "history": args.history, "runs": args.runs, "cases": figures}, f,
                          indent=2)  # fmt: skip
    finally:
        broker.close()
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(ident))


if __name__ == "__main__":
    main()
