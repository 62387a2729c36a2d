"""Side-by-side benchmark: PostgresBroker against Dramatiq's Redis and RabbitMQ brokers.

One command, one machine, one run::

    python -m benchmarks.run            # full run (about 13 minutes on a shared 2-core VM)
    python -m benchmarks.run --quick    # smoke run (about 1 minute)

Every broker gets the same no-op actor and real ``dramatiq`` worker
processes (2 processes x 8 threads).  The brokers take turns, and each
side-by-side figure is the median of 5 repetitions (the backlog pair runs
twice; ``--quick``: once each).  The figures, how each is taken:

brokers
    Ours; Redis and RabbitMQ as Dramatiq configures them by default (Redis
    without persistence, RabbitMQ publishing without confirms); and their
    durable kinds (issue 25), the fair comparison for a durable broker:
    ``redis-aof``, a redis-server this run starts on a free port with
    ``--appendonly yes --appendfsync always`` (every write fsynced before
    the reply) and stops at the end, and ``rabbitmq-confirms``,
    ``RabbitmqBroker(confirm_delivery=True)`` (persistent messages on a
    durable queue, each send confirmed once it is on disk).
single send
    ``actor.send()`` in a loop from one thread, no workers running.  Ours
    commits every send durably (``synchronous_commit = on``), as the
    durable peers do; the plain Redis and RabbitMQ do not.
8-thread send
    The same from 8 threads of one process at once, messages per second
    in all.
bulk enqueue
    The best bulk means each broker has: ours ``broker.enqueue_many`` in
    chunks; Redis a pipeline of Dramatiq's own enqueue script (no
    middleware hooks); RabbitMQ a plain ``send()`` loop (publishing without
    confirms is already pipelined).  This also fills the drain backlog.
drain
    N messages are enqueued first, then the workers start.  The clock
    starts when the queue is first seen shrinking (worker start-up is
    reported on its own) and stops when nothing is queued or in flight
    (ours: no queued or running row; Redis: Dramatiq's ``qsize``; RabbitMQ:
    the queue's ready count, which misses up to 32 unacked messages).
idle latency
    With the workers idle, ``stamp.send(time.time())`` at a low steady
    rate; the actor appends ``sent received`` to a file as its first step.
    Taken in the second round (the first with ``--quick``).
floors
    What this machine allows at best, beside the brokers in the same run:
    a durable one-row INSERT into a one-column table in a loop (no durable
    send can be cheaper) and paced like the idle-latency sends (no durable
    send adds less to the idle latency); a plain INSERT into our message
    table (the least a broker of rows claimed and acked by id pays per
    send); paced, that INSERT followed by the row's claim by id from a
    second session, and the same with a NOTIFY that wakes the claiming
    thread, which hands the claimed id to a waiting worker thread through a
    queue (the least a durable, fenced delivery woken by LISTEN/NOTIFY takes
    to reach a Dramatiq worker thread); and the time to import
    Dramatiq with psycopg against Dramatiq with pika or redis (no worker
    starts sooner); and Dramatiq's own worker draining a StubBroker (in
    memory, no broker behind it): its rate and CPU per message, and from
    them the drain no stock worker of ours or theirs can beat here.
    The targets table shows, beside each such target, the best ratio these
    floors leave.
big backlog (ours)
    The same drain with a 10k and a 200k backlog, worker RSS (peak per
    process) and connections per process (``pg_stat_activity`` by
    ``application_name``), and the table size (``pg_total_relation_size``,
    indexes and TOAST included) with the backlog, right after the drain (the
    workers' own vacuums included), after one more plain ``VACUUM``, and after
    ``broker.compact()``.

Results go to ``benchmarks/results/<full|quick>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import json
import os
import platform
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import dramatiq  # noqa: E402
import psycopg  # noqa: E402
from dramatiq.common import current_millis  # noqa: E402
from dramatiq.message import Message  # noqa: E402
from psycopg import sql  # noqa: E402

from benchmarks import apps  # noqa: E402
from dramatiq_pg_fenced import PostgresBroker  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"
KINDS = ("postgres", "redis", "redis-aof", "rabbitmq", "rabbitmq-confirms")
PROCESSES, THREADS = 2, 8


@dataclass
class Plan:
    name: str
    repeats: int
    backlog: int  # N for the side-by-side drain
    single_max: int  # sends per single-send measurement (also bounded by single_seconds)
    single_seconds: float
    latency_count: int
    latency_rate: float  # messages per second
    small: int  # ours: drain with a small backlog ...
    big: int  # ... against a big one
    pg_chunk: int  # enqueue_many chunk size
    backlog_repeats: int


FULL = Plan("full", 5, 20_000, 5_000, 5.0, 300, 20.0, 10_000, 200_000, 5_000, 2)
QUICK = Plan("quick", 1, 2_000, 500, 1.0, 40, 20.0, 2_000, 20_000, 5_000, 1)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def wait_until(check: Callable[[], bool], timeout: float, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(interval)
    return check()


# -- worker processes ----------------------------------------------------------
class Workers:
    """``dramatiq benchmarks.apps -p 2 -t 8`` in a session of its own."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.log_file = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "benchmarks.apps", "-p", str(PROCESSES), "-t", str(THREADS)]
            + ["--path", str(REPO)],
            cwd=REPO,
            env={**os.environ, **env},
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def children(self) -> list[int]:
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError), open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[1]) == self.proc.pid:
                        pids.append(int(entry))
        return pids

    def rss(self) -> dict[int, int]:
        """Resident memory of each worker process, bytes."""
        out = {}
        for pid in self.children():
            with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        out[pid] = int(line.split()[1]) * 1024
        return out

    def cpu(self) -> dict[int, float]:
        return cpu_seconds(self.children())

    def ready(self) -> int:
        return self.log_path.read_text(errors="replace").count("ready for action")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log("workers did not stop in time; killing their process group")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log_file.close()


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """User + system CPU time of each process so far, seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            out[pid] = (int(fields[11]) + int(fields[12])) / tick
    return out


def pids_named(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{entry}/comm") as f:
                if f.read().strip() == name:
                    pids.append(int(entry))
    return pids


# -- one driver per broker --------------------------------------------------
class Driver:
    """What the controller does with one broker: send, bulk-send, count."""

    kind = ""

    def __init__(self, plan: Plan, tmp: Path) -> None:
        self.plan = plan
        self.tmp = tmp
        self.broker: Any = None
        self.actors: dict[str, dramatiq.Actor] = {}

    def fresh(self) -> None:
        """An empty queue, and a controller-side broker with the actors declared."""
        raise NotImplementedError

    def close(self) -> None:
        if self.broker is not None:
            self.broker.close()
            self.broker = None

    def message(self) -> Message:
        return self.actors["noop"].message()

    def bulk(self, messages: list[Message]) -> None:
        raise NotImplementedError

    def queued(self) -> int:
        """Messages not yet picked up (for spotting the drain's start)."""
        raise NotImplementedError

    def empty(self) -> bool:
        raise NotImplementedError

    def worker_env(self) -> dict[str, str]:
        return {"BENCH_BROKER": self.kind}

    def server_pids(self) -> list[int]:
        """The server processes that work for the benchmark's workers (for CPU accounting)."""
        return []

    def versions(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        """The end of the run: close, and stop what the driver started."""
        self.close()


class PostgresDriver(Driver):
    kind = "postgres"

    def __init__(self, plan: Plan, tmp: Path, url: str, options: dict[str, Any] | None = None) -> None:
        super().__init__(plan, tmp)
        self.url = url
        self.options = options or {}
        self.schema = ""
        self.admin = psycopg.connect(apps.pg_url(url, "bench-controller-admin"), autocommit=True)
        self.used: set[str] = set()

    def fresh(self, **options: Any) -> None:
        self.close()
        self.drop()
        self.schema = f"bench_{uuid.uuid4().hex[:8]}"
        self.used.add(self.schema)
        self.broker = apps.make_broker(
            "postgres", schema=self.schema, application_name="bench-controller", **{**self.options, **options}
        )
        self.broker.migrate()
        self.actors = apps.declare(self.broker)
        ident = sql.Identifier(self.schema)
        self._queued = sql.SQL(
            "SELECT count(*) FROM (SELECT 1 FROM {}.message WHERE queue_name = %s AND state = 'queued' LIMIT %s) q"
        ).format(ident)
        self._busy = sql.SQL(
            "SELECT EXISTS (SELECT 1 FROM {}.message WHERE queue_name = %s AND state IN ('queued', 'running'))"
        ).format(ident)

    def relaxed_latency(self, path: Path) -> dict[str, float]:
        """Idle latency again, sent by a ``synchronous_commit=False`` broker to the same workers."""
        sender = apps.make_broker(
            "postgres",
            schema=self.schema,
            application_name="bench-controller-relaxed",
            **{**self.options, "synchronous_commit": False},
        )
        try:
            return measure_latency(self, self.plan, path, apps.declare(sender))
        finally:
            sender.close()

    def drop(self) -> None:
        if self.schema:
            self.admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))
            self.schema = ""

    def bulk(self, messages: list[Message]) -> None:
        step = self.plan.pg_chunk
        for i in range(0, len(messages), step):
            self.broker.enqueue_many(messages[i : i + step])

    def queued(self) -> int:
        # Bounded count: cheap next to the workers on a 2-core machine.
        return int(self._one(self._queued, [apps.QUEUE, 1_000_000]))

    def started(self, total: int) -> bool:
        # Polled every 10 ms while the workers start: through the lease index (only running rows
        # hold a lease), not a scan of the whole backlog that would take CPU from their start-up.
        # (ORDER BY ... LIMIT in a scalar subquery: without statistics of the fresh backlog the planner
        # would scan it all, and EXISTS drops the ORDER BY.)
        query = sql.SQL(
            "SELECT (SELECT 1 FROM {}.message WHERE lease_expires_at IS NOT NULL"
            " ORDER BY lease_expires_at LIMIT 1) IS NOT NULL"
        )
        return bool(self._one(query.format(sql.Identifier(self.schema))))

    def empty(self) -> bool:
        return not self._one(self._busy, [apps.QUEUE])

    def size(self) -> int:
        return int(self._one("SELECT pg_total_relation_size(%s::regclass)", [f'"{self.schema}".message']))

    def _one(self, query: Any, params: Any = None) -> Any:
        """The single value *query* returns, on the admin connection."""
        row = self.admin.execute(query, params).fetchone()
        assert row is not None
        return row[0]

    def vacuum(self) -> None:
        self.admin.execute(sql.SQL("VACUUM {}.message").format(sql.Identifier(self.schema)))

    def connections(self) -> dict[str, int]:
        rows = self.admin.execute(
            "SELECT application_name, count(*) FROM pg_stat_activity"
            " WHERE application_name LIKE 'bench-worker-%%' GROUP BY 1"
        ).fetchall()
        return {name: int(n) for name, n in rows}

    def server_pids(self) -> list[int]:
        rows = self.admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'bench-worker-%%'"
        ).fetchall()
        return [int(r[0]) for r in rows]

    def worker_env(self) -> dict[str, str]:
        return {
            "BENCH_BROKER": "postgres",
            "BENCH_PG_URL": self.url,
            "BENCH_PG_SCHEMA": self.schema,
            "BENCH_PG_OPTIONS": json.dumps(self.options),
        }

    def versions(self) -> dict[str, Any]:
        settings = {}
        for name in ("server_version", "synchronous_commit", "fsync", "shared_buffers", "max_connections"):
            settings[name] = self._one(sql.SQL("SHOW {}").format(sql.Identifier(name)))
        return {"postgresql": settings, "broker_options": self.options}

    def shutdown(self) -> None:
        self.close()
        for schema in self.used:
            self.admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
        self.admin.close()


class RedisDriver(Driver):
    kind = "redis"

    def fresh(self) -> None:
        if self.broker is None:
            self.broker = apps.make_broker(self.kind)
            self.actors = apps.declare(self.broker)
        self.broker.flush_all()

    def bulk(self, messages: list[Message]) -> None:
        """A pipeline of the same Lua enqueue Dramatiq runs per message, 1000 per round trip."""
        b = self.broker
        dispatch = b.scripts["dispatch"]
        unpack = b._max_unpack_size()
        for i in range(0, len(messages), 1000):
            pipe = b.client.pipeline(transaction=False)
            for message in messages[i : i + 1000]:
                redis_id = str(uuid.uuid4())
                data = message.copy(options={"redis_message_id": redis_id}).encode()
                args = ["enqueue", current_millis(), message.queue_name, b.broker_id, b.heartbeat_timeout]
                args += [b.dead_message_ttl, 0, unpack, redis_id, data]
                dispatch(keys=[b.namespace], args=args, client=pipe)
            pipe.execute()

    def queued(self) -> int:
        return int(self.broker.client.llen(f"{apps.REDIS_NAMESPACE}:{apps.QUEUE}"))

    def empty(self) -> bool:
        return int(self.broker.do_qsize(apps.QUEUE)) == 0

    def server_pids(self) -> list[int]:
        # This server's own process (the machine may run more than one redis-server: redis-aof's).
        return [int(self.broker.client.info("server")["process_id"])]

    def versions(self) -> dict[str, Any]:
        info = self.broker.client.info("server")
        persistence = {}
        for name in ("appendonly", "appendfsync", "save"):
            persistence |= self.broker.client.config_get(name)
        return {self.kind: {"version": info.get("redis_version"), **persistence}}


class RedisAofDriver(RedisDriver):
    """Dramatiq's ``RedisBroker`` on a redis-server of the benchmark's own, started on a free port with
    ``--appendonly yes --appendfsync always`` (every write fsynced before the reply: a durable send) and
    stopped at the end; the shared server's configuration is never touched."""

    kind = "redis-aof"

    def __init__(self, plan: Plan, tmp: Path) -> None:
        super().__init__(plan, tmp)
        self.dir = tmp / "redis-aof"
        self.dir.mkdir(exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log_file = open(tmp / "redis-aof.log", "w")  # noqa: SIM115 (closed in shutdown)
        self.server = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir)]
            + ["--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=self.log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

        def up() -> bool:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
            return False

        if not wait_until(up, timeout=10, interval=0.05):
            self.shutdown()
            raise RuntimeError(f"redis-aof: redis-server did not listen on {self.port} within 10 s")

    def fresh(self) -> None:
        if self.broker is None:
            self.broker = apps.make_broker(self.kind, redis_url=self.url)
            self.actors = apps.declare(self.broker)
        self.broker.flush_all()

    def worker_env(self) -> dict[str, str]:
        return {"BENCH_BROKER": self.kind, "BENCH_REDIS_URL": self.url}

    def shutdown(self) -> None:
        self.close()
        if self.server.poll() is None:
            self.server.terminate()
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(10)
        self.log_file.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RabbitmqDriver(Driver):
    kind = "rabbitmq"

    def fresh(self) -> None:
        # A new connection each time: pika's blocking connection answers no heartbeats while it waits, and
        # RabbitMQ closes one left idle while the other brokers take their turns.
        self.close()
        self.broker = apps.make_broker(self.kind)
        self.actors = apps.declare(self.broker)
        self.broker.declare_queue(apps.QUEUE, ensure=True)
        self.broker.flush_all()

    def bulk(self, messages: list[Message]) -> None:
        """RabbitMQ has no batch publish; without confirms a loop is already pipelined (with them, each
        send waits for its confirm)."""
        for message in messages:
            self.broker.enqueue(message)

    def queued(self) -> int:
        return int(self.broker.get_queue_message_counts(apps.QUEUE)[0])

    def empty(self) -> bool:
        return sum(self.broker.get_queue_message_counts(apps.QUEUE)[:2]) == 0

    def server_pids(self) -> list[int]:
        return pids_named("beam.smp")

    def versions(self) -> dict[str, Any]:
        props = self.broker.connection._impl.server_properties
        version = props.get("version", b"")
        return {
            self.kind: {
                "version": version.decode() if isinstance(version, bytes) else version,
                "confirm_delivery": self.broker.confirm_delivery,
            }
        }


class RabbitmqConfirmsDriver(RabbitmqDriver):
    """Dramatiq's ``RabbitmqBroker(confirm_delivery=True)``: each send() waits for the server's publisher
    confirm (persistent messages on a durable queue: confirmed once written to disk).  The same server as
    ``rabbitmq``; the two take turns on the one queue, emptied before each measurement."""

    kind = "rabbitmq-confirms"


DRIVERS: dict[str, type[Driver]] = {
    "redis": RedisDriver,
    "redis-aof": RedisAofDriver,
    "rabbitmq": RabbitmqDriver,
    "rabbitmq-confirms": RabbitmqConfirmsDriver,
}


# -- measurements ---------------------------------------------------------------
def measure_single(driver: Driver, plan: Plan) -> float:
    send = driver.actors["noop"].send
    send()  # warm the connection
    return _loop_rate(plan, send)


SEND_THREADS = 8


def measure_threaded(driver: Driver, plan: Plan, threads: int = SEND_THREADS) -> float:
    """Messages per second in all, *threads* threads each calling ``send()`` in a loop (a web server's
    request threads sending at once) for ``single_seconds`` or ``single_max`` sends each."""
    send = driver.actors["noop"].send
    send()  # warm the connection
    counts = [0] * threads
    failed: list[BaseException] = []
    go = threading.Barrier(threads + 1)

    def loop(i: int) -> None:
        try:
            go.wait()
            end = time.perf_counter() + plan.single_seconds
            while counts[i] < plan.single_max and time.perf_counter() < end:
                send()
                counts[i] += 1
        except BaseException as e:  # reported by the caller's thread
            failed.append(e)

    workers = [threading.Thread(target=loop, args=(i,)) for i in range(threads)]
    for thread in workers:
        thread.start()
    go.wait()
    start = time.perf_counter()
    for thread in workers:
        thread.join()
    elapsed = time.perf_counter() - start
    if failed:
        raise failed[0]
    return sum(counts) / elapsed


def measure_bulk(driver: Driver, n: int) -> float:
    messages = [driver.message() for _ in range(n)]
    start = time.perf_counter()
    driver.bulk(messages)
    return n / (time.perf_counter() - start)


@dataclass
class Drain:
    n: int
    rate: float
    seconds: float
    startup: float
    peak_rss: dict[int, int]
    peak_connections: dict[str, int]
    worker_cpu_us: float  # CPU time of the worker processes per message
    server_cpu_us: float  # CPU time of the broker's server processes per message


def measure_drain(driver: Driver, workers: Workers, n: int, timeout: float) -> Drain:
    """From the first consumed message to an empty queue, sampling RSS and connections."""
    rss: dict[int, int] = {}
    conns: dict[str, int] = {}
    is_pg = isinstance(driver, PostgresDriver)

    def sample() -> None:
        for pid, value in workers.rss().items():
            rss[pid] = max(rss.get(pid, 0), value)
        if is_pg:
            for name, value in driver.connections().items():  # type: ignore[attr-defined]
                conns[name] = max(conns.get(name, 0), value)

    def begun() -> bool:
        if is_pg:
            return driver.started(n)  # type: ignore[attr-defined]
        return driver.queued() < n

    if not wait_until(begun, timeout=60, interval=0.01):
        raise RuntimeError(f"{driver.kind}: workers did not start consuming within 60 s; see {workers.log_path}")
    t_start = time.monotonic()
    startup = t_start - workers.started_at
    worker_cpu0, server_cpu0 = workers.cpu(), cpu_seconds(driver.server_pids())
    deadline = t_start + timeout
    last_sample = 0.0
    while not driver.empty():
        now = time.monotonic()
        if now > deadline:
            raise RuntimeError(f"{driver.kind}: drain of {n} did not finish within {timeout:.0f} s")
        if now - last_sample > 0.25:
            sample()
            last_sample = now
        time.sleep(0.02)
    seconds = time.monotonic() - t_start
    worker_cpu = sum(v - worker_cpu0.get(pid, 0.0) for pid, v in workers.cpu().items())
    server_cpu = sum(v - server_cpu0.get(pid, 0.0) for pid, v in cpu_seconds(driver.server_pids()).items())
    sample()
    return Drain(n, n / seconds, seconds, startup, rss, conns, worker_cpu / n * 1e6, server_cpu / n * 1e6)


def measure_latency(
    driver: Driver, plan: Plan, path: Path, actors: dict[str, dramatiq.Actor] | None = None
) -> dict[str, float]:
    send = (actors or driver.actors)["stamp"].send
    path.write_text("")  # the workers append with O_APPEND: they follow the truncation
    time.sleep(1.0)  # idle: consumers are waiting, as they would between bursts
    start = time.monotonic()
    returned: dict[str, float] = {}  # repr(sent) -> when send() returned
    for i in range(plan.latency_count):
        pause = start + i / plan.latency_rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        sent = time.time()
        send(sent)
        returned[repr(sent)] = time.time()
    calls = sorted((end - float(sent)) * 1000 for sent, end in returned.items())

    def lines() -> list[str]:
        return path.read_text().splitlines() if path.exists() else []

    wait_until(lambda: len(lines()) >= plan.latency_count, timeout=30, interval=0.05)
    got = [line.split() for line in lines()]
    values = sorted((float(b) - float(a)) * 1000 for a, b in got)
    if not values:
        raise RuntimeError(f"{driver.kind}: no latency samples arrived")
    # From send() returning to the actor starting: the delivery alone (notify, claim, hand-off).
    after = sorted((float(b) - returned[a]) * 1000 for a, b in got if a in returned)
    return {
        "p50_ms": percentile(values, 50),
        "p99_ms": percentile(values, 99),
        "max_ms": values[-1],
        "send_call_p50_ms": percentile(calls, 50),  # part of the latency: ours is a durable commit
        "after_send_p50_ms": percentile(after, 50),
        "after_send_p99_ms": percentile(after, 99),
        "samples": len(values),
        "sent": plan.latency_count,
    }


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile of sorted *values*."""
    rank = max(1, -(-len(values) * p // 100))
    return values[int(rank) - 1]


@contextlib.contextmanager
def running_workers(driver: Driver, log_path: Path, extra: dict[str, str] | None = None) -> Iterator[Workers]:
    workers = Workers({**driver.worker_env(), **(extra or {})}, log_path)
    try:
        yield workers
    finally:
        workers.stop()


# -- the run -------------------------------------------------------------------
def side_by_side(drivers: list[Driver], plan: Plan, tmp: Path, out: dict[str, Any]) -> None:
    per: dict[str, dict[str, list[Any]]] = {
        d.kind: {"single": [], "threaded": [], "bulk": [], "drain": []} for d in drivers
    }
    # The idle latencies are taken once, in the second round: every server has had a round's load by then.
    latency_round = min(1, plan.repeats - 1)
    for rep in range(plan.repeats):
        for driver in drivers:
            kind = driver.kind
            driver.fresh()
            single = measure_single(driver, plan)
            driver.fresh()
            threaded = measure_threaded(driver, plan)
            driver.fresh()
            bulk = measure_bulk(driver, plan.backlog)
            # RabbitMQ publishes without confirms: wait until the broker holds the whole backlog,
            # or the drain (and the start-up, clocked to its first message) would start early.
            wait_until(held_all(driver, plan.backlog), timeout=60)
            lat_path = tmp / f"latency-{kind}-{rep}.txt"
            with running_workers(driver, tmp / f"workers-{kind}-{rep}.log", {"BENCH_LATENCY_FILE": str(lat_path)}) as w:
                drain = measure_drain(driver, w, plan.backlog, timeout=max(120.0, plan.backlog / 200))
                latency = measure_latency(driver, plan, lat_path) if rep == latency_round else None
                if rep == latency_round and isinstance(driver, PostgresDriver):
                    relaxed = driver.relaxed_latency(lat_path)
                    out["brokers"][kind]["latency_relaxed_enqueue"] = relaxed
                    log(
                        f"postgres idle latency with synchronous_commit=False sends: p50 {relaxed['p50_ms']:.2f} ms p99 {relaxed['p99_ms']:.2f} ms"
                    )
            per[kind]["single"].append(single)
            per[kind]["threaded"].append(threaded)
            per[kind]["bulk"].append(bulk)
            per[kind]["drain"].append(drain)
            if latency is not None:
                out["brokers"][kind]["latency"] = latency
            log(
                f"rep {rep + 1}/{plan.repeats} {kind:17s} single {single:7.0f}/s  {SEND_THREADS} threads {threaded:7.0f}/s  "
                f"bulk {bulk:7.0f}/s  "
                f"drain {drain.rate:8.0f}/s ({drain.seconds:.2f} s, start-up {drain.startup:.2f} s, "
                f"CPU/msg {drain.worker_cpu_us:.0f}+{drain.server_cpu_us:.0f} us)"
                + (f"  latency p50 {latency['p50_ms']:.2f} ms p99 {latency['p99_ms']:.2f} ms" if latency else "")
            )
    for kind, figures in per.items():
        drains: list[Drain] = figures["drain"]
        out["brokers"][kind].update(
            {
                "single_send_per_s": statistics.median(figures["single"]),
                "threaded_send_per_s": statistics.median(figures["threaded"]),
                "bulk_enqueue_per_s": statistics.median(figures["bulk"]),
                "drain_per_s": statistics.median(d.rate for d in drains),
                "worker_startup_s": statistics.median(d.startup for d in drains),
                "worker_cpu_us_per_msg": statistics.median(d.worker_cpu_us for d in drains),
                "server_cpu_us_per_msg": statistics.median(d.server_cpu_us for d in drains),
                "runs": {
                    "single_send_per_s": figures["single"],
                    "threaded_send_per_s": figures["threaded"],
                    "worker_startup_s": [d.startup for d in drains],
                    "bulk_enqueue_per_s": figures["bulk"],
                    "drain_per_s": [d.rate for d in drains],
                    "drain_seconds": [d.seconds for d in drains],
                },
                "peak_rss_mb_per_process": max(max(d.peak_rss.values(), default=0) for d in drains) / 2**20,
            }
        )
        if kind == "postgres":
            out["brokers"][kind]["connections_per_process"] = max(
                max(d.peak_connections.values(), default=0) for d in drains
            )


def held_all(driver: Driver, n: int) -> Callable[[], bool]:
    """Does the broker hold (at least) *n* queued messages?"""
    return lambda: driver.queued() >= n


def relaxed_single(url: str, options: dict[str, Any], plan: Plan, tmp: Path) -> float:
    driver = PostgresDriver(plan, tmp, url, {**options, "synchronous_commit": False})
    try:
        driver.fresh()
        return measure_single(driver, plan)
    finally:
        driver.shutdown()


IMPORTS = {
    "postgres": "dramatiq, psycopg, psycopg_pool",  # what any psycopg-based broker must import
    "ours": "dramatiq_pg_fenced",
    "rabbitmq": "dramatiq, dramatiq.brokers.rabbitmq",
    "redis": "dramatiq, dramatiq.brokers.redis",
}


def import_seconds(modules: str, runs: int = 5) -> float | None:
    """Median time a fresh interpreter takes to import *modules* (this checkout's package first on the path);
    ``None`` when they are not installed (pika and redis come with the ``bench`` extra)."""
    code = f"import time; t = time.perf_counter(); import {modules}; print(time.perf_counter() - t)"
    times = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
        if done.returncode and "ModuleNotFoundError" in done.stderr:
            return None
        done.check_returncode()
        times.append(float(done.stdout))
    return statistics.median(times)


# Dramatiq's own worker draining an in-memory StubBroker: what the stock worker spends per message
# with no broker behind it (its middleware, consumer and worker threads, the hand-offs between them).
_STUB_DRAIN = """
import json, sys, time
import dramatiq
from dramatiq.brokers.stub import StubBroker
n, threads = int(sys.argv[1]), int(sys.argv[2])
broker = StubBroker()
dramatiq.set_broker(broker)
noop = dramatiq.actor(lambda: None, actor_name="noop", queue_name="bench", max_retries=0)
for _ in range(n):
    noop.send()
worker = dramatiq.Worker(broker, worker_threads=threads)
cpu, start = time.process_time(), time.perf_counter()
worker.start()
broker.join("bench")
seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
worker.stop()
print(json.dumps({"per_s": n / seconds, "cpu_us_per_msg": cpu / n * 1e6}))
"""


def stub_drain(n: int, runs: int = 3) -> dict[str, float]:
    """Dramatiq's worker alone (``PROCESSES`` x ``THREADS`` shape, one process measured): median messages
    per second and worker CPU per message over *runs* drains of *n* no-op messages from a StubBroker.
    No broker's worker can spend less per message; with ``PROCESSES`` processes on this machine's cores,
    no drain can beat ``drain_ceiling_per_s``."""
    found = []
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, "-c", _STUB_DRAIN, str(n), str(THREADS)], cwd=REPO, capture_output=True, text=True, check=True
        )
        found.append(json.loads(done.stdout.strip().splitlines()[-1]))
    per_s = statistics.median(f["per_s"] for f in found)
    cpu_us = statistics.median(f["cpu_us_per_msg"] for f in found)
    cores = os.cpu_count() or 1
    return {
        "per_s": per_s,
        "cpu_us_per_msg": cpu_us,
        # Each process at most its measured rate; all of them together at most the cores' CPU.
        "drain_ceiling_per_s": min(PROCESSES * per_s, cores * 1e6 / cpu_us),
    }


def floors(url: str, plan: Plan) -> dict[str, Any]:
    """What this machine allows at best, measured in the same run as the brokers.

    A durable send cannot be cheaper than a durable one-row INSERT into a
    one-column table: the same round trip and WAL flush, no index, no
    NOTIFY.  A broker that keeps messages as rows it can claim and ack by
    id pays at least a plain INSERT into a table of ours (its primary key
    and claim index; no ``ON CONFLICT``, no NOTIFY), and one whose sends wake
    its consumers at least that INSERT with a NOTIFY.  Paced like the
    idle-latency sends, the bare INSERT is the least any durable send can add
    to the idle latency; and a delivery that is fenced needs, after that
    durable insert, at least one write by the consumer's own session: here
    the cheapest there is (the row's state by its primary key, without
    waiting for the disk), sent the moment the insert returns.  Woken by a
    NOTIFY instead, and handing the claimed row to a worker thread as every
    Dramatiq consumer thread does (RabbitMQ's path in the latency test makes
    that hand-off too), it takes what ``_rung_claim`` measures.  And a worker cannot
    start before it has imported Dramatiq and psycopg.
    """
    schema = f"bench_floor_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(schema)
    table = sql.SQL("{}.t").format(ident)
    insert = sql.SQL("INSERT INTO {} VALUES (1)").format(table)
    # Our message table, migrated into the floor's schema: its columns, primary key and indexes.
    insert_message = sql.SQL(
        "INSERT INTO {}.message (message_id, queue_name, actor_name, payload) VALUES (%s, 'bench', 'noop', %s)"
    ).format(ident)
    claim_by_id = sql.SQL(
        "UPDATE {}.message SET state = 'running', attempt = attempt + 1 WHERE message_id = %s RETURNING payload"
    ).format(ident)
    payload = Message(queue_name=apps.QUEUE, actor_name="noop", args=(), kwargs={}, options={}).encode()
    channel = f"{schema}_ring"
    insert_ringing = sql.SQL("WITH i AS ({} RETURNING 1) SELECT pg_notify(%s, %s::text) FROM i").format(insert_message)
    with psycopg.connect(apps.pg_url(url, "bench-floor-admin"), autocommit=True) as admin:
        try:
            migrated = PostgresBroker(apps.pg_url(url, "bench-floor"), schema=schema)
            try:
                migrated.migrate()
            finally:
                migrated.close()
            admin.execute(sql.SQL("CREATE TABLE {} (x int)").format(table))
            with (
                psycopg.connect(apps.pg_url(url, "bench-floor"), autocommit=True) as conn,
                psycopg.connect(apps.pg_url(url, "bench-floor-claimer"), autocommit=True) as claimer,
                psycopg.connect(apps.pg_url(url, "bench-floor-listener"), autocommit=True) as listener,
            ):
                claimer.execute("SET synchronous_commit = off")
                listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

                def claim(message_id: Any) -> None:
                    if claimer.execute(claim_by_id, (message_id,)).fetchone() is None:
                        raise RuntimeError(f"floor: row {message_id} was not there to claim")

                conn.execute(insert)
                rate = _loop_rate(plan, lambda: conn.execute(insert))
                rate_message = _loop_rate(plan, lambda: conn.execute(insert_message, (uuid.uuid4(), payload)))
                rate_ringing = _loop_rate(
                    plan, lambda: conn.execute(insert_ringing, (uuid.uuid4(), payload, "bench_floor_nobody", "x"))
                )
                # From SEND_THREADS sessions at once: PostgreSQL holds a lock from a NOTIFY's commit to its WAL
                # flush, so transactions that notify commit one at a time (no group commit among them).
                threaded = _threaded_rate(
                    url,
                    plan,
                    lambda c: c.execute(insert_message, (uuid.uuid4(), payload)),
                )
                threaded_ringing = _threaded_rate(
                    url,
                    plan,
                    lambda c: c.execute(insert_ringing, (uuid.uuid4(), payload, "bench_floor_nobody", "x")),
                )
                time.sleep(1.0)
                paced, delivered, rung, handed = [], [], [], []
                for _ in range(min(plan.latency_count, 100)):
                    time.sleep(1 / plan.latency_rate)
                    t = time.perf_counter()
                    conn.execute(insert)
                    paced.append((time.perf_counter() - t) * 1000)
                    time.sleep(1 / plan.latency_rate)
                    message_id = uuid.uuid4()
                    t = time.perf_counter()
                    conn.execute(insert_message, (message_id, payload))
                    claim(message_id)
                    delivered.append((time.perf_counter() - t) * 1000)
                    time.sleep(1 / plan.latency_rate)
                    rung_claimed, rung_handed = _rung_claim(conn, insert_ringing, channel, payload, listener, claim)
                    rung.append(rung_claimed)
                    handed.append(rung_handed)
        finally:
            admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
    return {
        "durable_insert_per_s": rate,
        "durable_insert_message_table_per_s": rate_message,
        "durable_insert_message_table_notify_per_s": rate_ringing,
        "durable_insert_message_table_threads_per_s": threaded,
        "durable_insert_message_table_notify_threads_per_s": threaded_ringing,
        "durable_insert_paced_p50_ms": percentile(sorted(paced), 50),
        "insert_then_claim_paced_p50_ms": percentile(sorted(delivered), 50),
        "insert_notify_claim_paced_p50_ms": percentile(sorted(rung), 50),
        "insert_notify_claim_handoff_paced_p50_ms": percentile(sorted(handed), 50),
        "import_s": {name: import_seconds(modules) for name, modules in IMPORTS.items()},
        "dramatiq_alone": stub_drain(plan.backlog),
    }


def _rung_claim(
    conn: psycopg.Connection,
    insert_ringing: sql.Composable,
    channel: str,
    payload: bytes,
    listener: psycopg.Connection,
    claim: Callable[[Any], None],
) -> tuple[float, float]:
    """Milliseconds from a durable INSERT that NOTIFYs the row's id to that row claimed by a thread woken by
    the notification, and to the claimed id taken from a ``queue.Queue`` by a waiting worker thread (the
    hand-off every Dramatiq broker's consumer thread makes): the least a delivery woken by LISTEN/NOTIFY takes."""
    claimed: list[float] = []
    handed: list[float] = []
    failed: list[BaseException] = []
    work: queue.Queue[Any] = queue.Queue()

    def claim_rung() -> None:
        try:
            for note in listener.notifies(timeout=5.0, stop_after=1):
                claim(note.payload)
                claimed.append(time.perf_counter())
                work.put(note.payload)
        except BaseException as e:  # reported by the caller's thread
            failed.append(e)
        finally:
            work.put(None)

    def worker() -> None:
        if work.get() is not None:
            handed.append(time.perf_counter())

    threads = [threading.Thread(target=worker), threading.Thread(target=claim_rung)]
    for thread in threads:
        thread.start()
    time.sleep(0.01)  # both wait, as a consumer and a worker thread between messages do
    message_id = uuid.uuid4()
    t = time.perf_counter()
    conn.execute(insert_ringing, (message_id, payload, channel, str(message_id)))
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    if not handed:
        raise RuntimeError("floor: the notification of a committed insert did not arrive within 5 s")
    return (claimed[0] - t) * 1000, (handed[0] - t) * 1000


def _threaded_rate(url: str, plan: Plan, call: Callable[[psycopg.Connection], Any]) -> float:
    """Calls per second in all, SEND_THREADS threads each on a connection of its own, for ``single_seconds``."""
    conns = [psycopg.connect(apps.pg_url(url, "bench-floor-threads"), autocommit=True) for _ in range(SEND_THREADS)]
    counts = [0] * SEND_THREADS

    def loop(i: int) -> None:
        end = time.perf_counter() + plan.single_seconds
        while counts[i] < plan.single_max and time.perf_counter() < end:
            call(conns[i])
            counts[i] += 1

    try:
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(SEND_THREADS)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(counts) / (time.perf_counter() - start)
    finally:
        for conn in conns:
            conn.close()


def _loop_rate(plan: Plan, call: Callable[[], Any]) -> float:
    """Calls per second, back to back, for at most ``single_max`` calls or ``single_seconds``."""
    count, start = 0, time.perf_counter()
    while count < plan.single_max and time.perf_counter() - start < plan.single_seconds:
        call()
        count += 1
    return count / (time.perf_counter() - start)


def backlog_scaling(driver: PostgresDriver, plan: Plan, tmp: Path, out: dict[str, Any]) -> None:
    runs: dict[str, list[dict[str, Any]]] = {}
    for _, n in [(r, n) for r in range(plan.backlog_repeats) for n in (plan.small, plan.big)]:
        driver.fresh()
        start = time.perf_counter()
        messages = [driver.message() for _ in range(n)]
        driver.bulk(messages)
        del messages
        enqueue_s = time.perf_counter() - start
        size_backlog = driver.size()
        with running_workers(driver, tmp / f"workers-backlog-{n}.log") as w:
            drain = measure_drain(driver, w, n, timeout=max(300.0, n / 200))
            time.sleep(0.5)
            idle_conns = driver.connections()
        size_after = driver.size()
        driver.vacuum()
        size_vacuumed = driver.size()
        start = time.perf_counter()
        driver.broker.compact()
        compact_s = time.perf_counter() - start
        size_compacted = driver.size()
        runs.setdefault(str(n), []).append(
            {
                "enqueue_per_s": n / enqueue_s,
                "drain_per_s": drain.rate,
                "drain_seconds": drain.seconds,
                "worker_startup_s": drain.startup,
                "worker_cpu_us_per_msg": drain.worker_cpu_us,
                "server_cpu_us_per_msg": drain.server_cpu_us,
                "peak_rss_mb_per_process": {str(k): v / 2**20 for k, v in drain.peak_rss.items()},
                "peak_connections_per_process": drain.peak_connections,
                "idle_connections_per_process": idle_conns,
                "size_with_backlog_bytes": size_backlog,
                "size_after_drain_bytes": size_after,
                "size_after_vacuum_bytes": size_vacuumed,
                "size_after_compact_bytes": size_compacted,
                "compact_seconds": compact_s,
            }
        )
        log(
            f"postgres backlog {n:>7}: drain {drain.rate:8.0f}/s ({drain.seconds:.1f} s, "
            f"CPU/msg {drain.worker_cpu_us:.0f}+{drain.server_cpu_us:.0f} us); "
            f"peak RSS {max(drain.peak_rss.values(), default=0) / 2**20:.0f} MB/process; "
            f"connections {max(drain.peak_connections.values(), default=0)}/process; "
            f"size {size_backlog / 2**20:.1f} MB -> {size_after / 2**20:.1f} MB -> {size_vacuumed / 2**20:.2f} MB (vacuum)"
            f" -> {size_compacted / 2**20:.2f} MB (compact, {compact_s:.2f} s)"
        )
    result: dict[str, Any] = {}
    for key, done in runs.items():
        result[key] = {
            **done[-1],
            "drain_per_s": statistics.median(r["drain_per_s"] for r in done),
            "worker_cpu_us_per_msg": statistics.median(r["worker_cpu_us_per_msg"] for r in done),
            "server_cpu_us_per_msg": statistics.median(r["server_cpu_us_per_msg"] for r in done),
            "peak_rss_mb_per_process": {
                k: max(r["peak_rss_mb_per_process"].get(k, 0) for r in done)
                for k in {k for r in done for k in r["peak_rss_mb_per_process"]}
            },
            "runs": done,
        }
    out["backlog"] = result


def targets(out: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    b = out["brokers"]
    rows = []

    def add(
        name: str, value: float | None, goal: float, unit: str, higher: bool = True, bound: float | None = None
    ) -> None:
        met = None if value is None else (value >= goal if higher else value <= goal)
        rows.append(
            {
                "target": name,
                "value": value,
                "goal": goal,
                "unit": unit,
                "higher_is_better": higher,
                "met": met,
                "bound": bound,  # the best value this machine allows (see floors()), when known
            }
        )

    def ratio(a: str, c: str, key: str) -> float | None:
        if a in b and c in b and key in b[a] and key in b[c] and b[c][key]:
            return float(b[a][key] / b[c][key])
        return None

    def latency(kind: str, key: str) -> float | None:
        value = b.get(kind, {}).get("latency", {}).get(key)
        return None if value is None else float(value)

    def latency_ratio(key: str) -> float | None:
        ours, theirs = latency("postgres", key), latency("rabbitmq", key)
        return None if ours is None or not theirs else ours / theirs

    # Issue 10's targets are ratios within one run; the absolute bulk rate is an older one.
    floor = out.get("floors") or {}
    imports = floor.get("import_s", {})
    # No broker's stock worker drains faster than Dramatiq's worker with no broker at all (see stub_drain).
    ceiling = (floor.get("dramatiq_alone") or {}).get("drain_ceiling_per_s")

    def over(value: float | None, kind: str, key: str) -> float | None:
        theirs = b.get(kind, {}).get(key)
        return None if value is None or not theirs else float(value / theirs)

    def drain(label: str, kind: str, goal: float) -> None:
        add(f"drain vs {label}", ratio("postgres", kind, "drain_per_s"), goal, "x", bound=over(ceiling, kind, "drain_per_s"))

    drain("RabbitMQ", "rabbitmq", 1.5)
    drain("Redis", "redis", 2.0)

    def theirs_latency(key: str) -> float | None:
        return latency("rabbitmq", key)

    add(
        "single send vs Redis (ours durable)",
        ratio("postgres", "redis", "single_send_per_s"),
        0.6,
        "x",
        # A broker of rows it claims and acks by id, whose sends wake its consumers: an INSERT into a table
        # with its keys and a NOTIFY (see floors()).
        bound=over(floor.get("durable_insert_message_table_notify_per_s"), "redis", "single_send_per_s"),
    )
    add("bulk enqueue vs Redis pipeline", ratio("postgres", "redis", "bulk_enqueue_per_s"), 2.0, "x")
    add("bulk enqueue", b.get("postgres", {}).get("bulk_enqueue_per_s"), 50_000, "msg/s")
    rabbit_p50 = theirs_latency("p50_ms")
    # A durable send, a notification, a fenced claim, the hand-off to a worker thread (see floors()).
    paced = floor.get("insert_notify_claim_handoff_paced_p50_ms")
    add(
        "idle latency p50 vs RabbitMQ",
        latency_ratio("p50_ms"),
        1.0,
        "x",
        higher=False,
        bound=None if paced is None or not rabbit_p50 else paced / rabbit_p50,
    )
    add("idle latency p99 vs RabbitMQ", latency_ratio("p99_ms"), 2.0, "x", higher=False)
    rabbit_startup = b.get("rabbitmq", {}).get("worker_startup_s")
    startup_bound = None
    if rabbit_startup and imports.get("postgres") is not None and imports.get("rabbitmq") is not None:
        # RabbitMQ's start-up with its imports swapped for the least a psycopg-based broker imports.
        startup_bound = (rabbit_startup - imports["rabbitmq"] + imports["postgres"]) / rabbit_startup
    add(
        "worker start-up vs RabbitMQ",
        ratio("postgres", "rabbitmq", "worker_startup_s"),
        1.0,
        "x",
        higher=False,
        bound=startup_bound,
    )
    # Issue 25: against the durable peers (a durable broker's fair comparison), and the latency floor.
    drain("Redis-AOF (appendfsync always)", "redis-aof", 2.0)
    drain("RabbitMQ-confirms", "rabbitmq-confirms", 2.0)
    add(
        "single send vs Redis-AOF",
        ratio("postgres", "redis-aof", "single_send_per_s"),
        1.0,
        "x",
        bound=over(floor.get("durable_insert_message_table_notify_per_s"), "redis-aof", "single_send_per_s"),
    )
    add(
        f"{SEND_THREADS}-thread send vs Redis-AOF",
        ratio("postgres", "redis-aof", "threaded_send_per_s"),
        1.0,
        "x",
        bound=over(floor.get("durable_insert_message_table_notify_threads_per_s"), "redis-aof", "threaded_send_per_s"),
    )
    ours_p50 = latency("postgres", "p50_ms")
    add(
        "idle latency p50 vs the floor (NOTIFY-woken claim and hand-off)",
        None if ours_p50 is None or not paced else ours_p50 / paced,
        1.2,
        "x",
        higher=False,
        bound=None if paced is None else 1.0,
    )
    confirms_p99 = latency("rabbitmq-confirms", "p99_ms")
    ours_p99 = latency("postgres", "p99_ms")
    add(
        "idle latency p99 vs RabbitMQ-confirms",
        None if ours_p99 is None or not confirms_p99 else ours_p99 / confirms_p99,
        2.0,
        "x",
        higher=False,
    )
    aof_startup = b.get("redis-aof", {}).get("worker_startup_s")
    aof_bound = None
    if aof_startup and imports.get("postgres") is not None and imports.get("redis") is not None:
        # Redis-AOF's start-up with its imports swapped for the least a psycopg-based broker imports.
        aof_bound = (aof_startup - imports["redis"] + imports["postgres"]) / aof_startup
    add(
        "worker start-up vs Redis-AOF",
        ratio("postgres", "redis-aof", "worker_startup_s"),
        1.0,
        "x",
        higher=False,
        bound=aof_bound,
    )
    backlog = out.get("backlog")
    if backlog:
        small, big = backlog[str(plan.small)], backlog[str(plan.big)]
        add(
            f"drain {plan.big // 1000}k vs {plan.small // 1000}k backlog",
            big["drain_per_s"] / small["drain_per_s"],
            0.9,
            "x",
        )
        rss_small = max(small["peak_rss_mb_per_process"].values(), default=0)
        rss_big = max(big["peak_rss_mb_per_process"].values(), default=0)
        add(
            f"worker RSS {plan.big // 1000}k vs {plan.small // 1000}k backlog",
            rss_big / rss_small if rss_small else None,
            1.1,
            "x",
            higher=False,
        )
    return rows


# -- output ---------------------------------------------------------------------
def fmt(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pair(latency: dict[str, float] | None) -> str | None:
    return None if latency is None else f"{latency['p50_ms']:.2f} / {latency['p99_ms']:.2f}"


def _after(latency: dict[str, float] | None) -> str | None:
    if latency is None or "after_send_p50_ms" not in latency:
        return None
    return f"{latency['after_send_p50_ms']:.2f} / {latency['after_send_p99_ms']:.2f}"


def table(out: dict[str, Any]) -> str:
    kinds = [k for k in KINDS if k in out["brokers"]]
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, key: Callable[[dict[str, Any]], Any], digits: int = 0) -> None:
        rows.append((label, [fmt(key(out["brokers"][k]), digits) for k in kinds]))

    row("single send() msg/s", lambda f: f.get("single_send_per_s"))
    row(f"send() from {SEND_THREADS} threads, msg/s in all", lambda f: f.get("threaded_send_per_s"))
    row("bulk enqueue msg/s", lambda f: f.get("bulk_enqueue_per_s"))
    row(f"drain {out['plan']['backlog'] // 1000}k backlog msg/s", lambda f: f.get("drain_per_s"))
    row("worker start-up s (not in drain)", lambda f: f.get("worker_startup_s"), 2)
    row("drain CPU us/msg, worker processes", lambda f: f.get("worker_cpu_us_per_msg"))
    row("drain CPU us/msg, broker server", lambda f: f.get("server_cpu_us_per_msg"))
    row("idle latency p50 ms", lambda f: f.get("latency", {}).get("p50_ms"), 2)
    row("idle latency p99 ms", lambda f: f.get("latency", {}).get("p99_ms"), 2)
    row("  of which the send() call, p50 ms", lambda f: f.get("latency", {}).get("send_call_p50_ms"), 2)
    row("from send() returning to actor start, p50 / p99 ms", lambda f: _after(f.get("latency")))
    row("idle latency p50 / p99 ms, relaxed sends", lambda f: _pair(f.get("latency_relaxed_enqueue")))
    row("peak worker RSS MB/process", lambda f: f.get("peak_rss_mb_per_process"), 1)
    row("DB connections/process", lambda f: f.get("connections_per_process"))
    names = {
        "postgres": "PostgresBroker (ours, durable)",
        "redis": "RedisBroker (no persistence)",
        "redis-aof": "RedisBroker, appendfsync always (durable)",
        "rabbitmq": "RabbitmqBroker (no confirms)",
        "rabbitmq-confirms": "RabbitmqBroker, publisher confirms (durable)",
    }
    lines = ["| figure | " + " | ".join(names[k] for k in kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    relaxed = out["brokers"].get("postgres", {}).get("single_send_relaxed_per_s")
    if relaxed:
        lines.append(f"| single send() msg/s, synchronous_commit=False | {fmt(relaxed)} |" + " - |" * (len(kinds) - 1))
    backlog = out.get("backlog")
    if backlog:
        lines += [
            "",
            "| ours, backlog | drain msg/s | peak RSS MB/process | connections/process"
            " | table+indexes with backlog | right after drain | after VACUUM | after compact() |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for n, f in backlog.items():
            lines.append(
                f"| {int(n):,} | {fmt(f['drain_per_s'])} | {fmt(max(f['peak_rss_mb_per_process'].values(), default=0), 1)} "
                f"| {max(f['peak_connections_per_process'].values(), default=0)} "
                f"| {f['size_with_backlog_bytes'] / 2**20:.1f} MB | {f['size_after_drain_bytes'] / 2**20:.1f} MB "
                f"| {f['size_after_vacuum_bytes'] / 2**20:.2f} MB "
                f"| {f.get('size_after_compact_bytes', 0) / 2**20:.2f} MB |"
            )
    floor = out.get("floors")
    if floor:
        lines += [
            "",
            "| floor on this machine (same run) | |",
            "|---|---|",
            f"| durable one-row INSERT, one-column table, in a loop | {fmt(floor['durable_insert_per_s'])} /s |",
            f"| the same INSERT paced like the idle-latency sends, p50 | {floor['durable_insert_paced_p50_ms']:.2f} ms |",
            "| durable one-row INSERT into our message table (its keys; no ON CONFLICT, no NOTIFY), in a loop"
            f" | {fmt(floor['durable_insert_message_table_per_s'])} /s |",
            "| the same INSERT with a NOTIFY in its statement (nobody listening), in a loop"
            f" | {fmt(floor['durable_insert_message_table_notify_per_s'])} /s |",
            f"| that INSERT from {SEND_THREADS} sessions at once, without / with the NOTIFY, in all"
            f" | {fmt(floor['durable_insert_message_table_threads_per_s'])} / "
            f"{fmt(floor['durable_insert_message_table_notify_threads_per_s'])} /s |",
            "| paced: that INSERT, then the row claimed by id from a second session (no disk wait), p50"
            f" | {floor['insert_then_claim_paced_p50_ms']:.2f} ms |",
            "| paced: that INSERT with a NOTIFY, the row claimed by a thread the notification woke, p50"
            f" | {floor['insert_notify_claim_paced_p50_ms']:.2f} ms |",
            "| paced: the same, until the claimed id is taken from a queue by a waiting worker thread, p50"
            f" | {floor['insert_notify_claim_handoff_paced_p50_ms']:.2f} ms |",
        ]
        alone = floor.get("dramatiq_alone")
        if alone:
            lines.append(
                f"| Dramatiq's worker alone ({THREADS} threads, StubBroker, no-op actor): drain, worker CPU per message"
                f" | {fmt(alone['per_s'])} /s, {alone['cpu_us_per_msg']:.0f} us |"
            )
            lines.append(
                f"| so no stock worker's drain beats ({PROCESSES} processes, {os.cpu_count()} cores)"
                f" | {fmt(alone['drain_ceiling_per_s'])} /s |"
            )
        for name, seconds in floor["import_s"].items():
            lines.append(f"| import {IMPORTS[name]} | {'not installed' if seconds is None else f'{seconds:.3f} s'} |")
    lines += ["", "| target | measured | goal | met | best this machine allows |", "|---|---|---|---|---|"]
    for t in out["targets"]:
        value = "-" if t["value"] is None else (f"{t['value']:,.2f}" if t["unit"] != "msg/s" else f"{t['value']:,.0f}")
        goal = ("<= " if not t["higher_is_better"] else ">= ") + (
            f"{t['goal']:,}" if t["unit"] == "msg/s" else f"{t['goal']}"
        )
        met = {True: "yes", False: "**no**", None: "-"}[t["met"]]
        bound = "-" if t.get("bound") is None else f"{t['bound']:.2f} {t['unit']}"
        lines.append(f"| {t['target']} | {value} {t['unit']} | {goal} {t['unit']} | {met} | {bound} |")
    return "\n".join(lines)


def chart(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in KINDS if k in out["brokers"]]
    labels = {
        "postgres": "Postgres\n(ours)",
        "redis": "Redis",
        "redis-aof": "Redis\nAOF always",
        "rabbitmq": "RabbitMQ",
        "rabbitmq-confirms": "RabbitMQ\nconfirms",
    }
    colors = {
        "postgres": "#336791",
        "redis": "#d82c20",
        "redis-aof": "#8c1c13",
        "rabbitmq": "#ff6600",
        "rabbitmq-confirms": "#b34700",
    }
    b = out["brokers"]
    fig, axes = plt.subplots(2, 4, figsize=(22, 9))

    def bars(ax: Any, key: str, title: str, unit: str, digits: int = 0) -> None:
        values = [b[k].get(key) or 0 for k in kinds]
        ax.bar(range(len(kinds)), values, color=[colors[k] for k in kinds])
        ax.set_xticks(range(len(kinds)), [labels[k] for k in kinds], fontsize=8)
        for i, v in enumerate(values):
            ax.annotate(f"{v:,.{digits}f}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(unit)

    bars(axes[0][0], "single_send_per_s", "single send() (ours, AOF, confirms: durable)", "messages/s")
    bars(axes[0][1], "threaded_send_per_s", f"send() from {SEND_THREADS} threads, in all", "messages/s")
    bars(axes[0][2], "bulk_enqueue_per_s", "bulk enqueue (best means each)", "messages/s")
    if "postgres" in b:
        axes[0][2].axhline(50_000, color="gray", ls="--", lw=1, label="target 50k/s")
        axes[0][2].legend(loc="upper right", fontsize=8)
    bars(axes[0][3], "drain_per_s", f"drain, {out['plan']['backlog']:,}-message backlog", "messages/s")
    bars(axes[1][1], "worker_startup_s", "worker start-up (to the first message)", "s", 2)

    ax = axes[1][0]
    width = 0.38
    for j, (key, name) in enumerate((("p50_ms", "p50"), ("p99_ms", "p99"))):
        values = [b[k].get("latency", {}).get(key) or 0 for k in kinds]
        xs = [i + (j - 0.5) * width for i in range(len(kinds))]
        ax.bar(xs, values, width, label=name, color=[colors[k] for k in kinds], alpha=1.0 if j == 0 else 0.55)
        for x, v in zip(xs, values, strict=True):
            ax.annotate(f"{v:.1f}", (x, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(kinds)), [labels[k] for k in kinds], fontsize=8)
    floor = (out.get("floors") or {}).get("insert_notify_claim_handoff_paced_p50_ms")
    if floor:
        ax.axhline(1.2 * floor, color="gray", ls="--", lw=1, label="target p50: 1.2x the floor")
    confirms = b.get("rabbitmq-confirms", {}).get("latency", {})
    if confirms:
        ax.axhline(2 * confirms["p99_ms"], color="gray", ls=":", lw=1, label="target p99: 2x RabbitMQ-confirms'")
    ax.set_yscale("log")
    ax.set_title(f"idle latency send->actor start ({out['plan']['latency_rate']:.0f} msg/s)")
    ax.set_ylabel("ms (log)")
    ax.legend(fontsize=8)

    backlog = out.get("backlog")
    if backlog:
        ns = list(backlog)
        ax = axes[1][2]
        rates = [backlog[n]["drain_per_s"] for n in ns]
        ax.bar([f"{int(n):,}" for n in ns], rates, color=colors["postgres"])
        for i, v in enumerate(rates):
            ax.annotate(f"{v:,.0f}", (i, v), ha="center", va="bottom", fontsize=9)
        ax.set_title("ours: drain rate by backlog size")
        ax.set_ylabel("messages/s")
        ax.set_xlabel("backlog (messages)")

        ax = axes[1][3]
        rss = [max(backlog[n]["peak_rss_mb_per_process"].values(), default=0) for n in ns]
        sizes = [backlog[n]["size_with_backlog_bytes"] / 2**20 for n in ns]
        after = [backlog[n].get("size_after_compact_bytes", backlog[n]["size_after_vacuum_bytes"]) / 2**20 for n in ns]
        xs = list(range(len(ns)))
        ax.bar([x - 0.27 for x in xs], rss, 0.27, label="peak worker RSS/process", color="#6a994e")
        ax.bar(xs, sizes, 0.27, label="table+indexes with backlog", color="#bc6c25")
        ax.bar([x + 0.27 for x in xs], after, 0.27, label="table+indexes drained, compacted", color="#dda15e")
        ax.set_xticks(xs, [f"{int(n):,}" for n in ns])
        ax.set_title("ours: memory and table size")
        ax.set_ylabel("MB")
        ax.set_xlabel("backlog (messages)")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(rss + sizes) * 1.35)
    else:
        axes[1][2].axis("off")
        axes[1][3].axis("off")

    meta = out["meta"]
    fig.suptitle(
        f"dramatiq-pg-fenced benchmark ({out['plan']['name']}): {PROCESSES} worker processes x {THREADS} threads, "
        f"{meta['cpus']} CPUs, load avg at start {meta['loadavg_start'][0]:.2f}, {meta['started']}"
        + (", ours on a PostgreSQL server of its own" if meta.get("pg_server", "").startswith("own") else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def compile_sources() -> list[str]:
    """Byte-compile this checkout's package and the benchmark's app module, as ``pip install``
    compiles an installed wheel (and as the other brokers' packages are, in site-packages).

    An editable checkout has no ``.pyc`` files, and with ``PYTHONDONTWRITEBYTECODE`` set none
    are ever written: every worker process would compile our modules from source at start-up
    (about 25-40 ms per process here), which a user of the package never pays.
    """
    done = []
    for path in (REPO / "dramatiq_pg_fenced", REPO / "benchmarks"):
        if compileall.compile_dir(str(path), quiet=1, maxlevels=0):
            done.append(str(path.relative_to(REPO)))
    return done


def git_commit() -> str | None:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small smoke run (under 2 minutes)")
    parser.add_argument("--brokers", default=",".join(KINDS), help="comma-separated subset of %(default)s")
    parser.add_argument("--no-backlog", action="store_true", help="skip the 10k/200k backlog part")
    parser.add_argument("--pg-url", default=os.environ.get("BENCH_PG_URL") or apps.PG_URL)
    parser.add_argument("--pg-options", default="{}", help="JSON of extra PostgresBroker options (for tuning)")
    parser.add_argument("--out", type=Path, default=None, help="results path stem (default: results/<full|quick>)")
    parser.add_argument(
        "--own-server",
        action="store_true",
        help="run ours on a PostgreSQL server of the benchmark's own (initdb, fsync on, stopped at the end), as"
        " redis-aof runs on its own: a shared server's WAL carries the other sessions' writes, and every commit"
        " of ours waits for them too",
    )
    args = parser.parse_args(argv)
    server = None
    if args.own_server:
        tests = str(REPO / "tests")
        if tests not in sys.path:
            sys.path.insert(0, tests)
        from test_faults import OwnedServer

        server = OwnedServer(fsync="on", max_connections="100")
    try:
        if server is not None:
            with psycopg.connect(server.url, autocommit=True) as conn:
                conn.execute("CREATE DATABASE bench")
                warm_up(conn)
            args.pg_url = server.url.rsplit("/", 1)[0] + "/bench"
        return run(args, parser)
    finally:
        if server is not None:
            server.close()


def warm_up(conn: psycopg.Connection) -> None:
    """Give a fresh server WAL segments to recycle, as a server in service has: about 200 MB of WAL, then a
    checkpoint.  A fresh cluster creates (and zero-fills) every WAL segment its first minutes write, and
    the first round's commits paid for it (in two runs, ours alone was slower in the first round than
    in all others)."""
    conn.execute("CREATE TABLE bench_warm_up AS SELECT g, repeat('x', 100) AS x FROM generate_series(1, 1500000) g")
    conn.execute("DROP TABLE bench_warm_up")
    conn.execute("CHECKPOINT")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    plan = QUICK if args.quick else FULL
    kinds = [k.strip() for k in args.brokers.split(",") if k.strip()]
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown broker {k!r}")
    options = json.loads(args.pg_options)
    os.environ["BENCH_PG_URL"] = args.pg_url
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or RESULTS / plan.name

    out: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "commit": git_commit(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
            "python": platform.python_version(),
            "dramatiq": dramatiq.__version__,
            "processes": PROCESSES,
            "threads": THREADS,
            "note": "2-core machine shared with other jobs; compare ratios from the same run",
            "pg_server": "own (initdb, fsync on)" if args.own_server else "shared",
        },
        "plan": plan.__dict__,
        "brokers": {k: {} for k in kinds},
    }
    out["meta"]["byte_compiled"] = compile_sources()
    log(f"{plan.name} run, brokers {kinds}, load average {os.getloadavg()}")
    begun = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="dramatiq-bench-") as tmpdir:
        tmp = Path(tmpdir)
        drivers: list[Driver] = []
        pg: PostgresDriver | None = None
        try:
            for kind in kinds:
                if kind == "postgres":
                    pg = PostgresDriver(plan, tmp, args.pg_url, options)
                    drivers.append(pg)
                else:
                    drivers.append(DRIVERS[kind](plan, tmp))
            for d in drivers:
                d.fresh()
                out["meta"].update(d.versions())
            side_by_side(drivers, plan, tmp, out)
            if pg is not None:
                out["brokers"]["postgres"]["single_send_relaxed_per_s"] = relaxed_single(
                    args.pg_url, options, plan, tmp
                )
                log(
                    f"postgres single send, synchronous_commit=False: {out['brokers']['postgres']['single_send_relaxed_per_s']:.0f}/s"
                )
                out["floors"] = floors(args.pg_url, plan)
                log(f"floors: {out['floors']}")
                if not args.no_backlog:
                    backlog_scaling(pg, plan, tmp, out)
        except BaseException:
            for path in sorted(tmp.glob("workers-*.log")):
                tail = path.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {path.name} (last lines)\n" + "\n".join(tail), file=sys.stderr)
            raise
        finally:
            for d in drivers:
                with contextlib.suppress(Exception):
                    d.shutdown()
    out["meta"]["loadavg_end"] = os.getloadavg()
    out["meta"]["seconds"] = round(time.monotonic() - begun, 1)
    out["targets"] = targets(out, plan)
    text = table(out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{stem}.json").write_text(json.dumps(out, indent=2, default=str) + "\n")
    chart(out, Path(f"{stem}.png"))
    print()
    print(text)
    print()
    log(f"done in {out['meta']['seconds']:.0f} s; wrote {stem}.json and {stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
