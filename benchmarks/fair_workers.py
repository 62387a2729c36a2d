"""Fair shares with stock ``dramatiq`` workers: issue 44's figures, from the send to the actor's start.

    python -m benchmarks.fair_workers [--flood 20000] [--keys 10000] [--window 10] [--url URL]

Not a test: figures to read (compare within the run; the machine is shared).  Every part starts the
stock CLI (``dramatiq benchmarks.fair_workers -p 2 -t 8``) on a schema of its own, the same actor
on a fair queue (``fairness_key``) and on a plain one (no key), and each run of the actor appends
``queue key sent started`` to a file (one ``O_APPEND`` write: the same cheap store for both).

1. flood: key A enqueues ``--flood`` messages at once, then keys B..E send 20 a second each while
   the workers drain; the p99 wait of B..E (send to start), on the fair queue, on the plain one,
   and on an idle fair queue (B..E alone).  Goal: fair within 2x of idle.  The drain's rate (every
   message, first start to last) fair against plain: goal at least 95%.
2. weights 3:1: keys ``w3`` (weight 3) and ``w1`` enqueue more than the window can drain, the actor
   works ``--work-ms`` each; the shares started in each ``--window`` seconds.  Goal: 3:1 within 10%.
3. many keys: ``--keys`` keys with 3 messages each, drained, fair against the same messages on the
   plain queue: the drain rate and the server's CPU per message.  Goal: the claim's cost within
   1.3x (the whole drain is what is timed here: claims, acks, the actor).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent
FAIR, PLAIN = "fair", "plain"
LATE_KEYS = ("B", "C", "D", "E")

_fd: int | None = None


def _record(queue: str, key: str, sent: float) -> None:
    started = time.time()
    global _fd
    if _fd is None:
        _fd = os.open(os.environ["BENCH_FAIR_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, f"{queue} {key} {sent!r} {started!r}\n".encode())
    work = float(os.environ.get("BENCH_FAIR_WORK_MS", "0"))
    if work:
        time.sleep(work / 1000)


def declare(broker: Any) -> tuple[dramatiq.Actor, dramatiq.Actor]:
    """The same actor on a fair queue and on a plain one (the controller and the workers share this)."""

    def fair_job(key: str, sent: float) -> None:
        _record(FAIR, key, sent)

    def plain_job(key: str, sent: float) -> None:
        _record(PLAIN, key, sent)

    fair = dramatiq.actor(
        fair_job,
        broker=broker,
        queue_name=FAIR,
        max_retries=0,
        fairness_key=lambda key, sent: key,
        fairness_weight=lambda key: 3.0 if key == "w3" else None,
    )
    plain = dramatiq.actor(plain_job, broker=broker, queue_name=PLAIN, max_retries=0)
    return fair, plain


if os.environ.get("BENCH_FAIR_SCHEMA"):  # imported by a worker process
    from dramatiq_pg_fenced import PostgresBroker

    broker = PostgresBroker(os.environ["BENCH_FAIR_URL"], schema=os.environ["BENCH_FAIR_SCHEMA"])
    dramatiq.set_broker(broker)
    fair_job, plain_job = declare(broker)


# -- the controller ------------------------------------------------------------------------------
class Part:
    """A schema, its actors in this process, and the stock CLI's workers on it."""

    def __init__(self, url: str, tmp: Path, name: str, work_ms: float = 0, processes: int = 2) -> None:
        from dramatiq_pg_fenced import PostgresBroker

        self.url, self.schema = url, f"bench_fair_{name}_{uuid.uuid4().hex[:6]}"
        self.file = tmp / f"{self.schema}.runs"
        self.broker = PostgresBroker(url, schema=self.schema)
        self.broker.migrate()
        dramatiq.set_broker(self.broker)
        self.fair, self.plain = declare(self.broker)
        env = dict(
            os.environ, BENCH_FAIR_SCHEMA=self.schema, BENCH_FAIR_URL=url, BENCH_FAIR_FILE=str(self.file),
            BENCH_FAIR_WORK_MS=str(work_ms),
        )  # fmt: skip
        self.log = open(tmp / f"{self.schema}.log", "w")  # noqa: SIM115 (closed in close)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "benchmarks.fair_workers", "-p", str(processes), "-t", "8", "--path", str(REPO)],
            cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while Path(self.log.name).read_text(errors="replace").count("ready for action") < processes:
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"workers did not start: {Path(self.log.name).read_text()[-2000:]}")
            time.sleep(0.1)

    def runs(self) -> list[tuple[str, str, float, float]]:
        if not self.file.exists():
            return []
        out = []
        for line in self.file.read_text().splitlines():
            queue, key, sent, started = line.split()
            out.append((queue, key, float(sent), float(started)))
        return out

    def wait_runs(self, n: int, timeout: float = 600) -> list[tuple[str, str, float, float]]:
        deadline = time.monotonic() + timeout
        while len(runs := self.runs()) < n:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(runs)} of {n} runs after {timeout} s")
            time.sleep(0.1)
        return runs

    def server_cpu(self) -> float:
        """The server processes' CPU seconds so far (all of this cluster's backends: read, not exact)."""
        from .plan import cpu_seconds, pids_named

        return sum(cpu_seconds(pids_named("postgres")).values())

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 15)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        self.log.close()
        self.broker.close()
        with psycopg.connect(self.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))


def pace(actor: dramatiq.Actor, keys: tuple[str, ...], rate: float, stop: threading.Event, count: list[int]) -> None:
    """Each of *keys* sends *rate* messages a second until *stop*."""
    step, at = 1 / rate, time.monotonic()
    while not stop.is_set():
        for key in keys:
            actor.send(key, time.time())
            count[0] += 1
        at += step
        time.sleep(max(0.0, at - time.monotonic()))


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))] if values else float("nan")


def flood(url: str, tmp: Path, n: int) -> dict[str, float]:
    out: dict[str, float] = {}
    part = Part(url, tmp, "idle")
    try:  # B..E alone on the fair queue: their wait on an idle queue
        stop, count = threading.Event(), [0]
        sender = threading.Thread(target=pace, args=(part.fair, LATE_KEYS, 20.0, stop, count))
        sender.start()
        time.sleep(10)
        stop.set()
        sender.join()
        runs = part.wait_runs(count[0])
        out["idle_p99_ms"] = p99([(s - t) * 1000 for _, _, t, s in runs])
    finally:
        part.close()
    for kind in (FAIR, PLAIN):
        part = Part(url, tmp, kind)
        try:
            actor = part.fair if kind == FAIR else part.plain
            sent = time.time()
            part.broker.enqueue_many([actor.message("A", sent) for _ in range(n)])
            stop, count = threading.Event(), [0]
            sender = threading.Thread(target=pace, args=(actor, LATE_KEYS, 20.0, stop, count))
            sender.start()
            while sum(1 for r in part.runs() if r[1] == "A") < n:
                time.sleep(0.1)
            stop.set()
            sender.join()
            runs = part.wait_runs(n + count[0])
            late = [(s - t) * 1000 for _, key, t, s in runs if key != "A"]
            starts = sorted(s for *_, s in runs)
            out[f"{kind}_late_p99_ms"] = p99(late)
            out[f"{kind}_late_count"] = len(late)
            out[f"{kind}_drain_per_s"] = len(runs) / (starts[-1] - starts[0])
        finally:
            part.close()
    return out


def weights(url: str, tmp: Path, window: float, windows: int, work_ms: float) -> dict[str, Any]:
    part = Part(url, tmp, "weights", work_ms=work_ms)
    try:
        # More than the workers can start in the windows: 16 threads, work_ms each.
        n = int(16 * 1000 / max(work_ms, 0.1) * window * (windows + 1))
        now = time.time()
        part.broker.enqueue_many([part.fair.message(k, now) for _ in range(n) for k in ("w3", "w1")])
        time.sleep(window * (windows + 0.5))
        runs = part.runs()
        first = min(s for *_, s in runs)
        per: dict[int, dict[str, int]] = defaultdict(lambda: {"w3": 0, "w1": 0})
        for _, key, _, s in runs:
            per[int((s - first) // window)][key] += 1
        shares = [per[w]["w3"] / per[w]["w1"] for w in range(windows) if per[w]["w1"]]
        return {"shares": shares, "window_s": window, "work_ms": work_ms}
    finally:
        part.close()


def many_keys(url: str, tmp: Path, keys: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for kind in (FAIR, PLAIN):
        part = Part(url, tmp, f"keys_{kind}")
        try:
            actor = part.fair if kind == FAIR else part.plain
            now = time.time()
            messages = [actor.message(f"k{k}", now) for _ in range(3) for k in range(keys)]
            cpu = part.server_cpu()
            part.broker.enqueue_many(messages)
            cpu_sent = part.server_cpu()
            runs = part.wait_runs(len(messages))
            starts = sorted(s for *_, s in runs)
            out[f"{kind}_drain_per_s"] = len(runs) / (starts[-1] - starts[0])
            out[f"{kind}_server_cpu_us_per_msg"] = (part.server_cpu() - cpu_sent) / len(runs) * 1e6
            out[f"{kind}_send_server_cpu_us_per_msg"] = (cpu_sent - cpu) / len(runs) * 1e6
        finally:
            part.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=10.0, help="seconds per window of the weights part")
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--work-ms", type=float, default=20.0, help="the actor's work in the weights part")
    parser.add_argument("--only", choices=("flood", "weights", "keys"), default=None, help="one part")
    parser.add_argument("--url", default=os.environ.get("BENCH_PG_URL") or "postgresql://postgres@127.0.0.1:5432/test")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "flood"):
            f = flood(args.url, Path(tmp), args.flood)
            print(f"flood ({args.flood:,} of key A, then B..E at 20/s each):")
            print(f"  p99 wait of B..E: fair {f['fair_late_p99_ms']:.0f} ms ({f['fair_late_count']:.0f} messages), "
                  f"plain {f['plain_late_p99_ms']:.0f} ms, idle fair queue {f['idle_p99_ms']:.0f} ms: "
                  f"fair/idle {f['fair_late_p99_ms'] / f['idle_p99_ms']:.2f}x (goal <= 2x)")  # fmt: skip
            print(f"  drain: fair {f['fair_drain_per_s']:,.0f}/s, plain {f['plain_drain_per_s']:,.0f}/s: "
                  f"{f['fair_drain_per_s'] / f['plain_drain_per_s']:.0%} (goal >= 95%)")  # fmt: skip
        if args.only in (None, "weights"):
            w = weights(args.url, Path(tmp), args.window, args.windows, args.work_ms)
            met = all(2.7 <= s <= 3.3 for s in w["shares"]) and bool(w["shares"])
            print(f"weights 3:1 ({args.windows} windows of {args.window:.0f} s, actor {args.work_ms:.0f} ms): shares "
                  + ", ".join(f"{s:.2f}" for s in w["shares"]) + f" (goal 3 within 10%: {met})")  # fmt: skip
        if args.only in (None, "keys"):
            k = many_keys(args.url, Path(tmp), args.keys)
            fair_cpu, plain_cpu = k["fair_server_cpu_us_per_msg"], k["plain_server_cpu_us_per_msg"]
            print(f"many keys ({args.keys:,} keys x 3): drain fair {k['fair_drain_per_s']:,.0f}/s, plain "
                  f"{k['plain_drain_per_s']:,.0f}/s ({k['plain_drain_per_s'] / k['fair_drain_per_s']:.2f}x the time); "
                  f"server CPU per message fair {fair_cpu:.0f} µs, plain {plain_cpu:.0f} µs "
                  f"({fair_cpu / plain_cpu:.2f}x; goal <= 1.3x)")  # fmt: skip
            print(f"  (server CPU per message sent: fair {k['fair_send_server_cpu_us_per_msg']:.0f} µs, plain "
                  f"{k['plain_send_server_cpu_us_per_msg']:.0f} µs)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
