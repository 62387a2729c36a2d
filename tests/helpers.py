"""Helpers shared by the test modules (imported as ``helpers``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

Factory = Callable[..., PostgresBroker]


@contextmanager
def running_worker(
    broker: PostgresBroker, threads: int = 4, prefetch: int | None = None, timeout: int = 100
) -> Iterator[dramatiq.Worker]:
    """An in-process Dramatiq worker on *broker*, stopped (gracefully) at the end."""
    worker = dramatiq.Worker(broker, worker_timeout=timeout, worker_threads=threads)
    if prefetch is not None:
        worker.queue_prefetch = prefetch
    worker.start()
    try:
        yield worker
    finally:
        worker.stop()


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll until *condition* is truthy; fail the test after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def stop_process(pid: int, timeout: float = 30.0) -> None:
    """SIGSTOP *pid* and return once every thread of it is stopped.

    ``kill()`` returns before the stop takes hold: each thread stops at its
    next return from the kernel, and one on another (virtual) CPU may go on a
    while (a CI run saw a stopped worker claim two messages after the call).
    A test whose next step counts on the process being frozen waits for it here."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            return True  # gone: it does nothing either
        states = []
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                continue  # a thread that ended
        return all(state in ("T", "t", "Z", "X") for state in states)

    wait_for(stopped, timeout, f"process {pid} to stop")


def once_reachable(call: Callable[[], Any], timeout: float = 30.0, what: str = "the server") -> Any:
    """*call*'s result, made again while it is refused as unreachable (``ConnectionClosed``).

    After a server's return, this process goes on knowing it unreachable until a connection
    attempt of its own succeeds (the pool tries every ``reconnect.RETRY_INTERVAL``); meanwhile the
    application's calls are refused at once, without waiting (database.py, ``ServerDown``).  A
    test that restarts a server and calls at once waits here for the process to see it back."""
    from dramatiq.errors import ConnectionClosed

    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except ConnectionClosed:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.05)


def clear_of_idle_polls(broker: PostgresBroker, queue_name: str, every: float, seconds: float) -> None:
    """Waits past the next idle poll of *queue_name* if it falls within *seconds*.

    Idle polls fall on a wall-clock grid (turns.py: every *every* seconds, at a fixed offset per
    queue), however long the interval; a test that counts claims and runs across a point of it
    sees the poll's claim too (a test with an hourly poll failed at every half hour).  A consumer that
    only runs when the test asks it for a message owes that poll afterwards: ask it once before counting."""
    wait = broker.parts.turns.until_grid(f"poll {queue_name}", every, group=queue_name)
    if wait < seconds:
        time.sleep(wait + 0.5)


def query(broker: PostgresBroker, text: str, params: Any = None) -> list[tuple]:
    """Run *text* with ``{schema}`` bound to the broker's schema."""
    stmt = sql.SQL(text).format(schema=sql.Identifier(broker.schema))
    with broker.database.connection() as conn:
        cur = conn.execute(stmt, params)
        return cur.fetchall() if cur.description else []


def expire_and_rescue(broker: PostgresBroker, where: str = "TRUE", params: Any = None, timeout: float = 10.0) -> int:
    """Let the leases of the running rows matching *where* lapse and have them taken back; returns how many.

    The test's own ``rescue()`` may find nothing to take back: the process's own chores run too (its
    maintenance rescues every second, its lease keeper extends the leases this process holds), and
    one of them may act between the test's expiry and its rescue (CI: ``rescue() == 1`` saw 0).  So
    this expires and rescues until each of those deliveries (message and attempt) is no longer running,
    whichever rescue took it back.
    """
    held = query(
        broker, f"SELECT message_id, attempt FROM {{schema}}.message WHERE state = 'running' AND ({where})", params
    )
    assert held, f"no running row matches {where!r}"
    ids, attempts = [r[0] for r in held], [r[1] for r in held]
    same = "state = 'running' AND (message_id, attempt) IN (SELECT * FROM unnest(%s::uuid[], %s::int[]))"

    def taken_back() -> bool:
        query(
            broker,
            f"UPDATE {{schema}}.message SET lease_expires_at = now() - interval '1 second' WHERE {same}",
            [ids, attempts],
        )
        broker.parts.maintenance.rescue()
        return not query(broker, f"SELECT 1 FROM {{schema}}.message WHERE {same}", [ids, attempts])

    wait_for(taken_back, timeout, f"the expired leases of {len(held)} running row(s) taken back")
    return len(held)


def listening(backend: Any, key: str) -> bool:
    """Does *backend* (results or rate limits) wait for a notification on *key* in this process?"""
    doorbell = backend.database.started_doorbell(backend.channel)
    return doorbell is not None and doorbell.has_waiters(key)


def acked(broker: PostgresBroker, message_id: str, attempt: int | None = None) -> bool:
    """Was the message acked (it is in the history, state ``done``), by *attempt* if given?"""
    info = broker.inspect(message_id)
    return info is not None and info["state"] == "done" and attempt in (None, info["attempt"])


def messages_in(url: str, schema: str = "dramatiq") -> list[tuple]:
    """Every message row of *schema* (id, queue, state, attempt), in id order."""
    with psycopg.connect(url, autocommit=True) as conn:
        stmt = sql.SQL("SELECT message_id::text, queue_name, state::text, attempt FROM {}.message ORDER BY 1")
        return conn.execute(stmt.format(sql.Identifier(schema))).fetchall()


def sessions_of(admin_url: str, dbname: str) -> int:
    """How many sessions were ever opened on database *dbname* (``pg_stat_database.sessions``), read from
    another database once the count is settled (a backend reports its session as it ends)."""
    last = None
    while True:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            row = conn.execute("SELECT sessions FROM pg_stat_database WHERE datname = %s", [dbname]).fetchone()
        count = int(row[0]) if row else 0
        if count == last:
            return count
        last = count
        time.sleep(1.0)


def ever_stored(broker: PostgresBroker, actor: str) -> int:
    """Messages of *actor* ever stored: queued, running, dead, cancelled or finished (history)."""
    live = query(broker, "SELECT count(*) FROM {schema}.message WHERE actor_name = %s", [actor])[0][0]
    done = query(broker, "SELECT count(*) FROM {schema}.history WHERE actor_name = %s", [actor])[0][0]
    return int(live) + int(done)
