"""Leases: what this process holds, and the keeper that extends them.

Every claimed message (prefetched, running, running on after its fenced
transaction committed, or settled with its outcome on the way to the
database) is held here with its attempt.  The
:class:`LeaseKeeper` extends all of them in one fenced statement every
``lease_seconds / 3``, on a thread of its own that does nothing else, so
rescue, vacuum and purge (see :mod:`.maintenance`) never delay it.  A row its
fenced transaction moved to ``committed`` is extended as a running one: the
actor may run on after its block, and its outcome, still to come, must find
the row to write what it caused (see :mod:`.exactly_once`).  Rows that
do not come back are lost to this process (redelivered elsewhere or
cancelled): their outcome will be fenced out.

A cancelled delivery whose actor still runs here keeps its row's lease: the
keeper extends it (``extend_cancelled``) until the delivery ends, so operators
see "cancel requested, still running" and a re-drive waits for its end.  Its
end clears the lease (``cancel_ended``): its outcome, fenced out (see
:meth:`.fencing.StaleWrites.report`), the start gate's refusal, or the keeper
for a cancelled delivery that never started.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import psycopg
from dramatiq.errors import ConnectionClosed

from ..config import Settings
from ..db.database import Database
from ..db.statements import Statements
from ..errors import MISSING_OBJECT, as_lost, unwritable
from .delivery import PostgresMessageProxy
from .fencing import State
from .interrupt import Interrupter
from .periodic import Periodic


class Held(NamedTuple):
    """A delivery this process holds."""

    queue_name: str
    attempt: int
    delivery: str  # the fence token


class Leases:
    """The registry of held deliveries; thread-safe (consumer, worker and writer threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a held message was released or settled
        self._held: dict[str, Held] = {}  # by message id
        self._lost: set[str] = set()
        self._settled: set[str] = set()  # outcome handed to the writer, not yet written
        self._started: dict[str, float] = {}  # passed the start gate (when: time.time()): its actor runs (or ran)
        self._cancelled: set[str] = set()  # its message was cancelled (a subset of _lost)
        self._draining = False  # the worker shuts down: claim nothing more
        self._per_queue: Counter[str] = Counter()
        self._settled_per_queue: Counter[str] = Counter()
        self.claims = 0  #: deliveries held since the process started (maintenance vacuums by it)

    def hold(self, queue_name: str, message_id: str, attempt: int, delivery: str) -> None:
        with self._lock:
            if message_id not in self._held:
                self._per_queue[queue_name] += 1
                self.claims += 1
            else:  # redelivered here while an older delivery's outcome is pending
                old = self._held[message_id]
                self._per_queue[old.queue_name] -= 1
                self._per_queue[queue_name] += 1
                self._lost.discard(message_id)
                self._started.pop(message_id, None)
                self._cancelled.discard(message_id)
                if message_id in self._settled:
                    self._settled.discard(message_id)
                    self._settled_per_queue[old.queue_name] -= 1
            self._held[message_id] = Held(queue_name, attempt, delivery)

    def release(self, message_id: str, delivery: str) -> None:
        """Forget the delivery (its outcome was written, fenced out or abandoned)."""
        with self._lock:
            held = self._held.get(message_id)
            if held is not None and held.delivery == delivery:
                del self._held[message_id]
                self._per_queue[held[0]] -= 1
                self._lost.discard(message_id)
                self._started.pop(message_id, None)
                self._cancelled.discard(message_id)
                if message_id in self._settled:
                    self._settled.discard(message_id)
                    self._settled_per_queue[held[0]] -= 1
                self._freed.notify_all()

    def settle(self, message_id: str) -> None:
        """Its outcome is on the way: a missing row is then no loss worth a warning, and its slot is free."""
        with self._lock:
            held = self._held.get(message_id)
            if held is not None and message_id not in self._settled:
                self._settled.add(message_id)
                self._settled_per_queue[held[0]] += 1
                self._freed.notify_all()

    def held(self, message_id: str) -> Held | None:
        """The delivery of *message_id* this process holds, if any."""
        with self._lock:
            return self._held.get(message_id)

    def capacity(self, queue_name: str, prefetch: int) -> int:
        """How many more messages of the queue this process may claim.

        Up to *prefetch* unsettled ones, as Dramatiq asks; a settled message
        (its outcome on its way to the database) no longer counts, so the next
        claim overlaps that write instead of waiting for it (held in all stays
        under twice the prefetch).
        """
        with self._lock:
            return self._capacity(queue_name, prefetch)

    def _capacity(self, queue_name: str, prefetch: int) -> int:
        if self._draining:
            return 0
        return room(prefetch, self._per_queue[queue_name], self._settled_per_queue[queue_name])

    def wait_for_capacity(self, queue_name: str, prefetch: int, timeout: float) -> bool:
        """Wait until :meth:`capacity` is positive (a consumer at its prefetch)."""
        with self._freed:
            return self._freed.wait_for(lambda: self._capacity(queue_name, prefetch) > 0, timeout)

    def start(self, message_id: str, delivery: str) -> bool:
        """Mark the delivery started, if this process still holds it and it was not lost; atomically,
        so :meth:`unstarted` never hands back a delivery whose actor runs."""
        with self._lock:
            held = self._held.get(message_id)
            if held is None or held.delivery != delivery or message_id in self._lost:
                return False
            self._started[message_id] = time.time()
            return True

    def undrain(self) -> None:
        """A worker starts (again) in this process: claim as usual."""
        with self._lock:
            self._draining = False

    def drain(self) -> list[tuple[str, Held]]:
        """The worker shuts down: claim nothing more (capacity is 0 from now on), and return every held
        delivery that has not started and has no outcome on its way (prefetched only)."""
        with self._lock:
            self._draining = True
            return [
                (mid, held)
                for mid, held in self._held.items()
                if mid not in self._started and mid not in self._settled and mid not in self._lost
            ]

    def waiting(self) -> dict[str, str]:
        """The prefetched deliveries (held, not started, not lost, no outcome on its way): message id -> token."""
        with self._lock:
            return {
                mid: held.delivery
                for mid, held in self._held.items()
                if mid not in self._started and mid not in self._settled and mid not in self._lost
            }

    def is_lost(self, message_id: str) -> bool:
        with self._lock:
            return message_id in self._lost

    def snapshot(self) -> dict[str, Held]:
        """Every held delivery, by message id."""
        with self._lock:
            return dict(self._held)

    def activity(self) -> dict[str, tuple[int, int]]:
        """Per queue: (busy: started and no outcome yet, its actor runs; prefetched: claimed, not started,
        not lost, no outcome).  Queues with neither are left out."""
        with self._lock:
            out: dict[str, list[int]] = {}
            for mid, held in self._held.items():
                if mid in self._settled:
                    continue
                if mid in self._started:
                    out.setdefault(held.queue_name, [0, 0])[0] += 1
                elif mid not in self._lost:
                    out.setdefault(held.queue_name, [0, 0])[1] += 1
            return {q: (b, p) for q, (b, p) in out.items()}

    def running(self) -> list[str]:
        """The message ids whose actor runs here now (started, no outcome yet): the busy ones of :meth:`activity`."""
        with self._lock:
            return sorted(mid for mid in self._started if mid in self._held and mid not in self._settled)

    def running_since(self) -> list[tuple[str, float]]:
        """:meth:`running`'s message ids, each with when its actor started (``time.time()``)."""
        with self._lock:
            return sorted((mid, t) for mid, t in self._started.items() if mid in self._held and mid not in self._settled)

    def mark_cancelled(self, message_id: str) -> None:
        """Its message was cancelled: if held and not started, it must not start (see FencedDelivery)."""
        with self._lock:
            if message_id in self._held:
                self._lost.add(message_id)
                self._cancelled.add(message_id)

    def cancelled(self) -> tuple[dict[str, str], dict[str, str]]:
        """The cancelled deliveries held here (message id -> token): (those whose actor runs: started,
        no outcome yet; those that never started, and never will)."""
        with self._lock:
            running, unstarted = {}, {}
            for mid in self._cancelled:
                held = self._held[mid]
                if mid in self._started:
                    if mid not in self._settled:
                        running[mid] = held.delivery
                elif mid not in self._settled:
                    unstarted[mid] = held.delivery
            return running, unstarted

    def mark_lost(self, deliveries: dict[str, str], kept: set[str]) -> set[str]:
        """After an extension of *deliveries* (message id -> token) that kept only *kept*: those now known lost."""
        with self._lock:
            lost = set()
            for mid, delivery in deliveries.items():
                held = self._held.get(mid)
                if mid not in kept and held is not None and held.delivery == delivery and mid not in self._settled:
                    lost.add(mid)
            self._lost |= lost
        return lost


def room(prefetch: int, held: int, settled: int) -> int:
    """Claimable now: *prefetch* unsettled at most, and fewer than twice *prefetch* held in all."""
    return min(prefetch - (held - settled), 2 * prefetch - held)


#: A delivery that waited in the prefetch longer than this (seconds) since its
#: claim, or since the last read that found its row still running under its
#: token, reads its row before it starts: was it cancelled or redelivered
#: meanwhile?  (A cancellation is also announced by NOTIFY, but that may arrive
#: a moment after the delivery starts.)  Only one started within this time of
#: its claim or of such a read skips the read: a cancel() cannot fall in
#: between unless it races that claim or read itself.
START_CHECK_AFTER = 0.005


class StartGate:
    """May a delivery held in the prefetch start?  (Asked by the ``FencedDelivery`` middleware.)"""

    def __init__(self, leases: Leases, database: Database, statements: Statements) -> None:
        self.leases = leases
        self.database = database
        self.statements = statements
        self._reading = threading.Lock()  # one read at a time: a thread that waited for it may need none
        #: (message id, token) -> when a read began that found the row running under that token (monotonic).
        self._read_at: dict[tuple[str, str], float] = {}

    def why_not(self, message: PostgresMessageProxy) -> str | None:
        """Why *message* must not start; ``None``: it may.

        Not if its lease was lost or its message cancelled (heard from the
        lease keeper or a cancel notification), nor, for one that waited in
        the prefetch, if its row is no longer running under its token.  That
        read covers every delivery waiting in the prefetch at once (one
        statement), so while actors start faster than ``START_CHECK_AFTER``
        apart, a read serves many starts instead of one each.  A delivery that
        must not start is settled with nothing written: the actor never runs,
        the row is someone else's.
        """
        held = self.leases.held(message.message_id)
        reason = None
        if held is None or held.delivery != message.delivery:
            reason = "this process no longer holds it"
        elif self.leases.is_lost(message.message_id):
            reason = "it was cancelled, or its lease was lost"
        elif not self._recent(message) and not self._read(message):
            reason = "it was cancelled, or redelivered elsewhere, while it waited in the prefetch"
        if reason is None and not self.leases.start(message.message_id, message.delivery):
            reason = "it was released (the worker is shutting down) or lost meanwhile"
        if reason is not None:
            message.settled = True
            self.leases.release(message.message_id, message.delivery)
            if held is not None and held.delivery == message.delivery:
                self._ended(message)
        return reason

    def _recent(self, message: PostgresMessageProxy) -> bool:
        """Was *message* claimed, or its row read running under its token, within ``START_CHECK_AFTER``?"""
        seen = max(message.claimed_at, self._read_at.get((message.message_id, message.delivery), 0.0))
        return time.monotonic() - seen <= START_CHECK_AFTER

    def _read(self, message: PostgresMessageProxy) -> bool:
        """Read whether *message*'s row, and every other waiting delivery's, is still running under its
        token (one statement); returns *message*'s answer."""
        with self._reading:
            if self._recent(message):
                return True  # read by the thread this one waited for
            waiting = self.leases.waiting()
            waiting[message.message_id] = message.delivery
            ids, tokens = list(waiting), list(waiting.values())
            began = time.monotonic()  # the read's snapshot is later: what it finds held was held then
            try:
                rows = self.database.run(
                    lambda conn: conn.execute(self.statements.still_held_many, [ids, tokens]).fetchall()
                )
            except ConnectionClosed:
                return True  # cannot tell: run it (at-least-once); its outcome is fenced either way
            found = {(mid, token) for mid, token in rows}  # text: still_held_many
            self._read_at = {key: began for key in found}  # a delivery that started or was dropped is forgotten here
            # The others found gone must not start either: lost now, they need no read of their own.
            self.leases.mark_lost(waiting, {mid for mid, _ in found})
            return (message.message_id, message.delivery) in found

    def _ended(self, message: PostgresMessageProxy) -> None:
        """A delivery that will not start: if its row was cancelled, it no longer says its actor runs.
        Best effort (one statement on a rare path): otherwise its lease lapses."""
        params = [[message.message_id], [message.delivery]]
        try:
            self.database.run(lambda conn: conn.execute(self.statements.cancel_ended, params))
        except Exception:  # the lease lapses within lease_seconds
            pass


class LeaseKeeper(Periodic):
    """Extends every lease this process holds, in one statement, every ``lease_seconds / 3``, on a
    connection of its own: made when there is a lease to extend, closed at a tick with none (an idle
    worker holds no connection for it)."""

    name = "dramatiq-pg-leases"
    what = "Lease keeper"

    def __init__(
        self,
        leases: Leases,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        on_cancelled: Callable[[str, str], object] | None = None,
    ) -> None:
        super().__init__(max(settings.lease_seconds / 3, 0.2), logger)
        self.leases = leases
        self.database = database
        self.statements = statements
        self.settings = settings
        #: Called with (message id, delivery token) for a delivery found cancelled (the interrupter).
        self.on_cancelled = on_cancelled
        self._conn: psycopg.Connection | None = None

    def tick(self) -> None:
        self.extend()

    def _extend(self, conn: psycopg.Connection, tokens: dict[str, str]) -> tuple[set[str], list[tuple[str, str]]]:
        """Extend the leases of *tokens* (message id -> token): (the ones kept, the ones found cancelled)."""
        extend = self.statements.extend if self.settings.durable_outcomes else self.statements.extend_relaxed
        params = {"ids": list(tokens), "deliveries": list(tokens.values()), "lease": self.settings.lease_seconds}
        kept = {str(r[0]) for r in conn.execute(extend, params).fetchall()}
        cancelled: list[tuple[str, str]] = []
        if len(kept) < len(tokens):
            rest = {mid: token for mid, token in tokens.items() if mid not in kept}
            rows = conn.execute(self.statements.delivery_states, [list(rest), list(rest.values())]).fetchall()
            # Locked elsewhere (an open fenced block, an operator): extended next time, not lost.
            kept |= {str(r[0]) for r in rows if r[2] in (State.RUNNING.value, State.COMMITTED.value)}
            cancelled = [(str(r[0]), str(r[1])) for r in rows if r[2] == State.CANCELLED.value]
        return kept, cancelled

    def _keep_cancelled(self, conn: psycopg.Connection) -> None:
        """The cancelled deliveries held here: the lease goes on while the actor runs, and is cleared for
        those that never started (fenced on their tokens; nothing runs when there is none)."""
        running, unstarted = self.leases.cancelled()
        if running:
            params = {"ids": list(running), "deliveries": list(running.values()), "lease": self.settings.lease_seconds}
            conn.execute(self.statements.extend_cancelled, params)
        if unstarted:
            conn.execute(self.statements.cancel_ended, [list(unstarted), list(unstarted.values())])

    def _connection(self) -> psycopg.Connection:
        """A connection of the keeper's own: a busy or exhausted pool never delays an extension.

        One made before its server was found to take no writes is dropped (see reconnect.py)."""
        conn = self._conn
        if conn is not None and not conn.closed and getattr(conn, "stale", False):
            with contextlib.suppress(Exception):
                conn.close()
        if self._conn is None or self._conn.closed:
            self._conn = self.database.connect()
        return self._conn

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
        self._close()

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    def extend(self) -> set[str]:
        """Extend every lease held (and not known lost), fenced; returns the ones found lost.

        Then the cancelled deliveries held here: the lease of one whose actor
        runs goes on (operators see it still running), one that never started
        has its lease cleared (it never will)."""
        held = {mid: h for mid, h in self.leases.snapshot().items() if not self.leases.is_lost(mid)}
        tokens = {mid: h.delivery for mid, h in held.items()}
        kept: set[str] = set()
        cancelled: list[tuple[str, str]] = []
        if not tokens and self.leases.cancelled() == ({}, {}):
            self._close()  # idle: a connection per process fewer; made again with the next lease
            return set()
        conn = self._connection()
        try:
            if tokens:
                kept, cancelled = self._extend(conn, tokens)
                for message_id, _ in cancelled:
                    self.leases.mark_cancelled(message_id)
            self._keep_cancelled(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError):
            self._conn = None
            with contextlib.suppress(Exception):
                conn.close()
            raise
        except psycopg.Error as e:  # a server that takes no writes is a lost connection (errors.py)
            if isinstance(e, MISSING_OBJECT):
                self.database.check_again(conn, e)  # the schema was dropped: said once (SchemaError)
            if not unwritable(e):
                raise
            self._conn = None
            self.database.drop_unwritable(conn, e)
            raise as_lost(e) from e
        lost = self.leases.mark_lost(tokens, kept)
        if self.on_cancelled is not None:
            for message_id, token in cancelled:  # a "!interrupt" notification lost, or LISTEN off
                self.on_cancelled(message_id, token)
        cancelled_ids = {message_id for message_id, _ in cancelled}
        for message_id in lost:
            if message_id in cancelled_ids:
                self.logger.info(
                    "Message %s (attempt %d) was cancelled; this process's outcome for it will be dropped.",
                    message_id,
                    held[message_id].attempt,
                )
                continue
            self.logger.warning(
                "Lease of message %s (attempt %d) was lost: it was redelivered, cancelled or finished elsewhere; "
                "this process's outcome for it will be fenced out.",
                message_id,
                held[message_id].attempt,
            )
        return lost


class CancelWatch(Periodic):
    """While this process does not listen: reads the rows of the interruptible deliveries running here
    every ``poll_interval``.  Without LISTEN (PgBouncer), or while another process listens for this
    one's queues (turns.py: one listener per set of queues), no ``!interrupt`` reaches it."""

    name = "dramatiq-pg-cancel-watch"
    what = "Cancel watch"

    def __init__(
        self,
        interrupter: Interrupter,
        database: Database,
        statements: Statements,
        settings: Settings,
        logger: logging.Logger,
        *,
        hears: Callable[[], int | None] | None = None,
    ) -> None:
        super().__init__(settings.poll_interval, logger)
        self.interrupter = interrupter
        self.database = database
        self.statements = statements
        #: Does this process hear the notifications now: ``None`` if not, else how many times it began
        #: to listen (turns.Turns.hearing).  (``hears`` itself ``None``: never: no LISTEN.)
        self.hears = hears
        self._heard: int | None = None

    def tick(self) -> None:
        heard = self.hears() if self.hears is not None else None
        if heard is None or heard != self._heard:  # not listening, or a cancel may have come before it did
            self.check()
        self._heard = heard

    def check(self) -> int:
        """Interrupt every running interruptible delivery whose row was cancelled; returns how many."""
        running = self.interrupter.running()
        if not running:
            return 0
        params = [list(running.values()), list(running)]
        rows = self.database.run(lambda conn: conn.execute(self.statements.delivery_states, params).fetchall())
        cancelled = [(str(mid), str(token)) for mid, token, state in rows if state == State.CANCELLED.value]
        return sum(self.interrupter.cancelled(mid, token) for mid, token in cancelled)
