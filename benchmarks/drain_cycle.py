"""Where a drain's time goes in a stock worker process: the consumer thread's claims against its wait for room.

    python -m benchmarks.drain_cycle [--url URL] [--messages 40000] [--rounds 3] [--prefetch N]

Each round enqueues ``--messages`` no-op messages in a schema of its own, then drains them with
the stock CLI (``dramatiq benchmarks.drain_cycle -p 1 -t 8``, Dramatiq's default prefetch of twice
the threads unless ``--prefetch``).  The worker process, which imports this module, times its
consumer thread: each claim (a pooled connection, the statement's round trip, the rows made
messages), the statement alone, and the waits for room (every slot of the prefetch taken by
messages not yet settled).  It prints the rate, the claims' sizes, and the share of the drain's
wall time in each.

What it showed on the 2-core machine of issue 25 (2026-12-06, shared server, 40k messages):
every claim takes the whole prefetch (16), about half of the consumer thread's time is its claims
(~1 ms each, ~0.8 ms of it the statement) and the rest its wait for room, while the worker threads
run the batch.  The worker threads wait for the claim, the claim for the batch: the two do not
overlap.  The consumer thread cannot claim early: it needs the GIL, which the busy worker threads
hand over only when they block on an empty work queue (or every ``sys.getswitchinterval()``).
See docs/performance.md for the variants tried.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STATS_EVERY = 100  # claims between two writes of the worker's figures

if os.environ.get("BENCH_CYCLE_FILE"):  # imported by the worker process
    from benchmarks.apps import actors, broker  # noqa: F401  (the actors Dramatiq's CLI looks for)
    from dramatiq_pg_fenced.core import consumer as _consumer
    from dramatiq_pg_fenced.core import leases as _leases

    _figures: dict[str, Any] = {"claims": 0, "claim_s": 0.0, "statement_s": 0.0, "room_s": 0.0, "sizes": {}}
    _sizes: collections.Counter[int] = collections.Counter()
    _started: list[float] = []

    def _write() -> None:
        _figures["sizes"] = dict(_sizes)
        _figures["wall_s"] = time.perf_counter() - _started[0]
        path = Path(os.environ["BENCH_CYCLE_FILE"])
        path.with_suffix(".tmp").write_text(json.dumps(_figures))
        path.with_suffix(".tmp").replace(path)

    def _timed(owner: Any, name: str, key: str, after: Any = None) -> None:
        real = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not _started:
                _started.append(time.perf_counter())
            begun = time.perf_counter()
            value = real(*args, **kwargs)
            _figures[key] += time.perf_counter() - begun
            if after is not None:
                after(value)
            return value

        setattr(owner, name, timed)

    def _claimed(rows: list[tuple]) -> None:
        _sizes[len(rows)] += 1
        _figures["claims"] += 1
        if _figures["claims"] % STATS_EVERY == 0:
            _write()

    _timed(_consumer.PostgresConsumer, "_claim", "claim_s")
    _timed(_consumer.PostgresConsumer, "_claim_rows", "statement_s", after=_claimed)
    _timed(_leases.Leases, "wait_for_capacity", "room_s")


def drain(url: str, messages: int, prefetch: int | None, tmp: Path) -> dict[str, Any]:
    """One round: enqueue, drain with the stock CLI, return the rate and the worker's figures."""
    import psycopg
    from psycopg import sql

    from benchmarks import apps

    schema = f"bench_cycle_{uuid.uuid4().hex[:8]}"
    producer = apps.make_broker("postgres", schema=schema, application_name="bench-cycle")
    producer.migrate()
    noop = apps.declare(producer)["noop"]
    producer.enqueue_many([noop.message() for _ in range(messages)])
    producer.close()
    stats = tmp / f"{schema}.json"
    env = dict(
        os.environ,
        BENCH_BROKER="postgres",
        BENCH_PG_URL=url,
        BENCH_PG_SCHEMA=schema,
        BENCH_CYCLE_FILE=str(stats),
        PYTHONPATH=str(REPO),
    )
    if prefetch:
        env["dramatiq_queue_prefetch"] = str(prefetch)
    ident = sql.Identifier(schema)
    queued = sql.SQL("SELECT count(*) FROM {}.message WHERE state = 'queued'").format(ident)
    busy = sql.SQL("SELECT EXISTS (SELECT 1 FROM {}.message WHERE state IN ('queued', 'running'))").format(ident)
    with psycopg.connect(apps.pg_url(url, "bench-cycle-admin"), autocommit=True) as admin:
        log = open(tmp / f"{schema}.log", "wb")  # noqa: SIM115 (closed below)
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "benchmarks.drain_cycle", "-p", "1", "-t", "8"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 60
            while admin.execute(queued).fetchone()[0] == messages:  # type: ignore[index]
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the worker took nothing in 60 s: see {log.name}")
                time.sleep(0.005)
            begun = time.monotonic()
            while admin.execute(busy).fetchone()[0]:  # type: ignore[index]
                if time.monotonic() > begun + max(120, messages / 200):
                    raise RuntimeError(f"the drain did not finish: see {log.name}")
                time.sleep(0.01)
            seconds = time.monotonic() - begun
            time.sleep(0.2)
        finally:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
            log.close()
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
    figures = json.loads(stats.read_text()) if stats.exists() else {}
    return {"rate": messages / seconds, "seconds": seconds, **figures}


def report(round_: dict[str, Any]) -> str:
    line = f"drain {round_['rate']:,.0f} msg/s ({round_['seconds']:.2f} s)"
    claims = round_.get("claims")
    if not claims:
        return line + "; no figures from the worker"
    wall = round_["wall_s"]
    sizes = ", ".join(f"{k} rows x{v}" for k, v in sorted(round_["sizes"].items(), key=lambda kv: -kv[1])[:4])
    return (
        f"{line}; {claims} claims ({sizes}); consumer thread: claiming {round_['claim_s'] / wall:.0%}"
        f" (the statement {round_['statement_s'] / wall:.0%}), waiting for room {round_['room_s'] / wall:.0%};"
        f" per claim {round_['claim_s'] / claims * 1e6:,.0f} µs, its statement {round_['statement_s'] / claims * 1e6:,.0f} µs"
    )


def main(argv: list[str] | None = None) -> int:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL") or "postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--messages", type=int, default=40_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--prefetch", type=int, default=None, help="the workers' queue prefetch (Dramatiq's default: 2 x threads)"
    )
    args = parser.parse_args(argv)
    os.environ["BENCH_PG_URL"] = args.url  # the producer's broker (benchmarks.apps.make_broker) and the worker's
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            print(f"round {i + 1}: " + report(drain(args.url, args.messages, args.prefetch, Path(tmp))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
