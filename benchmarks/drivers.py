"""One driver per broker the benchmark compares (PostgreSQL, Redis, Redis with AOF, RabbitMQ, RabbitMQ with confirms), and the measurements over a driver: sends, drains, latency, rates."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dramatiq  # noqa: E402
import psycopg  # noqa: E402
from dramatiq.common import current_millis  # noqa: E402
from dramatiq.message import Message  # noqa: E402
from psycopg import sql  # noqa: E402

from benchmarks import apps  # noqa: E402

from .plan import Plan, Workers, cpu_seconds, pids_named, wait_until


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
