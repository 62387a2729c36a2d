"""Wake one, not all (turns.py): of the processes that consume a set of queues, one listens.

PostgreSQL makes every listening backend of a database read every NOTIFY in
a transaction of its own, on any channel; so one process per set of queues
holds the set's door and LISTENs, and the others wait for it.  Given such
processes, I expect one of them to listen; a ring to reach a process that
has room (the door passes on when its holder is full); a queue that the
door's holder does not consume to have a listener of its own; and a message
to be delivered when the door's holder is stopped, by the others.  Their idle
polls are an hour apart here: only a ring delivers within the tests' time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import dramatiq
import psycopg
import pytest
from helpers import stop_process, wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import turns
from dramatiq_pg_fenced.core.consumer import PostgresConsumer
from dramatiq_pg_fenced.db import doorbell


@pytest.fixture
def quick_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The listeners read who holds a seat every 0.2 s, and a waiter waits 0.4 s for the door at a time."""
    monkeypatch.setattr(doorbell, "CHECK_EVERY", 0.1)
    monkeypatch.setattr(turns, "REFRESH_EVERY", 0.2)
    monkeypatch.setattr(turns, "DUTY", 0.5)


def send(broker: PostgresBroker, queue: str, n: int) -> str:
    message = dramatiq.Message(queue_name=queue, actor_name="nobody", args=(n,), kwargs={}, options={})
    broker.enqueue(message)
    return message.message_id


class Consuming:
    """A consumer on its own thread: what it delivered; acks at once unless told to hold."""

    def __init__(self, consumer: PostgresConsumer, *, hold: bool = False) -> None:
        self.consumer, self.hold = consumer, hold
        self.delivered: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            message = next(self.consumer)
            if message is not None:
                self.delivered.append(message.message_id)
                if not self.hold:
                    self.consumer.ack(message)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def brokers(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker],
) -> Iterator[Callable[[int], list[PostgresBroker]]]:
    def make(count: int) -> list[PostgresBroker]:
        first = dramatiq_pg_broker_factory(poll_interval=3600, rescue_interval=3600)
        return [first] + [
            dramatiq_pg_broker_factory(schema=first.schema, poll_interval=3600, rescue_interval=3600)
            for _ in range(count - 1)
        ]

    yield make


def listening(brokers: list[PostgresBroker]) -> list[PostgresBroker]:
    return [b for b in brokers if b.parts.turns.hearing() is not None]


def test_one_process_of_a_set_of_queues_listens_and_another_when_it_goes(
    brokers: Callable[[int], list[PostgresBroker]], quick_turns: None
) -> None:
    given = brokers(3)
    for b in given:
        b.declare_queue("q")
    running = [Consuming(b.consume("q", prefetch=2, timeout=100)) for b in given]
    try:
        wait_for(lambda: len(listening(given)) == 1, 15, "one process to listen")
        time.sleep(1.0)
        assert len(listening(given)) == 1  # and only one, for as long as it is there
        first = listening(given)[0]
        running[given.index(first)].close()
        first.close()  # its LISTEN connection ends: the door is free
        left = [b for b in given if b is not first]
        wait_for(lambda: len(listening(left)) == 1, 15, "another process to listen")
        sent = send(left[0], "q", 1)
        wait_for(lambda: any(sent in c.delivered for c in running), 15, "the message to be delivered")
    finally:
        for c in running:
            c.close()


def test_a_ring_for_a_full_listener_reaches_a_process_with_room(
    brokers: Callable[[int], list[PostgresBroker]], quick_turns: None
) -> None:
    given = brokers(2)
    for b in given:
        b.declare_queue("q")
    running = [Consuming(b.consume("q", prefetch=1, timeout=100), hold=True) for b in given]
    try:
        wait_for(lambda: len(listening(given)) == 1, 15, "one process to listen")
        holder = running[given.index(listening(given)[0])]
        wait_for(lambda: holder.consumer.turns._waiting == 1, 15, "the listener to see the other waiting")  # type: ignore[union-attr]
        first = send(given[0], "q", 1)
        wait_for(lambda: first in holder.delivered, 15, "the listener to take the first message")
        # When the listener is full (prefetch 1, held), a second message rings.
        second = send(given[0], "q", 2)
        other = running[1 - running.index(holder)]
        wait_for(lambda: second in other.delivered, 15, "the process with room to take the second")
        assert holder.delivered == [first]
    finally:
        for c in running:
            c.close()


def test_a_queue_the_listener_does_not_consume_has_a_listener_of_its_own(
    brokers: Callable[[int], list[PostgresBroker]], quick_turns: None
) -> None:
    a, b = brokers(2)
    a.declare_queue("a")
    b.declare_queue("b")
    running = [Consuming(a.consume("a", prefetch=2, timeout=100)), Consuming(b.consume("b", prefetch=2, timeout=100))]
    try:
        wait_for(lambda: len(listening([a, b])) == 2, 15, "each set of queues to have its listener")
        time.sleep(0.5)  # the rings after LISTEN are answered
        sent = [send(a, "b", 1), send(b, "a", 2)]
        wait_for(lambda: sent[0] in running[1].delivered, 15, "queue b's message to be delivered")
        wait_for(lambda: sent[1] in running[0].delivered, 15, "queue a's message to be delivered")
    finally:
        for c in running:
            c.close()


def as_older_version(t: turns.Turns) -> None:
    """Make *t* behave as a process of the version before doors: it listens to every ring, takes no
    seat in ``WAKE_ONE``, and answers rings in turn by rank."""
    real_check = t.check

    def check(conn: psycopg.Connection) -> bool:
        with t._lock:
            t._seated.add(turns.WAKE_ONE)  # as if taken: never is
        return real_check(conn)

    t.check = check  # type: ignore[method-assign]
    t.door_group = lambda: None  # type: ignore[method-assign]


def test_an_older_process_and_a_new_one_both_deliver(
    brokers: Callable[[int], list[PostgresBroker]], quick_turns: None
) -> None:
    old, new = brokers(2)
    as_older_version(old.parts.turns)
    for b in (old, new):
        b.declare_queue("q")
    running = [Consuming(b.consume("q", prefetch=2, timeout=100)) for b in (old, new)]
    try:
        wait_for(lambda: len(listening([old, new])) == 2, 15, "both to listen (the older one always does)")
        wait_for(lambda: (new.parts.turns.seat("q") or (0, 0))[1] == 2, 15, "the new one to see both seats")
        assert new.parts.turns.others_listen()  # so its claims say "!took" for the older one
        sent = []
        for n in range(6):
            sent.append(send(new, "q", n))
            wait_for(lambda: sent[-1] in running[0].delivered + running[1].delivered, 15, "the message")
        delivered = running[0].delivered + running[1].delivered
        assert sorted(delivered) == sorted(sent)  # each once
    finally:
        for c in running:
            c.close()


@pytest.mark.parametrize("durable", [False, True])
def test_a_claim_says_took_only_in_its_telling_form_and_only_when_it_took_rows_and_came_back_short(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], durable: bool
) -> None:
    """The usual claim is one UPDATE and notifies nothing; the form used while an older process
    listens says ``!took`` in its own commit when it took rows and left the queue drained (short of
    its limit), and not when it took none or a full limit (more may wait)."""
    from dramatiq_pg_fenced.core.consumer import with_limit
    from dramatiq_pg_fenced.core.floor import HEAD

    broker = dramatiq_pg_broker_factory(durable_outcomes=durable)
    broker.declare_queue("q")
    st = broker.statements
    plain, telling = (st.claim, st.claim_telling) if durable else (st.claim_relaxed, st.claim_telling_relaxed)
    channel = f"took_{os.getpid()}_{int(durable)}"
    params = {
        "queue": "q",
        "lease": 30,
        "consumer": "test",
        "from_priority": HEAD[0],
        "from_at": HEAD[1],
        "from_seq": HEAD[2],
        "channel": channel,
        "took": "!took q test",
    }
    with psycopg.connect(broker.url, autocommit=True) as listener, psycopg.connect(broker.url, autocommit=True) as conn:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))

        def claim(statement: bytes, limit: int) -> tuple[int, list[str]]:
            rows = conn.execute(with_limit(statement, limit), {**params, "limit": limit}).fetchall()
            return len(rows), [n.payload for n in listener.notifies(timeout=0.3)]

        for n in range(5):
            send(broker, "q", n)
        assert claim(plain, 2) == (2, [])  # the usual claim: nothing told
        assert claim(plain, 1) == (1, [])
        assert claim(telling, 1) == (1, [])  # a full limit: more may wait
        assert claim(telling, 4) == (1, ["!took q test"])  # short: the queue is drained for now
        assert claim(telling, 4) == (0, [])  # nothing taken: nothing answered


# -- real processes ------------------------------------------------------------
def ledger(broker: PostgresBroker) -> Callable[[], dict[int, int]]:
    schema = sql.Identifier(broker.schema)
    with broker.database.connection() as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.ledger (n integer NOT NULL, pid integer NOT NULL)").format(schema))

    def read() -> dict[int, int]:
        with broker.database.connection() as conn:
            return dict(conn.execute(sql.SQL("SELECT n, pid FROM {}.ledger").format(schema)).fetchall())

    return read


#: The queues a Dramatiq worker of wake_app consumes by default (delays are the database's: no delay queue).
DEFAULT = ["default"]


def door_holder(broker: PostgresBroker, queues: list[str]) -> int | None:
    """The pid of the worker process whose LISTEN connection holds the door of *queues* (all the
    queues it consumes)."""
    key = turns.lock_key(broker.schema, "door " + "\0".join(sorted(queues)))
    with broker.database.connection() as conn:
        row = conn.execute(
            "SELECT a.application_name FROM pg_locks AS l JOIN pg_stat_activity AS a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = %s::int::oid AND l.objid = 0"
            " AND l.objsubid = 2",
            [key],
        ).fetchone()
    return int(row[0].removeprefix("wake-")) if row and row[0].startswith("wake-") else None


@pytest.mark.slow
def test_a_stopped_listener_s_messages_are_delivered_by_the_others(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_cli: Callable[..., subprocess.Popen]
) -> None:
    broker = dramatiq_pg_broker_factory()
    broker.declare_queue("default")
    read = ledger(broker)
    cli = dramatiq_cli(broker, "tests.apps.wake_app", "--processes", "3", "--threads", "1")
    stopped: int | None = None
    try:
        wait_for(lambda: door_holder(broker, DEFAULT) is not None, 30, "a worker process to hold the door")
        broker.enqueue(
            dramatiq.Message(queue_name="default", actor_name="record_default", args=(0,), kwargs={}, options={})
        )
        wait_for(lambda: 0 in read(), 30, "the first message to be delivered")
        stopped = door_holder(broker, DEFAULT)
        assert stopped is not None
        stop_process(stopped)  # it would hear the next rings, and cannot answer them
        for n in range(1, 6):
            message = dramatiq.Message(
                queue_name="default", actor_name="record_default", args=(n,), kwargs={}, options={}
            )
            broker.enqueue(message)
        wait_for(lambda: len(read()) == 6, 60, "the others to deliver what rang for the stopped one")
        assert stopped not in {read()[n] for n in range(1, 6)}
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        cli.send_signal(signal.SIGTERM)
        cli.wait(60)


@pytest.mark.slow
def test_a_process_that_does_not_consume_the_queue_does_not_take_its_rings(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], dramatiq_cli: Callable[..., subprocess.Popen]
) -> None:
    broker = dramatiq_pg_broker_factory()
    for q in ("a", "b"):
        broker.declare_queue(q)
    read = ledger(broker)
    os.environ["WAKE_QUEUES"] = "a"
    try:
        only_a = dramatiq_cli(broker, "tests.apps.wake_app", "--processes", "2", "--threads", "1")
        os.environ["WAKE_QUEUES"] = "a,b"
        both = dramatiq_cli(broker, "tests.apps.wake_app", "--processes", "1", "--threads", "1")
    finally:
        os.environ.pop("WAKE_QUEUES", None)
    try:
        wait_for(
            lambda: door_holder(broker, ["a"]) is not None and door_holder(broker, ["a", "b"]) is not None,
            30,
            "each set of queues to have its listener",
        )
        for n in range(4):
            message = dramatiq.Message(queue_name="b", actor_name="record_b", args=(n,), kwargs={}, options={})
            broker.enqueue(message)
        wait_for(lambda: len(read()) == 4, 30, "queue b's messages to be delivered")
        for n in range(4, 8):
            message = dramatiq.Message(queue_name="a", actor_name="record_a", args=(n,), kwargs={}, options={})
            broker.enqueue(message)
        wait_for(lambda: len(read()) == 8, 30, "queue a's messages to be delivered")
    finally:
        for cli in (only_a, both):
            cli.send_signal(signal.SIGTERM)
        for cli in (only_a, both):
            cli.wait(60)
