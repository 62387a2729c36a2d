"""Stress figures: drain throughput under a pinned xmin, and right after repeated SIGKILLs.

    python -m benchmarks.stress [--n 30000] [--pin-seconds 60] [--kills 3]

Three drains of the same backlog (``--n`` messages, no-op actor) by real
``dramatiq`` workers (2 processes x 8 threads), on one machine, in one run:

- **undisturbed**: the baseline rate;
- **pinned xmin**: another session holds a ``REPEATABLE READ`` transaction
  (with its snapshot taken) open from before the drain until it ends, or for
  ``--pin-seconds`` at most, so vacuum may remove nothing newer;
- **after SIGKILLs**: the whole worker process group is SIGKILLed ``--kills``
  times, a second apart, and started again each time.  The rate reported is
  that of the first ``--window`` seconds after the last restart (from the first
  message it consumes).  The messages the killed processes held (prefetched or
  running) come back only when their lease expires (``lease_seconds``, 30 s by
  default): the time until the last one is reported too.

Each figure is printed as a share of the undisturbed rate (the machine is
shared: compare the ratios of one run).  Results go to
``benchmarks/results/stress.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from dramatiq.message import Message

from benchmarks import apps
from benchmarks.run import RESULTS, Plan, PostgresDriver, Workers, log, wait_until

PLAN = Plan("stress", 1, 0, 0, 0.0, 0, 0.0, 0, 0, 5_000, 1)


def backlog(driver: PostgresDriver, n: int) -> None:
    driver.fresh()
    messages = [Message(queue_name=apps.QUEUE, actor_name="noop", args=(), kwargs={}, options={}) for _ in range(n)]
    driver.bulk(messages)


def remaining(driver: PostgresDriver) -> int:
    return int(
        driver._one(f'SELECT count(*) FROM "{driver.schema}".message WHERE state IN (%s, %s)', ["queued", "running"])
    )


def drain(driver: PostgresDriver, workers: Workers, n: int, timeout: float = 600) -> float:
    """Rate from the first message consumed to an empty queue (messages/s)."""
    if not wait_until(lambda: remaining(driver) < n, timeout=60, interval=0.01):
        raise RuntimeError(f"workers did not start; see {workers.log_path}")
    start = time.monotonic()
    left = remaining(driver)
    if not wait_until(driver.empty, timeout=timeout, interval=0.02):
        raise RuntimeError("the drain did not finish")
    return left / (time.monotonic() - start)


def undisturbed(driver: PostgresDriver, n: int, tmp: Path) -> float:
    backlog(driver, n)
    workers = Workers(driver.worker_env(), tmp / "undisturbed.log")
    try:
        return drain(driver, workers, n)
    finally:
        workers.stop()


def pinned(driver: PostgresDriver, n: int, tmp: Path, seconds: float) -> dict[str, Any]:
    backlog(driver, n)
    pin = psycopg.connect(driver.url)  # not autocommit: the transaction stays open
    pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    pin.execute("SELECT count(*) FROM pg_class").fetchone()  # takes the snapshot: xmin is now pinned
    release = threading.Timer(seconds, pin.rollback)
    release.start()
    workers = Workers(driver.worker_env(), tmp / "pinned.log")
    try:
        start = time.monotonic()
        rate = drain(driver, workers, n)
        return {"rate": rate, "pinned_throughout": time.monotonic() - start < seconds}
    finally:
        release.cancel()
        pin.close()
        workers.stop()


def after_kills(driver: PostgresDriver, n: int, tmp: Path, kills: int, window: float) -> dict[str, Any]:
    backlog(driver, n)
    for k in range(kills):
        workers = Workers(driver.worker_env(), tmp / f"kill-{k}.log")
        wait_until(lambda: remaining(driver) < n, timeout=60, interval=0.01)
        time.sleep(1.0)
        os.killpg(workers.proc.pid, signal.SIGKILL)
        workers.proc.wait(10)
        workers.log_file.close()
    left = remaining(driver)
    workers = Workers(driver.worker_env(), tmp / "after.log")
    try:
        if not wait_until(lambda: remaining(driver) < left, timeout=60, interval=0.01):
            raise RuntimeError("workers did not start after the kills")
        start, first = time.monotonic(), remaining(driver)
        time.sleep(window)
        done = first - remaining(driver)
        wait_until(driver.empty, timeout=600, interval=0.05)
        return {
            "rate": done / window,
            "window_seconds": window,
            "left_after_kills": left,
            "seconds_to_last": time.monotonic() - start,
        }
    finally:
        workers.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30_000)
    parser.add_argument("--pin-seconds", type=float, default=60.0)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--kills-n", type=int, default=60_000, help="backlog of the SIGKILL run (it must outlast it)")
    parser.add_argument("--window", type=float, default=3.0, help="seconds measured after the last restart")
    args = parser.parse_args(argv)
    url = os.environ.get("BENCH_PG_URL") or apps.PG_URL
    out: dict[str, Any] = {"n": args.n, "load_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        driver = PostgresDriver(PLAN, tmp, url)
        try:
            out["undisturbed"] = undisturbed(driver, args.n, tmp)
            log(f"undisturbed: {out['undisturbed']:,.0f} msg/s")
            out["pinned"] = pinned(driver, args.n, tmp, args.pin_seconds)
            log(f"pinned xmin: {out['pinned']['rate']:,.0f} msg/s")
            out["after_kills"] = after_kills(driver, args.kills_n, tmp, args.kills, args.window)
            log(f"after {args.kills} SIGKILLs: {out['after_kills']['rate']:,.0f} msg/s")
        finally:
            driver.close()
            driver.drop()
    out["load_end"] = os.getloadavg()
    base = out["undisturbed"]
    print(f"{'drain of ' + format(args.n, ','):<34} {'msg/s':>8} {'share':>7}")
    print(f"{'undisturbed':<34} {base:>8,.0f} {1:>7.2f}")
    print(
        f"{'pinned xmin (REPEATABLE READ open)':<34} {out['pinned']['rate']:>8,.0f} {out['pinned']['rate'] / base:>7.2f}"
    )
    kills = f"{args.window:g} s after {args.kills} SIGKILLs"
    print(f"{kills:<34} {out['after_kills']['rate']:>8,.0f} {out['after_kills']['rate'] / base:>7.2f}")
    print(
        f"  the last message of the {out['after_kills']['left_after_kills']:,} left: "
        f"{out['after_kills']['seconds_to_last']:.1f} s after the restart (held ones wait for their lease)"
    )
    print(f"load average {out['load_start'][0]:.1f} -> {out['load_end'][0]:.1f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stress.json").write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
