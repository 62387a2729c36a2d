"""The floors of this package's own statements (claim rungs) and the backlog's scaling."""

from __future__ import annotations

import queue
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg  # noqa: E402
from dramatiq.message import Message  # noqa: E402
from psycopg import sql  # noqa: E402

from benchmarks import apps  # noqa: E402
from dramatiq_pg_fenced import PostgresBroker  # noqa: E402

from .drivers import PostgresDriver, _loop_rate, _threaded_rate, measure_drain, percentile, running_workers
from .plan import Plan, log
from .sides import IMPORTS, import_cpu_seconds, import_seconds, stub_drain


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
        # (a plan of one repeat, --quick's, is a smoke run: fewer fresh interpreters)
        "import_s": {name: import_seconds(modules, runs=5 if plan.repeats > 1 else 1) for name, modules in IMPORTS.items()},
        "import_cpu_s": import_cpu_seconds(runs=9 if plan.repeats > 1 else 1),
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
