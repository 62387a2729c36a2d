"""The benchmark's floors (``benchmarks/run.py``) run against the test database.

The benchmark itself needs Redis and RabbitMQ and is run by hand; the floors
need only PostgreSQL, and the targets table leans on them, so they are run
here on a tiny plan.  Nothing here asserts a timing: only that every floor
was measured and that the scratch schema is gone afterwards.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psycopg
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import run  # noqa: E402

TINY = run.Plan("tiny", 1, 10, 20, 0.2, 3, 100.0, 10, 10, 10, 1)


def _floor_schemas(url: str) -> list[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\\_floor\\_%'").fetchall()
    return [r[0] for r in rows]


def test_floors_measure_each_step_and_leave_no_schema(dramatiq_pg_url: str) -> None:
    before = set(_floor_schemas(dramatiq_pg_url))
    floor = run.floors(dramatiq_pg_url, TINY)
    for key in (
        "durable_insert_per_s",
        "durable_insert_message_table_per_s",
        "durable_insert_message_table_notify_per_s",
        "durable_insert_paced_p50_ms",
        "insert_then_claim_paced_p50_ms",
        "insert_notify_claim_paced_p50_ms",
        "insert_notify_claim_handoff_paced_p50_ms",
    ):
        assert floor[key] > 0, key
    assert floor["insert_notify_claim_handoff_paced_p50_ms"] >= floor["insert_notify_claim_paced_p50_ms"]
    assert set(floor["import_s"]) == set(run.IMPORTS)
    assert floor["import_s"]["postgres"] > 0 and floor["import_s"]["ours"] > 0
    # pika and redis come with the bench extra; without it their import floors are None, not a failure
    assert all(v is None or v > 0 for v in floor["import_s"].values())
    assert set(floor["import_cpu_s"]) == set(run.IMPORTS)
    assert floor["import_cpu_s"]["postgres"] > 0 and floor["import_cpu_s"]["ours"] > 0
    assert set(_floor_schemas(dramatiq_pg_url)) == before


def test_the_targets_take_their_bounds_from_the_floors() -> None:
    out = {
        "brokers": {
            "postgres": {"single_send_per_s": 1000.0, "latency": {"p50_ms": 3.0, "p99_ms": 5.0}},
            "redis": {"single_send_per_s": 4000.0},
            "rabbitmq": {"latency": {"p50_ms": 1.5, "p99_ms": 3.0}},
        },
        "floors": {
            "durable_insert_per_s": 4000.0,
            "durable_insert_message_table_per_s": 3000.0,
            "durable_insert_message_table_notify_per_s": 2800.0,
            "insert_notify_claim_paced_p50_ms": 1.6,
            "insert_notify_claim_handoff_paced_p50_ms": 1.8,
            "import_s": {},
        },
    }
    rows = {r["target"]: r for r in run.targets(out, TINY)}
    assert rows["single send vs Redis (ours durable)"]["bound"] == pytest.approx(0.7)
    assert rows["idle latency p50 vs RabbitMQ"]["bound"] == pytest.approx(1.2)
    assert rows["idle latency p50 vs RabbitMQ"]["value"] == pytest.approx(2.0)


def test_the_import_target_is_ours_over_the_least_a_psycopg_broker_imports() -> None:
    out = {"brokers": {}, "floors": {"import_s": {}, "import_cpu_s": {"postgres": 0.2, "ours": 0.21}}}
    rows = {r["target"]: r for r in run.targets(out, TINY)}
    row = rows["import dramatiq_pg_fenced vs its floor (dramatiq, psycopg, psycopg_pool), CPU"]
    assert row["value"] == pytest.approx(1.05) and row["met"] and row["bound"] == 1.0


def test_the_benchmark_byte_compiles_every_module_of_the_package() -> None:
    """Given an environment that writes no bytecode (PYTHONDONTWRITEBYTECODE), I expect every module of the
    package compiled before workers start, those of its folders (core/, db/, ...) too: else each worker
    compiles them from source at start-up, which no user of the installed wheel pays."""
    import importlib.util

    run.compile_sources()
    missing = [
        str(path.relative_to(REPO))
        for path in (REPO / "dramatiq_pg_fenced").rglob("*.py")
        if not Path(importlib.util.cache_from_source(str(path))).exists()
    ]
    assert missing == []
