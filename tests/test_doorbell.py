"""The LISTEN/NOTIFY doorbell on its own: plain keys ring at once, timed keys when due."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest

from dramatiq_pg_fenced.db.doorbell import Doorbell


@pytest.fixture
def bell(dramatiq_pg_url: str):
    doorbell = Doorbell(dramatiq_pg_url, f"t_bell_{uuid.uuid4().hex[:8]}", timed=True)
    yield doorbell
    doorbell.stop()


def notify(url: str, channel: str, payload: str) -> float:
    """NOTIFY; returns the time just before it was sent."""
    with psycopg.connect(url, autocommit=True) as conn:
        sent = time.monotonic()
        conn.execute("SELECT pg_notify(%s, %s)", [channel, payload])
    return sent


class Stamped(threading.Event):
    """An event that notes when it was set (monotonic): the tests compare when keys rang, in what
    order and how long after the send, instead of how long a wait took on a loaded machine."""

    at: float | None = None

    def set(self) -> None:
        if self.at is None:
            self.at = time.monotonic()
        super().set()

    def clear(self) -> None:
        self.at = None
        super().clear()


def ready(bell: Doorbell, *keys: str) -> list[Stamped]:
    """Subscribe to *keys*, and wait out the listener's connect ring (it rings everyone once)."""
    events = [Stamped() for _ in keys]
    for key, event in zip(keys, events, strict=True):
        bell.subscribe(key, event)
    for event in events:
        assert event.wait(10), "the listener did not connect"
        event.clear()
    return events


def test_a_timed_key_rings_when_due_not_before(bell: Doorbell, dramatiq_pg_url: str) -> None:
    (event,) = ready(bell, "q")
    sent = notify(dramatiq_pg_url, bell.channel, "q\t400")
    assert event.wait(10)
    assert event.at is not None and event.at - sent >= 0.4  # not before it is due (the timer counts from receipt)


def test_a_plain_key_rings_at_once_and_others_stay_quiet(bell: Doorbell, dramatiq_pg_url: str) -> None:
    event, other = ready(bell, "q", "other")
    notify(dramatiq_pg_url, bell.channel, "q")
    assert event.wait(2.0)
    assert not other.is_set()


def test_a_timer_in_a_batch_does_not_swallow_the_rest_of_the_batch(bell: Doorbell, dramatiq_pg_url: str) -> None:
    """One transaction, one packet: a timed key first, plain keys after it; the plain ones ring at once."""
    timed, first, second = ready(bell, "q", "a", "b")
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        sent = time.monotonic()
        conn.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", [bell.channel, ["q\t600", "a", "b"]])
    assert first.wait(10) and second.wait(10) and timed.wait(10)
    assert first.at is not None and second.at is not None and timed.at is not None
    assert first.at < timed.at and second.at < timed.at  # the plain keys did not wait for the timer
    assert timed.at - sent >= 0.6


def test_an_untimed_bell_takes_the_whole_payload_as_the_key(dramatiq_pg_url: str) -> None:
    """Results and rate limits use arbitrary keys: a tab in one is not a due time."""
    doorbell = Doorbell(dramatiq_pg_url, f"t_bell_{uuid.uuid4().hex[:8]}")
    try:
        (event,) = ready(doorbell, "key\t400")
        notify(dramatiq_pg_url, doorbell.channel, "key\t400")
        assert event.wait(0.3)
    finally:
        doorbell.stop()


def test_at_most_max_timers_are_kept_the_farthest_give_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Doorbell, "MAX_TIMERS", 2)
    doorbell = Doorbell("", "unused", timed=True)
    doorbell._add_timer(30.0, "c")
    doorbell._add_timer(10.0, "a")
    doorbell._add_timer(20.0, "b")  # full: "c" (the farthest) gives way
    doorbell._add_timer(40.0, "d")  # full and farther than all: left to the poll
    assert sorted(doorbell._timers) == [(10.0, "a"), (20.0, "b")]
