"""The reindex chore (core/reindex.py): indexes bloated by a pinned horizon are rebuilt once it ends.

Each test has a database of its own (test_pinned_horizon's ``own_database``): the chore looks at the
transactions of its database, and those of tests beside it must not count.  The bloat is written in
bulk with SQL (message lives under a pin, as test_pinned_horizon writes them), and the chore's size
floor lowered to fit it: what is checked is the mechanism (when it rebuilds, when it waits, what it
cleans up), not the floor.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from dramatiq import Message
from helpers import wait_for
from test_pinned_horizon import _lives, own_database  # noqa: F401  (own_database: a fixture)

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import reindex


@pytest.fixture
def broker(own_database: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresBroker]:  # noqa: F811
    monkeypatch.setattr(reindex, "MIN_BYTES", 64 * 1024)
    b = PostgresBroker(own_database, schema="rx")
    b.migrate()
    b.declare_queue("q")
    yield b
    b.close()


def sizes(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT c.relname, pg_relation_size(c.oid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = 'rx.message'::regclass"
        ).fetchall()
    return dict(rows)


def bloat(url: str, lives: int = 20_000) -> None:
    """*lives* message lives under another session's snapshot, then the snapshot gone and a vacuum: the
    dead versions removed, the index pages they filled left empty."""
    pin = psycopg.connect(url)
    try:
        pin.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        pin.execute("SELECT 1").fetchone()
        with psycopg.connect(url, autocommit=True) as conn:
            _lives(conn, "rx", lives)
    finally:
        pin.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE rx.message")


def test_indexes_a_pin_bloated_are_rebuilt_once_it_ends_and_the_queue_works_on(
    broker: PostgresBroker, own_database: str, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Given a message queued, 20,000 message lives under a pin, the pin released and a vacuum, I expect
    the check to rebuild the bloated indexes (each smaller after than before, the primary key among
    them), the queued message still claimable, and nothing left to rebuild at the next check."""
    kept: Message[Any] = Message(queue_name="q", actor_name="kept", args=(), kwargs={}, options={})
    broker.enqueue(kept)
    bloat(own_database)
    before = sizes(own_database)
    assert before["message_pkey"] > reindex.MIN_BYTES, before

    with caplog.at_level(logging.INFO):
        rebuilt = broker.parts.maintenance.reindexer.check()
    after = sizes(own_database)
    assert "message_pkey" in rebuilt, (rebuilt, before)
    for name in rebuilt:
        assert after[name] < before[name] / reindex.FACTOR, (name, before[name], after[name])
    assert set(after) == set(before), "the same indexes, no copy left"
    assert "Rebuilt rx.message_pkey (REINDEX CONCURRENTLY)" in caplog.text
    assert broker.parts.maintenance.reindexer.check() == []

    consumer = broker.consume("q", prefetch=1, timeout=100)
    try:
        delivered = wait_for(lambda: next(consumer), 30, "the kept message")
        assert delivered.message_id == kept.message_id
        consumer.ack(delivered)
    finally:
        consumer.close()


def test_no_reindex_while_an_old_transaction_holds_the_horizon(
    broker: PostgresBroker, own_database: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Given bloated indexes and another session's transaction older than OLD_TRANSACTION, I expect the
    check to rebuild nothing and say what it waits for; once that transaction ends, it rebuilds."""
    bloat(own_database)
    monkeypatch.setattr(reindex, "OLD_TRANSACTION", 0.0)
    old = psycopg.connect(own_database)
    try:
        old.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        old.execute("SELECT 1").fetchone()
        before = sizes(own_database)
        with caplog.at_level(logging.INFO):
            assert broker.parts.maintenance.reindexer.check() == []
        assert sizes(own_database) == before
        assert "1 transaction(s) older than 0 s hold back the horizon: no reindex until they end" in caplog.text
        assert broker.parts.maintenance.reindexer.every() == reindex.CHECK_HELD_EVERY
    finally:
        old.close()
    assert "message_pkey" in broker.parts.maintenance.reindexer.check()
    assert broker.parts.maintenance.reindexer.every() == reindex.CHECK_EVERY


def test_an_invalid_copy_a_failed_reindex_left_is_dropped(broker: PostgresBroker, own_database: str) -> None:  # noqa: F811
    """Given an invalid index named as a failed REINDEX CONCURRENTLY leaves its copy (here: a unique
    index built concurrently over duplicates, which fails and stays, invalid), I expect the check to
    drop it, and to leave the table's own indexes alone."""
    broker.enqueue_many([Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}) for _ in range(2)])
    with psycopg.connect(own_database, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute("CREATE UNIQUE INDEX CONCURRENTLY message_claim_idx_ccnew ON rx.message (queue_name)")
        (valid,) = conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'rx.message_claim_idx_ccnew'::regclass"
        ).fetchone() or (None,)
        assert valid is False
    before = set(sizes(own_database))
    assert broker.parts.maintenance.reindexer.check() == []
    assert broker.parts.maintenance.reindexer.dropped == ["message_claim_idx_ccnew"]
    assert set(sizes(own_database)) == before - {"message_claim_idx_ccnew"}


def test_a_role_that_may_not_vacuum_starts_no_reindex(broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a maintenance whose role may not vacuum (not the table's owner), I expect its tick, when the
    check is due, to start no reindex (REINDEX needs the same privileges)."""
    maintenance = broker.parts.maintenance
    started: list[Any] = []
    monkeypatch.setattr(maintenance.reindexer, "start", lambda: started.append(True))
    maintenance._may_vacuum = False
    maintenance._last_reindex = -1e9
    maintenance.tick()
    assert started == []
    maintenance._may_vacuum = True
    maintenance._last_reindex = -1e9
    maintenance.tick()
    assert started == [True]


def test_the_chore_runs_on_a_thread_of_its_own(broker: PostgresBroker, own_database: str) -> None:  # noqa: F811
    """start() returns at once; the check runs on its thread (which join() waits for) and rebuilds."""
    bloat(own_database)
    reindexer = broker.parts.maintenance.reindexer
    reindexer.start()
    reindexer.join(60)
    assert "message_pkey" in reindexer.rebuilt



def test_the_smaller_indexes_the_same_pin_bloated_are_rebuilt_with_the_largest(
    broker: PostgresBroker, own_database: str, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """Given the indexes a pin bloated, only the largest past MIN_BYTES, I expect the check to rebuild the
    others bloated as much and larger than WITH_OTHERS_BYTES with it (the same pin's pages), and none at
    all while no index is past MIN_BYTES."""
    bloat(own_database)
    before = sizes(own_database)
    largest = max(before.values())
    smaller = {name: size for name, size in before.items() if 64 * 1024 < size < largest}
    assert smaller, before  # (the claim and lease indexes: a live's entries are fewer there)
    monkeypatch.setattr(reindex, "WITH_OTHERS_BYTES", 64 * 1024)
    monkeypatch.setattr(reindex, "MIN_BYTES", largest)  # none past it
    assert broker.parts.maintenance.reindexer.check() == []
    monkeypatch.setattr(reindex, "MIN_BYTES", largest - 1)  # the largest alone past it
    rebuilt = broker.parts.maintenance.reindexer.check()
    after = sizes(own_database)
    assert set(smaller) <= set(rebuilt), (rebuilt, before)
    for name in smaller:
        assert after[name] < before[name] / reindex.FACTOR, (name, before[name], after[name])
