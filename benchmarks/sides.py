"""The brokers side by side, the relaxed single send, import times, the stub drain."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .drivers import (
    SEND_THREADS,
    Drain,
    Driver,
    PostgresDriver,
    measure_bulk,
    measure_drain,
    measure_latency,
    measure_single,
    measure_threaded,
    running_workers,
)
from .plan import PROCESSES, REPO, THREADS, Plan, log, wait_until


# -- the run -------------------------------------------------------------------
def side_by_side(drivers: list[Driver], plan: Plan, tmp: Path, out: dict[str, Any]) -> None:
    per: dict[str, dict[str, list[Any]]] = {
        d.kind: {"single": [], "threaded": [], "bulk": [], "drain": []} for d in drivers
    }
    # The idle latencies are taken once, in the second round: every server has had a round's load by then.
    latency_round = min(1, plan.repeats - 1)
    for rep in range(plan.repeats):
        for driver in drivers:
            kind = driver.kind
            driver.fresh()
            single = measure_single(driver, plan)
            driver.fresh()
            threaded = measure_threaded(driver, plan)
            driver.fresh()
            bulk = measure_bulk(driver, plan.backlog)
            # RabbitMQ publishes without confirms: wait until the broker holds the whole backlog,
            # or the drain (and the start-up, clocked to its first message) would start early.
            wait_until(held_all(driver, plan.backlog), timeout=60)
            lat_path = tmp / f"latency-{kind}-{rep}.txt"
            with running_workers(driver, tmp / f"workers-{kind}-{rep}.log", {"BENCH_LATENCY_FILE": str(lat_path)}) as w:
                drain = measure_drain(driver, w, plan.backlog, timeout=max(120.0, plan.backlog / 200))
                latency = measure_latency(driver, plan, lat_path) if rep == latency_round else None
                if rep == latency_round and isinstance(driver, PostgresDriver):
                    relaxed = driver.relaxed_latency(lat_path)
                    out["brokers"][kind]["latency_relaxed_enqueue"] = relaxed
                    log(
                        f"postgres idle latency with synchronous_commit=False sends: p50 {relaxed['p50_ms']:.2f} ms p99 {relaxed['p99_ms']:.2f} ms"
                    )
            per[kind]["single"].append(single)
            per[kind]["threaded"].append(threaded)
            per[kind]["bulk"].append(bulk)
            per[kind]["drain"].append(drain)
            if latency is not None:
                out["brokers"][kind]["latency"] = latency
            log(
                f"rep {rep + 1}/{plan.repeats} {kind:17s} single {single:7.0f}/s  {SEND_THREADS} threads {threaded:7.0f}/s  "
                f"bulk {bulk:7.0f}/s  "
                f"drain {drain.rate:8.0f}/s ({drain.seconds:.2f} s, start-up {drain.startup:.2f} s, "
                f"CPU/msg {drain.worker_cpu_us:.0f}+{drain.server_cpu_us:.0f} us)"
                + (f"  latency p50 {latency['p50_ms']:.2f} ms p99 {latency['p99_ms']:.2f} ms" if latency else "")
            )
    for kind, figures in per.items():
        drains: list[Drain] = figures["drain"]
        out["brokers"][kind].update(
            {
                "single_send_per_s": statistics.median(figures["single"]),
                "threaded_send_per_s": statistics.median(figures["threaded"]),
                "bulk_enqueue_per_s": statistics.median(figures["bulk"]),
                "drain_per_s": statistics.median(d.rate for d in drains),
                "worker_startup_s": statistics.median(d.startup for d in drains),
                "worker_cpu_us_per_msg": statistics.median(d.worker_cpu_us for d in drains),
                "server_cpu_us_per_msg": statistics.median(d.server_cpu_us for d in drains),
                "runs": {
                    "single_send_per_s": figures["single"],
                    "threaded_send_per_s": figures["threaded"],
                    "worker_startup_s": [d.startup for d in drains],
                    "bulk_enqueue_per_s": figures["bulk"],
                    "drain_per_s": [d.rate for d in drains],
                    "drain_seconds": [d.seconds for d in drains],
                },
                "peak_rss_mb_per_process": max(max(d.peak_rss.values(), default=0) for d in drains) / 2**20,
            }
        )
        if kind == "postgres":
            out["brokers"][kind]["connections_per_process"] = max(
                max(d.peak_connections.values(), default=0) for d in drains
            )


def held_all(driver: Driver, n: int) -> Callable[[], bool]:
    """Does the broker hold (at least) *n* queued messages?"""
    return lambda: driver.queued() >= n


def relaxed_single(url: str, options: dict[str, Any], plan: Plan, tmp: Path) -> float:
    driver = PostgresDriver(plan, tmp, url, {**options, "synchronous_commit": False})
    try:
        driver.fresh()
        return measure_single(driver, plan)
    finally:
        driver.shutdown()


IMPORTS = {
    "postgres": "dramatiq, psycopg, psycopg_pool",  # what any psycopg-based broker must import
    "ours": "dramatiq_pg_fenced",
    "rabbitmq": "dramatiq, dramatiq.brokers.rabbitmq",
    "redis": "dramatiq, dramatiq.brokers.redis",
}


def import_seconds(modules: str, runs: int = 5) -> float | None:
    """Median time a fresh interpreter takes to import *modules* (this checkout's package first on the path);
    ``None`` when they are not installed (pika and redis come with the ``bench`` extra)."""
    code = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    times = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        if done.returncode and "ModuleNotFoundError" in done.stderr:
            return None
        done.check_returncode()
        times.append(float(done.stdout))
    return statistics.median(times)


def import_cpu_seconds(runs: int = 9) -> dict[str, float | None]:
    """Per entry of :data:`IMPORTS`: the median CPU time (user + system, from ``wait4``) of a fresh interpreter
    that imports it, start-up and exit included (this checkout's package first on the path), the entries
    taken in turn, in alternating order, *runs* times (CPU time, not the wall clock: a loaded machine's wall
    clock measures its load as much as the import).  ``None`` when not installed."""
    found: dict[str, list[float] | None] = {name: [] for name in IMPORTS}
    names = list(IMPORTS)
    for run in range(runs):
        for name in names if run % 2 == 0 else names[::-1]:
            times = found[name]
            if times is None:
                continue
            child = subprocess.Popen(
                [sys.executable, "-c", f"import {IMPORTS[name]}"], cwd=REPO, stderr=subprocess.DEVNULL
            )
            _, status, usage = os.wait4(child.pid, 0)
            if status:
                found[name] = None  # not installed (pika, redis: the bench extra)
                continue
            times.append(usage.ru_utime + usage.ru_stime)
    return {name: None if times is None else statistics.median(times) for name, times in found.items()}


# Dramatiq's own worker draining an in-memory StubBroker: what the stock worker spends per message
# with no broker behind it (its middleware, consumer and worker threads, the hand-offs between them).
_STUB_DRAIN = """
import json, sys, time
import dramatiq
from dramatiq.brokers.stub import StubBroker
n, threads = int(sys.argv[1]), int(sys.argv[2])
broker = StubBroker()
dramatiq.set_broker(broker)
noop = dramatiq.actor(lambda: None, actor_name="noop", queue_name="bench", max_retries=0)
for _ in range(n):
    noop.send()
worker = dramatiq.Worker(broker, worker_threads=threads)
cpu, start = time.process_time(), time.perf_counter()
worker.start()
broker.join("bench")
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
worker.stop()
print(json.dumps({"per_s": n / seconds, "cpu_us_per_msg": cpu / n * 1e6}))
"""


def stub_drain(n: int, runs: int = 3) -> dict[str, float]:
    """Dramatiq's worker alone (``PROCESSES`` x ``THREADS`` shape, one process measured): median messages
    per second and worker CPU per message over *runs* drains of *n* no-op messages from a StubBroker.
    No broker's worker can spend less per message; with ``PROCESSES`` processes on this machine's cores,
    no drain can beat ``drain_ceiling_per_s``."""
    found = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", _STUB_DRAIN, str(n), str(THREADS)], cwd=REPO, capture_output=True, text=True, check=True
        )
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    per_s = statistics.median(f["per_s"] for f in found)
    cpu_us = statistics.median(f["cpu_us_per_msg"] for f in found)
    cores = os.cpu_count() or 1
    return {
        "per_s": per_s,
        "cpu_us_per_msg": cpu_us,
        # Each process at most its measured rate; all of them together at most the cores' CPU.
        "drain_ceiling_per_s": min(PROCESSES * per_s, cores * 1e6 / cpu_us),
    }
