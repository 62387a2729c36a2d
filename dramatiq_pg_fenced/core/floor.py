"""Where a consumer's claims start in the claim index: past the entries an old snapshot keeps dead.

Each claim leaves a dead entry at the head of the claim index, and while any
session of the database holds an old snapshot (a report, ``pg_dump``, a
forgotten ``BEGIN``) no vacuum may remove them, so a claim from the head
would step over every one of them.  A consumer (consumer.py) starts its
claims a little before the point where the queue was last seen drained
(:class:`Floor`), and goes back to the head now and then and whenever rows
may have gone back behind that point (:class:`LookBack`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from datetime import datetime, timedelta, timezone
from typing import Any

#: Where a claim from the head of the index starts: before every row.
HEAD = (-(2**31), "-infinity", -(2**63))
#: Seconds between two claims from the head, at most, while a row may wait
#: behind the floor (see :class:`Floor`), whatever the poll interval.
LOOK_BACK_EVERY = 1.0
#: While claims from the head find nothing behind the floor, the wait before the next doubles, up to
#: this many times ``LOOK_BACK_EVERY`` (one that finds a row there sets it back): each steps over the
#: entries an old snapshot keeps dead at the index's head, more the older it is (docs/performance.md).
LOOK_BACK_MAX_FACTOR = 8
#: How far before the database's clock at a drained claim the floor is put:
#: an enqueue stamps ``available_at`` when its statement starts and becomes
#: visible when it commits; one that commits later than this lands behind the
#: floor and waits for the next look back (``LOOK_BACK_EVERY``; :data:`LOOK_BACK_WINDOW`).
FLOOR_MARGIN = timedelta(milliseconds=250)
#: In a process that listens, a look back that nothing announced (the periodic one, and the one after
#: a claim from the floor that found nothing for a ring) starts this far before the floor, not at the
#: head: what lands behind the floor unannounced is an enqueue that committed late, by about as long
#: as its commit took.  Every row put back at its old place says ``"!back"`` (:class:`LookBack`), and
#: that look back goes to the head.  Under a pinned horizon a claim from the head steps over every
#: entry the pin keeps dead (270 ms after 30 minutes at 200 messages/s, docs/performance.md); one
#: from the window steps over the last few seconds' only.
LOOK_BACK_WINDOW = timedelta(seconds=10)
#: ... and once in this many seconds a probe beside the claims (a thread and a connection of its own)
#: looks for a claimable row behind the window, and asks for a look back to the head only if it finds
#: one: a row behind the window that nothing announced (a commit later than the window, a priority no
#: actor here has, an announcement missed).  The probe walks what the claim from the head would, but
#: the claims do not wait for it.  A process that does not listen hears no ``"!back"``: each of its
#: look backs goes to the head.
FULL_LOOK_BACK_EVERY = 300.0


#: How long a :class:`ServerClock`'s reading serves before the clock is read again.
CLOCK_FRESH_FOR = 60.0


class ServerClock:
    """The database's clock as seen from this process: a time at or before a statement's ``now()``.

    A claim that found nothing proves the queue drained, as a short one does,
    but returns no ``now()`` to put the floor at.  Each ``now()`` the database
    returned, less this process's monotonic time when the answer arrived, is
    at most the offset between the two clocks (``now()`` was taken before the
    answer left); the largest is kept, so ``sent + offset`` is at or before the
    ``now()`` of a statement sent at ``sent``.  A reading lower than that by more
    than :data:`FLOOR_MARGIN` (the server's clock stepped back, a failover to
    another server) replaces it: lower is the safe side.  A reading older than
    :data:`CLOCK_FRESH_FOR` seconds is not used: the consumer reads the clock
    again (one ``SELECT now()``) rather than trust a clock that may have moved.

    One per process (``ProcessParts.clock``), shared by its consumers' threads
    without a lock: every offset any of them writes is a lower bound, so the
    last write, whichever it is, is safe.
    """

    def __init__(self) -> None:
        self.offset: float | None = None  # seconds: the server's epoch time less the monotonic time
        self.read_at = -math.inf  # monotonic: the last reading

    def observe(self, server_now: datetime, received: float) -> None:
        """The database returned *server_now*; its answer arrived at monotonic time *received*."""
        lower = server_now.timestamp() - received
        if self.offset is None or lower > self.offset or lower < self.offset - FLOOR_MARGIN.total_seconds():
            self.offset = lower
        self.read_at = received

    def before(self, sent: float) -> datetime | None:
        """A time at or before the ``now()`` of a statement sent at monotonic time *sent*; ``None``
        if the clock was not read within :data:`CLOCK_FRESH_FOR` seconds."""
        if self.offset is None or sent - self.read_at > CLOCK_FRESH_FOR:
            return None
        return datetime.fromtimestamp(sent + self.offset, timezone.utc)


class Window(tuple):
    """Where a look back from :data:`LOOK_BACK_WINDOW` before the floor starts (a claim's start, as
    ``HEAD`` is one): ``(priority, available_at, seq)``."""

    __slots__ = ()


class LookBack:
    """Per process: how often each queue was told that rows went back behind the floor.

    Requeues at shutdown, rescues of expired leases, releases after a lost
    claim and a queue's resume put rows back at their old place in line; they
    send ``"!back <queue>"`` before ringing the queue (see
    :func:`~.doorbell.look_back`), and the next claim of every consumer of the
    queue in this process starts from the head.  A process that begins to
    listen (its queues' door, turns.py) may have missed some: every queue
    looks back then (:meth:`request_all`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._all = 0

    def request(self, queue_name: str) -> None:
        with self._lock:
            self._counts[queue_name] = self._counts.get(queue_name, 0) + 1

    def request_all(self) -> None:
        with self._lock:
            self._all += 1

    def count(self, queue_name: str) -> int:
        return self._counts.get(queue_name, 0) + self._all


class Floor:
    """Where one consumer's claims start: ``(priority, available_at, seq)`` in the claim index's order.

    A claim that comes back with rows proves that, at the database's
    ``now()`` of that claim, nothing was claimable between where it started
    and its first row (rows locked by other consumers' claims aside), nor
    anywhere after it if it came back short of its limit.  So the next claim
    may start at the lowest priority of the queue's actors and, within it, at
    the first row of a full claim, or ``FLOOR_MARGIN`` before the ``now()`` of
    a short one (of one that found nothing: before the server's clock as
    :class:`ServerClock` reads it); it does not visit the dead entries before that point (the
    claimed rows' old versions, which no vacuum may remove while some
    session's snapshot is older).  A row that lands behind the floor anyway
    (an enqueue that committed late, a message of a priority no actor here
    has, a row put back at its old place) is found by the next claim from the
    head: at once after a ``"!back"`` notification or a lost claim; within
    ``LOOK_BACK_EVERY`` seconds of the last one after a claim from the floor
    that came back empty (the doorbell rang for a row, and the floor did not
    find it: :attr:`look_back_due`), not at its next poll, whatever
    ``poll_interval``; and otherwise (a row left behind while the claims from
    the floor found others) at the next periodic claim from the head:
    ``LOOK_BACK_EVERY`` after the last one, up to ``LOOK_BACK_MAX_FACTOR``
    times that while they find nothing behind the floor (each doubles the wait;
    one that finds a row there sets it back).  In a process that listens, those
    last two start :data:`LOOK_BACK_WINDOW` before the floor (a :class:`Window`), and
    once every :data:`FULL_LOOK_BACK_EVERY` a probe beside the claims looks behind the
    window and, if it finds a row there, sends the next claim to the head.
    """

    def __init__(
        self, priority: int, look_back: LookBack | None, queue_name: str, *, windowed: bool = False
    ) -> None:
        self.priority = priority
        self.look_back = look_back if look_back is not None else LookBack()  # alone: nobody asks
        self.queue_name = queue_name
        #: Look backs that nothing announced start at the :class:`Window` (a process that hears "!back").
        self.windowed = windowed
        self._full_due = 0.0  # monotonic: when the next probe behind the window is due
        #: Set by :meth:`start` when that probe is due; the consumer clears it as it starts one.
        self.probe_wanted = False
        self.at: tuple[datetime, int] | None = None  # (available_at, seq); None: claim from the head
        self._head_due = 0.0  # monotonic
        self._head_at = -math.inf  # monotonic: the last claim from the head
        self._factor = 1  # of LOOK_BACK_EVERY until the next periodic claim from the head
        self._back_seen = self.look_back.count(queue_name)
        #: When the consumer must claim (from the head) though nothing rang (monotonic): set by a
        #: short claim from the floor, since a row may wait behind it; ``None`` after a claim from the head.
        self.look_back_due: float | None = None

    def start(self) -> tuple[int, Any, int]:
        """Where the next claim starts: ``HEAD`` when it must look back all the way (after a ``"!back"``,
        with no floor, when the probe found a row behind the window, or always in a process that does
        not listen), a :class:`Window` for a look back nothing announced, else the floor."""
        back = self.look_back.count(self.queue_name)
        if back != self._back_seen:
            self._back_seen = back
            self.at = None
        now = time.monotonic()
        if self.at is None:
            return HEAD
        if self.windowed and now >= self._full_due:
            self._full_due = now + FULL_LOOK_BACK_EVERY
            self.probe_wanted = True  # the consumer probes behind the window, beside its claims
        if now >= self._head_due or (self.look_back_due is not None and now >= self.look_back_due):
            if not self.windowed:
                return HEAD
            return self.window()
        return (self.priority, *self.at)

    def window(self) -> Window:
        """Where a look back nothing announced starts (the floor must be set)."""
        assert self.at is not None
        return Window((self.priority, self.at[0] - LOOK_BACK_WINDOW, HEAD[2]))

    def probed(self, found: bool | None) -> None:
        """The probe behind the window (another thread) ended: it *found* a claimable row there (the
        next claim goes to the head, at once), found none, or failed (``None``: probe again soon)."""
        if found is None:
            self._full_due = 0.0
        elif found:
            self.look_back.request(self.queue_name)
            self.look_back_due = time.monotonic()

    def claimed(
        self,
        start: tuple[int, Any, int],
        rows: list[tuple],
        limit: int,
        drained_at: datetime | None = None,
        *,
        rang: bool = True,
    ) -> None:
        """After a claim from *start* that returned *rows* (priority, available_at, seq at 4-6; now() at 7).

        *drained_at*, for a claim that returned nothing: a time at or before its ``now()``
        (:class:`ServerClock`).  Such a claim proves the queue drained from *start* on, as a short one
        does, and the floor moves to :data:`FLOOR_MARGIN` before it: an idle consumer (one whose
        process does not hold the queue's door takes nothing while the listener takes everything)
        would otherwise claim from where it last took a row, or from the head, for ever, and under a
        pinned horizon step over every entry left dead since.

        *rang*: the claim answered a ring (or its consumer does not listen, so any claim may): only
        then does one from the floor that found nothing look back soon, since the row that rang may
        lie behind the floor.  An idle poll's does not (it would claim again off its duty, turns.py)."""
        looked_back = start is HEAD or isinstance(start, Window)
        if looked_back:
            if self.at is not None:  # did it find a row behind the floor?  (Unknown without one.)
                floor = (self.priority, *self.at)
                behind = any((r[4], r[5], r[6]) < floor for r in rows)
                self._factor = 1 if behind else min(2 * self._factor, LOOK_BACK_MAX_FACTOR)
            self._head_at = time.monotonic()
            if start is HEAD:
                self._full_due = self._head_at + FULL_LOOK_BACK_EVERY
            self._head_due = self._head_at + LOOK_BACK_EVERY * self._factor
            self.look_back_due = None
        else:
            if not rows and rang:
                # What rang may lie behind the floor: look back by then.
                self.look_back_due = min(self._head_due, self._head_at + LOOK_BACK_EVERY)
            if self.at is None:
                return  # forgotten meanwhile: only a claim from the head sets it again
        if not rows:
            if drained_at is not None:
                # Drained (a paused queue's empty claim too: its resume says "!back").
                at = (drained_at - FLOOR_MARGIN, HEAD[2])
                self.at = at if looked_back or self.at is None else max(self.at, at)
            return
        drained = (rows[0][7] - FLOOR_MARGIN, HEAD[2])
        if len(rows) < limit:
            at = drained  # nothing claimable was left at all
        else:
            priority, available_at, seq = min((r[4], r[5], r[6]) for r in rows)
            if priority < self.priority:
                self.at = None  # a priority no actor here has is in line: claim from the head
                return
            at = (available_at, seq) if priority == self.priority else drained
        self.at = at if looked_back or self.at is None else max(self.at, at)

    def short(self) -> None:
        """A claim from the floor came back short, and a row may wait behind the floor (a fair claim's
        key whose slot its floor left empty): look back by the time a claim that found nothing would."""
        due = min(self._head_due, self._head_at + LOOK_BACK_EVERY)
        self.look_back_due = due if self.look_back_due is None else min(self.look_back_due, due)

    def forget(self) -> None:
        self.at = None


#: How many keys a fair consumer keeps a floor for (the most recently claimed ones: the arrays go with every
#: claim, and a key of a few messages gains nothing from one); a key without
#: one is claimed from its head.
KEY_FLOORS_MAX = 32


class KeyFloors:
    """Where a fair queue's claim starts in each key's rows: ``(available_at, seq)`` at the queue's
    :attr:`Floor.priority`, per key.

    The fair claim fills each key's slots with the key's own rows in the claim index's order from
    this point (``message_fair_key_idx``), so the rule of :class:`Floor` holds per key: a claim that
    took rows of a key proves that nothing of that key was claimable between where its scan started
    and its first row, and the next claim of the key may start there, past the entries the key's
    claimed rows left dead.  Without it every fair claim walked them from the key's head, and two
    worker processes claiming one flooding key stepped over each other's in-flight rows: 30% of the
    plain queue's drain (docs/performance.md, "Fair shares").  When the :class:`Floor` it goes with
    says to claim from the head (periodically, after a ``"!back"``, a lost claim, a short claim that
    may have left a row behind) every key starts at its head, and the floors start anew from what
    that claim took.  Kept for the :data:`KEY_FLOORS_MAX` keys claimed last.
    """

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.at: OrderedDict[str, tuple[datetime, int]] = OrderedDict()

    def params(self, start: tuple[int, Any, int]) -> dict[str, list[Any]]:
        """The fair claim's floor parameters for a claim from *start* (none from the head)."""
        floors = {} if start is HEAD else self.at
        return {
            "floor_keys": list(floors),
            "floor_at": [at for at, _ in floors.values()],
            "floor_seq": [seq for _, seq in floors.values()],
        }

    def claimed(self, start: tuple[int, Any, int], rows: list[tuple]) -> None:
        """After a fair claim from *start* that returned *rows* (priority, available_at, seq at 4-6,
        the key at 8)."""
        if start is HEAD:
            self.at.clear()
        firsts: dict[str, tuple[int, datetime, int]] = {}
        for row in rows:
            key, place = row[8], (row[4], row[5], row[6])
            if key is not None and (key not in firsts or place < firsts[key]):
                firsts[key] = place
        for key, (priority, available_at, seq) in firsts.items():
            if priority < self.priority:
                self.at.pop(key, None)  # a priority no actor here has is in this key's line: from its head
            elif priority == self.priority:
                old = self.at.get(key)
                self.at[key] = (available_at, seq) if old is None else max(old, (available_at, seq))
                self.at.move_to_end(key)
            # (its first row of a lower urgency: nothing of ours was due in its line; the floor stays)
        while len(self.at) > KEY_FLOORS_MAX:
            self.at.popitem(last=False)
