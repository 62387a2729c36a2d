"""What worker processes cost the server: idle transactions, connections, transactions per message.

    python -m benchmarks.idle_load [--processes 1,8,32] [--queues 10] [--window 30] [--rate 20]

Runs the stock ``dramatiq`` CLI (``--processes N --threads 1``) over
``--queues`` queues, in a database of its own (``BENCH_PG_URL``'s server,
database ``BENCH_IDLE_DB``, made if missing: ``pg_stat_database`` counts a
whole database, so nothing else may use it).  For each process count:

- **idle**: after the workers are ready and ``--settle`` seconds, the
  server's transactions per second (``xact_commit + xact_rollback``) over
  ``--window`` seconds, and the connections per worker process
  (``pg_stat_activity``, by ``application_name``);
- **wake** (only for the process counts in ``--wake``): ``--rate`` messages a
  second sent to one queue for ``--window`` seconds, one ``send()`` each from
  this process; the server's transactions per delivered message, sends
  included.

The statistics collector publishes a backend's counts up to a second or so
late (10 s for an idle one), so each window starts and ends in the same
steady state; the figures are rates over the window.

On a shared server the raw figure carries noise: every idle backend commits
an empty transaction when DDL in *other* databases fills the shared
invalidation queue (a catch-up interrupt), so the more connections, the more
of it.  The benchmark measures that noise in the same window on ``--control``
connections to a database of their own (each runs one empty statement a
second, as a worker's connections do; those statements are taken off) and
reports, beside the raw rate, the rate less the noise of as many backends as
the workers held (``*_less_noise``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

REPO = Path(__file__).resolve().parent.parent
APP = "bench-idle"


def url_for(database: str, application_name: str = "bench-idle-controller") -> str:
    base = os.environ.get("BENCH_PG_URL") or "postgresql://postgres@127.0.0.1:5432/postgres"
    info = conninfo_to_dict(base)
    info.update(dbname=database, application_name=application_name)
    return make_conninfo(**info)  # type: ignore[arg-type]


def declare(broker: dramatiq.Broker, queues: int) -> list[dramatiq.Actor]:
    def noop(n: int) -> None:
        """Nothing: the figures are the broker's."""

    return [
        dramatiq.actor(noop, broker=broker, actor_name=f"noop_{i}", queue_name=f"q{i}", max_retries=0)  # type: ignore[call-overload]
        for i in range(queues)
    ]


if os.environ.get("BENCH_IDLE_SCHEMA"):  # imported by a worker process
    from dramatiq_pg_fenced import PostgresBroker

    broker = PostgresBroker(
        url_for(os.environ["BENCH_IDLE_DB"], f"{APP}-{os.getpid()}"), schema=os.environ["BENCH_IDLE_SCHEMA"]
    )
    dramatiq.set_broker(broker)
    actors = declare(broker, int(os.environ["BENCH_IDLE_QUEUES"]))


class Control:
    """Idle-like connections to a database of their own: the per-backend noise of the same window."""

    def __init__(self, database: str, connections: int) -> None:
        self.database = database
        self.conns = [psycopg.connect(url_for(database, "bench-control"), autocommit=True) for _ in range(connections)]
        self.statements = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for conn in self.conns:
                conn.execute(b"")
                self.statements += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self.conns:
            conn.close()


class Stats:
    """Reads of ``pg_stat_database`` and ``pg_stat_activity`` from the ``postgres`` database (not counted)."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.conn = psycopg.connect(url_for("postgres"), autocommit=True)

    def xacts(self, database: str | None = None) -> int:
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self.conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s", [database or self.database]
        ).fetchone()
        return int(row[0]) if row else 0

    def noise(self, control: Control, seconds: float) -> tuple[float, Callable[[], float]]:
        """Start measuring the control's noise: returns a function giving it, per backend per second."""
        before, statements = self.xacts(control.database), control.statements

        def per_backend() -> float:
            after = self.xacts(control.database)
            return max(after - before - (control.statements - statements), 0) / len(control.conns) / seconds

        return before, per_backend

    def worker_backends(self) -> list[int]:
        rows = self.conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s",
            [self.database, f"{APP}-%"],
        ).fetchall()
        return [int(pid) for (pid,) in rows]

    def server_processes(self) -> list[int]:
        """Every process of the server (the postmaster, its backends and background processes), from
        ``/proc``: the children of this session's backend's parent."""
        postmaster = _parent(int(self.conn.execute("SELECT pg_backend_pid()").fetchone()[0]))  # type: ignore[index]
        return [postmaster] + [pid for pid in _pids() if _parent(pid) == postmaster]

    def connections(self) -> dict[str, int]:
        rows = self.conn.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = %s AND application_name LIKE %s"
            " GROUP BY 1",
            [self.database, f"{APP}-%"],
        ).fetchall()
        return {name: n for name, n in rows}


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
    return 0


def cpu_ns(pids: list[int]) -> dict[int, int]:
    """CPU time of each of *pids* so far, nanoseconds (``/proc/<pid>/schedstat``: an idle backend uses
    less than one clock tick of ``/proc/<pid>/stat`` in a window)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/schedstat") as f:
            out[pid] = int(f.read().split()[0])
    return out


def cpu_seconds_between(before: dict[int, int], after: dict[int, int]) -> float:
    """CPU seconds used between two :func:`cpu_ns` readings by the processes there at both (a backend that
    started in between counts from its start; one that ended in between does not count)."""
    return sum(after[pid] - before.get(pid, 0) for pid in after) / 1e9


def workers(processes: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "benchmarks.idle_load", "-p", str(processes), "-t", "1"]
            + ["--path", str(REPO)],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def run_one(args: argparse.Namespace, processes: int, database: str, control: Control) -> dict[str, Any]:
    from dramatiq_pg_fenced import PostgresBroker

    schema = f"idle_{uuid.uuid4().hex[:8]}"
    sender = PostgresBroker(url_for(database, "bench-sender"), schema=schema)
    sender.migrate()
    actors = declare(sender, args.queues)
    stats = Stats(database)
    log = Path(f"/tmp/idle_load_{processes}.log")
    env = {"BENCH_IDLE_SCHEMA": schema, "BENCH_IDLE_DB": database, "BENCH_IDLE_QUEUES": str(args.queues)}
    proc = workers(processes, env, log)
    out: dict[str, Any] = {"processes": processes, "queues": args.queues}
    try:
        deadline = time.monotonic() + 60 + 3 * processes
        while log.read_text(errors="replace").count("ready for action") < processes:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"workers not ready; see {log}")
            time.sleep(0.2)
        time.sleep(args.settle)
        conns = stats.connections()
        backends = sum(conns.values())
        _, noise = stats.noise(control, args.window)
        mine, server = stats.worker_backends(), stats.server_processes()
        mine_before, server_before = cpu_ns(mine), cpu_ns(server)
        before, t0 = stats.xacts(), time.monotonic()
        time.sleep(args.window)
        after, t1 = stats.xacts(), time.monotonic()
        cpu_mine = cpu_seconds_between(mine_before, cpu_ns(stats.worker_backends()))
        cpu_server = cpu_seconds_between(server_before, cpu_ns(stats.server_processes()))
        # Server CPU (/proc, ms per second of wall clock): the worker processes' own backends, and the whole
        # server (background processes, the control connections and this benchmark's reads included).
        out["server_cpu_ms_per_s_worker_backends"] = round(cpu_mine / (t1 - t0) * 1000, 2)
        out["server_cpu_ms_per_s_whole_server"] = round(cpu_server / (t1 - t0) * 1000, 2)
        out["server_cpu_ms_per_s_per_idle_process"] = round(cpu_mine / (t1 - t0) * 1000 / processes, 3)
        per_backend = noise()
        out["noise_per_backend_per_s"] = round(per_backend, 3)
        out["idle_xacts_per_s"] = round((after - before) / (t1 - t0), 2)
        out["idle_xacts_per_s_less_noise"] = round((after - before) / (t1 - t0) - per_backend * backends, 2)
        conns = stats.connections()  # after the window: a pool closes what it left unused for 20 s
        out["connections_per_process_max"] = max(conns.values(), default=0)
        out["connections_per_process_mean"] = round(sum(conns.values()) / max(len(conns), 1), 2)
        out["processes_connected"] = len(conns)
        if processes in args.wake:
            with psycopg.connect(url_for(database), autocommit=True) as conn:
                done_before = conn.execute(f'SELECT count(*) FROM "{schema}".history').fetchone()[0]  # type: ignore[index]
            _, noise = stats.noise(control, args.window)
            server_before = cpu_ns(stats.server_processes())
            before, t0 = stats.xacts(), time.monotonic()
            sent = 0
            while (now := time.monotonic()) < t0 + args.window:
                due = t0 + sent / args.rate
                if now < due:
                    time.sleep(due - now)
                actors[0].send(sent)
                sent += 1
            drained = time.monotonic() + 10
            with psycopg.connect(url_for(database), autocommit=True) as conn:
                while time.monotonic() < drained:
                    left = conn.execute(f'SELECT count(*) FROM "{schema}".message').fetchone()[0]  # type: ignore[index]
                    if not left:
                        break
                    time.sleep(0.2)
                time.sleep(1.5)
                after, t1 = stats.xacts(), time.monotonic()
                cpu_server = cpu_seconds_between(server_before, cpu_ns(stats.server_processes()))
                done = conn.execute(f'SELECT count(*) FROM "{schema}".history').fetchone()[0] - done_before  # type: ignore[index]
            idle = out["idle_xacts_per_s"] * (t1 - t0)
            less = noise() * (t1 - t0) * sum(stats.connections().values())
            # The idle rate measured above runs on beneath the messages; reported apart, not subtracted.
            out["wake_sent"] = sent
            out["wake_delivered"] = done
            out["wake_xacts_per_message"] = round((after - before) / max(done, 1), 2)
            out["wake_xacts_per_message_above_idle"] = round((after - before - idle) / max(done, 1), 2)
            out["wake_xacts_per_message_less_noise"] = round((after - before - less) / max(done, 1), 2)
            # The whole server's CPU over the window per delivered message, the idle load beneath included
            # (a backend that started in the window counts from its start).
            out["wake_server_cpu_us_per_message"] = round(cpu_server / max(done, 1) * 1e6, 1)
    finally:
        stop(proc)
        sender.close()
        with psycopg.connect(url_for(database), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,8,32")
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--settle", type=float, default=25.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--wake", default="8", help="process counts that also run the wake measurement")
    parser.add_argument("--control", type=int, default=8, help="connections that measure the noise")
    parser.add_argument(
        "--own-server",
        action="store_true",
        help="run on a PostgreSQL server of the benchmark's own (initdb, max_connections 400), stopped at the end:"
        " 32 processes need more connections than a shared server may spare, and no other database's DDL"
        " adds noise there",
    )
    args = parser.parse_args(argv)
    args.wake = {int(p) for p in args.wake.split(",") if p}
    database = os.environ.get("BENCH_IDLE_DB", "bench_idle")
    server = None
    if args.own_server:
        tests = str(REPO / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from test_faults import OwnedServer

        server = OwnedServer(max_connections="400")
        os.environ["BENCH_PG_URL"] = server.url  # the worker processes inherit it
    try:
        return measure(args, database)
    finally:
        if server is not None:
            server.close()


def measure(args: argparse.Namespace, database: str) -> int:
    with psycopg.connect(url_for("postgres"), autocommit=True) as conn:
        for name in (database, f"{database}_control"):
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone():
                conn.execute(f'CREATE DATABASE "{name}"')
    control = Control(f"{database}_control", args.control)
    try:
        for processes in (int(p) for p in args.processes.split(",")):
            print(json.dumps(run_one(args, processes, database, control)), flush=True)
    finally:
        control.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
