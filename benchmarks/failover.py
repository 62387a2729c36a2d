"""What survives a crash and a failover, per durability preset, and what each preset costs (issue 22).

Two parts, both on servers of the run's own (the machine's PostgreSQL binaries: ``initdb``,
``pg_basebackup -R``, ``pg_ctl promote``; ``tests/cluster.py`` builds them, as for the tests)::

    python -m benchmarks.failover faults [--runs 3]     # lost / ran twice / recovery, per preset and fault
    python -m benchmarks.failover cost [--runs 3]       # drain, idle latency and single send, per preset

faults
    Per preset (default: durable sends, relaxed claims and outcomes; ``durable_outcomes=True``) and
    standby (asynchronous, synchronous: ``synchronous_standby_names = '*'``), the harness of
    ``tests/test_failover.py``: two ``dramatiq`` worker processes of 4 threads (lease ``--lease-seconds``,
    10 s: longer than the outage, so a delivery whose outcome survived is not rescued meanwhile) and a
    producer sending every 10 ms (jobs of ``--job-seconds``: 0.01 leaves the workers idle most of the
    time, 0.1 lets a backlog grow) (a send that raised is sent again with the same id) on one
    multi-host URL with ``target_session_attrs=read-write``; an independent ledger on the shared
    server records every start and finish.  The faults (``cluster.FAULTS``):

    - ``kill``: ``pg_ctl stop -m immediate`` of the primary, promotion a second later;
    - ``read-only``: the primary stops taking writes with its sockets open, promotion a second later;
    - ``isolated``: the standby's WAL receiver is stopped (``primary_conninfo = ''``: a partition
      between the two, the clients still reach the primary) 5 s before the kill;
    - ``crash``: every process of the primary (alone) SIGKILLed, the server started again a second
      later (crash recovery; no failover).

    Figures per run: sends returned, gone (returned, and the new primary does not have them: they ran
    on the old one before the fault, or never), lost (returned, never ran), ran twice (started more than once),
    dead-lettered, workers restarted, recovery (promotion or restart to the first job started after
    it), the longest a send took to return; medians and ranges over ``--runs``.  The configurations
    take turns within each round.  The servers run with ``fsync = off`` (a process crash, not a
    machine's: the WAL the server wrote survives).

cost
    One primary and one standby, ``fsync`` on, reconfigured between runs (no standby: the standby
    stopped; asynchronous; synchronous), each with both presets, taking turns: per configuration a
    fresh schema, a single-send loop (``actor.send()``, no workers), a drain of ``--backlog``
    messages by ``benchmarks/run.py``'s workers (2 processes x 8 threads, no-op actor) and its idle
    latency (20 messages/s); the functions of ``benchmarks/run.py``.  Reported as ratios to the
    default preset without a standby of the same round (medians over rounds).  Both servers share
    the machine's 2 cores with the workers: a standby's replay takes CPU from them here, which a
    standby on its own machine would not.

Results go to ``benchmarks/results/failover-<part>.json``.  The ledger and the controller's schemas go
to ``--url`` (default ``$BENCH_PG_URL``, else ``postgresql://postgres@127.0.0.1:5432/test``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for path in (REPO, REPO / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from benchmarks import apps  # noqa: E402
from benchmarks import run as bench  # noqa: E402
from dramatiq_pg_fenced import PostgresBroker  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
PRESETS = {"default": {}, "durable_outcomes": {"durable_outcomes": True}}
STANDBYS = ("async", "sync")


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


# -- faults -----------------------------------------------------------------------------------------
def fault_configs(faults: list[str]) -> list[tuple[str, str, str | None]]:
    """(fault, preset, standby) of every configuration measured."""
    configs: list[tuple[str, str, str | None]] = []
    for fault in faults:
        for preset in PRESETS:
            for standby in (None,) if fault == "crash" else STANDBYS:
                configs.append((fault, preset, standby))
    return configs


@contextlib.contextmanager
def fault_env(url: str, servers: Any, durable_outcomes: bool, lease_seconds: float, logs: Path) -> Iterator[Any]:
    """What ``test_faults.fault_env`` gives a test: a schema with a ledger on *url* (not faulted), and a
    way to start ``dramatiq tests.apps.fault_app`` workers whose broker is on ``servers.url``."""
    from test_faults import Env, Ledger, Workers

    schema = f"fo_{uuid.uuid4().hex[:10]}"
    broker = PostgresBroker(url, schema=schema, lease_seconds=lease_seconds)
    broker.migrate()  # the schema the ledger lives in
    started: list[subprocess.Popen] = []

    def cli(broker: PostgresBroker, module: str, *args: str) -> subprocess.Popen:
        env = dict(
            os.environ,
            DRAMATIQ_PG_URL=url,
            DRAMATIQ_PG_SCHEMA=schema,
            FAULT_BROKER_URL=servers.url,
            FAULT_LEASE_SECONDS=str(lease_seconds),
            FAULT_DURABLE_OUTCOMES="1" if durable_outcomes else "0",
            PYTHONUNBUFFERED="1",
        )
        log_path = logs / f"{schema}-{len(started)}.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq", module, *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        proc.log_path = log_path  # type: ignore[attr-defined]
        started.append(proc)
        return proc

    env = Env(broker, Ledger(url, schema), Workers(cli, broker, threads=4))
    try:
        yield env
    finally:
        env.workers.stop_all()
        for proc in started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        env.ledger.conn.close()
        broker.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def one_fault(args: argparse.Namespace, fault: str, preset: str, standby: str | None, logs: Path) -> dict[str, Any]:
    import cluster

    servers = cluster.make_pair(standby)
    try:
        with fault_env(args.url, servers, preset == "durable_outcomes", args.lease_seconds, logs) as env:
            run = cluster.failover_run(servers, env, fault=fault, job_seconds=args.job_seconds)
    finally:
        if servers.standby is not None:
            servers.standby.close()
        servers.primary.close()
    logs_text = run.pop("logs")
    run["errors in worker logs"] = sum(1 for line in logs_text.splitlines() if " ERROR " in line or "CRITICAL" in line)
    return run


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure: the median and the range over *runs*."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs if r.get(key) is not None]
        if values and all(isinstance(v, (int, float)) for v in values):
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def faults(args: argparse.Namespace) -> dict[str, Any]:
    configs = fault_configs(args.faults.split(","))
    per: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="dramatiq-failover-") as tmp:
        for round_ in range(args.runs):
            for fault, preset, standby in configs:
                key = f"{fault} | {preset} | {standby or 'no standby'}"
                run = one_fault(args, fault, preset, standby, Path(tmp))
                per.setdefault(key, []).append(run)
                log(f"round {round_ + 1}/{args.runs} {key}: {run}")
    settings = {"job_seconds": args.job_seconds, "lease_seconds": args.lease_seconds, "rounds": args.runs}
    return {"settings": settings, "runs": per, "summary": {key: summary(runs) for key, runs in per.items()}}


def faults_table(out: dict[str, Any]) -> str:
    heads = ["fault | preset | standby", "runs", "returned", "gone", "lost", "ran twice", "dead", "recovery s"]
    heads.append("longest send s")
    keys = ["sends returned", "gone", "lost", "ran twice", "dead", "recovery (s)", "longest send (s)"]
    lines = [" | ".join(heads)]
    for config, runs in out["runs"].items():
        cells = [config, str(len(runs))]
        for key in keys:
            values = [r[key] for r in runs if r.get(key) is not None]
            if not values:
                cells.append("")
                continue
            med = statistics.median(values)
            cells.append(f"{med:g} ({min(values):g}-{max(values):g})" if len(values) > 1 else f"{med:g}")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


# -- cost -------------------------------------------------------------------------------------------
COST_STANDBYS = ("none", "async", "sync")


def configure(servers: Any, standby: str) -> None:
    """The pair as *standby* says: the standby stopped (``none``), streaming, or synchronous."""
    servers.primary.synchronous(standby == "sync")
    running = os.path.exists(os.path.join(servers.standby.datadir, "postmaster.pid"))
    if standby == "none":
        if running:
            servers.standby.stop("fast")
        bench.wait_until(lambda: servers.primary.replicas() == 0, 30)
        return
    if not running:
        servers.standby.start()
    if not bench.wait_until(lambda: servers.primary.replicas() == 1, 60, 0.1):
        raise RuntimeError("the standby does not stream from the primary")


def one_cost(servers: Any, preset: str, plan: bench.Plan, tmp: Path) -> dict[str, Any]:
    url = servers.primary.url
    os.environ["BENCH_PG_URL"] = url  # the controller's brokers (benchmarks/apps.py) and the workers'
    driver = bench.PostgresDriver(plan, tmp, url, PRESETS[preset])
    try:
        driver.fresh()
        single = bench.measure_single(driver, plan)
        driver.fresh()
        driver.bulk([driver.message() for _ in range(plan.backlog)])
        lat_path = tmp / "latency.txt"
        with bench.running_workers(driver, tmp / "workers.log", {"BENCH_LATENCY_FILE": str(lat_path)}) as workers:
            drain = bench.measure_drain(driver, workers, plan.backlog, timeout=max(120.0, plan.backlog / 200))
            latency = bench.measure_latency(driver, plan, lat_path)
    finally:
        driver.shutdown()
    return {
        "single_send_per_s": single,
        "drain_per_s": drain.rate,
        "worker_cpu_us_per_msg": drain.worker_cpu_us,
        "server_cpu_us_per_msg": drain.server_cpu_us,
        "latency_p50_ms": latency["p50_ms"],
        "latency_p99_ms": latency["p99_ms"],
        "send_call_p50_ms": latency["send_call_p50_ms"],
        "after_send_p50_ms": latency["after_send_p50_ms"],
    }


def cost(args: argparse.Namespace) -> dict[str, Any]:
    import cluster

    plan = bench.Plan("failover-cost", 1, args.backlog, 2_000, 2.0, 100, 20.0, 0, 0, 5_000, 0)
    bench.compile_sources()  # as benchmarks/run.py: the workers start from .pyc files
    configs = [(standby, preset) for standby in COST_STANDBYS for preset in PRESETS]
    per: dict[str, list[dict[str, Any]]] = {}
    ratios: dict[str, list[dict[str, float]]] = {}
    servers = cluster.make_pair("async", fsync="on")
    try:
        with tempfile.TemporaryDirectory(prefix="dramatiq-failover-cost-") as tmpdir:
            for round_ in range(args.runs):
                this_round: dict[str, dict[str, Any]] = {}
                for standby, preset in configs:
                    configure(servers, standby)
                    key = f"{preset} | {standby}"
                    figures = one_cost(servers, preset, plan, Path(tmpdir))
                    this_round[key] = figures
                    per.setdefault(key, []).append(figures)
                    log(
                        f"round {round_ + 1}/{args.runs} {key}: "
                        + ", ".join(f"{k} {v:.2f}" for k, v in figures.items())
                    )
                base = this_round["default | none"]
                for key, figures in this_round.items():
                    ratios.setdefault(key, []).append({k: v / base[k] for k, v in figures.items() if base[k]})
    finally:
        if servers.standby is not None:
            servers.standby.close()
        servers.primary.close()
    medians = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in per.items()}
    ratio_medians = {key: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for key, runs in ratios.items()}
    return {"plan": plan.__dict__, "runs": per, "medians": medians, "ratios_to_default_without_standby": ratio_medians}


def cost_table(out: dict[str, Any]) -> str:
    keys = ["drain_per_s", "single_send_per_s", "latency_p50_ms", "latency_p99_ms", "send_call_p50_ms"]
    lines = ["preset | standby | " + " | ".join(keys) + "   (median; x ratio to default without a standby)"]
    for key, figures in out["medians"].items():
        ratio = out["ratios_to_default_without_standby"][key]
        lines.append(key + " | " + " | ".join(f"{figures[k]:.1f} (x{ratio[k]:.2f})" for k in keys))
    return "\n".join(lines)


# -- the run ----------------------------------------------------------------------------------------
PARTS: dict[str, tuple[Callable[[argparse.Namespace], dict[str, Any]], Callable[[dict[str, Any]], str]]] = {
    "faults": (faults, faults_table),
    "cost": (cost, cost_table),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=sorted(PARTS))
    parser.add_argument("--runs", type=int, default=3, help="rounds; every configuration once per round")
    parser.add_argument("--faults", default=",".join(("kill", "read-only", "isolated", "crash")))
    parser.add_argument(
        "--job-seconds", type=float, default=0.01, help="faults: each job's time (0.1: a backlog grows)"
    )
    parser.add_argument(
        "--lease-seconds", type=float, default=10.0, help="faults: the workers' lease (longer than the outage)"
    )
    parser.add_argument("--backlog", type=int, default=10_000, help="cost: messages per drain")
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL") or apps.PG_URL)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    measure, table = PARTS[args.part]
    begun = time.monotonic()
    log(f"{args.part}: {args.runs} rounds, load average {os.getloadavg()}")
    out = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": bench.git_commit(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        **measure(args),
    }
    out["meta"]["loadavg_end"] = os.getloadavg()
    out["meta"]["seconds"] = round(time.monotonic() - begun, 1)
    path = args.out or RESULTS / f"failover-{args.part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2, default=str) + "\n")
    print()
    print(table(out))
    log(f"done in {out['meta']['seconds']:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
