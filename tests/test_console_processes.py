"""Worker processes as the console shows them: real ``dramatiq`` CLI processes register, count what
they run and what waits in their prefetch, go stale when killed and leave when stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import dramatiq
import pytest
from helpers import query, wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import processes
from dramatiq_pg_fenced.core.leases import Leases
from dramatiq_pg_fenced.ops import metrics

pytestmark = pytest.mark.slow

APP = "tests.apps.console_app"


def gate(broker: PostgresBroker) -> Callable[[int], None]:
    """Create the app's gate table; returns ``open(n)``: the actor waiting for *n* returns."""
    table = sql.SQL("{}.gate").format(sql.Identifier(broker.schema))
    with broker.database.connection() as conn:
        conn.execute(sql.SQL("CREATE TABLE {} (n integer NOT NULL)").format(table))

    def open_(n: int) -> None:
        with broker.database.connection() as conn:
            conn.execute(sql.SQL("INSERT INTO {} (n) VALUES (%s)").format(table), [n])

    return open_


def send(broker: PostgresBroker, *ns: int) -> None:
    broker.declare_queue("gated")
    broker.enqueue_many(
        dramatiq.Message(queue_name="gated", actor_name="wait", args=(n,), kwargs={}, options={}) for n in ns
    )


def test_worker_processes_register_count_their_work_go_stale_when_killed_and_leave_when_stopped(
    dramatiq_pg_url: str,
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    dramatiq_cli: Callable[..., subprocess.Popen],
) -> None:
    # Given two worker processes of two threads each (a prefetch of four per process)
    broker = dramatiq_pg_broker_factory()
    release = gate(broker)
    cli = dramatiq_cli(broker, APP, "--processes", "2", "--threads", "2")
    found = wait_for(lambda: len(broker.processes()) == 2 and broker.processes(), what="two processes")
    for p in found:
        assert p["queues"] == ["gated"] and p["threads"] == 2 and not p["stale"]
        assert p["version"] == processes.package_version() and p["pid"] != cli.pid
        assert (p["busy"], p["prefetched"]) == (0, 0)
        assert p["host"] == os.uname().nodename and p["process_id"].startswith(f"{p['host']}:{p['pid']}:")
    # (and the maintenance loop of one of them took the charts' sample of this minute)
    assert wait_for(lambda: query(broker, "SELECT count(*) FROM {schema}.queue_minute WHERE queue_name = ''")[0][0])
    # When twelve messages that hold their thread are sent: each process runs two and prefetches two
    send(broker, *range(12))

    def settled() -> list[dict] | None:
        now = broker.processes()
        counts = sorted((p["busy"], p["prefetched"]) for p in now)
        return now if counts == [(2, 2), (2, 2)] else None

    now = wait_for(settled, what="each process busy with 2 and 2 prefetched")
    assert all(p["per_queue"] == {"gated": {"busy": 2, "prefetched": 2}} for p in now)
    # (the running list tells each message apart: four started, four waiting in a prefetch)
    running = broker.list_messages("gated", "running").rows
    assert sorted(r["started"] for r in running) == [False] * 4 + [True] * 4
    # (the overview tells the same: 4 running, 4 prefetched, 4 queued)
    (row,) = wait_for(
        lambda: [q for q in broker.queue_overview() if q["queue"] == "gated" and q["running"] == 4] or None,
        what="the overview's split",
    )
    assert (row["running"], row["prefetched"], row["queued"]) == (4, 4, 4)
    states = broker.stats()["queues"]["gated"]
    assert (states["running"], states["prefetched"], states["queued"]) == (4, 4, 4)
    scrape = metrics.exposition(metrics.registry(broker.database, broker.statements)).decode()
    assert 'dramatiq_pg_messages{queue="gated",state="running"} 4.0' in scrape
    assert 'dramatiq_pg_messages{queue="gated",state="prefetched"} 4.0' in scrape
    url = dramatiq_pg_url
    shown = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "--schema", broker.schema, "stats", "--json"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (listed,) = [q for q in json.loads(shown)["queues"] if q["queue"] == "gated"]
    assert (listed["running"], listed["prefetched"]) == (4, 4)
    listed_processes = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "--schema", broker.schema, "processes"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    assert listed_processes[0].split() == [
        "process", "queues", "threads", "busy", "prefetched", "started", "heartbeat", "version", "status",
    ]  # fmt: skip
    assert sorted(line.split()[:5] for line in listed_processes[1:]) == sorted(
        [p["process_id"], "gated", "2", "2", "2"] for p in now
    )

    # When one process is SIGKILLed, it is stale after a few missed heartbeats; the other is not
    victim = now[0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(
        lambda: {p["pid"]: p["stale"] for p in broker.processes(stale_after=1.0)}.get(victim["pid"]) is True,
        what="the killed process shown stale",
    )
    beats = {p["pid"]: p["heartbeat_at"] for p in broker.processes()}
    wait_for(
        lambda: any(p["heartbeat_at"] > beats[p["pid"]] for p in broker.processes() if p["pid"] != victim["pid"]),
        what="another heartbeat of the survivor",
    )
    after = {p["pid"]: p for p in broker.processes(stale_after=1.0)}
    assert after[victim["pid"]]["heartbeat_at"] == beats[victim["pid"]]  # no heartbeat since
    # (the CLI's main process stops the other one when a child dies: a clean shutdown)
    for n in range(12):
        release(n)
    try:
        cli.wait(60)
    except subprocess.TimeoutExpired:
        cli.send_signal(signal.SIGTERM)
        cli.wait(60)
    # Then the process that stopped cleanly deleted its row; the killed one's stays, stale, until purged
    left = broker.processes(stale_after=1.0)
    assert [(p["pid"], p["stale"]) for p in left] == [(victim["pid"], True)]
    with broker.database.connection() as conn:
        conn.execute(broker.statements.process_purge, [0])
    assert broker.processes() == []


def test_a_process_counts_started_deliveries_busy_and_unstarted_ones_prefetched_until_their_outcome() -> None:
    # Given a process holding three deliveries of one queue and one of another
    leases = Leases()
    for n, queue in enumerate(["a", "a", "a", "b"]):
        leases.hold(queue, f"m{n}", 1, f"t{n}")
    # When one starts, one is cancelled before it starts and one of "a" is settled after starting
    assert leases.start("m0", "t0") and leases.start("m1", "t1")
    leases.settle("m1")
    leases.mark_cancelled("m2")
    # Then "a" has one busy and none prefetched (a cancelled one never starts), "b" one prefetched
    assert leases.activity() == {"a": (1, 0), "b": (0, 1)}
    assert leases.running() == ["m0"]


def test_a_process_is_stale_after_three_of_its_own_heartbeat_intervals(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    # Given two processes last heard 100 s ago, one beating every 10 s, one every 60 s (a long rescue interval)
    for name, every in (("fast", 10.0), ("slow", 60.0)):
        with broker.database.connection() as conn:
            conn.execute(broker.statements.process_beat, {
                "id": f"h:1:{name}", "host": "h", "pid": 1, "queues": ["q"], "threads": 1, "busy": 1, "prefetched": 0,
                "per_queue": '{"q": [1, 0]}', "running": [], "running_since": [], "version": "x", "beat_seconds": every,
            })  # fmt: skip
    query(broker, "UPDATE {schema}.process SET heartbeat_at = now() - interval '100 s'")
    # Then only the one that missed three of its heartbeats is stale, and only the other's counts are believed
    assert {p["process_id"]: p["stale"] for p in broker.processes()} == {"h:1:fast": True, "h:1:slow": False}
    with broker.database.connection() as conn:
        busy = conn.execute(broker.statements.process_busy, {"beats": processes.STALE_AFTER_BEATS}).fetchall()
    assert busy == [("q", 1)]  # the overview's running count: the slow one's busy thread only
