"""Soak: three scheduler processes, a one-second schedule, signals, for minutes; ticks expected vs messages.

    python -m benchmarks.schedules_soak [--minutes 3] [--url postgresql://postgres@127.0.0.1:5432/test]

Three standalone schedulers (``dramatiq-pg-fenced scheduler tests.apps.schedule_app``)
run the app's ``beat`` schedule (every second) on a fresh schema; one
``dramatiq`` worker process (that runs no scheduler) consumes the messages,
and ``beat`` writes a ledger row per run.  Every ``--chaos`` seconds one
scheduler, picked at random, is either SIGKILLed (and started again 3 s
later) or paused with SIGSTOP for 2 to 10 s and let go with SIGCONT.

At the end the schedulers stop, the worker drains the queue, and the run is
counted from the messages themselves (their ``tick`` option, in the message
and history tables) against every second between the first tick and the
last: ticks expected, messages found, ticks with two or more messages,
ticks with none; the ledger counts the actor's runs the same way.  The
schema is dropped.  Exit status 1 if any tick had no message or more than one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import psycopg
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

REPO = Path(__file__).resolve().parent.parent
APP = "tests.apps.schedule_app"
DEFAULT_URL = os.environ.get("DRAMATIQ_PG_TEST_URL", "postgresql://postgres@127.0.0.1:5432/test")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--schedulers", type=int, default=3)
    parser.add_argument("--chaos", type=float, default=20.0, help="seconds between two signals")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    schema = f"soak_{uuid.uuid4().hex[:10]}"
    ident = sql.Identifier(schema)
    broker = PostgresBroker(args.url, schema=schema)
    broker.migrate()
    broker.close()
    conn = psycopg.connect(args.url, autocommit=True)
    conn.execute(sql.SQL("CREATE TABLE {}.ledger (tick timestamptz NOT NULL, pid int NOT NULL)").format(ident))
    env = dict(os.environ, DRAMATIQ_PG_URL=args.url, DRAMATIQ_PG_SCHEMA=schema, PYTHONUNBUFFERED="1")
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / schema
    logs.mkdir()

    def spawn(command: list[str], name: str, extra: dict[str, str] | None = None) -> subprocess.Popen:
        with open(logs / f"{name}.log", "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", *command],
                cwd=REPO,
                env={**env, **(extra or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def scheduler(i: int) -> subprocess.Popen:
        return spawn(["dramatiq_pg_fenced.cli.command", "scheduler", APP], f"scheduler-{i}")

    def now() -> datetime:
        return conn.execute("SELECT clock_timestamp()").fetchone()[0]  # type: ignore[index]

    worker = spawn(["dramatiq", APP, "--processes", "1", "--threads", "2"], "worker", {"SCHEDULE_IN_WORKERS": "0"})
    procs = [scheduler(i) for i in range(args.schedulers)]
    events: list[str] = []
    started = now()
    print(f"schema {schema}: {args.schedulers} schedulers, 1 worker, {args.minutes:g} min (logs in {logs})")
    deadline = time.monotonic() + args.minutes * 60
    try:
        while time.monotonic() < deadline:
            time.sleep(min(args.chaos, max(deadline - time.monotonic(), 0)))
            if time.monotonic() >= deadline - 12:
                break
            i = rng.randrange(len(procs))
            if rng.random() < 0.5:
                os.kill(procs[i].pid, signal.SIGKILL)
                procs[i].wait()
                events.append(f"{now():%H:%M:%S} SIGKILL scheduler {i}, started again 3 s later")
                time.sleep(3)
                procs[i] = scheduler(i)
            else:
                pause = rng.uniform(2, 10)
                os.kill(procs[i].pid, signal.SIGSTOP)
                events.append(f"{now():%H:%M:%S} SIGSTOP scheduler {i} for {pause:.1f} s")
                time.sleep(pause)
                os.kill(procs[i].pid, signal.SIGCONT)
            print(events[-1], flush=True)
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        stopped = now()
        table = sql.SQL("SELECT count(*) FROM {}.message WHERE state IN ('queued', 'running')").format(ident)
        drain_deadline = time.monotonic() + 120
        while conn.execute(table).fetchone()[0] and time.monotonic() < drain_deadline:  # type: ignore[index]
            time.sleep(0.5)
        worker.terminate()
        worker.wait(timeout=60)
        return report(conn, ident, started, stopped, events)
    finally:
        for proc in [*procs, worker]:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                os.killpg(proc.pid, signal.SIGKILL)
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
        conn.close()


def report(
    conn: psycopg.Connection, ident: sql.Identifier, started: datetime, stopped: datetime, events: list[str]
) -> int:
    rows = conn.execute(
        sql.SQL(
            "SELECT payload FROM {s}.message WHERE actor_name = 'beat'"
            " UNION ALL SELECT payload FROM {s}.history WHERE actor_name = 'beat'"
        ).format(s=ident)
    ).fetchall()
    messages = Counter(datetime.fromisoformat(json.loads(bytes(r[0]))["options"]["tick"]) for r in rows)
    runs = Counter(r[0] for r in conn.execute(sql.SQL("SELECT tick FROM {}.ledger").format(ident)).fetchall())
    recorded = conn.execute(sql.SQL("SELECT count(*) FROM {}.schedule_tick").format(ident)).fetchone()[0]  # type: ignore[index]
    first, last = min(messages), max(messages)
    expected = int((last - first) / timedelta(seconds=1)) + 1
    window = [first + timedelta(seconds=i) for i in range(expected)]
    twice = sorted(t for t, n in messages.items() if n > 1)
    missing = [t for t in window if t not in messages]
    outside = [t for t in messages if not first <= t <= last]
    ran_twice = sorted(t for t, n in runs.items() if n > 1)
    not_run = [t for t in window if t not in runs]
    print()
    print(f"run:                    {started:%H:%M:%S} to {stopped:%H:%M:%S} UTC (database clock)")
    print(
        f"signals:                {len(events)} ({sum('SIGKILL' in e for e in events)} SIGKILL, "
        f"{sum('SIGSTOP' in e for e in events)} SIGSTOP)"
    )
    print(f"tick window:            {first:%H:%M:%S} to {last:%H:%M:%S}")
    print(f"ticks expected:         {expected}")
    print(f"messages found:         {sum(messages.values())} (for {len(messages)} distinct ticks)")
    print(f"tick records:           {recorded}")
    print(f"ticks with 2+ messages: {len(twice)} {[f'{t:%H:%M:%S}' for t in twice[:10]]}")
    print(f"ticks with no message:  {len(missing)} {[f'{t:%H:%M:%S}' for t in missing[:10]]}")
    print(f"actor runs:             {sum(runs.values())} ({len(ran_twice)} ticks run twice, {len(not_run)} not run)")
    ok = not twice and not missing and not outside and sum(messages.values()) == expected == recorded
    print("RESULT:                 " + ("exactly one message per tick" if ok else "MISMATCH"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
