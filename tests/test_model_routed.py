"""A model-based randomized test of the routed broker (Hypothesis stateful testing, real PostgreSQL).

Two databases (the test database, reached through a TCP proxy the test can cut, and a database of
the test's own on the same server), one schema name in both, as a deployment has it.  Queue ``a``
lives in ``first``, ``b`` in ``second``, ``m`` in ``first`` until ``move_queue`` moves it.  Two
``RoutedBroker``\\ s play two worker processes (each a consumer of every queue, on its database);
a route change adds two processes of the new configuration, the old ones still running.  The relays
are driven by hand.  Hypothesis interleaves at random:

- sends to queues of either database: plain, in ``transaction(conn)`` on the application's
  connection to ``first`` (commit or rollback), inside ``with_ack()`` of a delivery (nested outbox
  send too), inside ``fenced_transaction()`` of a delivery (commit, raise in the block, raise after
  it), and the middleware's follow-up after the actor (any outcome);
- deliveries acked, retried and nacked; a fenced actor that runs on after its block committed while
  its lease lapses far past the grace and maintenance runs, its process alive (its lease keeper
  extends the committed row) or stopped (maintenance finishes the row without what came after the
  block); every lease of a database lapsing and a rescue;
- relay passes, one interrupted between its insert in the target and its delete in the source
  (moved again later), and one during which a cancel of a message it moves runs;
- ``move_queue("m")`` by a process of the new configuration;
- cancel of any message at any moment (in an outbox, mid-relay, running, finished);
- ``first`` down (the proxy cut): cancel and inspect of a message in ``second`` answer, then it is back.

After every step, against the reference model (each failure names its invariant):

- a send that never committed (rolled back, or what a delivery caused without its outcome) exists
  in no database;
- nothing lost: every committed send is in a database, queued, running, dead or cancelled until done;
- exactly once: a message is in its own database only (a copy left in an outbox by an interrupted
  relay, not deliverable there, is allowed until the next relay deletes it);
- attempts never go down, per message id, across databases, relays and ``move_queue``;
- each message's state and attempt are the model's; a done message has no row left;
- what a delivery causes exists exactly when its outcome applied (``with_ack()``: an ack only; the
  middleware's follow-up: any outcome; a fenced block's sends: exactly when it committed);
- each committed fenced block's write (``tally``) is there once, and nothing of a rolled-back one;
- a cancelled message is never delivered afterwards, and nothing is delivered after it was done.

The rules that found the six holes of issue 36 on the code before their fixes are named in
:data:`KNOWN_BUGS` (all on); ``DRAMATIQ_PG_MODEL_ROUTED_OFF`` turns some off for one run, to see
which rule finds what.  A crash undoing relaxed commits is not modelled here (it needs a server of
the test's own: ``test_the_relay_moves_only_follow_ups_whose_commit_is_on_disk`` in
``test_routing.py``).  Bounded for CI as ``test_model.py`` (``DRAMATIQ_PG_MODEL_EXAMPLES``, default 15 examples, here of up to
30 steps; ``DRAMATIQ_PG_MODEL_SEED`` set: drawn at random).  ``DRAMATIQ_PG_MODEL_NO_SHRINK=1`` reports
the first failing example as found (Hypothesis shrinks it for up to 5 minutes otherwise).
"""

from __future__ import annotations

import math
import os
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import wait_for
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from test_faults import Proxy
from test_model import EXAMPLES, _Hooked

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import delivery
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy
from dramatiq_pg_fenced.core.maintenance import COMMITTED_GRACE_LEASES
from dramatiq_pg_fenced.errors import DeliveryLost
from dramatiq_pg_fenced.routing import RoutedBroker

#: The rules that found the holes of issue 36 before their fixes (on: exercised).  Each names the hole.
KNOWN_BUGS = {
    "fenced_outlives_its_lease": True,  # (1) maintenance finishes a committed row whose actor still runs
    "fenced_send_elsewhere": True,  # (2) a send to another database's queue in fenced_transaction()
    "cancel_during_relay": True,  # (4) cancel misses a message being relayed
    "interrupted_relay": True,  # (4) a cancel finds the copy a relay that died left in the outbox
    "first_down": True,  # (5) one database down blocks cancel/inspect
    "move_queue": True,  # (6) move_queue/relay reset attempt to 0
}
#: ``DRAMATIQ_PG_MODEL_ROUTED_OFF=first_down,move_queue``: those rules off for this run (to see the others).
for _name in filter(None, os.environ.get("DRAMATIQ_PG_MODEL_ROUTED_OFF", "").split(",")):
    KNOWN_BUGS[_name] = False
OLD_ROUTES = {"a": "first", "b": "second", "m": "first"}
NEW_ROUTES = {**OLD_ROUTES, "m": "second"}
QUEUES = ("a", "b", "m")
DBS = ("first", "second")
ROUTED_EXAMPLES = EXAMPLES
OPTIONS = {"lease_seconds": 600, "rescue_interval": 3600, "poll_interval": 0.05, "max_deliveries": None,
           "connect_timeout": 2}  # fmt: skip


def message(queue: str) -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue, actor_name=f"work_{queue}", args=(), kwargs={}, options={})


@dataclass
class Msg:
    queue: str
    db: str  # the database its row is in: its queue's, or an outbox
    state: str = "queued"  # queued | running | dead | cancelled | done
    attempt: int = 0
    current: PostgresMessageProxy | None = None  # the delivery holding it
    ghost: str | None = None  # an outbox copy an interrupted relay left there
    maybe: set[str] = field(default_factory=set)  # a send in a transaction: in any of these (resolved when seen)
    cause: str = "a send"  # what sent it (for the failure messages)


@dataclass
class Proc:
    router: RoutedBroker
    consumers: dict[str, Any]  # queue -> the consumer of its database


@dataclass
class Held:
    proxy: PostgresMessageProxy
    proc: Proc
    db: str
    consumer: Any


class _Interrupted(Exception):
    """The relay dies here."""


class RoutedModel(RuleBasedStateMachine):
    urls: dict[str, str]  # set by the test: database name -> URL (first's through the proxy)
    direct: dict[str, str]  # the same, not through the proxy (the test's own reads)
    proxy: Proxy

    @initialize()
    def start(self) -> None:
        self.schema = f"mr_{uuid.uuid4().hex[:10]}"
        self.own = {db: psycopg.connect(self.direct[db], autocommit=True) for db in DBS}
        self.procs = [self._proc(OLD_ROUTES) for _ in range(2)]
        for db in DBS:
            self._q(db, "CREATE TABLE {schema}.tally (delivery uuid PRIMARY KEY, message_id uuid NOT NULL, n int)")
        self.app = psycopg.connect(self.direct["first"])  # the application's own connection (the outbox pattern)
        self.msgs: dict[str, Msg] = {}
        self.never: dict[str, str] = {}  # message id -> why it must not exist
        self.held: list[Held] = []
        self.paused: set[tuple[str, str]] = set()  # (database, queue)
        self.tally: dict[str, set[str]] = {db: set() for db in DBS}
        self.top: dict[str, int] = {}  # message id -> the highest attempt seen

    def _proc(self, routes: dict[str, str]) -> Proc:
        shards = {db: PostgresBroker(self.urls[db], schema=self.schema, middleware=[], **OPTIONS) for db in DBS}  # type: ignore[arg-type]
        router = RoutedBroker(brokers=shards, routes=routes)
        if not hasattr(self, "procs"):
            router.migrate()
        for q in QUEUES:
            dramatiq.actor(broker=router, actor_name=f"work_{q}", queue_name=q)(lambda: None)
        consumers = {q: router.shard(q).consume(q, prefetch=1, timeout=1) for q in QUEUES}  # no relay thread
        for consumer in consumers.values():
            consumer.turns = None  # answered at once, whoever's turn it is (test_model.py)
        return Proc(router, consumers)

    def _q(self, db: str, text: str, params: Any = None) -> list[tuple]:
        cur = self.own[db].execute(sql.SQL(text).format(schema=sql.Identifier(self.schema)), params)
        return cur.fetchall() if cur.description else []

    # -- helpers -------------------------------------------------------------------------------
    def _sent(self, mid: str, queue: str, db: str, maybe: set[str] | None = None, cause: str = "a send") -> None:
        self.msgs[mid] = Msg(queue, db, maybe=set(maybe or ()), cause=cause)

    def _pick(self, pick: int, state: str | None = None) -> str | None:
        ids = [m for m, msg in self.msgs.items() if state is None or msg.state == state]
        return ids[pick % len(ids)] if ids else None

    def _claimable(self, db: str, queue: str) -> bool:
        return (db, queue) not in self.paused and any(
            m.db == db and m.queue == queue and m.state == "queued" for m in self.msgs.values()
        )

    def _due_from(self, db: str, queue: str, start: tuple) -> int:
        """Due rows of *queue* in *db* that sort at or after *start* in the claim index."""
        return self._q(
            db,
            "SELECT count(*) FROM {schema}.message WHERE queue_name = %(queue)s AND state = 'queued'"
            " AND available_at <= now() AND (priority, available_at, seq) >= (%(p)s::int, %(at)s::timestamptz, %(seq)s::bigint)",
            {"queue": queue, "p": start[0], "at": start[1], "seq": start[2]},
        )[0][0]

    def _claim(self, proc: Proc, queue: str, from_floor: bool = False) -> Held | None:
        """A claim of *proc*'s consumer of *queue*: from the head (its floor forgotten), or, *from_floor*,
        from where its floor says (floor.py: the floor, or the head or the window at a look back)."""
        consumer, db = proc.consumers[queue], proc.router.database_of(queue)
        proxy = None
        starts: list[tuple] = []
        if from_floor:
            real_start = consumer.floor.start

            def start() -> tuple:
                starts.append(where := real_start())
                return where

            consumer.floor.start = start  # type: ignore[method-assign]
        try:
            for _ in range(5):
                if not from_floor:
                    consumer.floor.forget()
                consumer.wake.set()
                proxy = next(consumer)
                if proxy is not None or not self._claimable(db, queue) or (from_floor and starts):
                    break
        finally:
            if from_floor:
                del consumer.floor.start
        if from_floor and proxy is None:
            # From its start, the first due row or none: none only where no due row lies at or after it
            # (a relayed row, a row moved by move_queue, one put back: each where the fence puts it).
            room = proc.router.shard(queue).parts.leases.capacity(queue, 1) > 0
            if room and (db, queue) not in self.paused:
                for where in starts:
                    assert self._due_from(db, queue, where) == 0, (
                        f"a claim of {queue!r} in {db!r} from its floor found nothing where a due row is at or"
                        f" after its start {where}"
                    )
            return None
        if proxy is None:
            room = proc.router.shard(queue).parts.leases.capacity(queue, 1) > 0  # prefetch=1: one at a time
            assert not room or not self._claimable(db, queue), f"a due message of queue {queue!r} in {db!r} is claimed"
            return None
        assert isinstance(proxy, PostgresMessageProxy)
        mid, msg = proxy.message_id, self.msgs.get(proxy.message_id)
        assert msg is not None, f"a message never sent is delivered: {mid}"
        assert msg.state != "cancelled", f"a cancelled message is never delivered afterwards: {mid} ran in {db!r}"
        assert msg.state != "done", f"nothing runs again after it was done: {mid} ran again in {db!r}"
        assert (msg.db, msg.state) == (db, "queued"), (mid, msg, db)
        assert proxy.attempt >= self.top.get(mid, 0) + 1, (
            f"attempts never go down: {mid} delivered at attempt {proxy.attempt} in {db!r} after attempt "
            f"{self.top.get(mid)} (a relay or move_queue reset it)"
        )
        msg.state, msg.attempt, msg.current = "running", proxy.attempt, proxy
        self.top[mid] = proxy.attempt
        return Held(proxy, proc, db, consumer)

    def _take(self, pick: int, which: int, queue: str) -> Held | None:
        if self.held:
            return self.held.pop(pick % len(self.held))
        return self._claim(self.procs[which % len(self.procs)], queue)

    def _current(self, held: Held) -> bool:
        msg = self.msgs[held.proxy.message_id]
        return msg.state == "running" and msg.current is held.proxy

    def _outbox_send(self, router: RoutedBroker, queue: str, commit: bool) -> str:
        """``with router.transaction(conn): send`` on the application's connection to ``first``."""
        m = message(queue)
        with router.transaction(self.app):
            router.enqueue(m)
        self.app.commit() if commit else self.app.rollback()
        return m.message_id

    # -- producers -----------------------------------------------------------------------------
    PROC = st.integers(0, 3)
    QUEUE = st.sampled_from(QUEUES)
    SENDS = st.lists(st.sampled_from(QUEUES), max_size=2)

    @rule(which=PROC, queue=QUEUE)
    def send(self, which: int, queue: str) -> None:
        router = self.procs[which % len(self.procs)].router
        m = router.enqueue(message(queue))
        self._sent(m.message_id, queue, router.database_of(queue))

    @rule(which=PROC, queue=QUEUE, commit=st.booleans())
    def outbox_send(self, which: int, queue: str, commit: bool) -> None:
        """A send in the application's transaction on ``first``: it exists exactly when that commits (in
        ``first``'s outbox, or, one server, written in its database's table: either is right)."""
        router = self.procs[which % len(self.procs)].router
        mid = self._outbox_send(router, queue, commit)
        if commit:
            self._sent(mid, queue, "first", {"first", router.database_of(queue)})
        else:
            self.never[mid] = "a send in transaction(conn), rolled back"

    # -- deliveries ----------------------------------------------------------------------------
    @rule(which=PROC, queues=st.lists(QUEUE, min_size=1, max_size=3))
    def claim(self, which: int, queues: list[str]) -> None:
        proc = self.procs[which % len(self.procs)]
        self.held += [held for q in queues if (held := self._claim(proc, q)) is not None]

    @rule(which=PROC, queue=QUEUE)
    def claim_from_the_floor(self, which: int, queue: str) -> None:
        """A consumer claims as it does between look backs: from its floor (test_model.py checks the
        floor's rules in one database; here, what relays, moves and rescues put in each)."""
        proc = self.procs[which % len(self.procs)]
        if (held := self._claim(proc, queue, from_floor=True)) is not None:
            self.held.append(held)

    def _deliver(self, held: Held, kind: str, tied: list[str], outbox: str | None, follow_up: str | None,
                 fenced: str | None = None, send_to: str | None = None, outlive: int | None = None,
                 alive: bool = True) -> None:  # fmt: skip
        """Run *held* as a worker thread runs it (test_model.py's _deliver), ending in ack, nack or retry.
        The body sends *tied* inside ``with_ack()`` (with *outbox*, one more in a nested application
        transaction); or, with *fenced*, writes ``tally`` and sends to *send_to* inside
        ``fenced_transaction()`` ("commit", "raise_inside", "raise_after"); with *outlive*, after the
        block committed, its lease lapses past the grace and process *outlive*'s maintenance runs, while
        the holder's lease keeper extends it (*alive*) or not (its process stopped: maintenance finishes
        the row without what the delivery causes after its block).  The middleware then sends *follow_up*."""
        proxy, router, db = held.proxy, held.proc.router, held.db
        mid, current = proxy.message_id, self._current(held)
        failure = ValueError(f"failure of delivery {proxy.delivery}")
        delivery.start(proxy)
        ack_sends: list[str] = []
        outboxed = block_sent = None
        committed = began = finished = False
        if fenced is not None:
            try:
                with router.fenced_transaction() as conn:
                    began = True
                    conn.execute(
                        sql.SQL("INSERT INTO {}.tally VALUES (%s, %s, 1) ON CONFLICT (delivery) DO UPDATE"
                                " SET n = tally.n + 1").format(sql.Identifier(self.schema)),
                        [proxy.delivery, mid],
                    )  # fmt: skip
                    if send_to is not None:
                        block_sent = router.enqueue(message(send_to)).message_id
                    if fenced == "raise_inside":
                        raise failure
                committed = True
            except DeliveryLost:
                assert not current, f"DeliveryLost only for a delivery that lost its row: {mid}"
            except ValueError:
                pass
            assert began == current, f"a fenced block begins exactly when its delivery holds its row: {mid}"
            if committed:
                kind = "ack" if fenced == "commit" else "nack"
                if outlive is not None:
                    # Leases and the grace pass while the actor runs on: its process's lease keeper
                    # extends the committed row meanwhile (its last extension lands after the clock
                    # moved), unless the process stopped (*alive* false: killed, paused, cut off).
                    grace = COMMITTED_GRACE_LEASES * OPTIONS["lease_seconds"] + 60  # type: ignore[operator]
                    self._q(db, "UPDATE {schema}.message SET lease_expires_at = now() - %s * interval '1 second'"
                                " WHERE message_id = %s", [grace, mid])  # fmt: skip
                    if alive:
                        router.shards[db].parts.keeper.extend()
                    maintenance = self.procs[outlive % len(self.procs)].router.shards[db].parts.maintenance
                    maintenance._last_finish = -math.inf  # its finish of committed rows is due
                    maintenance.rescue()
                    finished = not alive
            elif block_sent is not None:
                self.never[block_sent] = f"a send in fenced_transaction() of {mid}, rolled back"
        else:
            with router.with_ack():
                ack_sends = [router.enqueue(message(q)).message_id for q in tied]
                if outbox is not None:
                    outboxed = self._outbox_send(router, outbox[1:], outbox[0] == "+")
        if kind != "ack":
            proxy.stuff_exception(failure)
        delivery.defer_effects()
        sends = [router.enqueue(message(follow_up)).message_id] if follow_up is not None else []
        if kind == "retry":
            router.enqueue(proxy, delay=0)  # type: ignore[arg-type]  # Dramatiq's Retries
        elif kind == "nack":
            proxy.fail()
        if proxy.failed:
            held.consumer.nack(proxy)
        else:
            held.consumer.ack(proxy)
        assert router.flush_outcomes(10)

        if outboxed is not None:  # the innermost transaction decides, whatever the delivery's outcome
            assert outbox is not None
            if outbox[0] == "+":
                self._sent(outboxed, outbox[1:], "first", {"first", router.database_of(outbox[1:])})
            else:
                self.never[outboxed] = f"a send in transaction(conn) in with_ack() of {mid}, rolled back"
        if not current:  # fenced out: nothing it caused exists
            self.never.update(dict.fromkeys(ack_sends + sends, f"caused by {mid}'s delivery, fenced out"))
            return
        msg = self.msgs[mid]
        if finished:  # its process stopped: the block's effects stay, the rest is dropped (its ack stale)
            self.never.update(
                dict.fromkeys(ack_sends + sends, f"caused by {mid} after its block, finished by maintenance")
            )
            ack_sends, sends, tied, follow_up = [], [], [], None
        if committed:  # done with its block, whatever the actor did after it
            self.tally[db].add(str(proxy.delivery))
            if block_sent is not None:
                self._sent(block_sent, send_to, db, {db, router.database_of(send_to)}, f"the fenced block of {mid}")  # type: ignore[arg-type]
            kind = "done"
        self.never.update(dict.fromkeys(ack_sends if kind != "ack" else [], f"a send in with_ack() of {mid}'s {kind}"))
        for q, s in zip(tied if kind == "ack" else [], ack_sends if kind == "ack" else [], strict=True):
            self._sent(s, q, db, cause=f"a send in with_ack() of {mid}'s ack in {db!r}")
        for q, s in zip([follow_up] if follow_up else [], sends, strict=True):
            self._sent(
                s,
                q,
                db,
                cause=f"the middleware's follow-up of {mid}'s {'fenced block' if kind == 'done' else kind} in {db!r}",
            )
        msg.current = None
        if kind in ("ack", "done"):
            msg.state = "done"
        elif kind == "nack":
            msg.state = "dead"
        else:
            msg.state, msg.db = "queued", db  # back in line where it ran (an outbox after a move)

    PICK = st.integers(min_value=0)
    TIED = st.lists(QUEUE, max_size=2)
    OUTBOX = st.sampled_from([None, "+a", "+b", "-b", "-a"])
    FOLLOW = st.sampled_from([None, "a", "b", "m"])

    @rule(pick=PICK, which=PROC, queue=QUEUE, kind=st.sampled_from(["ack", "ack", "nack", "retry"]), tied=TIED,
          outbox=OUTBOX, follow_up=FOLLOW)  # fmt: skip
    def deliver(self, pick: int, which: int, queue: str, kind: str, tied: list[str], outbox: str | None,
                follow_up: str | None) -> None:  # fmt: skip
        """A delivery acked, nacked or retried, with sends in ``with_ack()`` to either database."""
        if (held := self._take(pick, which, queue)) is not None:
            self._deliver(held, kind, tied, outbox, follow_up)

    @rule(pick=PICK, which=PROC, queue=QUEUE, fenced=st.sampled_from(["commit", "raise_inside", "raise_after"]),
          then=st.sampled_from(["nack", "retry"]), elsewhere=st.booleans(), follow_up=FOLLOW)  # fmt: skip
    def fenced(self, pick: int, which: int, queue: str, fenced: str, then: str, elsewhere: bool,
               follow_up: str | None) -> None:  # fmt: skip
        """The actor writes in ``fenced_transaction()`` and sends to a queue of its database, or of the
        other (bug 2: written at once, not in the block)."""
        if (held := self._take(pick, which, queue)) is None:
            return
        here = held.proc.router.database_of(held.proxy.queue_name)
        options = [q for q in QUEUES if (held.proc.router.database_of(q) != here) == elsewhere]
        if elsewhere and not KNOWN_BUGS["fenced_send_elsewhere"]:
            options = [q for q in QUEUES if held.proc.router.database_of(q) == here]
        self._deliver(held, then, [], None, follow_up, fenced=fenced, send_to=options[pick % len(options)])

    @rule(pick=PICK, which=PROC, queue=QUEUE, outlive=PROC, follow_up=st.sampled_from(["a", "b"]),
          alive=st.sampled_from([True, True, False]))  # fmt: skip
    def fenced_outlives_its_lease(self, pick: int, which: int, queue: str, outlive: int, follow_up: str,
                                  alive: bool) -> None:  # fmt: skip
        """Its block committed, the actor runs on past its lease and the grace while a process's
        maintenance runs, then returns: with its process alive (its lease keeper extending the row),
        its follow-up is sent and its ack applies (bug 1: finished by maintenance, the follow-up lost);
        with its process stopped, maintenance finishes the row and nothing after the block exists."""
        if not KNOWN_BUGS["fenced_outlives_its_lease"]:
            return
        if (held := self._take(pick, which, queue)) is not None:
            self._deliver(held, "nack", [], None, follow_up, fenced="commit", outlive=outlive, alive=alive)

    @rule(db=st.sampled_from(DBS), which=PROC)
    def expire_and_rescue(self, db: str, which: int) -> None:
        """Every lease of *db* lapses and a process rescues: back in line (no max_deliveries)."""
        self._q(db, "UPDATE {schema}.message SET lease_expires_at = now() - interval '1 s' WHERE state = 'running'")
        self.procs[which % len(self.procs)].router.shards[db].parts.maintenance.rescue()
        for msg in self.msgs.values():
            if msg.state == "running" and msg.db == db:
                msg.state, msg.current = "queued", None

    # -- relays --------------------------------------------------------------------------------
    def _expect_relay(self, router: RoutedBroker, source: str, moved: list[str] | None = None) -> set[str]:
        """What a complete relay of *source* by *router* moves (read before it): the queued messages of
        queues routed elsewhere whose queue there is not paused; their leftover copies go."""
        foreign = {
            q for q in QUEUES if router.database_of(q) != source and (router.database_of(q), q) not in self.paused
        }
        queued = {str(m) for (m,) in self._q(source, "SELECT message_id FROM {schema}.message WHERE state = 'queued'"
                                                     " AND queue_name = ANY(%s)", [sorted(foreign)])}  # fmt: skip
        return queued if moved is None else queued & set(moved)

    def _relayed(self, router: RoutedBroker, source: str, ids: set[str], interrupted: bool = False) -> None:
        for mid, msg in self.msgs.items():
            if mid not in ids:
                continue
            if msg.ghost == source:
                msg.ghost = None if not interrupted else source
            elif msg.db == source and msg.state == "queued":
                msg.db = router.database_of(msg.queue)
                msg.ghost = source if interrupted else None

    @rule(which=PROC, source=st.sampled_from(DBS))
    def relay(self, which: int, source: str) -> None:
        router = self.procs[which % len(self.procs)].router
        ids = self._expect_relay(router, source)
        assert router.relay(source) == len(ids), "a relay takes the queued rows of the queues routed elsewhere"
        self._relayed(router, source, ids)

    @contextmanager
    def _hooked(self, router: RoutedBroker, db: str, statement: bytes, hook: Callable[[], None]) -> Iterator[None]:
        """Inside, *hook* runs right after *statement* on *db*'s connections of *router*."""
        database = router.shards[db].database
        real = database.connection

        @contextmanager
        def connection(*args: Any, **kwargs: Any) -> Iterator[Any]:
            with real(*args, **kwargs) as conn:
                yield _Hooked(conn, statement, hook)

        database.connection = connection  # type: ignore[method-assign]
        try:
            yield
        finally:
            del database.connection

    @rule(which=PROC, source=st.sampled_from(DBS))
    def relay_interrupted(self, which: int, source: str) -> None:
        """The relay dies between its insert in the target (committed) and its delete in the source:
        the rows stay in the outbox, and are moved again (inserting nothing) by a later relay."""
        if not KNOWN_BUGS["interrupted_relay"]:
            return
        router = self.procs[which % len(self.procs)].router
        if not (ids := self._expect_relay(router, source)):
            return
        target = next(db for db in DBS if db != source)

        def die() -> None:
            raise _Interrupted

        with pytest.raises(_Interrupted), self._hooked(router, target, router.shards[target].statements.relay_put, die):
            router.relay(source)
        self._relayed(router, source, ids, interrupted=True)

    @rule(pick=PICK, which=PROC, source=st.sampled_from(DBS), after_insert=st.booleans(), fresh=st.booleans())
    def cancel_during_relay(self, pick: int, which: int, source: str, after_insert: bool, fresh: bool) -> None:
        """Another process cancels a message the relay is moving, while the relay holds it (before or
        after its insert in the target): it is cancelled wherever it ends (bug 4: not found, and it runs)."""
        if not KNOWN_BUGS["cancel_during_relay"]:
            return
        router = self.procs[which % len(self.procs)].router
        other = self.procs[(which + 1) % len(self.procs)].router
        target = next(db for db in DBS if db != source)
        if fresh or not self._expect_relay(router, source):  # one more in the outbox, straight into its table
            queue = next(q for q in QUEUES if router.database_of(q) == target and (target, q) not in self.paused)
            self._sent(router.shards[source].enqueue(message(queue)).message_id, queue, source)
        ids = self._expect_relay(router, source)
        candidates = sorted(m for m in ids if self.msgs[m].ghost is None)
        if not candidates:
            return
        mid = candidates[pick % len(candidates)]
        answer: list[str] = []
        thread = threading.Thread(target=lambda: answer.append(other.cancel(mid).value))

        def cancel_meanwhile() -> None:
            thread.start()
            wait_for(lambda: not thread.is_alive() or self._waiting(source), 20, "the cancel to answer or wait")

        where, statement = (target, "relay_put") if after_insert else (source, "relay_take")
        with self._hooked(router, where, getattr(router.shards[where].statements, statement), cancel_meanwhile):
            router.relay(source)
        thread.join(30)
        self._relayed(router, source, ids)
        assert answer == ["cancelled_queued"], (
            f"cancel finds a message being relayed ({source!r} -> {target!r}, the relay "
            f"{'between its insert and its delete' if after_insert else 'before its insert'}): {mid} answered {answer}"
        )
        self.msgs[mid].state = "cancelled"
        self.msgs[mid].maybe = {source, target}  # wherever it ended, cancelled there

    def _waiting(self, db: str) -> bool:
        """Does a session of this example wait for a lock in *db*?"""
        return bool(self._q(db, "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type"
                                " = 'Lock' AND query ILIKE '%%' || %s || '%%'", [self.schema]))  # fmt: skip

    @rule(which=PROC, retried=st.booleans())
    def move_queue(self, which: int, retried: bool) -> None:
        """The route of m changes to second: two processes of the new configuration start, one moves the
        queue (the old processes keep running; their m is paused in first).  Nothing is lost or moved
        twice, and attempts are kept (bug 6: reset to 0)."""
        if not KNOWN_BUGS["move_queue"] or len(self.procs) > 2:
            return
        if retried:  # one at attempt 1 at least among those moved
            self.send(0, "m")
            if (held := self._claim(self.procs[0], "m")) is not None:
                self._deliver(held, "retry", [], None, None)
        if any(m.queue == "m" and m.db == "first" and m.state == "running" for m in self.msgs.values()):
            return  # move_queue waits for them: settle them first
        self.procs += [self._proc(NEW_ROUTES) for _ in range(2)]
        router = self.procs[2 + which % 2].router
        ids = self._expect_relay(router, "first")
        ids = {m for m in ids if self.msgs[m].queue == "m"}
        assert router.move_queue("m", timeout=30) == len(ids)
        self.paused.add(("first", "m"))
        self._relayed(router, "first", ids)

    # -- operators -----------------------------------------------------------------------------
    EXPECTED = {"queued": "cancelled_queued", "running": "cancelled_running", "dead": "already_dead",
                "cancelled": "already_cancelled", "done": "not_found"}  # fmt: skip

    @rule(pick=PICK, which=PROC)
    def cancel(self, pick: int, which: int) -> None:
        """Cancel any message, wherever it is (an outbox, its database, finished)."""
        mid = self._pick(pick)
        if mid is None:
            return
        msg = self.msgs[mid]
        answer = self.procs[which % len(self.procs)].router.cancel(mid).value
        if msg.ghost is not None and msg.state == "done" and answer == "cancelled_queued":
            return  # the copy an interrupted relay left in an outbox (not deliverable there)
        where = f"{msg.state} in {msg.db!r}" + (f", a copy left in {msg.ghost!r}'s outbox" if msg.ghost else "")
        assert answer == self.EXPECTED[msg.state], f"cancel finds the message wherever it is: {mid} ({where}): {answer}"
        if msg.state in ("queued", "running"):
            msg.state = "cancelled"

    @rule(pick=PICK, which=PROC)
    def first_down(self, pick: int, which: int) -> None:
        """The first database goes away (its proxy cut): inspect and cancel of a message in the second
        answer all the same (bug 5: they fail on the first); then it is back."""
        if not KNOWN_BUGS["first_down"]:
            return
        there = [m for m, msg in self.msgs.items() if msg.db == "second" and msg.state != "done" and not msg.ghost]
        if not there:
            return
        mid = there[pick % len(there)]
        router, msg = self.procs[which % len(self.procs)].router, self.msgs[mid]
        self.proxy.cut()
        try:
            try:
                found = router.inspect(mid)
                answer = router.cancel(mid).value
            except Exception as e:
                raise AssertionError(f"one database down stops only its own messages: {mid} in 'second': {e!r}") from e
        finally:
            self.proxy.restore()
            for shard in [p.router.shards["first"] for p in self.procs]:
                wait_for(partial(_answers, shard), 30, "the first database back")
        assert found is not None and found["database"] == "second", found
        assert answer == self.EXPECTED[msg.state], f"cancel with one database down: {mid} ({msg.state}): {answer}"
        if msg.state in ("queued", "running"):
            msg.state = "cancelled"

    # -- checks after every step ---------------------------------------------------------------
    @invariant()
    def the_databases_match_the_model(self) -> None:
        if not hasattr(self, "msgs"):
            return
        rows: dict[str, list[tuple[str, str, int]]] = defaultdict(list)
        done: set[str] = set()
        for db in DBS:
            for mid, state, attempt in self._q(
                db, "SELECT message_id::text, state::text, attempt FROM {schema}.message"
            ):
                rows[mid].append((db, state, attempt))
            done |= {m for (m,) in self._q(db, "SELECT message_id::text FROM {schema}.history")}
        wrong = {m: why for m, why in self.never.items() if m in rows or m in done}
        assert not wrong, f"a send that never committed (rolled back, or caused without its outcome) exists: {wrong}"
        for mid, msg in self.msgs.items():
            here = {db: (state, attempt) for db, state, attempt in rows.get(mid, [])}
            if msg.maybe and msg.state != "done":
                seen = [db for db in msg.maybe if db in here]
                if len(seen) == 1:
                    msg.db, msg.maybe = seen[0], set()
            if msg.state == "done":
                assert set(here) <= {msg.ghost}, f"nothing runs again after it was done: {mid} is in {here}"
                continue
            assert msg.db in here, (
                f"nothing lost: {mid} ({msg.cause}; queue {msg.queue!r}, {msg.state} in {msg.db!r}) is in no database"
            )
            extra = set(here) - {msg.db, msg.ghost}
            assert not extra, f"exactly once: {mid} is in {sorted(here)}, the model has it in {msg.db!r} only"
            if msg.ghost is not None and msg.ghost in here:
                assert here[msg.ghost][0] in ("queued", "cancelled"), (mid, here)
            state, attempt = here[msg.db]
            assert attempt >= self.top.get(mid, 0), (
                f"attempts never go down: {mid} is at attempt {attempt} in {msg.db!r}, it was delivered at "
                f"attempt {self.top[mid]}"
            )
            if msg.state == "cancelled":
                left = f" (the cancel found the copy an interrupted relay left in {msg.ghost!r})" if msg.ghost else ""
                assert state == "cancelled", (
                    f"a cancelled message stays cancelled: {mid} is {state} in {msg.db!r}{left}"
                )
            assert (state, attempt) == (msg.state, msg.attempt), (
                f"the database matches the model: {mid} is {state} at attempt {attempt} in {msg.db!r}, the model "
                f"says {msg.state} at {msg.attempt}"
            )

    @invariant()
    def fenced_writes_exactly_once(self) -> None:
        if not hasattr(self, "msgs"):
            return
        for db in DBS:
            found = self._q(db, "SELECT delivery::text, n FROM {schema}.tally")
            assert {d for d, _ in found} == self.tally[db], f"a fenced block's write exactly when it committed ({db})"
            assert all(n == 1 for _, n in found), f"a fenced block's write applied once ({db})"

    def teardown(self) -> None:
        for proc in getattr(self, "procs", []):
            proc.router.close()
        if hasattr(self, "app"):
            self.app.close()
        for conn in getattr(self, "own", {}).values():
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(self.schema)))
            conn.close()
        delivery.start(None)


def _answers(broker: PostgresBroker) -> bool:
    try:
        broker.database.run(lambda c: c.execute("SELECT 1").fetchone())
        return True
    except Exception:
        return False


@pytest.fixture
def two_databases(dramatiq_pg_url: str) -> Iterator[tuple[dict[str, str], dict[str, str], Proxy]]:
    """URLs of two databases on the test server: the test database through a cuttable proxy, and
    one made for this test (dropped after it)."""
    name = f"routed_model_{uuid.uuid4().hex[:8]}"
    info = conninfo_to_dict(dramatiq_pg_url)
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    proxy = Proxy(str(info.get("host") or "localhost"), int(info.get("port") or 5432))
    second = make_conninfo(dramatiq_pg_url, dbname=name)
    try:
        yield ({"first": make_conninfo(dramatiq_pg_url, host="127.0.0.1", port=str(proxy.port)), "second": second},
               {"first": dramatiq_pg_url, "second": second}, proxy)  # fmt: skip
    finally:
        proxy.close()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


# ~15-25 s (more under load): ROUTED_EXAMPLES runs (15 by default) of up to 30 steps on two databases.
@pytest.mark.slow
@pytest.mark.timeout(600 + 6 * ROUTED_EXAMPLES)
def test_the_routed_broker_against_a_reference_model(two_databases: Any) -> None:
    """Given two databases, processes of two configurations, hand-driven relays and faults, I expect
    every invariant of the module's docstring after every step."""
    from hypothesis.stateful import run_state_machine_as_test

    RoutedModel.urls, RoutedModel.direct, RoutedModel.proxy = two_databases
    run_state_machine_as_test(
        RoutedModel,
        settings=settings(
            max_examples=ROUTED_EXAMPLES,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=os.environ.get("DRAMATIQ_PG_MODEL_SEED") is None,
            database=None,
            phases=[Phase.explicit, Phase.reuse, Phase.generate]
            if os.environ.get("DRAMATIQ_PG_MODEL_NO_SHRINK")
            else list(Phase),
        ),
    )
