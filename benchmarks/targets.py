"""The targets the results are held against (docs/performance.md)."""

from __future__ import annotations

from typing import Any

from .drivers import SEND_THREADS
from .plan import Plan


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
    cpu = floor.get("import_cpu_s", {})
    ours_import, least_import = cpu.get("ours"), cpu.get("postgres")
    add(
        "import dramatiq_pg_fenced vs its floor (dramatiq, psycopg, psycopg_pool), CPU",
        None if ours_import is None or not least_import else ours_import / least_import,
        1.1,
        "x",
        higher=False,
        bound=1.0,  # it imports them
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
