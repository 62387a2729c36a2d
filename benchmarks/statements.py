"""Where a drain's server time goes: every statement's calls, plans and time, per message.

    python -m benchmarks.statements [--messages 10000] [--threads 8] [--processes 1] [--fair KEYS]

Starts a PostgreSQL server of its own (``initdb``, fsync on) with
``pg_stat_statements`` loaded and ``track_planning`` on, fills a queue with
no-op messages, and drains it with the stock ``dramatiq`` CLI (one process).
It prints the drain's rate, the worker's and the server's CPU per message
(the server's by process: each connection, the WAL writer...), and per
statement its calls, how many of them were planned, and its execution and
planning time per message.  A statement planned at (nearly) every call is
the first thing to look at: that is how the claim's re-planning was found
(docs/performance.md, "What changed on 2026-12-05").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.message import Message

REPO = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_by_process(match: bytes) -> dict[str, float]:
    """CPU seconds of every process whose command line holds *match*, by its title (``ps`` shows it)."""
    seconds: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
            if match not in title:
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = f"{title.split(b' (')[0].decode(errors='replace')[:48]} [{pid}]"
        seconds[name] = seconds.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return seconds


def own_server(**settings: str) -> tuple[Any, str]:
    """A PostgreSQL server of the run's own (tests/test_faults.py's ``OwnedServer``: the machine's
    binaries, a temporary folder), fsync on, ``pg_stat_statements`` loaded, with a database ``bench``
    that has the extension: (the server, the database's URL).  *settings* add to or override these."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_faults import OwnedServer

    server = OwnedServer(
        **{"fsync": "on", "max_connections": "100", "shared_preload_libraries": "pg_stat_statements", **settings}
    )
    with psycopg.connect(server.url, autocommit=True) as conn:
        conn.execute("CREATE DATABASE bench")
    url = server.url.rsplit("/", 1)[0] + "/bench"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION pg_stat_statements")
    return server, url


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument(
        "--fair", type=int, default=0, metavar="KEYS",
        help="drain a fair queue instead (benchmarks.fair_workers' actor), its messages spread over KEYS keys",
    )  # fmt: skip
    args = parser.parse_args(argv)
    from benchmarks import apps
    from dramatiq_pg_fenced import PostgresBroker

    server, url = own_server(**{"pg_stat_statements.track": "all", "pg_stat_statements.track_planning": "on"})
    try:
        broker = PostgresBroker(url, schema="bench")
        broker.migrate()
        env = {**os.environ, "BENCH_BROKER": "postgres", "BENCH_PG_URL": url, "BENCH_PG_SCHEMA": "bench"}
        app = "benchmarks.apps"
        if args.fair:
            import dramatiq

            from benchmarks import fair_workers

            dramatiq.set_broker(broker)
            fair, _ = fair_workers.declare(broker)
            broker.enqueue_many([fair.message(f"k{n % args.fair}", 0.0) for n in range(args.messages)])
            env.update(BENCH_FAIR_SCHEMA="bench", BENCH_FAIR_URL=url, BENCH_FAIR_FILE=os.devnull)
            app = "benchmarks.fair_workers"
        else:
            message = Message(queue_name=apps.QUEUE, actor_name="noop", args=(), kwargs={}, options={})
            broker.enqueue_many([message.copy(message_id=str(uuid.uuid4())) for _ in range(args.messages)])
        broker.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE bench.message")
            conn.execute("SELECT pg_stat_statements_reset()")
            before, started = cpu_by_process(b"postgres"), time.monotonic()
            worker = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", app, "-p", str(args.processes), "-t", str(args.threads)],
                cwd=REPO,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            left = "SELECT count(*) FROM bench.message WHERE state IN ('queued', 'running')"
            try:
                while conn.execute(left).fetchone() != (0,):
                    time.sleep(0.1)
                seconds = time.monotonic() - started
                after = cpu_by_process(b"postgres")
                workers = cpu_by_process(app.encode())
            finally:
                worker.terminate()
                worker.wait(30)
            rows = conn.execute(
                """
                SELECT calls, plans, total_exec_time, total_plan_time, left(regexp_replace(query, '\\s+', ' ', 'g'), 90)
                  FROM pg_stat_statements
                 WHERE dbid = (SELECT oid FROM pg_database WHERE datname = 'bench')
                 ORDER BY total_exec_time + total_plan_time DESC LIMIT 12
                """
            ).fetchall()
        n = args.messages
        server_cpu = {k: v - before.get(k, 0.0) for k, v in after.items()}
        print(
            f"drain of {n:,} ({args.processes} process(es) x {args.threads} threads, start-up included): {n / seconds:,.0f} msg/s; "
            f"worker CPU {sum(workers.values()) / n * 1e6:.0f} µs/msg, server {sum(server_cpu.values()) / n * 1e6:.0f} µs/msg"
        )
        for name, cpu in sorted(server_cpu.items(), key=lambda kv: -kv[1]):
            if cpu > 0:
                print(f"  server {name:56s} {cpu / n * 1e6:6.1f} µs/msg")
        print("calls   planned  exec µs/msg  plan µs/msg  statement (the polling count(*) is this script's)")
        for calls, plans, executing, planning, text in rows:
            print(f"{calls:6d} {plans:8d} {executing / n * 1000:12.1f} {planning / n * 1000:12.1f}  {text}")
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
