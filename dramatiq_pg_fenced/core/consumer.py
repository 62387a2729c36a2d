"""Consumer: claims due rows in batches and hands them to Dramatiq's worker.

A claim is one statement (``FOR UPDATE SKIP LOCKED`` in a CTE) that takes up
to the room left under the prefetch (:meth:`.Leases.capacity`) in rows,
bumps their attempt number and leases them to this consumer.  The attempt
goes on the delivered :class:`~.delivery.PostgresMessageProxy` (and a copy in
``options["attempt"]``); every later write for the delivery is fenced on it.

Where the claim's index scan starts is :class:`~.floor.Floor`'s business
(floor.py): past the dead entries an old snapshot keeps at the head of the
claim index.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime

import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import ConnectionClosed, DecodeError
from dramatiq.message import Message
from psycopg_pool import PoolTimeout

from ..config import Settings
from ..db.database import Database
from ..db.doorbell import Doorbell, look_back
from ..db.statements import Statements
from ..errors import SchemaError, lost_connection
from . import delivery, floor, turns
from .delivery import Outcome, PostgresMessageProxy, ResultWrite
from .fencing import State, Write
from .floor import HEAD, Floor, KeyFloors, LookBack, ServerClock
from .leases import Leases
from .outcomes import OutcomeWriter
from .turns import Answered, Turns

#: Claim limits up to this are written as they are; above it, rounded down to a power of two.
EXACT_LIMITS = 16


def claim_limit(room: int) -> int:
    """How many rows to claim when there is room for *room*: all of it up to :data:`EXACT_LIMITS`,
    else the largest power of two within it (the rest comes with the next claim), so that a process
    prepares a few dozen claims at most (see :func:`with_limit`), whatever its prefetch."""
    return room if room <= EXACT_LIMITS else 1 << (room.bit_length() - 1)


@functools.lru_cache(maxsize=256)
def with_limit(claim: bytes, limit: int) -> bytes:
    """The claim *claim* taking at most *limit* rows, written into its text.

    With a parameter there, the plan PostgreSQL keeps for a prepared claim
    (its generic plan) counts on taking a tenth of the queue, so it never won
    against a plan made for the call, and every claim was planned again: about
    0.6 ms of the server per claim, 40% of its time in a drain (profiled with
    ``pg_stat_statements.track_planning``).  With the number in the text, each
    limit is its own prepared statement, whose generic plan is kept after its
    first runs; :func:`claim_limit` keeps them few (psycopg keeps 100 prepared
    statements per connection, and one it drops must be prepared again).
    """
    return claim.replace(b"LIMIT %(limit)s", b"LIMIT %d" % int(limit), 1)


class LostClaims:
    """Per process: consumers whose last claim failed in flight, by queue.

    Such a claim may have committed rows nobody here saw.  The next claim of
    the queue in this process (by the same consumer, or the one Dramatiq's
    worker starts after a connection error) puts back the rows leased to
    those consumers that this process does not hold.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_queue: dict[str, set[str]] = {}

    def add(self, queue_name: str, consumer_id: str) -> None:
        with self._lock:
            self._by_queue.setdefault(queue_name, set()).add(consumer_id)

    def take(self, queue_name: str) -> list[str]:
        with self._lock:
            return sorted(self._by_queue.pop(queue_name, ()))

    def put_back(self, queue_name: str, consumer_ids: list[str]) -> None:
        with self._lock:
            self._by_queue.setdefault(queue_name, set()).update(consumer_ids)

    def waiting(self, queue_name: str) -> bool:
        """Is there something to put back for the queue?"""
        with self._lock:
            return bool(self._by_queue.get(queue_name))


class PostgresConsumer(Consumer):
    def __init__(
        self,
        queue_name: str,
        prefetch: int,
        timeout: int,
        *,
        consumer_id: str,
        database: Database,
        statements: Statements,
        settings: Settings,
        leases: Leases,
        lost_claims: LostClaims,
        writer: OutcomeWriter,
        doorbell: Doorbell | None,
        logger: logging.Logger,
        priority: int = 0,
        look_back: LookBack | None = None,
        clock: ServerClock | None = None,
        stored_exception: Callable[[PostgresMessageProxy], ResultWrite | None] | None = None,
        turns: Turns | None = None,
        answered: Answered | None = None,
        fair: bool = False,
    ) -> None:
        self.queue_name = queue_name
        #: A fair queue (an actor of it declares ``fairness_key``: sending/fairness.py) claims by weighted
        #: round robin across keys (the fair claim), topped up by the usual claim when it comes back short
        #: (rows without a tag: sent by a process that did not declare the actor) at most every
        #: ``LOOK_BACK_EVERY`` seconds.  Every other queue claims exactly as before.
        self.fair = fair
        self._top_up_due = 0.0  # monotonic
        #: Whose turn the idle poll of this queue is, and who answers a ring first, among the listening
        #: processes; which rings other processes' claims answered (turns.py).
        self.turns = turns
        self.answered = answered
        # A ring this process waits its turn to answer (turns.Turns.ring_delay): when it claims
        # (monotonic; None: no ring waits), unless another process's claim answers it first (its
        # count in ``answered`` moves past the one seen at the ring).
        self._ring_due: float | None = None
        self._ring_seen = 0
        #: The exception the Results middleware stores for a failed message: it rides the nack (results.py).
        self.stored_exception = stored_exception
        self.prefetch = max(prefetch, 1)
        self.timeout = timeout / 1000
        self.consumer_id = consumer_id
        self.database = database
        self.statements = statements
        self.settings = settings
        self.leases = leases
        self.lost_claims = lost_claims
        self.writer = writer
        self.logger = logger
        self.buffer: deque[PostgresMessageProxy] = deque()
        self._doorbell = doorbell
        self.wake: threading.Event | None = doorbell.subscribe(queue_name) if doorbell is not None else None
        # When the queue's next delayed row is due (monotonic; inf: none; None:
        # unknown), so the wait ends then, heard of or not (rows delayed before
        # this process listened, several delays in one enqueue_many, listen=False).
        self.next_due: float | None = None
        self.due_found = 0  #: how many reads of the next due time found a delayed row (tests, stats)
        self._timed_seen = 0
        self._due_read_at = 0.0  # monotonic; without LISTEN the next due time is read again now and then
        # Until when no claim is needed (monotonic): the last claim came back short, so the queue had
        # nothing more due, and the doorbell has not rung since.  Dramatiq asks for the next message
        # right after taking one; claiming again then would find nothing, and would compete for the
        # CPU with the worker thread starting that message.  The poll stays: every poll_interval, taken
        # in turn by the listening processes (one poll of the queue per interval in all: turns.py).
        self._quiet_until = 0.0
        # The wait until _quiet_until is only a look at the turns again, not a poll: the next poll of
        # ours was further away than turns.DUTY, and who is on duty may change meanwhile.
        self._only_look = False
        # A process that listens hears every "!back": its unannounced look backs may start at the window.
        self.floor = Floor(priority, look_back, queue_name, windowed=doorbell is not None and not fair)
        #: Where a claim that found nothing puts the floor (the process's: one reading serves every queue).
        self.clock = clock if clock is not None else ServerClock()
        self._answering = True  # the claim running now answers a ring (Floor.claimed's rang)
        self._probing = threading.Event()  # a probe behind the floor's window runs (_probe_behind)
        self.probes = 0  #: probes behind the window that ended (tests)
        self.key_floors = KeyFloors(priority)  # a fair queue's: where each key's rows are claimed from

    def __next__(self) -> MessageProxy | None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self.buffer:
                return self.buffer.popleft()
            full = self.leases.capacity(self.queue_name, self.prefetch) <= 0
            if not full and self._claim_due():
                # Does this claim answer a ring (a consumer that does not listen: any claim may)?
                self._answering = self.wake is None or self.wake.is_set() or self._ring_due is not None
                if self.wake is not None:
                    self.wake.clear()  # before the claim: a ring during it means another claim
                self._claim(deadline - time.monotonic())
                if self.buffer:
                    continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if full:
                # Every slot is taken: a settled message frees one, not the doorbell.
                self.leases.wait_for_capacity(self.queue_name, self.prefetch, remaining)
                continue
            wait = min(remaining, self.settings.poll_interval)
            if self._quiet_until:
                wait = min(wait, max(self._quiet_until - time.monotonic(), 0.0))
            if self.next_due is not None:
                wait = min(wait, max(self.next_due - time.monotonic(), 0.0))
            if self.floor.look_back_due is not None:
                wait = min(wait, max(self.floor.look_back_due - time.monotonic(), 0.0))
            if self._ring_due is not None:
                wait = min(wait, max(self._ring_due - time.monotonic(), 0.0))
            if self.wake is not None:
                self.wake.wait(wait)
            else:
                time.sleep(wait)

    def _claim_due(self) -> bool:
        """Must we claim now?  Not while the queue is known drained (see ``_quiet_until``)."""
        now = time.monotonic()
        if self.wake is None:
            return True
        if self._ring_due is not None and self.answered is not None:
            if self.answered.count(self.queue_name) != self._ring_seen:
                self._ring_due = None  # another process's claim answered it (after it rang)
            elif now >= self._ring_due:
                return True  # nobody did: our turn
        if self.wake.is_set() and not self._answer_later(now):
            return True
        if now >= self._quiet_until:
            if not self._only_look:
                return True
            self._set_quiet(now)  # not on duty (yet): look again later, and claim then if ours
            if now >= self._quiet_until:
                return True
        if self.next_due is not None and self.next_due <= now:
            return True
        if self.floor.look_back_due is not None and self.floor.look_back_due <= now:
            return True  # a row may wait behind the floor: look back, poll interval or not
        return self.lost_claims.waiting(self.queue_name)

    def _answer_later(self, now: float) -> bool:
        """The doorbell rang: must this process wait its turn to answer (see turns.py)?  If so the
        ring is remembered (the first one's time: later rings wait with it) and the wake cleared."""
        if self.turns is None or self.answered is None or self.wake is None:
            return False
        delay = self.turns.ring_delay(self.queue_name)
        if delay <= 0:
            return False
        self.wake.clear()
        if self._ring_due is None:
            self._ring_due = now + delay
            self._ring_seen = self.answered.count_at_ring(self.queue_name)
        return True

    def _claim(self, timeout: float) -> None:
        """Claim what there is room for.

        When the connection is lost, try once more on a fresh one; when the
        database is away, return without rows after waiting at most *timeout*
        seconds for a connection (the pool reconnects at a steady pace and
        hands one over as soon as it has it).  Dramatiq restarts a consumer
        that raises only after 3 s, and logs each time: that is for other errors.
        """
        limit = claim_limit(self.leases.capacity(self.queue_name, self.prefetch))
        if limit <= 0:
            return
        # Until this claim says otherwise (a short one sets them again), the next claim comes when there is
        # room: a stale "only look" would turn it into a look at the turns (no claim before the next duty).
        self._quiet_until, self._only_look = 0.0, False
        self._ring_due = None  # this claim answers whatever rang
        for tries in (1, 2):
            unsure = self.lost_claims.take(self.queue_name)
            try:
                with self.database.connection(raw=True, timeout=max(timeout, 0.01)) as conn:
                    if unsure:
                        self._release_unseen(conn, unsure)
                        unsure = []
                        self.floor.forget()
                    rows = self._claim_rows(conn, limit)
                    if len(rows) < limit and self.wake is not None:
                        self._set_quiet(time.monotonic())
                    if len(rows) < limit and self._due_unknown():
                        row = conn.execute(self.statements.next_due, {"queue": self.queue_name}).fetchone()
                        seconds = row[0] if row else None
                        self.next_due = math.inf if seconds is None else time.monotonic() + max(seconds, 0.0)
                        self.due_found += seconds is not None
                break
            except SchemaError:
                return  # not migrated (yet): the database layer says so once; claim again at the next poll
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                # A claim that failed in flight may have committed rows we never saw.
                self.lost_claims.put_back(
                    self.queue_name, unsure if isinstance(e, PoolTimeout) else [*unsure, self.consumer_id]
                )
                self.floor.forget()
                if not lost_connection(e):
                    raise ConnectionClosed(self.database.describe(e)) from None
                self.logger.debug("Claim of queue %r failed (try %d): %s", self.queue_name, tries, e)
                if tries == 2 or isinstance(e, PoolTimeout):
                    return
        rows.sort(key=lambda r: (r[4], r[5], r[6]))  # priority, due time, enqueue order
        for message_id, attempt, token, payload, *_ in rows:  # ids as text (db/queries/)
            self.leases.hold(self.queue_name, message_id, attempt, token)
            try:
                message = Message.decode(bytes(payload))
            except DecodeError as e:
                self.logger.error("Message %s has an undecodable payload; dead-lettering it: %s", message_id, e)
                self.writer.submit(
                    Outcome(
                        Write.NACK,
                        message_id,
                        attempt,
                        token,
                        error=f"undecodable payload: {e}",
                        queue_name=self.queue_name,
                    )
                )
                continue
            self.buffer.append(PostgresMessageProxy(message, attempt, token))

    def _set_quiet(self, now: float) -> None:
        """No claim until this process's next idle poll of the queue: ``poll_interval`` from now, or,
        while the listening processes take turns, the next point of its grid while it is on duty; a
        wait longer than one duty window ends with a look at the turns again instead (who is on duty
        changes as processes come and go)."""
        if self.turns is None:
            wait = self.settings.poll_interval
        else:
            wait = self.turns.next_turn(f"poll {self.queue_name}", self.settings.poll_interval, group=self.queue_name)
        self._only_look = wait > turns.DUTY
        self._quiet_until = now + min(wait, turns.DUTY)

    def _due_unknown(self) -> bool:
        """Must the next due time be read again? Unknown, passed, or new delayed rows were announced.

        Without LISTEN nothing announces them: read it again after every short
        claim at least half a poll interval after the last read, so a delayed
        message starts by ``max(due, enqueued + poll_interval)``.
        """
        now = time.monotonic()
        if self._doorbell is None:
            changed = now - self._due_read_at >= self.settings.poll_interval / 2
        else:
            timed = self._doorbell.timed_count(self.queue_name)
            changed = timed != self._timed_seen
            self._timed_seen = timed
        unknown = self.next_due is None or self.next_due <= now or changed
        if unknown:
            self._due_read_at = now
        return unknown

    def _claim_rows(self, conn: psycopg.Connection, limit: int) -> list[tuple]:
        start = self.floor.start()
        params = {
            "queue": self.queue_name,
            "limit": limit,
            "lease": self.settings.lease_seconds,
            "consumer": self.consumer_id,
            "from_priority": start[0],
            "from_at": start[1],
            "from_seq": start[2],
            "channel": self.settings.channel,
            # Taking rows and leaving the queue drained answers the rings others wait their turn for
            # (processes that listen to every ring: an older version's; turns.py).
            "took": self.answered.payload(self.queue_name)
            if self.answered is not None and self._others_listen()
            else None,
        }
        if self.fair:
            params.update(self.key_floors.params(start))
        claim = self._statement(fair=self.fair, telling=params["took"] is not None)
        # Prepared at once where statements are prepared at all (not behind PgBouncer): its plan is kept sooner.
        sent = time.monotonic()
        rows = conn.execute(with_limit(claim, limit), params, prepare=self.database.prepare or None).fetchall()
        # (A fair queue's floor says when to claim from the head.)
        self.floor.claimed(start, rows, limit, self._drained_at(conn, rows, sent), rang=self._answering)
        if self.floor.probe_wanted:
            self.floor.probe_wanted = False
            self._probe_behind()
        if not self.fair:
            return rows
        self.key_floors.claimed(start, rows)
        if len(rows) < limit and start is not HEAD:
            self.floor.short()  # a key's floor may have left its slot empty: look back soon
        if len(rows) < limit and time.monotonic() >= self._top_up_due:
            # Short: every due keyed row is taken (or locked by another claim); rows without a tag wait
            # for the usual claim, which takes them in the usual order (fairness.py), from the head.
            self._top_up_due = time.monotonic() + floor.LOOK_BACK_EVERY
            params["limit"] = room = claim_limit(limit - len(rows))
            params.update(from_priority=HEAD[0], from_at=HEAD[1], from_seq=HEAD[2])
            claim = self._statement(fair=False, telling=params["took"] is not None)
            rows += conn.execute(with_limit(claim, room), params, prepare=self.database.prepare or None).fetchall()
        return rows

    def _drained_at(self, conn: psycopg.Connection, rows: list[tuple], sent: float) -> datetime | None:
        """The clock's reading for the floor of a claim sent at *sent* that found nothing (floor.ServerClock);
        ``None`` for one that found rows (their ``now()`` is read instead) and in a fair queue (its key floors)."""
        if rows:
            self.clock.observe(rows[0][7], time.monotonic())
            return None
        if self.fair:
            return None
        drained_at = self.clock.before(sent)
        if drained_at is None:
            try:
                (server_now,) = conn.execute(self.statements.server_clock).fetchone() or (None,)
            except psycopg.Error:  # the claim is done and saw nothing: its floor stays, the pool sees to the rest
                return None
            if server_now is not None:
                self.clock.observe(server_now, time.monotonic())
                drained_at = self.clock.before(sent)
        return drained_at

    def _probe_behind(self) -> None:
        """Look for a claimable row behind the floor's window on a thread and a connection of its own
        (floor.FULL_LOOK_BACK_EVERY): under a pinned horizon that walk is as long as a claim from the
        head, and the claims do not wait for it; only a row found there sends the next one to the head."""
        if self._probing.is_set() or self.floor.at is None:
            return
        bound = self.floor.window()
        self._probing.set()

        def probe() -> None:
            found: bool | None = None
            try:
                params = {"queue": self.queue_name, "to_priority": bound[0], "to_at": bound[1], "to_seq": bound[2]}
                with self.database.connection(raw=True, timeout=self.settings.poll_interval) as conn:
                    found = conn.execute(self.statements.behind_window, params).fetchone() is not None
            except Exception as e:  # noqa: BLE001 (the database away, the broker closed: probe again later)
                self.logger.debug("Probe behind the floor of queue %r failed: %s", self.queue_name, e)
            finally:
                self.probes += found is not None
                self.floor.probed(found)
                self._probing.clear()
                if found and self.wake is not None:
                    self.wake.set()

        threading.Thread(target=probe, name=f"probe-{self.queue_name}", daemon=True).start()

    def _statement(self, *, fair: bool, telling: bool) -> bytes:
        st, durable = self.statements, self.settings.durable_outcomes
        if fair:
            if telling:
                return st.claim_fair_telling if durable else st.claim_fair_telling_relaxed
            return st.claim_fair if durable else st.claim_fair_relaxed
        if not telling:  # the usual claim: one UPDATE
            return st.claim if durable else st.claim_relaxed
        return st.claim_telling if durable else st.claim_telling_relaxed

    def _others_listen(self) -> bool:
        """May a process of an older version, which waits for ``!took``, hear this queue's rings (turns.py)?"""
        return self.turns is None or self.turns.others_listen()

    def _release_unseen(self, conn: psycopg.Connection, consumer_ids: list[str]) -> None:
        """After claims that failed in flight: put back what they may have leased to *consumer_ids* unseen."""
        held = [mid for mid, h in self.leases.snapshot().items() if h.queue_name == self.queue_name]
        params = {
            "consumers": consumer_ids,
            "queue": self.queue_name,
            "held": held,
            "max": self.settings.max_deliveries,
        }
        st = self.statements  # _logged: into the attempt log too (migration 023), while history is kept
        release = st.release_unseen_logged if self.settings.keep_finished > 0 else st.release_unseen
        rows = conn.execute(release, params).fetchall()
        dead = [str(mid) for mid, state in rows if state == State.DEAD.value]
        if len(rows) > len(dead):
            self.logger.warning(
                "Released %d message(s) of queue %r leased by a claim whose response was lost.",
                len(rows) - len(dead),
                self.queue_name,
            )
            if self.settings.listen:
                conn.execute(self.statements.notify, [self.settings.channel, look_back([self.queue_name])])
        for message_id in dead:
            self.logger.error(
                "Message %s of queue %r, leased by a claim whose response was lost, had %d deliveries without "
                "an outcome: it is dead-lettered (max_deliveries).",
                message_id,
                self.queue_name,
                self.settings.max_deliveries,
            )

    def ack(self, message: MessageProxy) -> None:
        self._settle(message, Write.ACK)

    def nack(self, message: MessageProxy) -> None:
        self._settle(message, Write.NACK)

    def _settle(self, message: MessageProxy, kind: Write) -> None:
        if not isinstance(message, PostgresMessageProxy):
            raise TypeError(f"{message!r} was not delivered by a PostgresBroker")
        if delivery.running() is message:
            delivery.start(None)  # this thread's sends are its own again
        if message.settled:
            # A retry the actor made itself was handed over at once (or the delivery never started): what
            # the delivery caused since is no part of that retry, and is dropped, counted.
            late = len(message.ack_sends) + len(message.follow_ups) + len(message.countdowns)
            if late:
                self.writer.stale.drop_unacked(Write.RETRY, message.message_id, message.attempt, late)
                message.ack_sends, message.follow_ups, message.countdowns = [], [], []
            return
        message.settled = True
        failed_after_commit = message.committed and kind is Write.NACK
        if message.committed:  # its fenced transaction wrote the ack: what it caused since rides this
            if failed_after_commit:
                delivery.failed_after_its_commit(self.logger, message, "dead-lettered")
            kind = Write.ACK
        nack = kind is Write.NACK
        outcome = message.decided or Outcome(
            kind,
            message.message_id,
            message.attempt,
            message.delivery,
            error=message.error_text("rejected") if nack else None,
            queue_name=self.queue_name,
            exception=message.exception if nack else None,
            result=None if nack else message.pending_result,
        )
        outcome.committed = message.committed
        if self.stored_exception is not None and (failed_after_commit or (nack and outcome.kind is Write.NACK)):
            # Rides this nack, only if it applies, in its transaction; after a committed fenced
            # transaction, the failure is the result of the ack it committed.
            outcome.result = self.stored_exception(message)
        outcome.follow_ups, outcome.countdowns = message.follow_ups, message.countdowns
        if message.ack_sends:
            if outcome.kind is Write.ACK:
                outcome.follow_ups = [*outcome.follow_ups, *message.ack_sends]
            else:  # with_ack(): a retry or a dead letter is no ack
                self.writer.stale.drop_unacked(
                    outcome.kind, message.message_id, message.attempt, len(message.ack_sends)
                )
        message.pending_result = message.decided = None
        self.writer.submit(outcome)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Release unstarted messages at once (fenced; the attempt stays)."""
        proxies = [m for m in messages if isinstance(m, PostgresMessageProxy) and not m.settled and self._still_held(m)]
        if self.buffer:
            proxies.extend(self.buffer)
            self.buffer.clear()
        if not proxies:
            return
        # On ConnectionClosed their leases lapse and the rescuer re-queues them;
        # the writer forgets them either way, or they would hold prefetch slots.
        released = self.writer.requeue(proxies)
        self.logger.info("Released %d unstarted message(s).", len(released))

    def _still_held(self, message: PostgresMessageProxy) -> bool:
        held = self.leases.held(message.message_id)
        return held is not None and held.delivery == message.delivery  # not released at shutdown already

    def close(self) -> None:
        if self._doorbell is not None and self.wake is not None:
            self._doorbell.unsubscribe(self.queue_name, self.wake)
        if self.buffer:
            count = len(self.buffer)
            try:
                self.requeue([])
            except ConnectionClosed:
                self.logger.warning("Could not release %d prefetched message(s); their leases will lapse.", count)
