"""Leases: what this process holds, extended in one statement, off the hot path.

Every claimed message (prefetched, running, or waiting for its outcome to be
written) is registered here with its attempt.  A keeper thread extends all of
them in one fenced statement every ``lease_seconds / 3``; rows that do not
come back are lost to this process (redelivered elsewhere or cancelled).  The
same thread returns expired leases of any process to the queue, so a crashed
worker's messages are claimable again within one rescue interval.  After
every few thousand claims of this process it also vacuums the message table:
claimed rows leave dead entries at the head of the claim index, and without
this every claim of a long backlog steps over more of them until autovacuum
comes by (once a minute with PostgreSQL's defaults).  A role that may not
vacuum the table (not its owner) leaves it to autovacuum, and says so once.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import TYPE_CHECKING

import psycopg

from .errors import lost_connection
from .reconnect import RETRY_INTERVAL

if TYPE_CHECKING:
    from .broker import PostgresBroker


#: Claims by this process between two vacuums of the message table, and the
#: shortest pause between them (seconds).
VACUUM_AFTER_CLAIMS = 5000
VACUUM_MIN_INTERVAL = 10.0


class Leases:
    def __init__(self, broker: PostgresBroker) -> None:
        self.broker = broker
        self.logger = broker.logger
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)  # a held message was released
        self._held: dict[str, tuple[str, int]] = {}  # message_id -> (queue, attempt)
        self._lost: set[str] = set()
        self._finishing: set[str] = set()  # outcome handed to the writer, not yet written
        self._per_queue: Counter[str] = Counter()
        self._settling: Counter[str] = Counter()  # per queue: held, with the outcome on its way
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_purge = 0.0
        self._claims = 0  # since the last vacuum
        self._last_vacuum = 0.0
        self._may_vacuum: bool | None = None

    # -- registry (called from consumer and worker threads) ---------------
    def hold(self, queue_name: str, message_id: str, attempt: int) -> None:
        with self._lock:
            if message_id not in self._held:
                self._per_queue[queue_name] += 1
                self._claims += 1
            elif message_id in self._finishing:  # redelivered here while an older outcome is pending
                self._finishing.discard(message_id)
                self._settling[self._held[message_id][0]] -= 1
            self._held[message_id] = (queue_name, attempt)
        self.start()

    def release(self, message_id: str, attempt: int) -> None:
        with self._lock:
            held = self._held.get(message_id)
            if held is not None and held[1] == attempt:
                del self._held[message_id]
                self._per_queue[held[0]] -= 1
                self._lost.discard(message_id)
                if message_id in self._finishing:
                    self._finishing.discard(message_id)
                    self._settling[held[0]] -= 1
                self._freed.notify_all()

    def finishing(self, message_id: str) -> None:
        """Its outcome is on the way: a missing row is then no loss worth a warning."""
        with self._lock:
            held = self._held.get(message_id)
            if held is not None and message_id not in self._finishing:
                self._finishing.add(message_id)
                self._settling[held[0]] += 1
                self._freed.notify_all()

    def holding(self, message_id: str) -> tuple[str, int] | None:
        """(queue, attempt) of *message_id* if this process holds it."""
        with self._lock:
            return self._held.get(message_id)

    def capacity(self, queue_name: str, prefetch: int) -> int:
        """How many more messages of the queue this process may claim.

        Up to *prefetch* unsettled ones, as Dramatiq asks; a message whose
        outcome is on its way to the database no longer counts, so the next
        claim overlaps that write instead of waiting for it (held in all stays
        under twice the prefetch).
        """
        with self._lock:
            return self._capacity(queue_name, prefetch)

    def _capacity(self, queue_name: str, prefetch: int) -> int:
        held = self._per_queue[queue_name]
        return min(prefetch - (held - self._settling[queue_name]), 2 * prefetch - held)

    def wait_for_capacity(self, queue_name: str, prefetch: int, timeout: float) -> bool:
        """Wait until :meth:`capacity` is positive (a consumer at its prefetch)."""
        with self._freed:
            return self._freed.wait_for(lambda: self._capacity(queue_name, prefetch) > 0, timeout)

    def is_lost(self, message_id: str) -> bool:
        with self._lock:
            return message_id in self._lost

    def held(self) -> dict[str, tuple[str, int]]:
        with self._lock:
            return dict(self._held)

    # -- keeper thread --------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            with self._lock:
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="dramatiq-pg-leases", daemon=True)
                    self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        broker = self.broker
        extend_every = max(broker.lease_seconds / 3, 0.2)
        next_extend = time.monotonic() + extend_every
        lost = False  # the last round lost its connection: the database may be back from an outage
        while not self._stopped.wait(RETRY_INTERVAL if lost else min(broker.rescue_interval, extend_every)):
            try:
                if lost or time.monotonic() >= next_extend:  # after an outage, leases first
                    self.extend()
                    next_extend = time.monotonic() + extend_every
                lost = False
                self.rescue()
                if self._claims >= VACUUM_AFTER_CLAIMS and time.monotonic() - self._last_vacuum > VACUUM_MIN_INTERVAL:
                    self._claims = 0
                    self._last_vacuum = time.monotonic()
                    self.vacuum()
                if time.monotonic() - self._last_purge > 60:
                    self._last_purge = time.monotonic()
                    with broker._pool_connection(raw=True) as conn:
                        conn.execute(broker._sql.purge_finished, [broker.dead_message_ttl])
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                lost = lost_connection(e)
                if lost:  # the next round waits in the pool; reconnect.py logs the outage
                    self.logger.debug("Lease keeper lost its connection: %s", e)
                else:
                    self.logger.warning("Lease keeper could not reach the database: %s", e)
            except Exception:
                self.logger.exception("Lease keeper failed; trying again.")

    def may_vacuum(self) -> bool:
        """Asked once per process: may this role vacuum the message table?"""
        if self._may_vacuum is None:
            broker = self.broker
            with broker._pool_connection(raw=True) as conn:
                row = conn.execute(broker._sql.may_vacuum, [f'"{broker.schema}".message']).fetchone()
            self._may_vacuum = bool(row and row[0])
            if not self._may_vacuum:
                self.logger.info(
                    "This database role may not VACUUM %s.message; workers leave it to autovacuum "
                    "(a long backlog's claims may slow down between its runs).",
                    broker.schema,
                )
        return self._may_vacuum

    def vacuum(self) -> bool:
        """Vacuum the message table if this role may; returns whether it did."""
        if not self.may_vacuum():
            return False
        broker = self.broker
        with broker._pool_connection(raw=True) as conn:
            conn.execute(broker._sql.vacuum)
        return True

    def extend(self) -> None:
        """Extend every lease this process holds, in one fenced statement."""
        held = {mid: att for mid, (_, att) in self.held().items() if not self.is_lost(mid)}
        if not held:
            return
        broker = self.broker
        with broker._pool_connection(raw=True) as conn:
            rows = conn.execute(broker._sql.extend, [broker.lease_seconds, list(held), list(held.values())]).fetchall()
        kept = {str(r[0]) for r in rows}
        with self._lock:
            lost = {mid for mid in set(held) - kept if mid in self._held and mid not in self._finishing}
            self._lost |= lost
        if lost:
            for message_id in lost:
                self.logger.warning(
                    "Lease of message %s (attempt %d) was lost: it was redelivered, cancelled or finished elsewhere; "
                    "this process's outcome for it will be fenced out.",
                    message_id,
                    held[message_id],
                )

    def rescue(self) -> int:
        """Return expired leases (of any process) to their queues."""
        broker = self.broker
        with broker._pool_connection(raw=True) as conn:
            rows = conn.execute(broker._sql.rescue).fetchall()
            if rows:
                queues = sorted({r[1] for r in rows})
                conn.execute(broker._sql.notify, [broker.channel, queues])
        for message_id, queue_name, attempt in rows:
            self.logger.warning(
                "Lease of message %s on queue %r (attempt %d) expired; it is queued for redelivery.",
                message_id,
                queue_name,
                attempt,
            )
        return len(rows)
