"""dramatiq-pg-fenced under the long-horizon harness (hardbyte/postgresql-job-queue-benchmarking).

One process, as the harness's adapter contract asks (its CONTRIBUTING_ADAPTERS.md): it reads the
harness's environment, migrates the broker's schema, produces at ``PRODUCER_RATE`` with bulk sends
(``broker.enqueue_many``), consumes with a real ``dramatiq.Worker`` of ``WORKER_COUNT`` threads on
``PostgresBroker``, and prints JSON lines on stdout: a descriptor at start, then every
``SAMPLE_EVERY_S`` (aligned to the wall clock) one record per metric. Logs go to stderr.

- ``claim_p50_ms`` / ``claim_p95_ms`` / ``claim_p99_ms``: from the producer's stamp, taken as it
  builds a batch for ``enqueue_many``, to the actor's first line; the last 30 s, as histograms of
  3 significant figures per second (bounded memory).
- ``enqueue_rate``: messages whose ``enqueue_many`` returned; ``completion_rate``: actor calls that
  returned; each the window's count over ``SAMPLE_EVERY_S``.
- ``queue_depth``: queued rows that are due (``state = 'queued' AND available_at <= now()``).
- ``producer_target_rate``: the rate the producer is asked for (the harness's control file).

Pacing: with ``PRODUCER_PACING=harness`` (the harness's default) the producer inserts what the
harness's ``ENQUEUE <n>`` tokens on stdin ask, scaled by the control file's rate over
``PRODUCER_RATE`` (so ``high-load`` phases raise it); with ``PRODUCER_PACING=adapter`` it credits
``rate x elapsed wall-clock time`` itself. ``PRODUCER_MODE=depth-target`` keeps ``TARGET_DEPTH``
due rows instead. A failed send (the database away in a chaos phase) is logged and not retried:
the offered load of an outage is lost, as an application's would be.

Chaos needs nothing more: the broker waits for the server at start, reconnects after a restart or
a killed backend, and a process killed with SIGKILL leaves leases that another (or the restarted
one) rescues when they expire. On SIGTERM the worker stops (its prefetched messages go back to
the queue), the broker closes, and the process exits 0 within a few seconds.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import dramatiq
import psycopg
from psycopg import sql

import dramatiq_pg_fenced
from dramatiq_pg_fenced import PostgresBroker

SYSTEM = "dramatiq-pg-fenced"
SCHEMA = "dramatiq"
QUEUE = "bench"
EVENT_TABLES = [f"{SCHEMA}.message", f"{SCHEMA}.history", f"{SCHEMA}.attempt_log"]
WINDOW_S = 30
OBSERVER_METRICS = {"queue_depth", "producer_target_rate"}  # global figures: replica 0 only

log = logging.getLogger("dramatiq-pg-fenced-bench")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


@dataclass(frozen=True)
class Config:
    """The harness's environment (CONTRIBUTING_ADAPTERS.md, "Env in")."""

    database_url: str
    scenario: str = "long_horizon"
    producer_mode: str = "fixed"
    producer_rate: int = 800
    pacing: str = "adapter"
    batch_max: int = 128
    batch_ms: int = 25
    target_depth: int = 1000
    worker_count: int = 32
    payload_bytes: int = 256
    work_ms: int = 1
    sample_every_s: int = 5
    instance_id: int = 0
    rate_file: str = ""
    broker_options: str = "{}"

    @classmethod
    def from_env(cls) -> Config:
        e = os.environ
        return cls(
            database_url=e["DATABASE_URL"],
            scenario=e.get("SCENARIO", "long_horizon"),
            producer_mode=e.get("PRODUCER_MODE", "fixed"),
            producer_rate=env_int("PRODUCER_RATE", 800),
            pacing=e.get("PRODUCER_PACING", "adapter"),
            batch_max=max(1, env_int("PRODUCER_BATCH_MAX", 128)),
            batch_ms=max(1, env_int("PRODUCER_BATCH_MS", 25)),
            target_depth=env_int("TARGET_DEPTH", 1000),
            worker_count=max(1, env_int("WORKER_COUNT", 32)),
            payload_bytes=env_int("JOB_PAYLOAD_BYTES", 256),
            work_ms=env_int("JOB_WORK_MS", 1),
            sample_every_s=max(1, env_int("SAMPLE_EVERY_S", 5)),
            instance_id=env_int("BENCH_INSTANCE_ID", 0),
            rate_file=e.get("PRODUCER_RATE_CONTROL_FILE", ""),
            # Ours, for tuning: JSON of PostgresBroker keyword arguments.
            broker_options=e.get("DRAMATIQ_PG_FENCED_OPTIONS", "{}"),
        )

    def target_rate(self) -> float:
        """The rate asked for now: the control file the harness rewrites in high-load phases."""
        try:
            with open(self.rate_file) as fh:
                return float(fh.read().strip())
        except (OSError, ValueError):
            return float(self.producer_rate)


class LatencyWindow:
    """Latencies of the last ``WINDOW_S`` seconds: one histogram per second, values rounded to
    3 significant figures, so memory is bounded by the distinct values, not the message count."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[int, Counter[float]] = {}

    def add(self, ms: float) -> None:
        second = int(time.monotonic())
        with self._lock:
            self._seconds.setdefault(second, Counter())[float(f"{ms:.3g}")] += 1

    def percentiles(self, *ps: float) -> list[float]:
        oldest = int(time.monotonic()) - WINDOW_S
        merged: Counter[float] = Counter()
        with self._lock:
            for second in [s for s in self._seconds if s <= oldest]:
                del self._seconds[second]
            for counts in self._seconds.values():
                merged.update(counts)
        total = sum(merged.values())
        if not total:
            return [0.0 for _ in ps]
        values = sorted(merged.items())
        out = []
        for p in ps:  # nearest rank: the least value with at least p of the counts at or below it
            rank, seen = max(1.0, p * total), 0
            for value, count in values:
                seen += count
                if seen >= rank:
                    out.append(value)
                    break
        return out


class Tally:
    """A counter that threads add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int) -> None:
        with self._lock:
            self.value += n


class Bench:
    """The broker, its worker and the producer, depth and sampler threads of one adapter process."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.stopping = threading.Event()
        self.latencies = LatencyWindow()
        self.enqueued, self.completed = Tally(), Tally()
        self.depth = 0
        self.padding = "x" * max(0, cfg.payload_bytes)
        self.broker = PostgresBroker(cfg.database_url, schema=SCHEMA, **json.loads(cfg.broker_options))
        self.broker.migrate()
        work_s = cfg.work_ms / 1000

        def bench_job(seq: int, sent_at: float, padding: str) -> None:
            self.latencies.add(max(0.0, (time.time() - sent_at) * 1000))
            if work_s:
                time.sleep(work_s)
            self.completed.add(1)

        self.job = dramatiq.actor(broker=self.broker, queue_name=QUEUE, actor_name="bench_job")(bench_job)
        self.worker = dramatiq.Worker(self.broker, worker_threads=cfg.worker_count)

    def descriptor(self) -> dict[str, Any]:
        with psycopg.connect(self.cfg.database_url, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL("SELECT max(version) FROM {}.schema_version").format(sql.Identifier(SCHEMA))
            ).fetchone()
        return {
            "kind": "descriptor",
            "system": SYSTEM,
            "event_tables": EVENT_TABLES,
            "extensions": [],
            "version": f"dramatiq-pg-fenced {dramatiq_pg_fenced.__version__}, dramatiq {dramatiq.__version__}",
            "schema_version": str(row[0] if row else None),
            "db_name": urlsplit(self.cfg.database_url).path.lstrip("/"),
            "started_at": now_iso(),
        }

    def run(self) -> None:
        emit(self.descriptor(), self.cfg.instance_id)
        self.worker.start()
        threads = [self.sampler, self.depth_poller]
        if self.cfg.producer_mode == "depth-target":
            threads.append(self.produce_to_depth)
        elif self.cfg.pacing == "harness":
            threads.append(self.produce_from_tokens)
        else:
            threads.append(self.produce_at_rate)
        for target in threads:
            threading.Thread(target=target, name=target.__name__, daemon=True).start()
        self.stopping.wait()
        log.info("SIGTERM: stopping the worker")
        self.worker.stop(timeout=4000)
        self.broker.close()

    # --- producers -------------------------------------------------------------------------

    def send(self, n: int) -> None:
        """*n* messages in ``enqueue_many`` calls of at most ``PRODUCER_BATCH_MAX``."""
        while n > 0 and not self.stopping.is_set():
            size = min(n, self.cfg.batch_max)
            n -= size
            seq, sent_at = self.enqueued.value, time.time()
            messages = [self.job.message(seq + i, sent_at, self.padding) for i in range(size)]
            try:
                self.broker.enqueue_many(messages)
            except Exception as exc:  # the database away: this batch is lost, the next one tries again
                log.warning("enqueue_many of %d failed: %s", size, exc)
                self.stopping.wait(0.2)
                continue
            self.enqueued.add(size)

    def produce_at_rate(self) -> None:
        """Credit ``rate x elapsed`` on the wall clock every ``PRODUCER_BATCH_MS`` (the contract's
        normative shape: an iteration that runs long is credited for its real length)."""
        credit, last = 0.0, time.monotonic()
        while not self.stopping.wait(max(0.0, last + self.cfg.batch_ms / 1000 - time.monotonic())):
            now = time.monotonic()
            credit += self.cfg.target_rate() * (now - last)
            last = now
            whole = int(credit)
            credit -= whole
            self.send(whole)

    def produce_from_tokens(self) -> None:
        """The harness's ``ENQUEUE <n>`` tokens, scaled by the control file's rate over the base rate."""
        tokens: queue.Queue[int] = queue.Queue()

        def read_stdin() -> None:
            for line in sys.stdin:
                parts = line.split()
                if len(parts) == 2 and parts[0] == "ENQUEUE" and parts[1].isdigit():
                    tokens.put(int(parts[1]))

        threading.Thread(target=read_stdin, name="stdin", daemon=True).start()
        credit = 0.0
        while not self.stopping.is_set():
            try:
                n = tokens.get(timeout=0.5)
                while not tokens.empty() and n < self.cfg.batch_max:  # catch up after a slow send
                    n += tokens.get_nowait()
            except queue.Empty:
                continue
            credit += n * self.cfg.target_rate() / max(1, self.cfg.producer_rate)
            whole = int(credit)
            credit -= whole
            self.send(whole)

    def produce_to_depth(self) -> None:
        while not self.stopping.is_set():
            missing = self.cfg.target_depth - self.depth
            if missing <= 0:
                self.stopping.wait(0.05)
                continue
            self.send(min(missing, self.cfg.batch_max))
            self.depth += min(missing, self.cfg.batch_max)  # until the next poll says better

    # --- observers -------------------------------------------------------------------------

    def depth_poller(self) -> None:
        """Due queued rows, every 0.25 s, on a connection of its own (made again after a failure)."""
        count = sql.SQL(
            "SELECT count(*) FROM {}.message WHERE queue_name = %s AND state = 'queued' AND available_at <= now()"
        ).format(sql.Identifier(SCHEMA))
        while not self.stopping.is_set():
            try:
                with psycopg.connect(self.cfg.database_url, autocommit=True, connect_timeout=5) as conn:
                    while not self.stopping.wait(0.25):
                        row = conn.execute(count, [QUEUE]).fetchone()
                        self.depth = int(row[0]) if row else 0
            except psycopg.Error as exc:
                log.warning("queue depth: %s", exc)
                self.stopping.wait(1.0)

    def sampler(self) -> None:
        """Every ``SAMPLE_EVERY_S``, aligned to the wall clock's multiples of it, one record per metric.
        A rate is the window's count over the nominal window, so that ``rate x window_s`` adds up to the
        exact count (the harness integrates them into jobs enqueued, completed and lost)."""
        every = self.cfg.sample_every_s
        tick = (int(time.time()) // every + 1) * every
        last_enq, last_done = self.enqueued.value, self.completed.value
        while not self.stopping.wait(max(0.0, tick - time.time())):
            tick = max(tick + every, (int(time.time()) // every + 1) * every)  # a stall skips ticks
            enq, done = self.enqueued.value, self.completed.value
            p50, p95, p99 = self.latencies.percentiles(0.50, 0.95, 0.99)
            metrics: list[tuple[str, float, float]] = [
                ("claim_p50_ms", p50, WINDOW_S),
                ("claim_p95_ms", p95, WINDOW_S),
                ("claim_p99_ms", p99, WINDOW_S),
                ("enqueue_rate", (enq - last_enq) / every, every),
                ("completion_rate", (done - last_done) / every, every),
                ("queue_depth", float(self.depth), 0),
                ("producer_target_rate", self.cfg.target_rate() if self.cfg.producer_mode == "fixed" else 0.0, 0),
            ]
            last_enq, last_done = enq, done
            t = now_iso()
            for metric, value, window_s in metrics:
                if metric in OBSERVER_METRICS and self.cfg.instance_id != 0:
                    continue
                record = {"t": t, "system": SYSTEM, "kind": "adapter", "subject_kind": "adapter", "subject": ""}
                emit({**record, "metric": metric, "value": value, "window_s": window_s}, self.cfg.instance_id)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def emit(record: dict[str, Any], instance_id: int) -> None:
    """One JSON line on stdout, stamped with the replica's id (the harness's tailer reads it)."""
    print(json.dumps({**record, "instance_id": instance_id}), flush=True)


def on_signal(event: threading.Event) -> Callable[[int, Any], None]:
    return lambda signum, frame: event.set()


def main() -> int:
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="[dramatiq-pg-fenced] %(levelname)s %(name)s: %(message)s"
    )
    cfg = Config.from_env()
    if cfg.scenario != "long_horizon":
        print(f"[dramatiq-pg-fenced] unsupported SCENARIO {cfg.scenario!r}: only long_horizon", file=sys.stderr)
        return 2
    bench = Bench(cfg)
    signal.signal(signal.SIGTERM, on_signal(bench.stopping))
    signal.signal(signal.SIGINT, on_signal(bench.stopping))
    bench.run()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
