"""Queues over 1, 2 and 3 databases (issue 27.7): the aggregate drain, and the CPU per message of the
servers and of the workers, in one run.

Three queues (q0, q1, q2) with a no-op actor each, routed round-robin over *k* PostgreSQL servers
of the benchmark's own (``initdb`` on this machine, durable: ``fsync`` and ``synchronous_commit`` on),
*n* messages spread evenly, enqueued first; then the stock CLI (``dramatiq benchmarks.routed_app
-p 2 -t 8``) drains them.  The drain is timed from the first claim to the last ack; CPU is read
from ``/proc`` for each server's processes and the workers'.  Best of *rounds* per *k*.

    python benchmarks/routing.py [--messages 30000] [--rounds 2]

On this 2-core machine the workers and every server share the same two cores, so more databases
cannot drain faster here; the CPU per message says what one primary costs, and so what several
on hosts of their own would carry (printed at the end).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import psycopg  # noqa: E402
from dramatiq.message import Message  # noqa: E402
from psycopg import sql  # noqa: E402
from test_faults import OwnedServer, process_tree  # noqa: E402

from dramatiq_pg_fenced.routing.router import RoutedBroker  # noqa: E402

QUEUES = ("q0", "q1", "q2")


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def left(servers: list[OwnedServer], schema: str) -> int:
    total = 0
    for server in servers:
        with psycopg.connect(server.url, autocommit=True) as c:
            row = c.execute(sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(schema))).fetchone()
            total += int(row[0]) if row else 0
    return total


def drain(servers: list[OwnedServer], n: int) -> dict[str, float]:
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    routes = {q: f"db{i % len(servers)}" for i, q in enumerate(QUEUES)}
    router = RoutedBroker({f"db{i}": s.url for i, s in enumerate(servers)}, routes=routes, schema=schema)
    router.migrate()
    for q in QUEUES:
        router.declare_queue(q)
    router.enqueue_many(
        Message(queue_name=q, actor_name=f"noop{q[1]}", args=(), kwargs={}, options={})
        for i in range(n)
        for q in [QUEUES[i % len(QUEUES)]]
    )
    router.close()
    env = dict(
        os.environ,
        ROUTED_URLS=",".join(s.url for s in servers),
        ROUTED_ROUTES=",".join(f"{q}={d}" for q, d in routes.items()),
        ROUTED_SCHEMA=schema,
    )
    server_pids = [p for s in servers for p in s.processes()]
    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "benchmarks.routed_app", "-p", "2", "-t", "8"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while left(servers, schema) == n:
            time.sleep(0.01)
        t0, server0, worker0 = time.monotonic(), cpu_seconds(server_pids), cpu_seconds(process_tree(proc.pid))
        while left(servers, schema) > 0:
            time.sleep(0.02)
        seconds = time.monotonic() - t0
        server_pids = [p for s in servers for p in s.processes()]  # backends come and go: read them all now
        server = cpu_seconds(server_pids) - server0
        worker = cpu_seconds(process_tree(proc.pid)) - worker0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    return {"rate": n / seconds, "seconds": seconds, "server_us": server / n * 1e6, "worker_us": worker / n * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=30000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    servers = [OwnedServer(fsync="on", max_connections="100") for _ in range(3)]
    best: dict[int, dict[str, float]] = {}
    try:
        for _ in range(args.rounds):
            for k in (1, 2, 3):
                run = drain(servers[:k], args.messages)
                if k not in best or run["rate"] > best[k]["rate"]:
                    best[k] = run
    finally:
        for server in servers:
            server.close()
    print(f"{args.messages} messages over 3 queues, stock CLI -p 2 -t 8, best of {args.rounds}:")
    for k, run in best.items():
        print(
            f"  {k} database(s): {run['rate']:6.0f} messages/s ({run['seconds']:.2f} s), x{run['rate'] / best[1]['rate']:.2f}; "
            f"per message: {run['server_us']:4.0f} us server CPU, {run['worker_us']:4.0f} us worker CPU"
        )
    server_us, worker_us = best[1]["server_us"], best[1]["worker_us"]
    rate = 8e6 / server_us  # one primary with 8 cores of its own, its CPU the limit
    print(
        f"On paper: one primary spends {server_us:.0f} us of CPU per message, so one with 8 cores of its own carries "
        f"about {rate:,.0f} messages/s, its workers needing about {worker_us * rate / 1e6:.0f} cores at that rate "
        f"({worker_us:.0f} us each); N such primaries carry N times that, ordering holding within each."
    )

if __name__ == "__main__":
    main()
