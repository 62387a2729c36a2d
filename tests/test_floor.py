"""Where claims start (floors.Floor): past the dead head of the claim index, yet nothing is left behind.

A consumer that saw its queue drained claims from a floor a little before
that moment instead of from the head of the index; these tests put rows
behind that floor in every way one can get there and check that they are
claimed: at once when something announces them (a rescue, a release, a
resume), and by the next look back at the head otherwise (a late commit, a
priority no actor here has).
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from helpers import expire_and_rescue, query, wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import floor as floors
from dramatiq_pg_fenced.core.consumer import PostgresConsumer
from dramatiq_pg_fenced.core.floor import HEAD


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory(poll_interval=0.1, rescue_interval=3600)
    dramatiq.set_broker(broker)

    @dramatiq.actor(queue_name="floor")
    def work(n: int) -> None:
        pass

    return broker


@pytest.fixture
def no_look_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Claims from the head only when told to (an hour apart otherwise)."""
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 3600.0)


@pytest.fixture
def starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, Any, int]]]:
    """Where each claim of the test started."""
    seen: list[tuple[int, Any, int]] = []
    real = floors.Floor.start

    def start(self: floors.Floor) -> tuple[int, Any, int]:
        where = real(self)
        seen.append(where)
        return where

    monkeypatch.setattr(floors.Floor, "start", start)
    yield seen


def send(broker: PostgresBroker, n: int) -> Message:
    return broker.enqueue(Message(queue_name="floor", actor_name="work", args=(n,), kwargs={}, options={}))


def next_message(c: PostgresConsumer, timeout: float = 10.0) -> Any:
    return wait_for(lambda: next(c), timeout=timeout, what="a delivery")


def listening(broker: PostgresBroker) -> None:
    """Wait until *broker*'s process listens: a few round trips after its first consumer (its seats and
    its queues' door first, turns.py), and as it begins every queue looks back once."""
    wait_for(lambda: broker.parts.turns.hearing() is not None, 10, "the process to listen")


def drained_floor(broker: PostgresBroker, c: PostgresConsumer) -> Any:
    """Claim one message from the head with the queue otherwise empty: the floor is set after it."""
    c.floor.forget()
    proxy = next_message(c)
    assert c.floor.at is not None, "a short claim from the head sets the floor"
    return proxy


def test_claims_start_at_the_floor_once_the_queue_was_seen_drained(
    broker: PostgresBroker, no_look_back: None, starts: list
) -> None:
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        listening(broker)
        send(broker, 0)
        first = drained_floor(broker, c)
        starts.clear()
        send(broker, 1)
        second = next_message(c)
        assert tuple(second.args) == (1,)
        assert starts and all(s is not HEAD for s in starts), starts  # claimed from the floor, not the head
        c.ack(first)
        c.ack(second)
    finally:
        c.close()


def test_a_rescued_message_behind_the_floor_is_claimed_at_once(broker: PostgresBroker, no_look_back: None) -> None:
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        old = send(broker, 0)
        held = next_message(c)  # the row of `old` is now running, with its old place in line
        time.sleep(0.4)  # the next floor (claim time - 250 ms) lies after `old`'s place
        send(broker, 1)
        newer = drained_floor(broker, c)
        assert query(
            broker,
            "SELECT available_at < %s FROM {schema}.message WHERE message_id = %s",
            [c.floor.at[0], old.message_id],
        ) == [(True,)]
        # Its holder vanished: the lease lapses and maintenance (of any process) puts it back.
        broker.parts.leases.release(held.message_id, held.delivery)  # this process forgets it, as a crashed one would
        assert expire_and_rescue(broker, "message_id = %s", [old.message_id]) == 1
        again = next_message(c)
        assert again.message_id == old.message_id and again.attempt == 2
        c.ack(newer)
        c.ack(again)
    finally:
        c.close()


def test_released_messages_behind_the_floor_are_claimed_at_once(
    broker: PostgresBroker, dramatiq_pg_broker_factory: Callable[..., PostgresBroker], no_look_back: None
) -> None:
    other = dramatiq_pg_broker_factory(schema=broker.schema, poll_interval=0.1, rescue_interval=3600)
    dramatiq.actor(queue_name="floor", actor_name="work", broker=other)(lambda n: None)
    c = broker.consume("floor", prefetch=4, timeout=200)
    listening(broker)  # the process that claims is the one that listens for the queue: the other waits
    leaving = other.consume("floor", prefetch=4, timeout=200)
    try:
        old = send(broker, 0)
        prefetched = next_message(leaving)  # another process took it and then shuts down
        time.sleep(0.4)
        send(broker, 1)
        newer = drained_floor(broker, c)
        leaving.requeue([prefetched])  # released at its old place in line
        again = next_message(c)
        assert again.message_id == old.message_id
        c.ack(newer)
        c.ack(again)
    finally:
        leaving.close()
        c.close()


def test_a_resumed_queue_is_claimed_from_the_head(broker: PostgresBroker, no_look_back: None) -> None:
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        listening(broker)  # the resume's "!back" reaches a process that listens
        send(broker, 0)
        first = drained_floor(broker, c)
        broker.pause("floor")
        # A row at an old place in line (an operator's insert, a late commit) while paused.
        late = late_row(broker, priority=0, seconds_ago=60)
        broker.resume("floor")
        got = next_message(c)
        assert got.message_id == late
        c.ack(first)
        c.ack(got)
    finally:
        c.close()


def late_row(broker: PostgresBroker, *, priority: int, seconds_ago: float) -> str:
    """A queued row stamped *seconds_ago*: what an enqueue that commits that much later than it started leaves."""
    message_id = str(uuid.uuid4())
    payload = Message(
        queue_name="floor", actor_name="work", args=(99,), kwargs={}, options={}, message_id=message_id
    ).encode()
    query(
        broker,
        "INSERT INTO {schema}.message (message_id, queue_name, actor_name, priority, available_at, payload)"
        " VALUES (%s, 'floor', 'work', %s, now() - %s * interval '1 second', %s)",
        [message_id, priority, seconds_ago, payload],
    )
    return message_id


@pytest.mark.parametrize("listen", [True, False], ids=["listen", "poll"])
@pytest.mark.parametrize("priority", [0, -5], ids=["late-commit", "unknown-priority"])
def test_rows_behind_the_floor_are_found_by_the_next_look_back(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
    monkeypatch: pytest.MonkeyPatch,
    starts: list,
    listen: bool,
    priority: int,
) -> None:
    # Rows 30 s behind the floor lie behind the window of a listening process's look backs too: the
    # full one finds them (every FULL_LOOK_BACK_EVERY; the next test has the window's).
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 0.3)
    monkeypatch.setattr(floors, "FULL_LOOK_BACK_EVERY", 0.3)
    broker = dramatiq_pg_broker_factory(poll_interval=0.1, rescue_interval=3600, listen=listen)
    dramatiq.actor(queue_name="floor", actor_name="work", broker=broker)(lambda n: None)
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        if listen:
            listening(broker)  # its start's look back is over: the next one must be the floor's
        send(broker, 0)
        first = drained_floor(broker, c)
        # Nothing announces these rows, and they lie before the floor: an enqueue that committed
        # long after it began, and a priority no actor of this process has.
        late = late_row(broker, priority=priority, seconds_ago=30)
        starts.clear()
        got = next_message(c)
        assert got.message_id == late
        assert HEAD in starts  # found by a claim from the head
        c.ack(first)
        c.ack(got)
    finally:
        c.close()


def test_a_listening_process_looks_back_over_the_window_and_to_the_head_only_every_full_look_back(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], monkeypatch: pytest.MonkeyPatch, starts: list
) -> None:
    """Given a listening consumer whose floor is set, I expect its look backs that nothing announced to
    start LOOK_BACK_WINDOW before the floor, not at the head (under a pinned horizon the head is where
    every claimed row's dead entry lies): a row that committed 3 s late is found by one; the probe behind
    the window (every FULL_LOOK_BACK_EVERY, beside the claims) sends no claim to the head while it finds
    nothing; a row 60 s behind the floor is passed by the window's look backs until the probe finds it,
    and the next claim goes to the head for it."""
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 0.2)
    monkeypatch.setattr(floors, "LOOK_BACK_MAX_FACTOR", 1)
    monkeypatch.setattr(floors, "FULL_LOOK_BACK_EVERY", 3600.0)
    broker = dramatiq_pg_broker_factory(poll_interval=0.1, rescue_interval=3600)
    dramatiq.actor(queue_name="floor", actor_name="work", broker=broker)(lambda n: None)
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        listening(broker)
        send(broker, 0)
        first = drained_floor(broker, c)  # a claim from the head: the full look back is an hour away
        late = late_row(broker, priority=0, seconds_ago=3)
        starts.clear()
        got = next_message(c)
        assert got.message_id == late
        assert HEAD not in starts and any(isinstance(s, floors.Window) for s in starts), starts
        window = next(s for s in starts if isinstance(s, floors.Window))
        assert window[1] == c.floor.at[0] - floors.LOOK_BACK_WINDOW or window[1] < c.floor.at[0], window
        c.ack(first)
        c.ack(got)

        starts.clear()
        c.floor._full_due = 0.0  # the probe is due (FULL_LOOK_BACK_EVERY has passed); nothing is behind
        wait_for(lambda: next(c) or c.probes >= 1, 30, "a probe behind the window")
        assert HEAD not in starts, starts

        far = late_row(broker, priority=0, seconds_ago=60)
        starts.clear()
        # Three look backs over the window pass it by (each a claim of its own: the row stays queued).
        wait_for(lambda: next(c) or sum(isinstance(s, floors.Window) for s in starts) >= 3, 30, "three window look backs")
        assert HEAD not in starts, starts
        assert query(broker, "SELECT state FROM {schema}.message WHERE message_id = %s", [far]) == [("queued",)]
        c.floor._full_due = 0.0  # the probe is due again: it finds the row, and the next claim goes to the head
        got = next_message(c)
        assert got.message_id == far
        assert HEAD in starts and c.probes >= 2, (starts, c.probes)
        c.ack(got)
    finally:
        c.close()


def test_a_process_that_does_not_listen_looks_back_to_the_head(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], monkeypatch: pytest.MonkeyPatch, starts: list
) -> None:
    """Without LISTEN no "!back" says a row went back behind the floor: every look back goes to the head."""
    monkeypatch.setattr(floors, "LOOK_BACK_EVERY", 0.2)
    broker = dramatiq_pg_broker_factory(poll_interval=0.1, rescue_interval=3600, listen=False)
    dramatiq.actor(queue_name="floor", actor_name="work", broker=broker)(lambda n: None)
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        assert not c.floor.windowed
        send(broker, 0)
        first = drained_floor(broker, c)
        far = late_row(broker, priority=0, seconds_ago=60)
        starts.clear()
        got = next_message(c)
        assert got.message_id == far and HEAD in starts
        assert not any(isinstance(s, floors.Window) for s in starts), starts
        c.ack(first)
        c.ack(got)
    finally:
        c.close()


def test_a_lost_claim_makes_the_next_claim_look_back(broker: PostgresBroker, no_look_back: None, starts: list) -> None:
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        send(broker, 0)
        first = drained_floor(broker, c)
        broker.parts.lost_claims.add("floor", "someone/floor/9")  # a claim of this process failed in flight
        starts.clear()
        send(broker, 1)
        second = next_message(c)
        assert starts[0] is HEAD, starts
        c.ack(first)
        c.ack(second)
    finally:
        c.close()


def test_a_backlog_drains_in_order_from_the_floor(broker: PostgresBroker, no_look_back: None, starts: list) -> None:
    sent = [send(broker, n).message_id for n in range(7)]
    c = broker.consume("floor", prefetch=2, timeout=200)
    try:
        got = []
        for _ in range(7):
            m = next_message(c)
            got.append(m.message_id)
            c.ack(m)
        assert got == sent
        assert any(s is not HEAD for s in starts)  # full claims set the floor too
    finally:
        c.close()


def test_a_priority_no_actor_here_has_sends_claims_back_to_the_head(broker: PostgresBroker, no_look_back: None) -> None:
    urgent = [late_row(broker, priority=-5, seconds_ago=1) for _ in range(3)]
    c = broker.consume("floor", prefetch=2, timeout=200)
    try:
        first = [next_message(c), next_message(c)]  # a full claim, and its first row is of priority -5
        assert c.floor.at is None
        for m in first:
            c.ack(m)
        third = next_message(c)
        assert {m.message_id for m in [*first, third]} == set(urgent)
        c.ack(third)
    finally:
        c.close()


def test_a_message_sent_in_a_long_transaction_is_claimed_at_its_commit(
    broker: PostgresBroker, dramatiq_pg_url: str, no_look_back: None
) -> None:
    """The outbox: the row's place in line is its transaction's start, long before the floor."""
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        with psycopg.connect(dramatiq_pg_url) as conn:
            conn.execute("SELECT now()")  # the transaction has begun: its now() is fixed
            time.sleep(0.4)
            send(broker, 0)
            first = drained_floor(broker, c)
            with broker.transaction(conn):
                outboxed = send(broker, 1)
            assert next(c) is None  # not committed yet
        got = next_message(c)
        assert got.message_id == outboxed.message_id
        c.ack(first)
        c.ack(got)
    finally:
        c.close()


def test_a_late_commit_behind_the_floor_is_claimed_within_a_second_whatever_the_poll_interval(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_pg_url: str
) -> None:
    """Given a consumer polling every 30 s (LISTEN on) whose floor lies after the start of a
    transaction still open elsewhere; when that transaction inserts a row and rings the queue
    as it commits (an enqueue that committed late: nothing says "!back"), I expect the row
    claimed by the next look back, within a second, not at the next poll 30 s later."""
    broker = dramatiq_pg_broker_factory(poll_interval=30, rescue_interval=3600)
    dramatiq.actor(queue_name="floor", actor_name="work", broker=broker)(lambda n: None)
    c = broker.consume("floor", prefetch=4, timeout=200)
    try:
        with psycopg.connect(dramatiq_pg_url) as conn:
            conn.execute("SELECT now()")  # the transaction has begun: its now() is fixed
            time.sleep(0.4)
            send(broker, 0)
            first = drained_floor(broker, c)  # the floor: 250 ms before this claim, after that now()
            late = str(uuid.uuid4())
            payload = Message(queue_name="floor", actor_name="work", args=(1,), kwargs={}, options={},
                              message_id=late).encode()  # fmt: skip
            insert = (
                "INSERT INTO {}.message (message_id, queue_name, actor_name, payload) VALUES (%s, 'floor', 'work', %s)"
            )
            conn.execute(sql.SQL(insert).format(sql.Identifier(broker.schema)), [late, payload])
            conn.execute("SELECT pg_notify(%s, 'floor')", [broker.channel])  # delivered at the commit
        behind = "SELECT available_at < %s FROM {schema}.message WHERE message_id = %s"
        assert query(broker, behind, [c.floor.at[0], late]) == [(True,)]
        got = next_message(c, timeout=10)  # a generous bound; the next poll would come after 30 s
        assert got.message_id == late
        c.ack(first)
        c.ack(got)
    finally:
        c.close()


def test_a_short_claim_from_the_floor_schedules_a_look_back_that_a_claim_from_the_head_ends() -> None:
    """Without a database: a short claim from the floor (what rang may lie behind it) makes the
    consumer claim from the head within LOOK_BACK_EVERY; a claim from the head clears that, so
    an idle consumer goes back to its poll interval."""
    floor = floors.Floor(0, None, "floor")
    now = datetime.now(timezone.utc)
    row = (None, None, None, None, 0, now, 1, now)  # priority, available_at, seq at 4-6; now() at 7
    assert floor.start() is HEAD
    floor.claimed(HEAD, [row], 4)  # short, from the head: the floor is set, no look back pending
    assert floor.at is not None and floor.look_back_due is None
    start = floor.start()
    assert start is not HEAD
    floor.claimed(start, [row] * 4, 4)  # full: the consumer claims again at once anyway
    assert floor.look_back_due is None
    floor.claimed(start, [], 4)  # short: a look back is due by the head's next turn
    assert floor.look_back_due is not None and floor.look_back_due - time.monotonic() <= floors.LOOK_BACK_EVERY
    floor.claimed(HEAD, [], 4)
    assert floor.look_back_due is None


def test_claims_from_the_head_that_find_nothing_behind_the_floor_come_less_often_up_to_a_bound() -> None:
    """Without a database: given claims from the head that find no row behind the floor (each steps
    over the dead entries an old snapshot keeps at the head of the claim index), I expect the wait
    before the next one to double up to LOOK_BACK_MAX_FACTOR times LOOK_BACK_EVERY, one that finds a
    row behind the floor to set it back, a claim from the floor that found rows to schedule no look
    back, and one that came back empty (what rang may lie behind the floor) to bring it within
    LOOK_BACK_EVERY of the last claim from the head, whatever the wait."""
    floor = floors.Floor(0, None, "floor")
    now = datetime.now(timezone.utc)

    def row(at: datetime, seq: int) -> tuple:
        return (None, None, None, None, 0, at, seq, now)  # priority, available_at, seq at 4-6; now() at 7

    floor.claimed(HEAD, [row(now, 1)], 4)  # short: the floor is set (FLOOR_MARGIN before now())
    waits = []
    for _ in range(6):
        floor.claimed(HEAD, [row(now, 2)], 4)  # its row lies after the floor: nothing behind it
        waits.append(round((floor._head_due - time.monotonic()) / floors.LOOK_BACK_EVERY))
    assert waits == [2, 4, 8, 8, 8, 8]
    start = floor.start()
    assert start is not HEAD
    floor.claimed(start, [row(now, 3)], 4)  # short, but it found rows: no look back scheduled
    assert floor.look_back_due is None
    floor.claimed(start, [], 4)  # empty: a look back within LOOK_BACK_EVERY of the last one
    assert floor.look_back_due is not None and floor.look_back_due - time.monotonic() <= floors.LOOK_BACK_EVERY
    floor.claimed(HEAD, [row(now - timedelta(seconds=5), 4)], 4)  # a row behind the floor: back to every second
    assert floor._head_due - time.monotonic() <= floors.LOOK_BACK_EVERY


def test_the_probe_behind_the_window_sends_a_claim_to_the_head_only_when_it_found_a_row() -> None:
    """Without a database: in a listening process (windowed), a due probe is asked for beside the
    claim from the floor (never a claim from the head in its place); one that found nothing changes
    nothing, one that found a row sends the next claim to the head at once, and one that failed is
    asked for again at the next claim."""
    floor = floors.Floor(0, None, "floor", windowed=True)
    now = datetime.now(timezone.utc)
    row = (None, None, None, None, 0, now, 1, now)  # priority, available_at, seq at 4-6; now() at 7
    floor.claimed(HEAD, [row], 4)  # short, from the head: the floor is set, the probe FULL_LOOK_BACK_EVERY away
    assert floor.start() == (0, *floor.at) and not floor.probe_wanted
    floor._full_due = 0.0
    start = floor.start()
    assert start is not HEAD and not isinstance(start, floors.Window) and floor.probe_wanted
    floor.probe_wanted = False  # the consumer starts the probe
    assert floor.start() is not HEAD and not floor.probe_wanted  # not asked twice
    floor.probed(False)
    assert floor.start() is not HEAD
    floor.probed(None)  # failed: asked for again
    floor.start()
    assert floor.probe_wanted
    floor.probe_wanted = False
    floor.probed(True)
    assert floor.look_back_due is not None and floor.start() is HEAD
    floor._head_due = 0.0  # a periodic look back is due: from the window, not the head
    floor.claimed(HEAD, [row], 4)
    floor._head_due = 0.0
    assert isinstance(floor.start(), floors.Window)
    assert not isinstance(floors.Floor(0, None, "floor").start(), floors.Window)  # not windowed: the head


def test_a_claim_that_found_nothing_moves_the_floor_to_the_servers_clock() -> None:
    """Without a database: given claims that found nothing, each with the server's clock read at or
    before its now(), I expect the floor FLOOR_MARGIN before that time (from the head as from the
    floor), never moved back by an earlier reading from the floor, and left alone with no reading
    (before: an empty claim left the floor where it was, or unset, so an idle consumer claimed from
    the head for ever)."""
    floor = floors.Floor(0, None, "floor", windowed=True)
    t = datetime.now(timezone.utc)
    floor.claimed(HEAD, [], 4, None)
    assert floor.at is None and floor.start() is HEAD  # no reading: no proof where the queue stands
    floor.claimed(HEAD, [], 4, t)
    assert floor.at == (t - floors.FLOOR_MARGIN, HEAD[2])
    start = floor.start()
    assert start == (0, t - floors.FLOOR_MARGIN, HEAD[2])
    later = t + timedelta(seconds=3)
    floor.claimed(start, [], 4, later)
    assert floor.at == (later - floors.FLOOR_MARGIN, HEAD[2])
    floor.claimed(floor.start(), [], 4, t)  # an earlier reading: the floor stays
    assert floor.at == (later - floors.FLOOR_MARGIN, HEAD[2])
    floor.claimed(floor.start(), [], 4, None)
    assert floor.at == (later - floors.FLOOR_MARGIN, HEAD[2])


def test_the_servers_clock_is_read_at_or_before_a_statements_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a database: the offset kept is the largest reading (each is at most the true one), a
    reading lower by more than FLOOR_MARGIN replaces it (the server's clock stepped back: lower is
    safe), and a clock not read for CLOCK_FRESH_FOR seconds gives no time."""
    clock = floors.ServerClock()
    assert clock.before(100.0) is None
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    clock.observe(base, received=10.0)  # offset: base - 10 s
    assert clock.before(11.0) == base + timedelta(seconds=1)
    clock.observe(base + timedelta(seconds=1, milliseconds=5), received=11.0)  # an answer that came quicker
    assert clock.before(12.0) == base + timedelta(seconds=2, milliseconds=5)
    clock.observe(base + timedelta(seconds=1, milliseconds=900), received=12.0)  # 105 ms lower: latency
    assert clock.before(12.0) == base + timedelta(seconds=2, milliseconds=5)
    clock.observe(base + timedelta(seconds=2), received=13.0)  # 1 s lower: the server's clock stepped back
    assert clock.before(13.0) == base + timedelta(seconds=2)
    assert clock.before(13.0 + floors.CLOCK_FRESH_FOR + 1) is None


def test_an_idle_consumer_claims_from_its_floor_not_from_the_head(
    broker: PostgresBroker, no_look_back: None, starts: list
) -> None:
    """Given a listening consumer whose claims find nothing (another process takes every message), I
    expect one claim from the head, then claims from a floor that follows the server's clock (never
    ahead of it): under a pinned horizon each claim from the head steps over every entry the pin
    keeps dead.  A message sent then is still claimed."""
    c = broker.consume("floor", prefetch=4, timeout=100)
    try:
        listening(broker)
        c.floor.forget()
        starts.clear()
        floors_seen = []

        def claimed_nothing_after(claims: int) -> bool:
            return next(c) is None and len(starts) > claims

        for _ in range(3):
            wait_for(functools.partial(claimed_nothing_after, len(starts)), 10, "an empty claim")
            floors_seen.append(c.floor.at)
            (server_now,) = query(broker, "SELECT now()")[0]
            assert c.floor.at is not None and c.floor.at[0] <= server_now - floors.FLOOR_MARGIN
        assert starts[0] is HEAD and all(s is not HEAD for s in starts[1:]), starts
        assert floors_seen == sorted(floors_seen) and floors_seen[0] < floors_seen[-1]
        send(broker, 7)
        got = next_message(c)
        assert tuple(got.args) == (7,)
        c.ack(got)
    finally:
        c.close()
