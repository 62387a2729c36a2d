"""The periodic rescue looks only at the leases that expired since its previous pass (issue 41),
and still takes back every expired lease: those a pass saw locked at the next pass that finds them
unlocked, those behind its window at the next full pass (``FULL_RESCUE_EVERY``).  Here the passes
are driven by hand, as the maintenance thread's tick calls them (``rescue(full=False)``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from dramatiq.message import Message
from helpers import Factory, query

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import maintenance as maintenance_module


def running(broker: PostgresBroker, lease_from_now: str) -> str:
    """A message sent and leased to a consumer gone, its lease *lease_from_now* (an interval) away."""
    message = broker.enqueue(Message(queue_name="w", actor_name="nobody", args=(), kwargs={}, options={}))
    query(
        broker,
        "UPDATE {schema}.message SET state = 'running', attempt = 1, delivery = gen_random_uuid(),"
        " consumer_id = 'gone', claimed_at = now(), lease_expires_at = now() + %s::interval WHERE message_id = %s",
        [lease_from_now, message.message_id],
    )
    return message.message_id


def state(broker: PostgresBroker, message_id: str) -> str:
    return query(broker, "SELECT state FROM {schema}.message WHERE message_id = %s", [message_id])[0][0]


@pytest.fixture
def broker(dramatiq_pg_broker_factory: Factory) -> PostgresBroker:
    b = dramatiq_pg_broker_factory(lease_seconds=60, rescue_interval=3600)
    b.declare_queue("w")
    return b


def test_a_lease_a_periodic_pass_saw_locked_is_taken_back_by_the_next_pass_after_the_lock_is_gone(
    broker: PostgresBroker, dramatiq_pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a periodic rescue that ran (its window set, no margin), then a lease that expires while
    another session holds its row locked, I expect the next periodic passes to skip it, and the one
    after the lock is gone to take it back, though its lease lies before the previous pass's now()."""
    monkeypatch.setattr(maintenance_module, "RESCUE_MARGIN", timedelta(0))
    maintenance = broker.parts.maintenance
    assert maintenance.rescue(full=False) == 0  # the first pass (full); the window starts at its now()
    locked = running(broker, "0 seconds")  # expires at once, after that pass's now()
    with psycopg.connect(dramatiq_pg_url) as other:
        other.execute(
            f'SELECT 1 FROM "{broker.schema}".message WHERE message_id = %s FOR UPDATE', [locked]
        ).fetchall()
        assert maintenance.rescue(full=False) == 0  # skipped, not waited for
        assert maintenance.rescue(full=False) == 0
        other.rollback()
    assert maintenance.rescue(full=False) == 1
    assert state(broker, locked) == "queued"


def test_a_lease_behind_the_periodic_window_is_taken_back_by_the_next_full_pass(
    broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a periodic rescue that ran, then a lease set an hour back (as by a clock set back, or a
    claim that committed far later than the margin), I expect periodic passes to leave it while no
    full pass is due, and the next full one (every FULL_RESCUE_EVERY) to take it back."""
    maintenance = broker.parts.maintenance
    assert maintenance.rescue(full=False) == 0
    behind = running(broker, "-1 hour")
    fresh = running(broker, "-1 second")
    assert maintenance.rescue(full=False) == 1  # the one within its window
    assert (state(broker, fresh), state(broker, behind)) == ("queued", "running")
    monkeypatch.setattr(maintenance, "_last_full", maintenance._last_full - maintenance_module.FULL_RESCUE_EVERY)
    assert maintenance.rescue(full=False) == 1
    assert state(broker, behind) == "queued"


def test_a_rescue_called_by_hand_takes_back_every_expired_lease(broker: PostgresBroker) -> None:
    """Given a periodic pass that ran, then a lease set an hour back, I expect ``rescue()`` (full, as
    an operator or a test calls it) to take it back at once."""
    maintenance = broker.parts.maintenance
    maintenance.rescue(full=False)
    behind: Any = running(broker, "-1 hour")
    assert maintenance.rescue() == 1
    assert state(broker, behind) == "queued"


def test_a_committed_row_behind_the_finish_window_is_finished_by_the_next_full_finish(
    broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a periodic finish of committed rows that ran, then a committed row whose lease lies
    two hours back (a fenced block that held its row longer than the grace), I expect periodic
    finishes to leave it while no full one is due, and the next full one to finish it, though the
    rescue's own full pass came at another tick (the finish runs once per lease at most)."""
    maintenance = broker.parts.maintenance
    maintenance.rescue(full=False)  # the first: full, and a finish
    committed = running(broker, "-2 hours")
    query(broker, "UPDATE {schema}.message SET state = 'committed' WHERE message_id = %s", [committed])
    monkeypatch.setattr(maintenance, "_last_finish", float("-inf"))
    maintenance.rescue(full=False)
    assert state(broker, committed) == "committed"
    monkeypatch.setattr(maintenance, "_last_full_finish", maintenance._last_full_finish - maintenance_module.FULL_RESCUE_EVERY)
    monkeypatch.setattr(maintenance, "_last_finish", float("-inf"))
    maintenance.rescue(full=False)
    assert not query(broker, "SELECT 1 FROM {schema}.message WHERE message_id = %s", [committed])
