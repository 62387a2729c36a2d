"""Side-by-side benchmark: PostgresBroker against Dramatiq's Redis and RabbitMQ brokers.

One command, one machine, one run::

    python -m benchmarks.run            # full run (about 13 minutes on a shared 2-core VM)
    python -m benchmarks.run --quick    # smoke run (about 1 minute)

Every broker gets the same no-op actor and real ``dramatiq`` worker
processes (2 processes x 8 threads).  The brokers take turns, and each
side-by-side figure is the median of 5 repetitions (the backlog pair runs
twice; ``--quick``: once each).  The figures, how each is taken:

brokers
    Ours; Redis and RabbitMQ as Dramatiq configures them by default (Redis
    without persistence, RabbitMQ publishing without confirms); and their
    durable kinds (issue 25), the fair comparison for a durable broker:
    ``redis-aof``, a redis-server this run starts on a free port with
    ``--appendonly yes --appendfsync always`` (every write fsynced before
    the reply) and stops at the end, and ``rabbitmq-confirms``,
    ``RabbitmqBroker(confirm_delivery=True)`` (persistent messages on a
    durable queue, each send confirmed once it is on disk).
single send
    ``actor.send()`` in a loop from one thread, no workers running.  Ours
    commits every send durably (``synchronous_commit = on``), as the
    durable peers do; the plain Redis and RabbitMQ do not.
8-thread send
    The same from 8 threads of one process at once, messages per second
    in all.
bulk enqueue
    The best bulk means each broker has: ours ``broker.enqueue_many`` in
    chunks; Redis a pipeline of Dramatiq's own enqueue script (no
    middleware hooks); RabbitMQ a plain ``send()`` loop (publishing without
    confirms is already pipelined).  This also fills the drain backlog.
drain
    N messages are enqueued first, then the workers start.  The clock
    starts when the queue is first seen shrinking (worker start-up is
    reported on its own) and stops when nothing is queued or in flight
    (ours: no queued or running row; Redis: Dramatiq's ``qsize``; RabbitMQ:
    the queue's ready count, which misses up to 32 unacked messages).
idle latency
    With the workers idle, ``stamp.send(time.time())`` at a low steady
    rate; the actor appends ``sent received`` to a file as its first step.
    Taken in the second round (the first with ``--quick``).
floors
    What this machine allows at best, beside the brokers in the same run:
    a durable one-row INSERT into a one-column table in a loop (no durable
    send can be cheaper) and paced like the idle-latency sends (no durable
    send adds less to the idle latency); a plain INSERT into our message
    table (the least a broker of rows claimed and acked by id pays per
    send); paced, that INSERT followed by the row's claim by id from a
    second session, and the same with a NOTIFY that wakes the claiming
    thread, which hands the claimed id to a waiting worker thread through a
    queue (the least a durable, fenced delivery woken by LISTEN/NOTIFY takes
    to reach a Dramatiq worker thread); and the time to import
    Dramatiq with psycopg against Dramatiq with pika or redis (no worker
    starts sooner); and Dramatiq's own worker draining a StubBroker (in
    memory, no broker behind it): its rate and CPU per message, and from
    them the drain no stock worker of ours or theirs can beat here.
    The targets table shows, beside each such target, the best ratio these
    floors leave.
big backlog (ours)
    The same drain with a 10k and a 200k backlog, worker RSS (peak per
    process) and connections per process (``pg_stat_activity`` by
    ``application_name``), and the table size (``pg_total_relation_size``,
    indexes and TOAST included) with the backlog, right after the drain (the
    workers' own vacuums included), after one more plain ``VACUUM``, and after
    ``broker.compact()``.

Results go to ``benchmarks/results/<full|quick>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import dramatiq  # noqa: E402
import psycopg  # noqa: E402

from benchmarks import apps  # noqa: E402

from .drivers import (  # noqa: F401
    DRIVERS,
    SEND_THREADS,
    Drain,
    Driver,
    PostgresDriver,
    RabbitmqConfirmsDriver,
    RabbitmqDriver,
    RedisAofDriver,
    RedisDriver,
    _loop_rate,
    _threaded_rate,
    free_port,
    measure_bulk,
    measure_drain,
    measure_latency,
    measure_single,
    measure_threaded,
    percentile,
    running_workers,
)
from .floors import (  # noqa: F401
    _rung_claim,
    backlog_scaling,
    floors,
)
from .plan import (  # noqa: F401
    FULL,
    KINDS,
    PROCESSES,
    QUICK,
    REPO,
    RESULTS,
    THREADS,
    Plan,
    Workers,
    cpu_seconds,
    log,
    pids_named,
    wait_until,
)
from .report import (  # noqa: F401
    _after,
    _pair,
    chart,
    compile_sources,
    fmt,
    git_commit,
    table,
)
from .sides import (  # noqa: F401
    _STUB_DRAIN,
    IMPORTS,
    held_all,
    import_seconds,
    relaxed_single,
    side_by_side,
    stub_drain,
)
from .targets import (  # noqa: F401
    targets,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (under 2 minutes)")
    parser.add_argument("--brokers", default=",".join(KINDS), help="comma-separated subset of %(default)s")
    parser.add_argument("--no-backlog", action="store_true", help="skip the 10k/200k backlog part")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL") or apps.PG_URL)
    parser.add_argument("--pg-options", default="{}", help="JSON of extra PostgresBroker options (for tuning)")
    parser.add_argument("--out", type=Path, default=None, help="results path stem (default: results/<full|quick>)")
    parser.add_argument(
        "--own-server",
        action="store_true",
        help="run ours on a PostgreSQL server of the benchmark's own (initdb, fsync on, stopped at the end), as"
        " redis-aof runs on its own: a shared server's WAL carries the other sessions' writes, and every commit"
        " of ours waits for them too",
    )
    args = parser.parse_args(argv)
    server = None
    if args.own_server:
        tests = str(REPO / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from test_faults import OwnedServer

        server = OwnedServer(fsync="on", max_connections="100")
    try:
        if server is not None:
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute("CREATE DATABASE bench")
                warm_up(conn)
            args.pg_url = server.url.rsplit("/", 1)[0] + "/bench"
        return run(args, parser)
    finally:
        if server is not None:
            server.close()


def warm_up(conn: psycopg.Connection) -> None:
    """Give a fresh server WAL segments to recycle, as a server in service has: about 200 MB of WAL, then a
    checkpoint.  A fresh cluster creates (and zero-fills) every WAL segment its first minutes write, and
    the first round's commits paid for it (in two runs, ours alone was slower in the first round than
    in all others)."""
    conn.execute("CREATE TABLE bench_warm_up AS SELECT g, repeat('x', 100) AS x FROM generate_series(1, 1500000) g")
    conn.execute("DROP TABLE bench_warm_up")
    conn.execute("CHECKPOINT")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan = QUICK if args.quick else FULL
    kinds = [k.strip() for k in args.brokers.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown broker {k!r}")
    options = json.loads(args.pg_options)
    os.environ["BENCH_PG_URL"] = args.pg_url
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or RESULTS / plan.name

    out: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": git_commit(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "python": platform.python_version(),
            "dramatiq": dramatiq.__version__,
            "processes": PROCESSES,
            "threads": THREADS,
            "note": "2-core machine shared with other jobs; compare ratios from the same run",
            "pg_server": "own (initdb, fsync on)" if args.own_server else "shared",
        },
        "plan": plan.__dict__,
        "brokers": {k: {} for k in kinds},
    }
    out["meta"]["byte_compiled"] = compile_sources()
    log(f"{plan.name} run, brokers {kinds}, load average {os.getloadavg()}")
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dramatiq-bench-") as tmpdir:
        tmp = Path(tmpdir)
        drivers: list[Driver] = []
        pg: PostgresDriver | None = None
        try:
            for kind in kinds:
                if kind == "postgres":
                    pg = PostgresDriver(plan, tmp, args.pg_url, options)
                    drivers.append(pg)
                else:
                    drivers.append(DRIVERS[kind](plan, tmp))
            for d in drivers:
                d.fresh()
                out["meta"].update(d.versions())
            side_by_side(drivers, plan, tmp, out)
            if pg is not None:
                out["brokers"]["postgres"]["single_send_relaxed_per_s"] = relaxed_single(
                    args.pg_url, options, plan, tmp
                )
                log(
                    f"postgres single send, synchronous_commit=False: {out['brokers']['postgres']['single_send_relaxed_per_s']:.0f}/s"
                )
                out["floors"] = floors(args.pg_url, plan)
                log(f"floors: {out['floors']}")
                if not args.no_backlog:
                    backlog_scaling(pg, plan, tmp, out)
        except BaseException:
            for path in sorted(tmp.glob("workers-*.log")):
                tail = path.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {path.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
            raise
        finally:
            for d in drivers:
                with contextlib.suppress(Exception):
                    d.shutdown()
    out["meta"]["loadavg_end"] = os.getloadavg()
    out["meta"]["seconds"] = round(time.monotonic() - begun, 1)
    out["targets"] = targets(out, plan)
    text = table(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    chart(out, Path(f"{stem}.png"))
    print()
    print(text)
    print()
    log(f"done in {out['meta']['seconds']:.0f} s; wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
