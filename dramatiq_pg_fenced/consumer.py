"""Consumer: claims due rows in batches and hands them to Dramatiq's worker.

A claim is one statement (``FOR UPDATE SKIP LOCKED`` in a CTE) that takes up
to the room left under the prefetch (``Leases.capacity``) in rows, bumps their attempt number and leases
them to this process.  The attempt goes into ``message.options["attempt"]``
and every later write for the delivery is fenced on it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message
from psycopg_pool import PoolTimeout

from .errors import lost_connection
from .outcomes import Outcome, ResultWrite

if TYPE_CHECKING:
    from .broker import PostgresBroker


class PostgresMessageProxy(MessageProxy):
    """A delivered message: knows its attempt and whether it was settled.

    ``settled`` is set once a fenced transition (a retry) was handed to the
    writer, so the ack Dramatiq sends after a retry is a quiet no-op.
    ``pending_result`` is set by the results backend: the result is written
    in the transaction of this attempt's ack, and only if the ack applies.
    """

    def __init__(self, message: Message, attempt: int) -> None:
        super().__init__(message)
        self.attempt = attempt
        self.settled = False
        self.pending_result: ResultWrite | None = None


class PostgresConsumer(Consumer):
    def __init__(self, broker: PostgresBroker, queue_name: str, prefetch: int, timeout: int) -> None:
        self.broker = broker
        self.logger = broker.logger
        self.queue_name = queue_name
        self.prefetch = max(prefetch, 1)
        self.timeout = timeout / 1000
        self.buffer: deque[PostgresMessageProxy] = deque()
        self.doorbell = broker._doorbell_event(queue_name)
        # When the queue's next delayed row is due (monotonic; inf: none; None:
        # unknown), so the wait ends then, heard of or not (rows delayed before
        # this process listened, several delays in one enqueue_many, listen=False).
        self.next_due: float | None = None
        self._timed_seen = 0
        # The keeper also rescues other processes' expired leases: a consuming
        # process must run it even before it holds anything, or a message of a
        # dead or paused worker waits until some worker happens to claim.
        broker._leases.start()

    def __next__(self) -> MessageProxy | None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.buffer:
                return self.buffer.popleft()
            if self.doorbell is not None:
                self.doorbell.clear()
            full = self.broker._leases.capacity(self.queue_name, self.prefetch) <= 0
            if not full:
                self._claim(deadline - time.monotonic())
                if self.buffer:
                    continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if full:
                # Every slot is taken: a settled message frees one, not the doorbell.
                self.broker._leases.wait_for_capacity(self.queue_name, self.prefetch, remaining)
                continue
            wait = min(remaining, self.broker.poll_interval)
            if self.next_due is not None:
                wait = min(wait, max(self.next_due - time.monotonic(), 0.0))
            if self.doorbell is not None:
                self.doorbell.wait(wait)
            else:
                time.sleep(wait)

    def _claim(self, timeout: float) -> None:
        """Claim what there is room for.  When the connection is lost, try once more on a fresh one;
        when the database is away, return without rows after waiting at most *timeout* seconds for
        a connection (the pool reconnects at a steady pace and hands one over as soon as it has it).
        Dramatiq restarts a consumer that raises only after 3 s, and logs each time: that is for
        other errors."""
        broker = self.broker
        limit = broker._leases.capacity(self.queue_name, self.prefetch)
        if limit <= 0:
            return
        unsure = broker._state().unsure_claims
        for tries in (1, 2):
            try:
                with broker._pool_connection(raw=True, timeout=max(timeout, 0.01)) as conn:
                    if self.queue_name in unsure:
                        self._release_unseen(conn)
                        unsure.discard(self.queue_name)
                    rows = self._claim_rows(conn, limit)
                    if len(rows) < limit and self._due_unknown():
                        row = conn.execute(broker._sql.next_due, {"queue": self.queue_name}).fetchone()
                        seconds = row[0] if row else None
                        self.next_due = math.inf if seconds is None else time.monotonic() + max(seconds, 0.0)
                break
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if not isinstance(e, PoolTimeout):
                    unsure.add(self.queue_name)  # it may have committed rows we never saw
                if not lost_connection(e):
                    raise ConnectionClosed(broker._describe(e)) from None
                self.logger.debug("Claim of queue %r failed (try %d): %s", self.queue_name, tries, e)
                if tries == 2 or isinstance(e, PoolTimeout):
                    return
        rows.sort(key=lambda r: (r[3], r[4], r[5]))
        for message_id, attempt, payload, _, _, _ in rows:
            message_id = str(message_id)
            broker._leases.hold(self.queue_name, message_id, attempt)
            try:
                message = Message.decode(bytes(payload))
            except DecodeError as e:
                self.logger.error("Message %s has an undecodable payload; dead-lettering it: %s", message_id, e)
                broker._writer.submit(
                    Outcome("nack", message_id, attempt, error=f"undecodable payload: {e}", queue_name=self.queue_name)
                )
                continue
            message.options["attempt"] = attempt
            self.buffer.append(PostgresMessageProxy(message, attempt))

    def _due_unknown(self) -> bool:
        """Must the next due time be read again? Unknown, passed, or new delayed rows were announced."""
        doorbell = self.broker._state().doorbell
        timed = doorbell.timed_count(self.queue_name) if doorbell is not None else 0
        changed = timed != self._timed_seen
        self._timed_seen = timed
        return self.next_due is None or self.next_due <= time.monotonic() or changed

    def _claim_rows(self, conn: psycopg.Connection, limit: int) -> list[tuple]:
        broker = self.broker
        params = {
            "queue": self.queue_name,
            "limit": limit,
            "lease": broker.lease_seconds,
            "consumer": broker.consumer_id,
        }
        return conn.execute(broker._sql.claim, params).fetchall()

    def _release_unseen(self, conn: psycopg.Connection) -> None:
        """After a claim that failed in flight: put back what it may have leased to us unseen."""
        broker = self.broker
        held = [mid for mid, (queue, _) in broker._leases.held().items() if queue == self.queue_name]
        rows = conn.execute(broker._sql.release_unseen, [broker.consumer_id, self.queue_name, held]).fetchall()
        if rows:
            self.logger.warning(
                "Released %d message(s) of queue %r leased by a claim whose response was lost.",
                len(rows),
                self.queue_name,
            )
            if broker.listen:
                conn.execute(broker._sql.notify, [broker.channel, [self.queue_name]])

    def ack(self, message: MessageProxy) -> None:
        self._settle(message, "ack")

    def nack(self, message: MessageProxy) -> None:
        self._settle(message, "nack")

    def _settle(self, message: MessageProxy, kind: str) -> None:
        if not isinstance(message, PostgresMessageProxy):
            raise TypeError(f"{message!r} was not delivered by a PostgresBroker")
        if message.settled:
            return  # a retry already decided this attempt's outcome
        message.settled = True
        error = None
        if kind == "nack":
            exc = message._exception
            error = message.options.get("traceback") or (repr(exc) if exc is not None else "rejected")
        self.broker._writer.submit(
            Outcome(
                kind,
                message.message_id,
                message.attempt,
                error=error,
                queue_name=self.queue_name,
                exception=message._exception if kind == "nack" else None,
                result=message.pending_result if kind == "ack" else None,
            )
        )
        message.pending_result = None

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Release unstarted messages at once (fenced; the attempt stays)."""
        proxies = [m for m in messages if isinstance(m, PostgresMessageProxy) and not m.settled]
        if self.buffer:
            proxies.extend(self.buffer)
            self.buffer.clear()
        if not proxies:
            return
        try:
            self.broker._requeue(proxies)
        except ConnectionClosed:
            # Their leases will lapse and the rescuer re-queues them; forget them
            # here, or they would hold prefetch slots of this process forever.
            for proxy in proxies:
                self.broker._leases.release(proxy.message_id, proxy.attempt)
            raise

    def close(self) -> None:
        doorbell = self.broker._state().doorbell
        if doorbell is not None and self.doorbell is not None:
            doorbell.unsubscribe(self.queue_name, self.doorbell)
        if self.buffer:
            count = len(self.buffer)
            try:
                self.requeue([])
            except ConnectionClosed:
                self.logger.warning("Could not release %d prefetched message(s); their leases will lapse.", count)
