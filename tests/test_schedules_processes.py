"""Scheduler processes, one one-second schedule, no leader: exactly one message per tick.

Real OS processes (``dramatiq-pg-fenced scheduler tests.apps.schedule_app``),
real signals: one is SIGKILLed midway, another paused with SIGSTOP for a few
seconds and let go; in a rolling deploy, an old process starts again after the
new ones.  The messages are counted against the ticks of the window: every
second between the first and the last tick has one message, no second has two.
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
from failure_report import on_failure, process_log, schema_rows
from helpers import query, stop_process, wait_for

from dramatiq_pg_fenced import PostgresBroker

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
APP = "tests.apps.schedule_app"


@pytest.fixture
def schedulers(
    dramatiq_pg_url: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[..., subprocess.Popen]]:
    """``start(broker, **env)``: a standalone scheduler process on *broker*'s schema (killed at teardown).
    If the test fails, its report shows each scheduler's log and the schema's rows."""
    started: list[subprocess.Popen] = []
    schemas: set[str] = set()

    def start(broker: PostgresBroker, **env_vars: str) -> subprocess.Popen:
        env = dict(os.environ, DRAMATIQ_PG_URL=dramatiq_pg_url, DRAMATIQ_PG_SCHEMA=broker.schema, PYTHONUNBUFFERED="1")
        env.update(env_vars)
        log_path = tmp_path / f"scheduler-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dramatiq_pg_fenced.cli", "scheduler", APP],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        started.append(proc)
        on_failure(request.node, f"log of scheduler {len(started)} ({log_path.name})", process_log(proc, log_path))
        if broker.schema not in schemas:
            schemas.add(broker.schema)
            on_failure(request.node, f"rows of schema {broker.schema}", schema_rows(dramatiq_pg_url, broker.schema))
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
    schedulers: Callable[..., subprocess.Popen],
) -> None:
    # ~15-20 s: three scheduler processes start (~2 s each under load), then a kill, a 5 s pause and
    # the ticks after each (one a second): the scenario is wall-clock time.
    broker = dramatiq_pg_broker_factory()
    procs = [schedulers(broker) for _ in range(3)]
    wait_for(lambda: len(ticks_of(broker)) >= 2, timeout=60, what="the first ticks")

    def ticks_past(moment: datetime, seconds: int) -> None:
        """Wait for the tick *seconds* after *moment* to be enqueued (by whichever scheduler is left)."""
        wait_for(lambda: max(ticks_of(broker)) >= moment + timedelta(seconds=seconds), 30, f"the ticks after {moment}")

    killed_at = db_now(broker)
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait()
    ticks_past(killed_at, 3)
    paused_at = db_now(broker)
    stop_process(procs[1].pid)
    time.sleep(5)  # the fault itself: a scheduler paused for 5 s (past its turn) while the third goes on
    os.kill(procs[1].pid, signal.SIGCONT)
    resumed_at = db_now(broker)
    ticks_past(resumed_at, 3)
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


def labels_of(broker: PostgresBroker) -> dict[datetime, str]:
    """The ``label`` each tick's message carries (which version of the code defined it)."""
    rows = query(broker, "SELECT payload FROM {schema}.message UNION ALL SELECT payload FROM {schema}.history")
    found = {}
    for (payload,) in rows:
        message = json.loads(bytes(payload))
        found[datetime.fromisoformat(message["options"]["tick"])] = message["kwargs"].get("label", "")
    return found


def test_a_rolling_deploy_switches_to_the_new_definition_once_even_when_an_old_process_restarts_after_it(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    schedulers: Callable[..., subprocess.Popen],
) -> None:
    broker = dramatiq_pg_broker_factory()
    # Given two processes of the old code
    olds = [schedulers(broker, SCHEDULE_LABEL="old") for _ in range(2)]
    wait_for(lambda: len(ticks_of(broker)) >= 2, timeout=60, what="the old code's first ticks")
    # When a process of the new code (other arguments) starts
    schedulers(broker, SCHEDULE_LABEL="new")
    wait_for(lambda: "new" in labels_of(broker).values(), timeout=60, what="the new code's first tick")
    # and then an old process starts again (a crash, a rescheduled pod), after the new one
    os.kill(olds[0].pid, signal.SIGKILL)
    olds[0].wait()
    restarted_at = db_now(broker)
    schedulers(broker, SCHEDULE_LABEL="old")
    time.sleep(6)
    stopped_at = db_now(broker)

    # I expect every tick once, none lost at the switch, and the old definition never back
    counts = ticks_of(broker)
    assert max(counts.values()) == 1, f"ticks enqueued twice: {[t for t, n in counts.items() if n > 1]}"
    first, last = min(counts), max(counts)
    assert len(counts) == int((last - first) / timedelta(seconds=1)) + 1, "a tick is missing"
    labels = [label for _, label in sorted(labels_of(broker).items())]
    switch = labels.index("new")
    assert set(labels[:switch]) == {"old"} and set(labels[switch:]) == {"new"}, labels
    assert [t for t in counts if restarted_at < t <= stopped_at]  # the restarted old process ran meanwhile
