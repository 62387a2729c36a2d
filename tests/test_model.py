"""A model-based randomized test of the fence (Hypothesis stateful testing, real PostgreSQL).

Three brokers on one schema play three worker processes, each with one
consumer of the same queue.  Hypothesis interleaves at random: sends, re-sends
of an id, claims, acks (with a follow-up message tied to them), nacks, retries,
late writes from stale deliveries, lease expiry and rescue, cancels, and writes
whose connection breaks at commit.  After every step the database is checked
against a reference model (sends with a unique key included, issue 12):

- each message is where the model says (queued, running, dead, cancelled, or
  finished and gone), at the attempt the model says;
- attempt numbers only grow (for one incarnation of an id);
- a follow-up message exists exactly for the acks that applied: no effect of a
  fenced-out delivery;
- nothing is stranded: every running row is held by the delivery the model
  calls current;
- each row carries the unique key the model says, and a send with a held key
  returned the holder's id.

Bounded for CI (``DRAMATIQ_PG_MODEL_EXAMPLES``, default 12 examples of up to 40
steps); ``DRAMATIQ_PG_MODEL_EXAMPLES=300 python -m pytest tests/test_model.py``
is the long run.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from helpers import Factory, query
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, multiple, rule

from dramatiq_pg_fenced import PostgresBroker, delivery
from dramatiq_pg_fenced.config import DEFAULT_MAX_DELIVERIES
from dramatiq_pg_fenced.delivery import PostgresMessageProxy

QUEUE = "model"
FOLLOW_UPS = "model-follow-ups"
EXAMPLES = int(os.environ.get("DRAMATIQ_PG_MODEL_EXAMPLES", "12"))


@dataclass
class Row:
    state: str  # queued | running | dead | cancelled
    attempt: int
    current: PostgresMessageProxy | None = None  # the delivery that holds it, when running
    lost: int = 0  # deliveries that ended without an outcome (max_deliveries counts them)
    key: str | None = None  # its unique_key column
    until: str | None = None  # "started" or "finished" with a key


@dataclass
class Held:
    """A delivery some broker holds, with the broker and consumer that own it."""

    proxy: PostgresMessageProxy
    broker: PostgresBroker
    consumer: Any
    settled: bool = False


@dataclass
class World:
    rows: dict[str, Row] = field(default_factory=dict)  # the model: message id -> row (absent: finished)
    follow_ups: set[str] = field(default_factory=set)  # follow-up ids that must exist
    dropped: set[str] = field(default_factory=set)  # follow-up ids that must not


class FenceModel(RuleBasedStateMachine):
    factory: Factory  # set by the test

    deliveries = Bundle("deliveries")

    @initialize()
    def start(self) -> None:
        first = self.factory(lease_seconds=600, rescue_interval=3600, poll_interval=0.05)
        others = [
            self.factory(schema=first.schema, lease_seconds=600, rescue_interval=3600, poll_interval=0.05)
            for _ in range(2)
        ]
        self.brokers = [first, *others]
        for broker in self.brokers:
            broker.declare_queue(QUEUE)
            broker.declare_queue(FOLLOW_UPS)
        self.consumers = [b.consume(QUEUE, prefetch=1, timeout=20) for b in self.brokers]  # one claim, one row
        self.world = World()
        self.ids: list[str] = []

    # -- producers -------------------------------------------------------------------------
    @rule()
    def send(self) -> None:
        m = dramatiq.Message(queue_name=QUEUE, actor_name="nobody", args=(), kwargs={}, options={})
        self.brokers[0].enqueue(m)
        self.world.rows[m.message_id] = Row("queued", 0)
        self.ids.append(m.message_id)

    @rule(pick=st.integers(min_value=0))
    def resend(self, pick: int) -> None:
        """The same id again: ignored while its row exists, a new incarnation once it finished."""
        if not self.ids:
            return
        message_id = self.ids[pick % len(self.ids)]
        m = dramatiq.Message(queue_name=QUEUE, actor_name="nobody", args=(), kwargs={}, options={})
        self.brokers[1].enqueue(m.copy(message_id=message_id))
        if message_id not in self.world.rows:
            self.world.rows[message_id] = Row("queued", 0)

    @rule(key=st.sampled_from(["k1", "k2"]), until=st.sampled_from(["started", "finished"]))
    def send_unique(self, key: str, until: str) -> None:
        """A send with a key: not inserted while a row holds it (queued; running if 'finished')."""
        m = dramatiq.Message(
            queue_name=QUEUE,
            actor_name="nobody",
            args=(),
            kwargs={},
            options={"unique_key": key, "unique_until": until},
        )
        holders = [
            mid
            for mid, row in self.world.rows.items()
            if row.key == key and (row.state == "queued" or (row.state == "running" and row.until == "finished"))
        ]
        sent = self.brokers[2].enqueue(m)
        if holders:
            assert sent.message_id == holders[0], "a send with a held key gets the holder's id"
            return
        assert sent.message_id == m.message_id
        self.world.rows[m.message_id] = Row("queued", 0, key=key, until=until)
        self.ids.append(m.message_id)

    def _back_to_queue(self, ids: list[str]) -> None:
        """The key each of these running rows keeps as one statement moves them back (sql.py, _retake):
        a 'started' row's only if no other row with the key is queued or running, as read before."""
        keys = {
            mid: None
            if any(
                other != mid and o.key == row.key and o.state in ("queued", "running")
                for other, o in self.world.rows.items()
            )
            else row.key
            for mid in ids
            if (row := self.world.rows[mid]).key is not None and row.until == "started"
        }
        for mid, key in keys.items():
            self.world.rows[mid].key = key

    # -- consumers ---------------------------------------------------------------------------
    @rule(target=deliveries, which=st.integers(min_value=0, max_value=2))
    def claim(self, which: int) -> Any:
        proxy = next(self.consumers[which])
        return multiple() if proxy is None else self._claimed(which, proxy)  # nothing claimed: nothing to settle

    def _claimed(self, which: int, proxy: Any) -> Held:
        assert isinstance(proxy, PostgresMessageProxy)
        row = self.world.rows.get(proxy.message_id)
        assert row is not None and row.state == "queued", (proxy.message_id, row)
        assert proxy.attempt == row.attempt + 1, "attempt numbers grow by one per delivery"
        row.state, row.attempt, row.current = "running", proxy.attempt, proxy
        return Held(proxy, self.brokers[which], self.consumers[which])

    @rule(target=deliveries, held=deliveries)
    def redeliver_elsewhere(self, held: Held) -> Any:
        """Its holder stalls past the lease: the row is rescued and claimed by another process at once,
        while the stale delivery is still held (and may settle later)."""
        row = self.world.rows.get(held.proxy.message_id)
        if held.settled or row is None or row.current is not held.proxy:
            return multiple()
        query(
            self.brokers[0],
            "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 s' WHERE message_id = %s",
            [held.proxy.message_id],
        )
        self._back_to_queue([held.proxy.message_id])
        self.brokers[2].parts.maintenance.rescue()
        row.lost += 1
        row.state = "dead" if row.lost >= DEFAULT_MAX_DELIVERIES else "queued"
        row.current = None
        for which, consumer in enumerate(self.consumers):
            if self.brokers[which] is not held.broker and (proxy := next(consumer)) is not None:
                return self._claimed(which, proxy)
        return multiple()

    def _settle(self, held: Any, kind: str) -> None:
        if held.settled:
            return
        held.settled = True
        proxy, broker = held.proxy, held.broker
        row = self.world.rows.get(proxy.message_id)
        current = row is not None and row.state == "running" and row.current is proxy
        follow_up = str(uuid.uuid4())
        if kind == "ack":
            delivery.start(proxy)  # as the middleware's after_process_message does
            delivery.defer_effects()
            broker.enqueue(
                dramatiq.Message(queue_name=FOLLOW_UPS, actor_name="next", args=(), kwargs={}, options={}).copy(
                    message_id=follow_up
                )
            )
            held.consumer.ack(proxy)
        elif kind == "nack":
            held.consumer.nack(proxy)
        else:
            broker.enqueue(proxy, delay=0)  # Dramatiq's Retries, outside the deferred phase: at once
        assert broker.flush_outcomes(10)
        if not current:
            if kind == "ack":
                self.world.dropped.add(follow_up)
            return
        assert row is not None
        if kind == "ack":
            del self.world.rows[proxy.message_id]
            self.world.follow_ups.add(follow_up)
        elif kind == "nack":
            row.state, row.current = "dead", None
        else:
            self._back_to_queue([proxy.message_id])
            row.state, row.current = "queued", None

    @rule(held=consumes(deliveries))
    def ack(self, held: Any) -> None:
        self._settle(held, "ack")

    @rule(held=consumes(deliveries))
    def nack(self, held: Any) -> None:
        self._settle(held, "nack")

    @rule(held=consumes(deliveries))
    def retry(self, held: Any) -> None:
        self._settle(held, "retry")

    @rule(held=deliveries)
    def ack_at_broken_commit(self, held: Any) -> None:
        """The ack's commit may or may not have happened when the connection broke: either way the
        writer tries again, and the outcome is the same as one clean ack."""
        if held.settled:
            return
        broker = held.broker
        writer = broker.parts.writer
        real = writer.write
        calls = 0

        def break_after_commit(batch: list[Any]) -> None:
            nonlocal calls
            calls += 1
            real(batch)
            if calls == 1:
                raise psycopg.OperationalError("server closed the connection unexpectedly")

        writer.write = break_after_commit  # type: ignore[method-assign]
        try:
            self._settle(held, "ack")
        finally:
            del writer.write

    # -- faults and operators --------------------------------------------------------------------
    @rule()
    def expire_and_rescue(self) -> None:
        """Every lease lapses (the holders paused): rows go back to the queue, their deliveries go stale."""
        query(
            self.brokers[0],
            "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 s' WHERE state = 'running'",
        )
        self._back_to_queue([mid for mid, row in self.world.rows.items() if row.state == "running"])
        self.brokers[2].parts.maintenance.rescue()
        for row in self.world.rows.values():
            if row.state == "running":
                row.lost += 1
                row.state = "dead" if row.lost >= DEFAULT_MAX_DELIVERIES else "queued"
                row.current = None

    @rule(pick=st.integers(min_value=0))
    def cancel(self, pick: int) -> None:
        if not self.ids:
            return
        message_id = self.ids[pick % len(self.ids)]
        outcome = self.brokers[1].cancel(message_id).value
        row = self.world.rows.get(message_id)
        if row is None:
            assert outcome == "not_found"
        elif row.state in ("queued", "running"):
            assert outcome == f"cancelled_{row.state}"
            row.state, row.current = "cancelled", None
        else:
            assert outcome == ("already_cancelled" if row.state == "cancelled" else "already_dead")

    # -- checks after every step ----------------------------------------------------------------
    @invariant()
    def database_matches_the_model(self) -> None:
        if not hasattr(self, "world"):
            return
        found = {
            str(mid): (state, attempt, key)
            for mid, state, attempt, key in query(
                self.brokers[0],
                "SELECT message_id, state, attempt, unique_key FROM {schema}.message WHERE queue_name = %s",
                [QUEUE],
            )
        }
        expected = {mid: (row.state, row.attempt, row.key) for mid, row in self.world.rows.items()}
        assert found == expected

    @invariant()
    def effects_only_from_applied_deliveries(self) -> None:
        if not hasattr(self, "world"):
            return
        present = {
            str(mid)
            for (mid,) in query(
                self.brokers[0], "SELECT message_id FROM {schema}.message WHERE queue_name = %s", [FOLLOW_UPS]
            )
        }
        assert self.world.follow_ups <= present, "a follow-up of an applied ack is missing"
        assert not (self.world.dropped & present), "a fenced-out delivery caused a follow-up"

    def teardown(self) -> None:
        for broker in getattr(self, "brokers", []):
            broker.close()
        delivery.start(None)


def test_the_fence_against_a_reference_model(dramatiq_pg_broker_factory: Factory) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    FenceModel.factory = staticmethod(dramatiq_pg_broker_factory)  # type: ignore[assignment]
    run_state_machine_as_test(
        FenceModel,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=os.environ.get("DRAMATIQ_PG_MODEL_SEED") is None,
            database=None,
        ),
    )
