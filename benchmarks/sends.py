"""Sends against their floors, in one run: issue 40's goals 1 and 2.

    python -m benchmarks.sends [--rounds 5] [--seconds 5] [--url URL]

On a PostgreSQL server of its own (initdb, fsync on) unless ``--url`` is given, in alternating
rounds (medians, with the spread beside them):

- the floors: a bare durable one-row INSERT into our message table in a loop, on one connection and
  from 8 sessions at once, with and without a ``NOTIFY`` in its transaction;
- ``send()`` of a no-op actor, from one thread and from 8;
- the client's CPU per call (user and system time of this process) of a single ``send()`` and of
  a bare INSERT: on this 2-core machine the client and the server share the CPUs, and a send's own
  Python work is what keeps it from its floor (docs/performance.md, "Sends against their floors").

The ratios printed are the goals': 8-thread ``send()`` against 8 sessions of bare INSERTs (goal
>= 0.8x), single ``send()`` against the bare INSERT loop (goal >= 0.8x).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.message import Message
from psycopg import sql

from benchmarks import apps
from dramatiq_pg_fenced import PostgresBroker

from .drivers import PostgresDriver, _loop_rate, _threaded_rate, measure_single, measure_threaded
from .plan import FULL, log

REPO = Path(__file__).resolve().parent.parent


def floor_rates(url: str, plan: Any, schema: str) -> dict[str, float]:
    """One round of the floors, on a migrated *schema*."""
    ident = sql.Identifier(schema)
    insert = sql.SQL(
        "INSERT INTO {}.message (message_id, queue_name, actor_name, payload) VALUES (%s, 'bench', 'noop', %s)"
    ).format(ident)
    ringing = sql.SQL("WITH i AS ({} RETURNING 1) SELECT pg_notify(%s, %s::text) FROM i").format(insert)
    payload = Message(queue_name=apps.QUEUE, actor_name="noop", args=(), kwargs={}, options={}).encode()
    with psycopg.connect(apps.pg_url(url, "bench-floor"), autocommit=True) as conn:
        single = _loop_rate(plan, lambda: conn.execute(insert, (uuid.uuid4(), payload)))
    threaded = _threaded_rate(url, plan, lambda c: c.execute(insert, (uuid.uuid4(), payload)))
    threaded_ringing = _threaded_rate(url, plan, lambda c: c.execute(ringing, (uuid.uuid4(), payload, "nobody", "x")))
    return {"floor_single": single, "floor_threads": threaded, "floor_threads_notify": threaded_ringing}


def ours(driver: PostgresDriver, plan: Any) -> dict[str, float]:
    """One round of ``send()``: single and from 8 threads, and the client's CPU per single send."""
    driver.fresh()
    send = driver.actors["noop"].send
    single = measure_single(driver, plan)
    cpu, n = time.process_time(), 2000
    for _ in range(n):
        send()
    cpu_us = (time.process_time() - cpu) / n * 1e6
    return {"single": single, "threads": measure_threaded(driver, plan), "send_cpu_us": cpu_us}


def bare_cpu(url: str, schema: str) -> float:
    """The client's CPU per bare durable INSERT, in µs."""
    insert = sql.SQL(
        "INSERT INTO {}.message (message_id, queue_name, actor_name, payload) VALUES (%s, 'bench', 'noop', %s)"
    ).format(sql.Identifier(schema))
    with psycopg.connect(apps.pg_url(url, "bench-floor"), autocommit=True) as conn:
        cpu, n = time.process_time(), 2000
        for _ in range(n):
            conn.execute(insert, (uuid.uuid4(), b"x" * 100))
        return (time.process_time() - cpu) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    parser.add_argument("--url", default=None, help="a server to use (default: one of the benchmark's own)")
    parser.add_argument("--out", type=Path, default=None, help="write every round as JSON here")
    args = parser.parse_args(argv)
    plan = dataclasses.replace(FULL, single_seconds=args.seconds, single_max=10**9)
    server = None
    url = args.url
    if url is None:
        sys.path.insert(0, str(REPO / "tests"))
        from test_faults import OwnedServer

        server = OwnedServer(fsync="on", max_connections="100")
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        url = server.url.rsplit("/", 1)[0] + "/bench"
    schema = f"bench_sends_floor_{uuid.uuid4().hex[:8]}"
    rounds: list[dict[str, float]] = []
    try:
        migrated = PostgresBroker(apps.pg_url(url, "bench-floor"), schema=schema)
        migrated.migrate()
        migrated.close()
        with tempfile.TemporaryDirectory() as tmp:
            driver = PostgresDriver(plan, Path(tmp), url)
            try:
                for n in range(args.rounds):
                    row: dict[str, float] = {}
                    # alternate the order within a round, so that no kind always runs first
                    parts = [
                        lambda: {**floor_rates(url, plan, schema), "insert_cpu_us": bare_cpu(url, schema)},
                        lambda: ours(driver, plan),
                    ]
                    for part in parts if n % 2 == 0 else parts[::-1]:
                        row.update(part())
                    rounds.append(row)
                    log(f"round {n + 1}: " + ", ".join(f"{k} {v:,.0f}" for k, v in row.items()))
            finally:
                driver.shutdown()
    finally:
        with psycopg.connect(apps.pg_url(url, "bench-floor-admin"), autocommit=True) as admin:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        if server is not None:
            server.close()

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    print()
    for key in rounds[0]:
        values = [r[key] for r in rounds]
        unit = " µs" if key.endswith("_us") else "/s"
        print(f"{key:<24} {statistics.median(values):,.0f}{unit} ({min(values):,.0f}-{max(values):,.0f})")
    print()
    print(
        f"8-thread send() vs 8 sessions of bare INSERTs:    {med('threads') / med('floor_threads'):.2f}x (goal >= 0.8x)"
    )
    print(
        f"single send() vs the bare INSERT loop:            {med('single') / med('floor_single'):.2f}x (goal >= 0.8x)"
    )
    print(f"8 sessions of INSERTs with a NOTIFY vs without:  {med('floor_threads_notify') / med('floor_threads'):.2f}x")
    print(f"client CPU per send() vs per bare INSERT:         {med('send_cpu_us') / med('insert_cpu_us'):.2f}x")
    if args.out:
        args.out.write_text(json.dumps({"rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
