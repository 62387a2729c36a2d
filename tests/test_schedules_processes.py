"""Three scheduler processes, one one-second schedule, no leader: exactly one message per tick.

Real OS processes (``dramatiq-pg-fenced scheduler tests.apps.schedule_app``),
real signals: one is SIGKILLed midway, another paused with SIGSTOP for a few
seconds and let go.  The messages are counted against the ticks of the
window: every second between the first and the last tick has one message,
no second has two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from helpers import query, wait_for

from dramatiq_pg_fenced import PostgresBroker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
APP = "tests.apps.schedule_app"


@pytest.fixture
def schedulers(dramatiq_pg_url: str, tmp_path: Path) -> Iterator[Callable[[PostgresBroker], subprocess.Popen]]:
    """``start(broker)``: a standalone scheduler process on *broker*'s schema (killed at teardown)."""
    started: list[subprocess.Popen] = []

    def start(broker: PostgresBroker) -> subprocess.Popen:
        env = dict(os.environ, DRAMATIQ_PG_URL=dramatiq_pg_url, DRAMATIQ_PG_SCHEMA=broker.schema, PYTHONUNBUFFERED="1")
        with open(tmp_path / f"scheduler-{len(started)}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq_pg_fenced.cli", "scheduler", APP],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def ticks_of(broker: PostgresBroker) -> Counter[datetime]:
    """Messages per tick, read from the messages themselves (their ``tick`` option)."""
    rows = query(broker, "SELECT payload FROM {schema}.message UNION ALL SELECT payload FROM {schema}.history")
    return Counter(datetime.fromisoformat(json.loads(bytes(r[0]))["options"]["tick"]) for r in rows)


def db_now(broker: PostgresBroker) -> datetime:
    return query(broker, "SELECT clock_timestamp()")[0][0]


def test_three_schedulers_one_killed_one_paused_enqueue_each_tick_exactly_once(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    schedulers: Callable[[PostgresBroker], subprocess.Popen],
) -> None:
    broker = dramatiq_pg_broker_factory()
    procs = [schedulers(broker) for _ in range(3)]
    wait_for(lambda: len(ticks_of(broker)) >= 2, timeout=60, what="the first ticks")

    time.sleep(4)
    killed_at = db_now(broker)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait()
    time.sleep(3)
    paused_at = db_now(broker)
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(5)
    os.kill(procs[1].pid, signal.SIGCONT)
    resumed_at = db_now(broker)
    time.sleep(4)
    for proc in procs[1:]:
        proc.terminate()
    for proc in procs[1:]:
        assert proc.wait(timeout=30) == 0

    counts = ticks_of(broker)
    assert max(counts.values()) == 1, f"ticks enqueued twice: {[t for t, n in counts.items() if n > 1]}"
    first, last = min(counts), max(counts)
    expected = int((last - first) / timedelta(seconds=1)) + 1
    missing = [first + timedelta(seconds=i) for i in range(expected) if first + timedelta(seconds=i) not in counts]
    assert not missing, f"ticks with no message: {missing}"
    assert len(counts) == expected
    # The window spans the kill and the pause, and every tick is a whole second.
    assert first < killed_at and paused_at < resumed_at < last
    assert all(t.microsecond == 0 for t in counts)
    # The tick records agree with the messages, one by one.
    recorded = query(broker, "SELECT tick, message_id FROM {schema}.schedule_tick")
    assert sorted(t for t, _ in recorded) == sorted(counts)
    (last_tick, last_message) = query(broker, "SELECT last_tick, last_message_id FROM {schema}.schedule")[0]
    assert last_tick == last and (last, last_message) in set(recorded)
