"""The PostgreSQL rate-limiter backend: Redis semantics, expiry, and contention from real processes."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from dramatiq.errors import RateLimitExceeded
from dramatiq.rate_limits import Barrier, BucketRateLimiter, ConcurrentRateLimiter, WindowRateLimiter
from helpers import Factory, listening, wait_for
from psycopg import sql

from dramatiq_pg_fenced.features.rate_limits import PostgresBackend

SPAWN = multiprocessing.get_context("spawn")  # children start clean: no threads or pools inherited


@pytest.fixture
def schema(dramatiq_pg_broker_factory: Factory) -> str:
    return dramatiq_pg_broker_factory().schema


@pytest.fixture
def backend(dramatiq_pg_url: str, schema: str) -> Iterator[PostgresBackend]:
    backend = PostgresBackend(dramatiq_pg_url, schema=schema)
    yield backend
    backend.close()


def contend(target: Callable[..., None], args: tuple, processes: int) -> list[Any]:
    """Run *target*(*args, start, out) in *processes* fresh processes released at once; what each put in out.

    *start* is a barrier the children and this process wait at: they go when all are ready (an event
    set at once let a child start before the others had even imported, on a loaded machine, and
    finish alone: "they did contend" failed so)."""
    start, out = SPAWN.Barrier(processes + 1), SPAWN.Queue()
    children = [SPAWN.Process(target=target, args=(*args, start, out)) for _ in range(processes)]
    for child in children:
        child.start()
    start.wait(timeout=120)
    results = [out.get(timeout=120) for _ in children]
    for child in children:
        child.join(timeout=30)
    return results


def rows(url: str, schema: str, text: str, params: Any = None) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(sql.SQL(text).format(schema=sql.Identifier(schema)), params)
        return cur.fetchall() if cur.description else []


# -- the backend API, as Dramatiq's Redis backend behaves ------------------------------
def test_add(backend: PostgresBackend) -> None:
    assert backend.add("k", 3, 60_000) is True
    assert backend.add("k", 5, 60_000) is False
    assert backend.incr("k", 0, 3, 60_000) is True  # the value is still 3
    assert backend.incr("k", 1, 3, 60_000) is False


def test_incr_and_decr_respect_their_bounds(backend: PostgresBackend) -> None:
    assert backend.incr("n", 2, 3, 60_000) is True  # absent counts as 0
    assert backend.incr("n", 1, 3, 60_000) is True
    assert backend.incr("n", 1, 3, 60_000) is False
    assert backend.decr("n", 2, 0, 60_000) is True
    assert backend.decr("n", 2, 0, 60_000) is False  # 1 - 2 < 0
    assert backend.decr("n", 1, 0, 60_000) is True
    assert backend.decr("absent", 1, 0, 60_000) is False
    assert backend.incr("absent", 5, 4, 60_000) is False
    # Negative values and amounts beyond the maximum, as with Redis.
    assert backend.decr("neg", 5, -10, 60_000) is True
    assert backend.incr("neg", 7, 3, 60_000) is True  # -5 + 7 = 2 <= 3
    assert backend.incr("neg", 2, 3, 60_000) is False


def test_incr_and_sum(backend: PostgresBackend) -> None:
    keys = ["w@3", "w@2", "w@1"]
    assert backend.incr("w@1", 2, 10, 60_000) is True
    assert backend.incr_and_sum("w@3", lambda: keys, 1, 3, 60_000) is True  # 2 + 1 <= 3
    assert backend.incr_and_sum("w@3", lambda: keys, 1, 3, 60_000) is False  # the window is full
    assert backend.incr_and_sum("w@4", lambda: ["w@4", "w@3"], 1, 3, 60_000) is True  # w@1 left the window
    assert backend.incr_and_sum("x", lambda: ["x"], 4, 3, 60_000) is False


def test_keys_expire(dramatiq_pg_url: str, schema: str, backend: PostgresBackend) -> None:
    assert backend.add("short", 1, 200)
    assert backend.incr("counter", 3, 3, 200)
    assert not backend.add("short", 1, 200)
    wait_for(lambda: backend.add("short", 7, 60_000), what="the key to expire")
    # "counter" expires a moment after "short" (it was set after it): then it counts from 0 again.
    wait_for(lambda: backend.incr("counter", 3, 3, 60_000), what="the counter to expire")
    assert rows(dramatiq_pg_url, schema, "SELECT key, value FROM {schema}.rate_limit ORDER BY key") == [
        ("counter", 3),
        ("short", 7),
    ]
    backend.wait_notify("event", 100)
    wait_for(lambda: rows(dramatiq_pg_url, schema, "SELECT 1 FROM {schema}.rate_limit WHERE expires_at <= now()"))
    backend.purge()
    assert rows(dramatiq_pg_url, schema, "SELECT key FROM {schema}.rate_limit ORDER BY key") == [
        ("counter",),
        ("short",),
    ]


def test_wait_and_wait_notify(backend: PostgresBackend) -> None:
    assert backend.wait("ev", 100) is False
    backend.wait_notify("ev", 60_000)
    assert backend.wait("ev", 0) is True  # an event lasts its ttl, so a late waiter sees it (as with Redis)
    backend.wait_notify("brief", 100)
    assert backend.wait("brief", 0) is True
    wait_for(lambda: not backend.wait("brief", 0), what="the event to expire")


def test_wait_is_woken_by_notify(dramatiq_pg_url: str, schema: str) -> None:
    """The waiter polls once an hour: only the NOTIFY can end its wait early."""
    waiter = PostgresBackend(dramatiq_pg_url, schema=schema, poll_interval=3600)
    notifier = PostgresBackend(dramatiq_pg_url, schema=schema)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.wait("door", 60_000)))
    thread.start()
    try:
        wait_for(lambda: listening(waiter, "door"))
        time.sleep(0.2)
        notifier.wait_notify("door", 60_000)
        thread.join(timeout=30)  # half the waiter's own timeout
        assert not thread.is_alive(), "wait() was not woken by the notification"
        assert got == [True]
    finally:
        thread.join()
        waiter.close()
        notifier.close()


def test_limiters_in_one_process(backend: PostgresBackend) -> None:
    mutex = ConcurrentRateLimiter(backend, f"mutex-{uuid.uuid4()}", limit=1)
    with mutex.acquire():
        with mutex.acquire(raise_on_failure=False) as acquired:
            assert not acquired
        with pytest.raises(RateLimitExceeded):
            with mutex.acquire():
                pass  # pragma: no cover
    with mutex.acquire(raise_on_failure=False) as acquired:
        assert acquired  # released

    bucket = BucketRateLimiter(backend, f"bucket-{uuid.uuid4()}", limit=2, bucket=3_600_000)
    outcomes = []
    for _ in range(3):
        with bucket.acquire(raise_on_failure=False) as acquired:
            outcomes.append(acquired)
    assert outcomes == [True, True, False]

    window = WindowRateLimiter(backend, f"window-{uuid.uuid4()}", limit=2, window=3600)
    outcomes = []
    for _ in range(3):
        with window.acquire(raise_on_failure=False) as acquired:
            outcomes.append(acquired)
    assert outcomes == [True, True, False]


# -- contention from processes ----------------------------------------------------------
def _mutex_worker(url: str, schema: str, key: str, wanted: int, start: Any, out: Any) -> None:
    backend = PostgresBackend(url, schema=schema)
    mutex = ConcurrentRateLimiter(backend, key, limit=1)
    intervals, refused = [], 0
    start.wait()
    deadline = time.monotonic() + 60
    while len(intervals) < wanted and time.monotonic() < deadline:
        with mutex.acquire(raise_on_failure=False) as acquired:
            if acquired:
                begin = time.monotonic_ns()
                time.sleep(0.002)  # hold it a little, so others collide with the holder
                intervals.append((begin, time.monotonic_ns()))
            else:
                refused += 1
    out.put((intervals, refused))
    backend.close()


def test_concurrent_limiter_of_one_never_runs_two_at_once(dramatiq_pg_url: str, schema: str) -> None:
    key, processes, wanted = f"mutex-{uuid.uuid4()}", 4, 15
    results = contend(_mutex_worker, (dramatiq_pg_url, schema, key, wanted), processes)
    intervals = sorted(i for ledger, _ in results for i in ledger)
    assert len(intervals) == processes * wanted
    for (_, end), (begin, _) in zip(intervals, intervals[1:], strict=False):
        assert end < begin, "two holders of a limit-1 ConcurrentRateLimiter overlapped"
    assert sum(refused for _, refused in results) > 0  # they did contend
    assert rows(dramatiq_pg_url, schema, "SELECT value FROM {schema}.rate_limit WHERE key = %s", [key]) == [(0,)]


class _LedgerBackend(PostgresBackend):
    """Records each successful incr_and_sum in the same transaction, so the ledger's
    order is the order in which the limiter's own rows were locked and committed."""

    def _incr_and_sum(self, conn: psycopg.Connection, key: str, summed: list[str], *args: Any) -> bool:
        ok = super()._incr_and_sum(conn, key, summed, *args)
        if ok:
            conn.execute(
                sql.SQL("INSERT INTO {}.window_ledger (key, summed) VALUES (%s, %s)").format(
                    sql.Identifier(self.schema)
                ),
                [key, summed],
            )
        return ok


def _window_worker(url: str, schema: str, key: str, seconds: float, start: Any, out: Any) -> None:
    backend = _LedgerBackend(url, schema=schema)
    limiter = WindowRateLimiter(backend, key, limit=3, window=2)
    granted = refused = 0
    start.wait()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with limiter.acquire(raise_on_failure=False) as acquired:
            if acquired:
                granted += 1
            else:
                refused += 1
    out.put((granted, refused))
    backend.close()


def test_window_limiter_never_exceeds_its_window(dramatiq_pg_url: str, schema: str) -> None:
    """Each grant saw at most limit - 1 earlier grants in its window, across processes."""
    rows(dramatiq_pg_url, schema, "CREATE TABLE {schema}.window_ledger (seq bigserial, key text, summed text[])")
    key, processes = f"window-{uuid.uuid4()}", 3
    results = contend(_window_worker, (dramatiq_pg_url, schema, key, 3.0), processes)
    granted = sum(g for g, _ in results)
    assert granted > 0 and sum(r for _, r in results) > 0
    ledger = rows(dramatiq_pg_url, schema, "SELECT seq, key, summed FROM {schema}.window_ledger ORDER BY seq")
    assert len(ledger) == granted
    for i, (_, _, window) in enumerate(ledger):
        earlier = sum(1 for _, k, _ in ledger[:i] if k in window)
        assert earlier + 1 <= 3, f"grant {i} made {earlier + 1} grants in its window {window}"


def _barrier_party(url: str, schema: str, key: str, start: Any, out: Any) -> None:
    backend = PostgresBackend(url, schema=schema)
    start.wait()
    out.put(Barrier(backend, key).wait(block=False))
    backend.close()


def test_barrier_is_released_exactly_once(dramatiq_pg_url: str, schema: str, backend: PostgresBackend) -> None:
    key, parties = f"barrier-{uuid.uuid4()}", 6
    assert Barrier(backend, key).create(parties)
    assert not Barrier(backend, key).create(parties)  # already there
    released = contend(_barrier_party, (dramatiq_pg_url, schema, key), 6)
    assert released.count(True) == 1
    assert released.count(False) == parties - 1


def test_blocking_barrier_wakes_every_party(dramatiq_pg_url: str, schema: str) -> None:
    """Parties wait with block=True (polling once an hour); the last one to arrive wakes them all."""
    key, parties = f"barrier-{uuid.uuid4()}", 4
    backends = [PostgresBackend(dramatiq_pg_url, schema=schema, poll_interval=3600) for _ in range(parties)]
    try:
        assert Barrier(backends[0], key).create(parties)
        got: list[bool] = []
        waiters = [
            threading.Thread(target=lambda b=b: got.append(Barrier(b, key).wait(timeout=60_000))) for b in backends[:-1]
        ]
        for thread in waiters:
            thread.start()
        for b in backends[:-1]:
            wait_for(lambda b=b: listening(b, f"{key}@events"))
        time.sleep(0.2)
        assert Barrier(backends[-1], key).wait(block=False) is True  # the last party releases it
        for thread in waiters:
            thread.join(timeout=30)
            assert not thread.is_alive(), "a party was not woken"
        assert got == [True] * (parties - 1)
        # Someone who waits on it later finds it released (the event lives for the barrier's ttl).
        assert backends[0].wait(f"{key}@events", 1000) is True
    finally:
        for b in backends:
            b.close()
