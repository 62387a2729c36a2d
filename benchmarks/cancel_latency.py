"""From ``cancel()`` to the stop of a running actor (``interrupt_on_cancel``), in a real worker.

    python -m benchmarks.cancel_latency [--url URL] [--runs 200]

Starts ``dramatiq tests.apps.cancel_app`` (one process, two threads) on a
fresh schema, then, run after run: sends one message, waits until its actor
has written ``started``, waits a random time (0-50 ms; for the cases below
that wait in steps, up to one step), takes the wall clock and
calls ``broker.cancel()`` from this process; the actor writes the wall clock
at which ``MessageCancelled`` reached it (``time.time()``, one machine, one
clock).  Cases:

- ``spin``: a pure-Python loop (CPU-bound);
- ``nap 10 ms`` / ``nap 100 ms``: ``time.sleep`` in steps of that length (the
  exception lands when the current sleep returns);
- ``nap 1 s``: ``time.sleep(1)`` steps, to show a long C call is not cut short;
- ``interrupt.sleep(60)``: the sleep that a cancel ends at once;
- ``spin, listen=False``: a worker without LISTEN (PgBouncer mode), where the
  cancel watch reads the rows every ``poll_interval`` (1 s, the default).

Prints p50, p99 and the maximum per case (milliseconds), and the time the
``cancel()`` call itself took.  The schema is dropped at the end.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import dramatiq
import psycopg
from psycopg import sql

from dramatiq_pg_fenced import CancelOutcome, PostgresBroker

REPO = Path(__file__).resolve().parent.parent


class Worker:
    """``dramatiq tests.apps.cancel_app -p 1 -t 2`` on *schema*."""

    def __init__(self, url: str, schema: str, *, listen: bool, poll_interval: float) -> None:
        env = dict(
            os.environ,
            DRAMATIQ_PG_URL=url,
            DRAMATIQ_PG_SCHEMA=schema,
            DRAMATIQ_PG_LISTEN="1" if listen else "0",
            DRAMATIQ_PG_POLL_INTERVAL=str(poll_interval),
        )
        self.log = tempfile.NamedTemporaryFile(prefix="cancel-latency-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "tests.apps.cancel_app", "-p", "1", "-t", "2"],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self, *, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if keep_log:
            print(f"worker log: {self.log.name}")
        else:
            os.unlink(self.log.name)


def fresh_schema(url: str) -> tuple[PostgresBroker, str]:
    schema = f"cl_{uuid.uuid4().hex[:10]}"
    broker = PostgresBroker(url, schema=schema)
    broker.migrate()
    with broker.database.connection() as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.ledger (message_id uuid, event text, at float8)").format(sql.Identifier(schema))
        )
    broker.declare_queue("default")
    return broker, schema


def stamp(broker: PostgresBroker, message_id: str, event: str) -> float | None:
    with broker.database.connection() as conn:
        row = conn.execute(
            sql.SQL("SELECT at FROM {}.ledger WHERE message_id = %s AND event = %s").format(
                sql.Identifier(broker.schema)
            ),
            [message_id, event],
        ).fetchone()
    return None if row is None else float(row[0])


def wait_stamp(broker: PostgresBroker, message_id: str, event: str, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    while (at := stamp(broker, message_id, event)) is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {event!r} for {message_id} within {timeout} s")
        time.sleep(0.002)
    return at


def measure(
    broker: PostgresBroker, actor: str, args: tuple, runs: int, spread: float
) -> tuple[list[float], list[float]]:
    """(cancel-to-stop ms, cancel() call ms) for *runs* messages of *actor*, each cancelled a random
    0 to *spread* seconds after its start (so the cancel falls anywhere in a sleep step or a poll)."""
    stops, calls = [], []
    for _ in range(runs):
        message = dramatiq.Message(queue_name="default", actor_name=actor, args=args, kwargs={}, options={})
        broker.enqueue(message)
        wait_stamp(broker, message.message_id, "started", 60)
        time.sleep(random.uniform(0, spread))
        before = time.time()
        outcome = broker.cancel(message.message_id)
        calls.append((time.time() - before) * 1000)
        if outcome is not CancelOutcome.RUNNING:
            raise RuntimeError(f"cancel of {message.message_id}: {outcome}")
        stopped = wait_stamp(broker, message.message_id, "stopped", 30)
        stops.append((stopped - before) * 1000)
    return stops, calls


def percentile(values: list[float], p: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--runs", type=int, default=200, help="runs per case (the 1 s and listen=False cases: a tenth)")
    args = parser.parse_args()
    few = max(args.runs // 10, 5)
    cases = [  # (name, actor, its arguments, runs, cancelled within, LISTEN on)
        ("spin (CPU-bound)", "spin", (), args.runs, 0.05, True),
        ("nap, time.sleep(0.01) steps", "nap", (0.01,), args.runs, 0.05, True),
        ("nap, time.sleep(0.1) steps", "nap", (0.1,), args.runs, 0.1, True),
        ("nap, time.sleep(1) steps", "nap", (1.0,), few, 1.0, True),
        ("nap, interrupt.sleep(60)", "nap", (60.0, True), args.runs, 0.05, True),
        ("spin, listen=False (cancel watch, poll 1 s)", "spin", (), few, 1.0, False),
    ]
    print(f"load average at start: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    print(f"{'case':46} {'runs':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'cancel() p50':>13}")
    for listen in (True, False):
        broker, schema = fresh_schema(args.url)
        worker = Worker(args.url, schema, listen=listen, poll_interval=1.0)
        failed = True
        try:
            measure(broker, "spin", (), 3, 0.01)  # the worker is up and warm
            for name, actor, actor_args, runs, spread, case_listen in cases:
                if case_listen is not listen:
                    continue
                stops, calls = measure(broker, actor, actor_args, runs, spread)
                print(
                    f"{name:46} {runs:>5} {percentile(stops, 50):>9.1f} {percentile(stops, 99):>9.1f} "
                    f"{max(stops):>9.1f} {statistics.median(calls):>13.2f}",
                    flush=True,
                )
            failed = False
        finally:
            worker.stop(keep_log=failed)
            broker.close()
            with psycopg.connect(args.url, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
