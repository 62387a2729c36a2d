"""Turns: chores that one listening process per database does at a time, not every process.

An idle worker process used to poll each of its queues every
``poll_interval`` and rescue expired leases every ``rescue_interval``: the
server's idle load grew with processes x queues.  While a process listens,
polls are only a safety net (a notification lost to nobody, a producer that
does not ring, a row behind a consumer's floor that nothing announced), and
one poll of a queue per interval across all processes serves it as well as
one per process.

So each process takes a *seat* on its LISTEN connection: the lowest free
slot of a session advisory lock of the schema (:data:`KEY_PREFIX`), held
while that connection lives and freed by the server when it dies.  Every
:data:`REFRESH_EVERY` seconds, on the same connection, the process reads
which sessions hold seats (``pg_locks``): its rank among them and how many
there are.  Time is cut into *duty* windows (:data:`DUTY`, or a chore's
period when longer) that belong to one rank each, in turn
(:meth:`Turns.owner`): the process on duty polls each idle queue every
``poll_interval`` and rescues every ``rescue_interval`` (:meth:`Turns.next_turn`,
:meth:`Turns.on_duty`); the others do neither.  One duty for all of a
process's queues keeps its pooled connection in use (a connection idle for
2 s costs a check on its next checkout, reconnect.py).  The purges go by
windows of their own period.

Wake one, not all.  PostgreSQL signals *every* backend of the database that
LISTENs on any channel for each NOTIFY, and each one reads the notification
in a transaction of its own: with N listening processes a ring costs N
server transactions, whatever the channel (a channel per process would save
nothing).  So of the processes that consume the same set of queues, one at a
time listens: the holder of the set's *door*, a session advisory lock
(:meth:`Turns.admit`, on the LISTEN connection).  The others do not LISTEN;
their LISTEN connection waits in the server's queue for the door (at most
:func:`wait_for_door` seconds a time, then the seats are read again: that is
the connection's check).  The door's holder claims on each ring at once.
When a ring comes for a queue it has no room for (its prefetch taken) and
another process waits for the door, it passes the door on (:meth:`Turns.stay`;
not before it held it :data:`HOLD` seconds: such a ring is passed at the
listener's next check then, if there is still no room):
UNLISTEN, unlock, and the server hands the lock to the process that waited
longest, which LISTENs and claims on each of its queues once (a ring sent
while nobody listened is found so).  Its consumers find everything else as
before: the idle polls in turn (below) and a delayed row's due time read
after a short claim.  A process that does not listen hears no ``!cancel``
and no ``!interrupt``: its cancel watch reads the rows of the interruptible
deliveries running in it every ``poll_interval``, and once each time it
begins to listen (leases.CancelWatch, :meth:`Turns.hearing`), and a
prefetched delivery is checked before it starts (leases.StartGate).  A door
holder that ran no statement for :func:`stuck_after` seconds (stopped,
starved) makes the waiters listen too, as all did before doors, until it
runs again.

Rings to processes that all listen (older versions of this package, or a
process that consumes nothing) are answered in turn: the owner of the queue's
current ring window (:data:`RING_WINDOW`) claims at once, and each other
process waits :data:`RING_STEP` seconds per rank behind it, and claims then
only if no other process's claim has said, since the ring, that it took rows
and left the queue drained (``"!took"``, sent by the claim statement itself:
:class:`Answered`, and only while such processes hold seats:
:meth:`Turns.others_listen`).  A door's holder claims at once.

Unknown turns (not listening yet, LISTEN lost, the seat read failed) mean
every chore is this process's, as it was before turns: a process whose LISTEN
connection is down polls every ``poll_interval`` and rescues every
``rescue_interval``.  A door whose holder's connection ends is free at once,
and the next waiter takes it within milliseconds.  Processes that see the
membership differently for a moment (one joined or left within the last refresh) may both do a window, or
neither: the next window is another's.  Nothing here decides *whether*
something happens, only who does the idle chores and how often: a ring, a
due delayed row, a look-back after a short claim from the floor and the
claims after a lost connection are untouched.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Callable

import psycopg
import psycopg.errors

from ..db.statements import Statements

logger = logging.getLogger(__name__)

#: Seconds between two reads of who holds a seat (one transaction of each listening process); the
#: read stands for the doorbell's own check of its connection (doorbell.CHECK_EVERY), not on top of it.
REFRESH_EVERY = 5.0
#: Turns read longer ago than this are unknown (every chore is ours again).
STALE_AFTER = 3 * REFRESH_EVERY
#: Seconds a process is on duty for the idle polls and the rescue before the next rank is.
DUTY = 10.0
#: Seconds a process answers the rings of a queue at once before the next rank does (load spreads).
RING_WINDOW = 1.0
#: Seconds each rank behind the ring window's owner waits before it claims on a ring nobody answered.
RING_STEP = 0.05
#: Seconds a door's holder keeps the door at least before it passes it (a ring it has no room for
#: sooner is passed at its listener's next check, if there is still no room): under a load that keeps
#: every process full the door goes round ten times a second at most, not at every ring.
HOLD = 0.1
#: What the advisory lock's first key is made of, with the schema.
KEY_PREFIX = "dramatiq-pg-fenced turns "
#: The group in which every process of this version takes a seat: a process with a seat in ``""``
#: and none here is an older one, which listens to every ring and waits for ``!took``.
WAKE_ONE = "\x01wake one"


def stuck_after() -> float:
    """Seconds without a statement after which a door's holder is taken for stuck (stopped, starved):
    it reads the seats every :data:`REFRESH_EVERY` seconds, at a check of its listener (each second)."""
    return 3 * REFRESH_EVERY + 2.0


def wait_for_door() -> float:
    """Seconds a waiter's LISTEN connection waits for the door before it reads the seats again (its
    check): twice :data:`REFRESH_EVERY`, a read per 10 s, as often as a listener's per 5 s costs two."""
    return 2 * REFRESH_EVERY


def _hash(text: str) -> int:
    return zlib.crc32(text.encode())


def lock_key(schema: str, group: str = "") -> int:
    """The first key of a group's seats (a positive int4, the same in every process)."""
    return _hash(f"{KEY_PREFIX}{schema}\0{group}") & 0x7FFFFFFF


class Turns:
    """This process's place among the listening processes of one schema (see the module docstring).

    Seats are taken per *group*: ``""`` for every consuming process (the rescue
    and the purges), one for the relays of a routed broker (routing.py), and one per queue, taken by the processes that consume it
    (:meth:`join`), so that a queue's polls and rings go only to its consumers.
    Attached to the broker's doorbell (:meth:`.doorbell.Doorbell.attend`):
    :meth:`listening` takes the seats on each new LISTEN connection,
    :meth:`check` takes those of queues joined since and reads the membership
    again when due, :meth:`deaf` forgets it all.
    """

    def __init__(
        self,
        statements: Statements,
        schema: str,
        groups: tuple[str, ...] = ("",),
        heard: Callable[[], None] | None = None,
    ) -> None:
        self.statements = statements
        self.schema = schema
        #: Called each time this process begins to listen: a ``!back`` sent before went unheard
        #: (consumer.LookBack.request_all).
        self._on_heard = heard
        self._lock = threading.Lock()
        # A process's turns take seats in *groups* from the start; the broker's join "" as they consume
        # (only a consuming process rescues and purges: one that only relays takes no turn there).
        self._groups: set[str] = set(groups)
        self._seated: set[str] = set()  # the groups with a seat on the current LISTEN connection
        self._seats: dict[str, tuple[int, int]] = {}  # group -> (rank, count)
        self._read_at = 0.0  # monotonic
        self._room: dict[str, Callable[[], bool]] = {}  # queue -> has this process room for one more?
        self._door: str | None = None  # the door group whose lock this process's LISTEN connection holds
        self._waiting = 0  # sessions waiting for that door, at the last read
        self._hears = False  # is the LISTEN connection listening (door or not)?
        self._listens = 0  # how many times it began to listen: what was sent before went unheard
        self._stuck = False  # has the door's holder run nothing for long (then the waiters listen too)?
        self._older = True  # does a process of an older version (no seat in WAKE_ONE) hold a seat?
        self._door_at = 0.0  # monotonic: when this process took the door
        self._passing: str | None = None  # a queue rung while it had no room, before HOLD was up

    def join(self, *groups: str, room: Callable[[], bool] | None = None) -> None:
        """Take turns in *groups* (``""``: the rescue and purges; a queue this process consumes; the
        relays', routing.py) from the next check on; *room*: has this process room for one more
        message of those queues (else the door goes on at a ring of one: see the module docstring)."""
        with self._lock:
            self._groups.update(groups)
            if room is not None:
                self._room.update((g, room) for g in groups if g)

    # -- the doorbell's side ------------------------------------------------
    def listening(self, conn: psycopg.Connection) -> None:
        """On a new LISTEN connection: take the lowest free seat of each group, then read the membership."""
        with self._lock:
            self._seated = set()
            self._door = None
        conn.execute(self.statements.turn_door_patience, {"ms": f"{round(wait_for_door() * 1000)}ms"})
        self.check(conn)

    def door_group(self) -> str | None:
        """The door of this process's set of queues (``None``: it consumes none, and listens to all)."""
        with self._lock:
            queues = sorted(g for g in self._groups if g)
        return "door " + "\0".join(queues) if queues else None

    def admit(self, conn: psycopg.Connection) -> bool:
        """Before LISTEN, on the LISTEN connection: may this process listen now?  Waits for the door of
        its queues (at most :func:`wait_for_door` seconds, in the server's queue), then says yes; or
        reads the seats (the connection's check) and says no.  Yes at once without queues."""
        door = self.door_group()
        if door is None:
            return True
        try:
            conn.execute(self.statements.turn_door, {"key": lock_key(self.schema, door)})
        except psycopg.errors.LockNotAvailable:
            if not self.check(conn):  # seats of the queues joined meanwhile, and who is there
                self.refresh(conn)
            with self._lock:
                return self._stuck  # its holder ran nothing for long: listen too, as before doors
        with self._lock:
            self._door = door  # who waits behind it: at the next seat read
            self._door_at, self._passing = time.monotonic(), None
        return True

    def stay(self, key: str | None) -> bool:
        """On the listener's thread, after a ring of *key* (``None``: the periodic check): go on
        listening?  No when this process holds the door of a set of queues it no longer consumes
        (one joined since), and when *key* is a queue of its door that it has no room for while
        another process waits for the door (that one listens instead)."""
        mine = self.door_group()
        with self._lock:
            door, waiting, passing = self._door, self._waiting, self._passing
            if door is None:  # listening without the door: while its holder is stuck, or with no queues
                return self._stuck or mine is None
            early = time.monotonic() - self._door_at < HOLD
            if key is None and passing is not None and not early:
                key, self._passing = passing, None  # rung before HOLD was up: pass now if still full
            room = self._room.get(key or "")
        if door != mine:
            return False
        if key is None or room is None or waiting == 0 or room():
            return True
        if early:
            with self._lock:
                self._passing = key
            return True
        return False

    def leave(self, conn: psycopg.Connection) -> None:
        """The LISTEN connection stopped listening (UNLISTEN done): let the door go to the next waiter."""
        with self._lock:
            door, self._door, self._hears = self._door, None, False
        if door is not None:
            conn.execute(self.statements.turn_door_leave, {"key": lock_key(self.schema, door)})

    def heard(self) -> None:
        """LISTEN is in place (again): from now on this process hears the notifications."""
        with self._lock:
            self._hears = True
            self._listens += 1
        if self._on_heard is not None:
            self._on_heard()

    def hearing(self) -> int | None:
        """Does this process hear the notifications now (``!interrupt`` among them)?  ``None`` if not,
        else how many times it began to listen (a change: what was sent before went unheard)."""
        with self._lock:
            return self._listens if self._hears else None

    def others_listen(self) -> bool:
        """May a process that listens to every ring and waits for ``!took`` hold a seat (an older
        version)?  Yes while the turns are unknown."""
        return self.seat(WAKE_ONE) is None or self._older or self._stuck

    def check(self, conn: psycopg.Connection) -> bool:
        """On the LISTEN connection, often: seats for groups joined since; the membership when due.
        Returns whether it ran a statement."""
        with self._lock:
            new = sorted((self._groups | {WAKE_ONE}) - self._seated)
        if new:
            conn.execute(self.statements.turn_take, {"keys": [lock_key(self.schema, g) for g in new]}).fetchall()
            with self._lock:
                self._seated.update(new)
        if new or time.monotonic() - self._read_at >= REFRESH_EVERY:
            self.refresh(conn)
            return True
        return bool(new)

    def refresh(self, conn: psycopg.Connection) -> None:
        with self._lock:
            groups = {lock_key(self.schema, g): g for g in self._seated}
        door = self.door_group()
        door_key = lock_key(self.schema, door) if door is not None else None  # NULL: no door to read
        rows = conn.execute(self.statements.turn_seats, {"keys": list(groups), "door": door_key}).fetchall()
        pids: dict[str, list[int]] = {}
        waiting, stuck = 0, False
        me = conn.info.backend_pid
        for key, pid, seat, idle in rows:  # in seat order per key
            if key == door_key and seat <= 0:
                waiting += seat < 0
                stuck = stuck or (seat == 0 and pid != me and idle is not None and idle > stuck_after())
            elif key in groups:
                pids.setdefault(groups[key], []).append(pid)
        older = set(pids.get("", ())) - set(pids.get(WAKE_ONE, ()))  # seated, and not of this version
        with self._lock:
            self._seats = {g: (p.index(me), len(p)) for g, p in pids.items() if me in p}
            self._read_at = time.monotonic()
            self._waiting, self._stuck, self._older = waiting, stuck, bool(older)

    def deaf(self) -> None:
        """The LISTEN connection is gone (and its seats with it): every chore is ours until the next."""
        with self._lock:
            self._seats = {}
            self._seated = set()
            self._door, self._hears, self._waiting, self._stuck = None, False, 0, False

    # -- the chores' side ---------------------------------------------------
    def seat(self, group: str = "") -> tuple[int, int] | None:
        """(this process's rank in *group*, how many processes take turns in it), or ``None`` while unknown."""
        with self._lock:
            if time.monotonic() - self._read_at > STALE_AFTER:
                return None
            return self._seats.get(group)

    @staticmethod
    def window(key: str, period: float, at: float) -> tuple[int, float]:
        """The window of *key* that wall-clock time *at* falls in: (its number, when it starts)."""
        offset = (_hash(key) / 2**32) * period  # staggered per key
        number = math.floor((at + offset) / period)
        return number, number * period - offset

    @staticmethod
    def owner(key: str, number: int, count: int) -> int:
        """The rank whose turn window *number* of *key* is, among *count*."""
        return (number + _hash(key)) % count

    def mine(self, key: str, period: float, at: float | None = None, *, group: str = "") -> bool:
        """Is the window of *key* at *at* (now) this process's in *group*?  Yes while the turns are unknown."""
        seat = self.seat(group)
        if seat is None:
            return True
        rank, count = seat
        number, _ = self.window(key, period, time.time() if at is None else at)
        return self.owner(key, number, count) == rank

    def until_mine(self, key: str, period: float, at: float | None = None, *, group: str = "") -> float:
        """Seconds from *at* (now) until the next window of *key* that is this process's in *group*
        begins (*period* while the turns are unknown: every window is ours, as without turns)."""
        seat = self.seat(group)
        if seat is None:
            return period
        rank, count = seat
        at = time.time() if at is None else at
        number, start = self.window(key, period, at)
        for step in range(1, count + 1):
            if self.owner(key, number + step, count) == rank:
                return start + step * period - at
        return period  # not reached: one of any *count* windows in a row is ours

    def next_turn(self, key: str, every: float, at: float | None = None, *, group: str = "") -> float:
        """Seconds from *at* (now) until this process's next run of chore *key*, done every *every*
        seconds by the process on duty in *group*.  Runs fall on a grid staggered per key (a
        process's queues are not all polled at once); duty windows last ``max(every, DUTY)`` and go
        round the ranks in turn, with one key for every group, so that a process is on duty for all
        its queues at once and its pooled connection stays in use.  While the turns are unknown,
        every point of the grid is this process's."""
        at = time.time() if at is None else at
        point = self._grid_after(key, every, at, group)
        length = max(every, DUTY)
        if self.seat(group) is None or self.mine("duty", length, point, group=group):
            return point - at
        duty = at + self.until_mine("duty", length, at, group=group)
        return self._grid_after(key, every, duty - 1e-9, group) - at

    def _grid_after(self, key: str, every: float, at: float, group: str) -> float:
        """The first point of *key*'s grid after *at*: every *every* seconds, the groups this process
        takes turns in (its queues, and ``""`` for the rescue) spread evenly over the interval, so
        that their chores never coincide; any other key by its hash."""
        with self._lock:
            groups = sorted(self._groups)  # "" (the rescue's) first
        if group in groups:
            offset = groups.index(group) / len(groups) * every
        else:
            offset = (_hash(key) / 2**32) * every
        return offset + (math.floor((at - offset) / every) + 1) * every

    def until_grid(self, key: str, every: float, at: float | None = None, *, group: str = "") -> float:
        """Seconds from *at* (now) until the next point of *key*'s grid (see :meth:`next_turn`), duty or not."""
        at = time.time() if at is None else at
        return self._grid_after(key, every, at, group) - at

    def on_duty(self, every: float, at: float | None = None, *, group: str = "") -> bool:
        """Is this process on duty in *group* at *at* (now) for a chore done every *every* seconds?"""
        return self.mine("duty", max(every, DUTY), at, group=group)

    def ring_delay(self, queue_name: str, at: float | None = None) -> float:
        """Seconds this process waits after a ring of *queue_name* before it claims (unless answered):
        0 for the holder of a door (it is the only one of its kind to hear), for the owner of the ring
        window at *at* (now) and while the turns are unknown."""
        seat = self.seat(queue_name)
        if seat is None or self._door is not None:
            return 0.0
        rank, count = seat
        key = f"ring {queue_name}"
        number, _ = self.window(key, RING_WINDOW, time.time() if at is None else at)
        return ((rank - self.owner(key, number, count)) % count) * RING_STEP


class Answered:
    """Per process: how many claims of other processes said they answered a ring of each queue.

    The claim statement of a process that took rows and left its queue drained
    notifies ``"!took <queue> <process>"`` (:meth:`payload`); the doorbell hands
    the argument to :meth:`took`.  A process's own claims are not counted: a
    ring it heard while its own claim ran may have come after that claim's
    snapshot, so it answers that ring itself.  The doorbell tells it of each ring
    (:meth:`rang`), in order with the answers, so that a consumer that wakes late
    still knows which answers came after the ring it woke for.
    """

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex[:12]  # this process (a forked child builds its own)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}
        self._at_ring: dict[str, int] = {}

    def payload(self, queue_name: str) -> str:
        return f"!took {queue_name} {self.token}"

    def took(self, arg: str) -> None:
        queue_name, _, token = arg.rpartition(" ")
        if token != self.token and queue_name:
            with self._lock:
                self._counts[queue_name] = self._counts.get(queue_name, 0) + 1

    def rang(self, queue_name: str) -> None:
        """The doorbell rang *queue_name* (on its thread, in order with :meth:`took`)."""
        with self._lock:
            self._at_ring[queue_name] = self._counts.get(queue_name, 0)

    def count(self, queue_name: str) -> int:
        """How many answers of other processes were heard for *queue_name*."""
        return self._counts.get(queue_name, 0)

    def count_at_ring(self, queue_name: str) -> int:
        """:meth:`count` as it was when *queue_name* last rang: an answer counted since came after it."""
        return self._at_ring.get(queue_name, 0)
