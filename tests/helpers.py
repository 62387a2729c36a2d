"""Helpers shared by the test modules (imported as ``helpers``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
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


def query(broker: PostgresBroker, text: str, params: Any = None) -> list[tuple]:
    """Run *text* with ``{schema}`` bound to the broker's schema."""
    stmt = sql.SQL(text).format(schema=sql.Identifier(broker.schema))
    with broker.database.connection() as conn:
        cur = conn.execute(stmt, params)
        return cur.fetchall() if cur.description else []


def listening(backend: Any, key: str) -> bool:
    """Does *backend* (results or rate limits) wait for a notification on *key* in this process?"""
    doorbell = backend.database.started_doorbell(backend.channel)
    return doorbell is not None and doorbell.has_waiters(key)


def acked(broker: PostgresBroker, message_id: str, attempt: int | None = None) -> bool:
    """Was the message acked (it is in the history, state ``done``), by *attempt* if given?"""
    info = broker.inspect(message_id)
    return info is not None and info["state"] == "done" and attempt in (None, info["attempt"])
