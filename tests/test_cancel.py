"""Cancellation and inspection, with an in-process Dramatiq worker on a real database."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage
from helpers import running_worker, wait_for

from dramatiq_pg_fenced import CancelOutcome, PostgresBroker


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory(lease_seconds=5, rescue_interval=0.2, poll_interval=0.1)
    broker.add_middleware(CurrentMessage())
    dramatiq.set_broker(broker)
    return broker


def current() -> Any:
    message = CurrentMessage.get_current_message()
    assert message is not None
    return message


def state(broker: PostgresBroker, message_id: str) -> tuple[str, int] | None:
    info = broker.inspect(message_id)
    return None if info is None else (info["state"], info["attempt"])


def make_due(broker: PostgresBroker, message_id: str) -> None:
    """Pretend the message's delay or backoff has passed."""
    with broker.database.connection() as conn:
        conn.execute(
            f"UPDATE {broker.schema}.message SET available_at = now() - interval '1 second' WHERE message_id = %s",
            [message_id],
        )


def test_cancel_queued_message_never_runs(broker: PostgresBroker) -> None:
    ran: list[int] = []

    @dramatiq.actor(queue_name="cq")
    def job(n: int) -> None:
        ran.append(n)

    first, second = job.send(1), job.send(2)
    assert broker.cancel(first.message_id) is CancelOutcome.QUEUED
    assert state(broker, first.message_id) == ("cancelled", 0)
    assert broker.is_cancelled(first.message_id)
    assert not broker.is_cancelled(second.message_id)
    with running_worker(broker, threads=2):
        broker.join("cq", timeout=30_000)  # the cancelled one is older: it would have been claimed first
    assert ran == [2]
    assert state(broker, first.message_id) == ("cancelled", 0)
    assert broker.cancel(first.message_id) is CancelOutcome.ALREADY_CANCELLED
    assert broker.cancel(second.message_id) is CancelOutcome.NOT_FOUND  # acked rows leave the table
    assert broker.cancel("00000000-0000-0000-0000-000000000000") is CancelOutcome.NOT_FOUND


def test_cancel_retry_waiting_for_its_backoff(broker: PostgresBroker) -> None:
    """A message that failed once has attempt 1 while it waits: it is still cancellable, and stays cancelled."""
    ran: list[int] = []

    @dramatiq.actor(queue_name="cr", max_retries=5, min_backoff=60_000, max_backoff=120_000)
    def flaky() -> None:
        ran.append(current().options["attempt"])
        raise RuntimeError("boom")

    @dramatiq.actor(queue_name="cr")
    def sentinel() -> None:
        pass

    message = flaky.send()
    mid = message.message_id
    with running_worker(broker, threads=2):
        wait_for(lambda: state(broker, mid) == ("queued", 1), 30, "the retry to be written")
        info = broker.inspect(mid)
        assert info is not None and info["retries"] == 1 and "boom" in (info["last_error"] or "")
        assert broker.cancel(mid) is CancelOutcome.QUEUED
        assert state(broker, mid) == ("cancelled", 1)
        make_due(broker, mid)  # the backoff "passes"; a still-queued row would now run at once
        sentinel.send()
        broker.join("cr", timeout=30_000)
    assert ran == [1]
    assert state(broker, mid) == ("cancelled", 1)
    assert broker.cancel(mid) is CancelOutcome.ALREADY_CANCELLED


@pytest.mark.parametrize("outcome", ["ack", "nack", "retry"])
def test_cancel_running_message_fences_out_its_outcome(broker: PostgresBroker, outcome: str) -> None:
    """Cancelled while running: the actor can see it; its ack / nack / retry is a no-op counted as
    a cancelled write (not a stale one); the row stays cancelled and the message never runs again."""
    started, go = threading.Event(), threading.Event()
    runs: list[int] = []
    seen: dict[str, bool] = {}

    @dramatiq.actor(queue_name="cx", max_retries=3, min_backoff=1, max_backoff=10)
    def long(outcome: str) -> None:
        message = current()
        runs.append(message.options["attempt"])
        seen["before"] = broker.is_cancelled(message.message_id)
        started.set()
        assert go.wait(30)
        seen["after"] = broker.is_cancelled(message.message_id)
        if outcome != "ack":
            raise RuntimeError(f"fails on purpose ({outcome})")

    @dramatiq.actor(queue_name="cx")
    def sentinel() -> None:
        pass

    options: dict[str, Any] = {"max_retries": 0} if outcome == "nack" else {}
    with running_worker(broker, threads=2):
        message = long.send_with_options(args=(outcome,), **options)
        mid = message.message_id
        assert started.wait(30)
        before = broker.stats()
        assert broker.cancel(mid) is CancelOutcome.RUNNING
        assert state(broker, mid) == ("cancelled", 1)
        go.set()
        wait_for(
            lambda: broker.stats()["process"]["cancelled_writes"] > before["process"]["cancelled_writes"],
            30,
            "the cancelled attempt's outcome to be dropped",
        )
        sentinel.send()
        broker.join("cx", timeout=30_000)
        after = broker.stats()
    assert seen == {"before": False, "after": True}
    assert after["process"]["cancelled_writes"] == before["process"]["cancelled_writes"] + 1
    assert after["process"]["stale_writes"] == before["process"]["stale_writes"]
    assert after["totals"].get("stale_writes", 0) == before["totals"].get("stale_writes", 0)
    assert state(broker, mid) == ("cancelled", 1)
    assert runs == [1]


def test_inspect_shows_what_operators_need(broker: PostgresBroker) -> None:
    started, go = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="ci", max_retries=5, min_backoff=60_000, max_backoff=120_000)
    def inspected(x: int, fail: bool = False) -> None:
        if fail:
            raise ValueError("bad input")
        started.set()
        assert go.wait(30)

    assert broker.inspect("00000000-0000-0000-0000-000000000000") is None

    delayed = inspected.send_with_options(args=(1,), delay=60_000)
    info = broker.inspect(delayed.message_id)
    assert info is not None
    assert {
        "message_id",
        "state",
        "attempt",
        "queue_name",
        "actor_name",
        "retries",
        "enqueued_at",
        "available_at",
        "lease_expires_at",
        "lease_holder",
        "last_error",
    } <= set(info)
    assert info["message_id"] == delayed.message_id
    assert (info["state"], info["attempt"], info["retries"]) == ("queued", 0, 0)
    assert (info["queue_name"], info["actor_name"]) == ("ci", "inspected")
    assert isinstance(info["enqueued_at"], datetime) and info["available_at"] > info["enqueued_at"]
    assert info["lease_expires_at"] is None and info["lease_holder"] is None and info["last_error"] is None
    assert list(info["args"]) == [1]

    with running_worker(broker, threads=2):
        running = inspected.send(2)
        assert started.wait(30)
        info = broker.inspect(running.message_id)
        assert info is not None
        assert (info["state"], info["attempt"]) == ("running", 1)
        assert info["lease_holder"].startswith(broker.consumer_id)
        assert info["lease_expires_at"] is not None and info["lease_expires_at"] > info["enqueued_at"]

        failed = inspected.send(3, fail=True)
        info = wait_for(
            lambda: (i := broker.inspect(failed.message_id)) and i["state"] == "queued" and i["attempt"] == 1 and i,
            30,
            "the retry to be written",
        )
        assert info["retries"] == 1
        assert "bad input" in info["last_error"]
        assert info["lease_expires_at"] is None and info["lease_holder"] is None
        assert info["available_at"] > info["enqueued_at"]
        go.set()
        done = wait_for(
            lambda: (i := broker.inspect(running.message_id)) and i["state"] == "done" and i,
            30,
            "the running message's ack",
        )
    # Acked, it is still known (history, kept for keep_finished): when, which attempt, who, how long.
    assert done["attempt"] == 1 and done["lease_holder"].startswith(broker.consumer_id)
    assert done["claimed_at"] <= done["finished_at"] and 0 <= done["ran_seconds"] < 30
    assert list(done["args"]) == [2] and done["last_error"] is None
    assert [h["attempt"] for h in done["history"]] == [1]


def test_a_cancelled_message_whose_actor_still_runs_says_so_until_it_ends(
    broker: PostgresBroker, dramatiq_pg_url: str
) -> None:
    """Cancelled while its (not interruptible) actor runs: inspect, lists, the CLI and the dashboard say
    "cancel requested, still running on <holder> since <claim>", for longer than a lease, and every
    re-drive is refused; when the actor ends, the message is cancelled like any other, and re-drivable."""
    from test_dashboard import call

    from dramatiq_pg_fenced.cli.command import main
    from dramatiq_pg_fenced.dashboard import dashboard_app
    from dramatiq_pg_fenced.ops import admin

    started, go = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="slow", max_retries=0)
    def slow() -> None:
        started.set()
        assert go.wait(60)

    app = dashboard_app(broker, actions=True)
    with running_worker(broker, threads=2), _finally(go.set):
        message = slow.send()
        mid = message.message_id
        assert started.wait(30)
        assert broker.cancel(mid) is CancelOutcome.RUNNING
        time.sleep(broker.settings.lease_seconds + 1)  # past the lease it had: the keeper keeps it
        assert broker.redrive(mid) is False  # its actor still runs: not again meanwhile
        info = broker.inspect(mid)
        assert info is not None and info["state"] == "cancelled" and info["still_running"] is True
        assert info["ran_seconds"] is None
        assert info["note"] == (
            f"cancel requested, still running on {info['lease_holder']} since {info['claimed_at'].astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
        )
        assert info["lease_holder"].startswith(broker.consumer_id)
        # Every re-drive is refused meanwhile, saying why
        refused = admin.redrive(broker.database, broker.statements, [mid], None)
        assert refused.skipped[mid].startswith("cancel requested, still running on ")
        assert main(["--url", dramatiq_pg_url, "--schema", broker.schema, "redrive", mid]) == 1
        (row,) = broker.list_messages("slow", "cancelled").rows
        assert row["still_running"] is True
        _, _, page = call(app, f"/message/{mid}")
        assert "cancel requested, still running on" in page and "Re-drive" not in page
        status, headers, _ = call(app, "/action", "POST", {"token": app.token, "action": "redrive", "message_id": mid})
        assert "not+re-driven%3A+cancel+requested%2C+still+running" in headers["Location"]
        assert state(broker, mid) == ("cancelled", 1)
        # When the actor ends, its outcome is dropped and the message no longer runs
        go.set()
        info = wait_for(lambda: (i := broker.inspect(mid)) and not i["still_running"] and i, 10, "the end")
    assert info["state"] == "cancelled" and info["lease_expires_at"] is None and "note" not in info
    _, _, page = call(app, f"/message/{mid}")
    assert "still running" not in page and "Re-drive" in page
    assert broker.redrive(mid) is True


def test_a_cancelled_message_that_never_started_is_not_shown_running(broker: PostgresBroker) -> None:
    """Cancelled while prefetched (one thread, busy): within a keeper's tick it no longer looks running."""
    started, go = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="pre")
    def busy(n: int) -> None:
        started.set()
        assert go.wait(60)

    with running_worker(broker, threads=1, prefetch=2), _finally(go.set):
        first, second = busy.send(1), busy.send(2)
        assert started.wait(30)
        wait_for(lambda: state(broker, second.message_id) == ("running", 1), 10, "the prefetch")
        assert broker.cancel(second.message_id) is CancelOutcome.RUNNING
        wait_for(
            lambda: not broker.inspect(second.message_id)["still_running"],
            broker.settings.lease_seconds / 3 + 3,
            "the keeper to see it never started",
        )
        assert broker.inspect(first.message_id)["state"] == "running"
        go.set()


@contextmanager
def _finally(release: Callable[[], object]) -> Iterator[None]:
    """Call *release* however the block ends (a failed test must not leave a worker thread waiting)."""
    try:
        yield
    finally:
        release()
