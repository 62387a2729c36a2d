"""What worker processes cost the server: idle transactions, connections, transactions per message.

    python -m benchmarks.idle_load [--processes 1,8,32] [--queues 10] [--window 30] [--rate 20]
                                   [--own-server] [--server-log [PATH]]

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

``pg_stat_database`` counts every transaction of the database, the server's own
among them: an idle backend that fell behind the shared invalidation queue, which
DDL anywhere on the server fills (another database's included: a test suite making
schemas beside), reads it in a transaction of its own (a catch-up), and so the more
idle backends, the more of them.  On a shared server ``idle_xacts_per_s`` carries
them (8 processes beside the test suite: 46.2 a second, of which 14.4 the workers'
own; docs/performance.md, "What each idle transaction is for").  So either run it
on a server of its own (``--own-server``: no other database's DDL), or count from
the server's log (``--server-log PATH``, or ``--server-log`` alone with
``--own-server``): the database then logs every statement and every transaction's
start and end (``log_statement``, ``log_min_messages = debug5``: superuser; reset
afterwards), and ``idle_log_*`` give the worker processes' backends' transactions
by kind over the same window, the server's catch-ups apart (:mod:`.server_log`).
Logging every transaction costs the server: read the CPU figures of a run without it.

(An earlier version took the noise off with control connections that each ran an empty
statement a second: the transactions of a backend that runs only empty statements, its
catch-ups included, reach ``pg_stat_database`` only when it exits, so those controls always
measured 0.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from . import server_log

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

    def clock(self) -> str:
        """The server's clock as its log stamps lines (``log_timezone``, milliseconds): where a window starts
        and ends in the log."""
        row = self.conn.execute(
            "SELECT to_char(clock_timestamp() AT TIME ZONE current_setting('log_timezone'), 'YYYY-MM-DD HH24:MI:SS.MS')"
        )
        return str(row.fetchone()[0])  # type: ignore[index]

    def backends(self) -> dict[int, str]:
        """The database's backends now: pid -> application name."""
        rows = self.conn.execute(
            "SELECT pid, application_name FROM pg_stat_activity WHERE datname = %s", [self.database]
        ).fetchall()
        return {int(pid): str(name) for pid, name in rows}

    def log_everything(self, on: bool) -> None:
        """Make the database's new sessions log every statement and every transaction's start and end (or
        no longer): what :mod:`.server_log` reads.  Needs a superuser."""
        ident = sql.Identifier(self.database)
        for name, value in (("log_statement", "all"), ("log_min_messages", "debug5")):
            if on:
                self.conn.execute(
                    sql.SQL("ALTER DATABASE {} SET {} = {}").format(ident, sql.Identifier(name), sql.Literal(value))
                )
            else:
                self.conn.execute(sql.SQL("ALTER DATABASE {} RESET {}").format(ident, sql.Identifier(name)))

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


def run_one(args: argparse.Namespace, processes: int, database: str) -> dict[str, Any]:
    from dramatiq_pg_fenced import PostgresBroker

    schema = f"idle_{uuid.uuid4().hex[:8]}"
    sender = PostgresBroker(url_for(database, "bench-sender"), schema=schema)
    sender.migrate()
    actors = declare(sender, args.queues)
    stats = Stats(database)
    if args.server_log:
        stats.log_everything(True)  # before the workers connect: a session takes the settings as it starts
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
        log_from = os.path.getsize(args.server_log) if args.server_log else 0
        time.sleep(args.settle)
        mine, server = stats.worker_backends(), stats.server_processes()
        mine_before, server_before = cpu_ns(mine), cpu_ns(server)
        before, t0, clock0 = stats.xacts(), time.monotonic(), stats.clock()
        seen = stats.backends() if args.server_log else {}
        while (left := t0 + args.window - time.monotonic()) > 0:
            time.sleep(min(left, 0.5) if args.server_log else left)
            seen.update(stats.backends() if args.server_log else {})  # every backend of the window, by pid
        after, t1, clock1 = stats.xacts(), time.monotonic(), stats.clock()
        out["idle_window"] = [clock0, clock1]  # the server's clock, in its log's zone
        cpu_mine = cpu_seconds_between(mine_before, cpu_ns(stats.worker_backends()))
        cpu_server = cpu_seconds_between(server_before, cpu_ns(stats.server_processes()))
        # Server CPU (/proc, ms per second of wall clock): the worker processes' own backends, and the whole
        # server (background processes and this benchmark's reads included).
        out["server_cpu_ms_per_s_worker_backends"] = round(cpu_mine / (t1 - t0) * 1000, 2)
        out["server_cpu_ms_per_s_whole_server"] = round(cpu_server / (t1 - t0) * 1000, 2)
        out["server_cpu_ms_per_s_per_idle_process"] = round(cpu_mine / (t1 - t0) * 1000 / processes, 3)
        out["idle_xacts_per_s"] = round((after - before) / (t1 - t0), 2)
        if args.server_log:
            out.update(log_figures(args.server_log, log_from, seen, (clock0, clock1), t1 - t0))
        conns = stats.connections()  # after the window: a pool closes what it left unused for 20 s
        out["connections_per_process_max"] = max(conns.values(), default=0)
        out["connections_per_process_mean"] = round(sum(conns.values()) / max(len(conns), 1), 2)
        out["processes_connected"] = len(conns)
        if processes in args.wake:
            with psycopg.connect(url_for(database), autocommit=True) as conn:
                done_before = conn.execute(f'SELECT count(*) FROM "{schema}".history').fetchone()[0]  # type: ignore[index]
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
            # The idle rate measured above runs on beneath the messages; reported apart, not subtracted.
            out["wake_sent"] = sent
            out["wake_delivered"] = done
            out["wake_xacts_per_message"] = round((after - before) / max(done, 1), 2)
            out["wake_xacts_per_message_above_idle"] = round((after - before - idle) / max(done, 1), 2)
            # The whole server's CPU over the window per delivered message, the idle load beneath included
            # (a backend that started in the window counts from its start).
            out["wake_server_cpu_us_per_message"] = round(cpu_server / max(done, 1) * 1e6, 1)
    finally:
        stop(proc)
        sender.close()
        if args.server_log:
            stats.log_everything(False)
        with psycopg.connect(url_for(database), autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    return out


def log_figures(
    path: str, offset: int, backends: dict[int, str], window: tuple[str, str], seconds: float
) -> dict[str, Any]:
    """The idle window's transactions from the server's log (:mod:`.server_log`), per second: the worker
    processes' backends' by kind, the server's catch-ups in them apart, each worker process's, and the
    other backends' of the database (the benchmark's sender, autovacuum), in all and by name."""
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    by_process: dict[str, list[int]] = {}
    for pid, name in backends.items():
        by_process.setdefault(name, []).append(pid)
    workers = [pid for name, pids in by_process.items() if name.startswith(f"{APP}-") for pid in pids]
    others = [pid for pid in backends if pid not in workers]
    ours = server_log.count(lines, workers, *window)
    catch_ups = ours.pop(server_log.CATCH_UP, 0)
    each = [
        sum(n for kind, n in server_log.count(lines, pids, *window).items() if kind != server_log.CATCH_UP)
        for name, pids in by_process.items()
        if name.startswith(f"{APP}-")
    ]
    return {
        "idle_log_xacts_per_s": round(sum(ours.values()) / seconds, 2),
        "idle_log_catchup_xacts_per_s": round(catch_ups / seconds, 2),
        "idle_log_xacts_per_s_by_kind": {kind: round(n / seconds, 2) for kind, n in ours.most_common()},
        "idle_log_xacts_per_s_per_process_min_max": [
            round(min(each, default=0) / seconds, 2),
            round(max(each, default=0) / seconds, 2),
        ],
        "idle_log_other_backends_xacts_per_s": round(
            sum(server_log.count(lines, others, *window).values()) / seconds, 2
        ),
        # Who they were: the sender's pool (bench-sender), autovacuum, ...: name -> transactions per second.
        "idle_log_other_backends_by_name": {
            name: round(sum(server_log.count(lines, pids, *window).values()) / seconds, 2)
            for name, pids in by_process.items()
            if not name.startswith(f"{APP}-")
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="1,8,32")
    parser.add_argument("--queues", type=int, default=10)
    parser.add_argument("--settle", type=float, default=25.0)
    parser.add_argument("--window", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=20.0)
    parser.add_argument("--wake", default="8", help="process counts that also run the wake measurement")
    parser.add_argument(
        "--own-server",
        action="store_true",
        help="run on a PostgreSQL server of the benchmark's own (initdb, max_connections 400), stopped at the end:"
        " 32 processes need more connections than a shared server may spare, and no other database's DDL"
        " makes catch-up transactions there",
    )
    parser.add_argument(
        "--server-log",
        nargs="?",
        const=OWN_LOG,
        metavar="PATH",
        help="also count the idle window's transactions by kind from the server's log, at PATH (alone, with"
        " --own-server: that server's); the database logs every statement and transaction meanwhile (superuser)",
    )
    args = parser.parse_args(argv)
    args.wake = {int(p) for p in args.wake.split(",") if p}
    database = os.environ.get("BENCH_IDLE_DB", "bench_idle")
    if args.server_log == OWN_LOG and not args.own_server:
        parser.error("--server-log without a PATH needs --own-server")
    server = None
    if args.own_server:
        tests = str(REPO / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from test_faults import OwnedServer

        server = OwnedServer(max_connections="400")
        os.environ["BENCH_PG_URL"] = server.url  # the worker processes inherit it
        if args.server_log == OWN_LOG:
            args.server_log = os.path.join(server.datadir, "log")
    try:
        return measure(args, database)
    finally:
        if server is not None:
            server.close()


#: ``--server-log`` given without a path: the log of the benchmark's own server.
OWN_LOG = "own"


def measure(args: argparse.Namespace, database: str) -> int:
    with psycopg.connect(url_for("postgres"), autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [database]).fetchone():
            conn.execute(f'CREATE DATABASE "{database}"')
    for processes in (int(p) for p in args.processes.split(",")):
        print(json.dumps(run_one(args, processes, database)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
