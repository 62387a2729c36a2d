"""The dashboard's pages on a big table: how long each takes (the console's pages too: search, charts,
processes, schedules, audit log, a bulk action's question).

    python -m benchmarks.dashboard_budget [--url URL] [--queued 1000000]

Fills a fresh schema with ``--queued`` due messages in one queue (plus a
delayed tenth as many, 10,000 dead letters, 10,000 cancelled and 100,000
history rows on a second queue), then renders each page through the WSGI app
five times and prints the median (milliseconds, server side: the queries
and the HTML).  The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import statistics
import time
import uuid
from typing import Any
from urllib.parse import quote

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app


def render(app: Any, path: str) -> float:
    path, _, qs = path.partition("?")
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "QUERY_STRING": qs, "wsgi.input": io.BytesIO(),
               "HTTP_HOST": "localhost"}  # fmt: skip
    status: list[str] = []
    started = time.perf_counter()
    b"".join(app(environ, lambda s, h: status.append(s)))
    elapsed = time.perf_counter() - started
    assert status == ["200 OK"], (path, status)
    return elapsed * 1000


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--queued", type=int, default=1_000_000)
    args = parser.parse_args()
    schema = f"db_{uuid.uuid4().hex[:10]}"
    broker = PostgresBroker(args.url, schema=schema, listen=False)
    broker.migrate()
    ident = sql.Identifier(schema)
    payload = dramatiq.Message(queue_name="big", actor_name="noop", args=(1,), kwargs={}, options={}).encode()
    try:
        with psycopg.connect(args.url, autocommit=True) as conn:
            started = time.perf_counter()
            insert = sql.SQL(
                "INSERT INTO {}.message (message_id, queue_name, actor_name, priority, state, available_at,"
                " finished_at, payload) SELECT gen_random_uuid(), %s, 'noop', g %% 3, %s,"
                " now() + %s * interval '1 s' - g * interval '1 ms', CASE WHEN %s = 'queued' THEN NULL ELSE now() END,"
                " %s FROM generate_series(1, %s) AS g"
            ).format(ident)
            conn.execute(insert, ["big", "queued", 0, "queued", payload, args.queued])
            conn.execute(insert, ["big", "queued", 3600, "queued", payload, args.queued // 10])
            conn.execute(insert, ["big", "dead", 0, "dead", payload, 10_000])
            conn.execute(insert, ["small", "cancelled", 0, "cancelled", payload, 10_000])
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,"
                    " claimed_at, finished_at, payload) SELECT gen_random_uuid(), g, 'small', 'noop', 0, 1, now(),"
                    " now(), now() - g * interval '10 ms', %s FROM generate_series(1, 100000) AS g"
                ).format(ident),
                [payload],
            )
            conn.execute(sql.SQL("VACUUM ANALYZE {}.message").format(ident))
            conn.execute(sql.SQL("VACUUM ANALYZE {}.history").format(ident))
            print(f"filled in {time.perf_counter() - started:.1f} s")
            one = conn.execute(
                sql.SQL("SELECT message_id FROM {}.message WHERE state = 'dead' LIMIT 1").format(ident)
            ).fetchone()
            done = conn.execute(sql.SQL("SELECT message_id FROM {}.history LIMIT 1").format(ident)).fetchone()
        app = dashboard_app(broker, actions=True)
        first = broker.list_messages("big", "queued", limit=50)
        pages = {
            "queues": "/",
            "messages, queued (first page)": "/messages?queue=big&state=queued",
            "messages, queued (next page)": f"/messages?queue=big&state=queued&after={quote(first.next or '')}",
            "messages, queued, actor filter": "/messages?queue=big&state=queued&actor=noop",
            "messages, queued, actor matching none": "/messages?queue=big&state=queued&actor=nobody",
            "messages, dead": "/messages?queue=big&state=dead",
            "messages, done (history)": "/messages?queue=small&state=done",
            "one message (dead)": f"/message/{one[0]}" if one else "/",
            "one message (done)": f"/message/{done[0]}" if done else "/",
            "metrics (exact counts)": "/metrics",
            "search, unfiltered": "/search?go=1",
            "search, queue and state": "/search?queue=big&state=dead",
            "search, by id": f"/search?id={one[0]}" if one else "/",
            "search, args contain [1]": "/search?args=%5B1%5D",
            "search, args matching none": "/search?args=%5B2%5D",
            "charts, all queues, last hour": "/charts",
            "charts, queue big, last day": "/charts?queue=big&span=day",
            "processes": "/processes",
            "schedules": "/schedules",
            "audit log": "/audit",
            "bulk question: cancel queue big (10,000+)": "/bulk?action=cancel&scope=filter&queue=big",
            "bulk question: re-drive big's dead": "/bulk?action=redrive&scope=filter&queue=big&state=dead",
        }
        print(f"{args.queued:,} due + {args.queued // 10:,} delayed rows in one queue; median of 5 (ms):")
        for name, path in pages.items():
            times = [render(app, path) for _ in range(5)]
            print(f"  {name:40s} {statistics.median(times):8.1f}")
    finally:
        broker.close()
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))


if __name__ == "__main__":
    main()
