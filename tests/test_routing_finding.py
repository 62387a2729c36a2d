"""Finding a message over several databases (issue 36, points 4 and 5): a cancel finds a message a
relay is moving between two databases, and a database that does not answer stops neither cancel
nor inspect in the others (it is named instead)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import Factory, wait_for
from psycopg import sql

from dramatiq_pg_fenced import CancelOutcome, PostgresBroker
from dramatiq_pg_fenced.cli.command import main
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.ops.finding import Unreachable
from dramatiq_pg_fenced.routing import relay as relaying
from dramatiq_pg_fenced.routing.router import RoutedBroker

#: A port nobody listens on: the URL of a database that is down.
DOWN_URL = "postgresql://postgres@127.0.0.1:1/test"


def outbox_message(shard: PostgresBroker, queue: str) -> dramatiq.Message:
    """A message of *queue* written straight into *shard*'s table (an outbox row if routed elsewhere)."""
    shard.declare_queue(queue)
    return shard.enqueue(dramatiq.Message(queue_name=queue, actor_name="job", args=(), kwargs={}, options={}))


def states(shard: PostgresBroker) -> list[tuple[str, str, int]]:
    with psycopg.connect(shard.url, autocommit=True) as c:
        query = sql.SQL("SELECT message_id::text, state, attempt FROM {}.message ORDER BY 1")
        return [(str(i), str(s), int(a)) for i, s, a in c.execute(query.format(sql.Identifier(shard.schema)))]


def lock_waits(shard: PostgresBroker) -> set[tuple[int, Any]]:
    """(pid, query start) of the sessions on *shard*'s schema waiting for a row lock (on its schema: the
    other tests running at the same time, pytest-xdist, wait for locks in the same database)."""
    with psycopg.connect(shard.url, autocommit=True) as c:
        rows = c.execute(
            "SELECT pid, query_start FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            " AND strpos(query, %s) > 0",
            [shard.schema],
        ).fetchall()
    return {(int(p), q) for p, q in rows}


@pytest.fixture
def two(dramatiq_pg_broker_factory: Factory) -> Iterator[RoutedBroker]:
    """Queue "a" in "first" (the default) and "b" in "second"; "first" comes first (the old cancel asked
    it first: for an outbox row of "a" in "second", the target before the source)."""
    first, second = dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()
    router = RoutedBroker(brokers={"first": first, "second": second}, routes={"b": "second"}, default="first")
    router.declare_queue("a")
    try:
        yield router
    finally:
        router.close()


@pytest.fixture
def held_relay(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(held, release): the relay stops with its batch taken in the source (deleted there, locked,
    not committed), before its insert in the target, until *release* is set."""
    held, release = threading.Event(), threading.Event()

    def hold(stage: str, source: str, target: str, ids: list[str]) -> None:
        if stage == "taken":
            held.set()
            assert release.wait(60), "the test never released the relay"

    monkeypatch.setattr(relaying, "_relay_hook", hold)
    yield held, release
    release.set()


def relay_in_thread(router: RoutedBroker, name: str) -> tuple[threading.Thread, list[Any]]:
    moved: list[Any] = []

    def relay() -> None:
        try:
            moved.append(router.relay(name))
        except RuntimeError as e:  # the hook's failure
            moved.append(e)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    return thread, moved


def cancel_in_thread(router: RoutedBroker, message_id: str) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(router.cancel(message_id)), daemon=True)
    thread.start()
    return thread, out


def test_a_cancel_during_a_relays_move_cancels_the_message_in_its_database(
    two: RoutedBroker, held_relay: tuple[threading.Event, threading.Event]
) -> None:
    """Given an outbox row of queue "a" in "second", and its relay held with the row taken there,
    before its insert in "first", I expect a cancel from another thread to wait for the move and
    cancel the message in "first" (it asked "first", then "second", and missed it in both):
    cancelled, never delivered."""
    held, release = held_relay
    first, second = two.shards["first"], two.shards["second"]
    message = outbox_message(second, "a")
    relay, moved = relay_in_thread(two, "second")
    assert held.wait(30)
    before = lock_waits(second)
    canceller, out = cancel_in_thread(two, message.message_id)
    wait_for(lambda: lock_waits(second) - before, timeout=30)  # the cancel waits for the relay's lock
    release.set()
    relay.join(30)
    canceller.join(60)
    assert moved == [1]
    assert out == [CancelOutcome.QUEUED]
    assert states(first) == [(message.message_id, "cancelled", 0)]
    assert states(second) == []


def test_a_cancel_outlasting_its_lock_timeout_on_a_relays_move_waits_for_the_move(
    two: RoutedBroker, held_relay: tuple[threading.Event, threading.Event]
) -> None:
    """Given the relay held longer than the cancel's lock timeout (two lock waits seen in a row),
    I expect the cancel not to answer in_fenced_transaction (a relay is no fenced transaction) but
    to wait for the move, then cancel the message where it went."""
    held, release = held_relay
    first, second = two.shards["first"], two.shards["second"]
    message = outbox_message(second, "a")
    relay, _ = relay_in_thread(two, "second")
    assert held.wait(30)
    before = lock_waits(second)
    canceller, out = cancel_in_thread(two, message.message_id)
    seen: set[tuple[int, Any]] = set()

    def two_waits() -> bool:
        seen.update(lock_waits(second) - before)
        return len(seen) >= 2 or not canceller.is_alive()

    wait_for(two_waits, timeout=30)
    release.set()
    relay.join(30)
    canceller.join(60)
    assert out == [CancelOutcome.QUEUED]
    assert states(first) == [(message.message_id, "cancelled", 0)]


def test_a_relay_that_fails_between_its_commits_leaves_no_copy_of_a_cancelled_message_to_run(
    two: RoutedBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an outbox row of queue "b" in "first" whose relay fails after its insert committed in
    "second" (its delete in "first" rolls back: the row is in both until a relay moves it again,
    which inserts nothing), and a cancel waiting meanwhile, I expect the message cancelled in both
    databases (the cancel did not stop at the outbox's copy, asked first), and a relay afterwards
    to move nothing: no copy of it is ever queued."""
    held, release = threading.Event(), threading.Event()

    def fail(stage: str, source: str, target: str, ids: list[str]) -> None:
        if stage == "inserted":
            held.set()
            release.wait(60)
            raise RuntimeError("the relay dies before its delete commits")

    monkeypatch.setattr(relaying, "_relay_hook", fail)
    first, second = two.shards["first"], two.shards["second"]
    two.declare_queue("b")
    message = outbox_message(first, "b")
    relay, moved = relay_in_thread(two, "first")
    assert held.wait(30)
    before = lock_waits(first)
    canceller, out = cancel_in_thread(two, message.message_id)
    wait_for(lambda: lock_waits(first) - before, timeout=30)  # the cancel waits for the relay's lock
    release.set()
    relay.join(30)
    canceller.join(60)
    assert isinstance(moved[0], RuntimeError)
    assert out == [CancelOutcome.QUEUED]
    monkeypatch.setattr(relaying, "_relay_hook", lambda *_: None)
    assert two.relay("first") == 0  # a cancelled outbox row is not taken
    assert states(second) == [(message.message_id, "cancelled", 0)]
    assert states(first) == [(message.message_id, "cancelled", 0)]


def test_a_cancelled_outbox_row_is_not_relayed(two: RoutedBroker) -> None:
    """Given an outbox row cancelled before any relay took it, I expect the relay to move nothing:
    it stays cancelled where it is."""
    first, second = two.shards["first"], two.shards["second"]
    message = outbox_message(second, "a")
    assert two.cancel(message.message_id) == CancelOutcome.QUEUED
    assert two.relay("second") == 0
    assert states(second) == [(message.message_id, "cancelled", 0)] and states(first) == []


@pytest.fixture
def with_one_down(dramatiq_pg_broker_factory: Factory) -> Iterator[RoutedBroker]:
    """"down" (asked first; nobody listens on its port) and "first" (the default)."""
    down = PostgresBroker(DOWN_URL, middleware=[], connect_timeout=1)
    router = RoutedBroker(brokers={"down": down, "first": dramatiq_pg_broker_factory()}, routes={"b": "down"},
                          default="first")  # fmt: skip
    try:
        yield router
    finally:
        router.close()


def test_a_database_that_is_down_stops_neither_cancel_nor_inspect_in_the_others(
    with_one_down: RoutedBroker,
) -> None:
    """Given a router whose first database is down, I expect a message of the healthy one inspected
    and cancelled there; an id none of the answering databases holds raises Unreachable naming the
    one that is down (never a plain not_found nor None); stats show the healthy one and name it."""
    router = with_one_down
    message = outbox_message(router.shards["first"], "a")
    assert router.inspect(message.message_id)["database"] == "first"  # type: ignore[index]
    assert router.cancel(message.message_id) == CancelOutcome.QUEUED
    unknown = str(uuid.uuid4())
    with pytest.raises(Unreachable, match="down") as raised:
        router.cancel(unknown)
    assert raised.value.databases == ["down"]
    with pytest.raises(Unreachable, match="down"):
        router.inspect(unknown)
    stats = router.stats()
    assert list(stats["databases"]) == ["first"] and stats["unreachable"] == ["down"]


def test_the_commands_and_the_dashboard_name_a_database_that_is_down(
    dramatiq_pg_url: str, with_one_down: RoutedBroker, capsys: Any
) -> None:
    """Given the command line naming a database that is down and a healthy one, I expect cancel and
    inspect of a message in the healthy one to work there; of an id in none of those that answered,
    the one that is down named on stderr and exit 3; the dashboard's message page likewise."""
    router = with_one_down
    first = router.shards["first"]
    message = outbox_message(first, "a")
    argv = ["--url", f"down={DOWN_URL}", "--url", f"first={dramatiq_pg_url}", "--schema", f"first={first.schema}"]
    assert main([*argv, "inspect", message.message_id]) == 0
    assert '"database": "first"' in capsys.readouterr().out
    assert main([*argv, "cancel", message.message_id]) == 0
    assert capsys.readouterr().out.strip() == "cancelled_queued (database first)"
    unknown = str(uuid.uuid4())
    for command in ("cancel", "inspect"):
        assert main([*argv, command, unknown]) == 3, command
        err = capsys.readouterr().err
        assert "database down did not answer" in err, command
    # The dashboard's message page: found in the healthy one; an unknown id names the missing one
    from test_operating_several import call

    app = dashboard_app(router, actions=True)
    status, _, page = call(app, f"/message/{message.message_id}")
    assert status == "200 OK" and "cancelled" in page
    status, _, page = call(app, f"/message/{unknown}")
    assert status.startswith("503") and "database down did not answer" in page
    # and its cancel acts in the healthy one, or names the missing one
    other = outbox_message(first, "a")
    status, location, _ = call(app, "/action", {"token": app.token, "action": "cancel", "message_id": other.message_id})
    assert "cancel: cancelled_queued (database first)" in location
    status, location, _ = call(app, "/action", {"token": app.token, "action": "cancel", "message_id": unknown})
    assert "cancel: not_found; database down did not answer" in location
