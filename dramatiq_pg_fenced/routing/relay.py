"""The relay of a routed broker's outbox: :class:`Relay`, one thread per database and process, and
:class:`RelayMethods`, the moves themselves (a mixin of :class:`~.router.RoutedBroker`).

A delivery's follow-up for a queue of another database is a queued row of that queue in the
delivery's own database (its outbox), written with its outcome; the relay moves it to its
database once, through the ``relayed`` table (migration 017).  See the docstring of
:mod:`.router` for the whole story, and ``relay_*`` in ``db/queries/relay.py`` for the statements.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.errors import ConnectionClosed

from ..broker import PostgresBroker
from ..core import turns
from ..db.reconnect import RETRY_INTERVAL
from . import groups

#: Seconds between a relay's looks when no doorbell rang (a safety net: a ring wakes it at once).
RELAY_POLL = 5.0
#: The turns group of the relays (turns.py): no queue is named so (Dramatiq's names cannot hold spaces).
RELAY_GROUP = "relay of the outbox"
#: Rows a relay moves per transaction.
RELAY_BATCH = 500
#: Seconds a ``relayed`` row is kept: a message whose source database comes back later than this
#: with it still in its outbox (a relay died between the two commits) would be moved twice.
RELAYED_KEEP = 7 * 24 * 3600
#: Seconds between a relay's purges of its database's old ``relayed`` rows.
RELAYED_PURGE_EVERY = 3600.0


def _relay_hook(stage: str, source: str, target: str, ids: list[str]) -> None:
    """A test hook (a no-op): :meth:`RoutedBroker.relay` calls it with a batch taken in *source* (its
    rows deleted there, locked, not committed) before its insert in *target* (*stage* ``"taken"``),
    and once that insert committed, before the delete commits (``"inserted"``): tests hold a relay there."""



class RelayMethods:
    """The relays of a :class:`~.router.RoutedBroker` (a mixin): what to move out of a database,
    and the move (look, take, put, and the source's delete with the commit)."""

    shards: dict[str, PostgresBroker]
    routes: dict[str, str]
    queues: set[str]
    group_home: str | None
    relay_poll: float
    relay_conflicts: int
    logger: Any
    _relays: dict[str, Relay]
    _relays_lock: threading.Lock

    if TYPE_CHECKING:

        def database_of(self, queue_name: str) -> str: ...

    def foreign_queues(self, name: str) -> list[str]:
        """The queues whose rows do not belong in database *name* (routed elsewhere; with the countdown
        rows of group members, outside the groups' home)."""
        queues = self.queues | set(self.routes)
        if self.group_home is not None:
            queues.add(groups.COUNTDOWN_QUEUE)
        return sorted(q for q in queues if self.database_of(q) != name)

    def _paused_in_their_databases(self, queues: list[str]) -> set[str]:
        """Of *queues*, those paused in the database they are routed to: nothing is moved into a paused
        queue (what :meth:`move_queue` relies on while processes of an older configuration, which route
        the queue back, still run)."""
        by_target: dict[str, list[str]] = {}
        for q in queues:
            by_target.setdefault(self.database_of(q), []).append(q)
        paused: set[str] = set()
        for target, mine in by_target.items():
            shard = self.shards[target]
            with shard.database.connection() as conn:
                paused.update(str(r[0]) for r in conn.execute(shard.statements.paused_among, [mine]))
        return paused

    def start_relays(self) -> None:
        """This process's relay of each database (once; after a fork, afresh)."""
        with self._relays_lock:
            for name in self.shards:
                relay = self._relays.get(name)
                if relay is None or not relay.alive():
                    relay = self._relays[name] = Relay(self, name)
                    relay.start()

    def relay(self, name: str, limit: int = RELAY_BATCH, *, queues: list[str] | None = None) -> int:
        """Move one batch of database *name*'s outbox (of *queues* only, if given) to the queues'
        databases; returns how many moved."""
        source = self.shards[name]
        foreign = self.foreign_queues(name) if queues is None else [q for q in queues if self.database_of(q) != name]
        foreign = [q for q in foreign if q not in self._paused_in_their_databases(foreign)]
        if not foreign:
            return 0
        with source.database.connection() as conn:
            looked = self._look(conn, source, foreign, limit)
            if not looked:
                return 0
            with conn.transaction():
                moved_rows = self._take(conn, source, foreign, looked)
                if moved_rows:
                    self._move(conn, source, name, moved_rows)
                # Only now do the rows leave here: a failure before this commit moves them again, and the
                # relayed table there makes that insert nothing.
        return len(moved_rows)

    @staticmethod
    def _look(conn: psycopg.Connection, source: PostgresBroker, queues: list[str], limit: int) -> list[tuple[Any, ...]]:
        """The rows of *queues* waiting in *source*'s outbox (id, row version, the WAL position read),
        oldest first, once their commits are on disk there (``relay_look`` in db/queries/: an ack commits
        asynchronously by default; the look's own durable commit flushes the WAL past them if the
        WAL writer has not yet).  Run alone, in autocommit: its commit must come before the move."""
        return conn.execute(source.statements.relay_look, {"queues": queues, "limit": limit}).fetchall()

    @staticmethod
    def _take(
        conn: psycopg.Connection, source: PostgresBroker, queues: list[str], looked: list[tuple[Any, ...]]
    ) -> list[tuple[Any, ...]]:
        """Delete, in the relay's open transaction on *conn*, the rows *looked* at, at the version the
        look saw (one written since is left for the next look); rows another relay holds are skipped."""
        params = {"ids": [r[0] for r in looked], "versions": [r[1] for r in looked], "queues": queues}
        return conn.execute(source.statements.relay_take, params).fetchall()

    def _move(self, conn: psycopg.Connection, source: PostgresBroker, name: str, rows: list[tuple[Any, ...]]) -> None:
        """Apply the outbox rows taken from database *name* (in the relay's transaction on *conn*) in
        their databases: countdowns at the groups' home, messages inserted, each once."""
        by_target: dict[str, list[tuple[Any, ...]]] = {}
        for row in rows:
            by_target.setdefault(self.database_of(row[1]), []).append(row)
        for target_name, moved in by_target.items():
            target = self.shards[target_name]
            countdowns = [r for r in moved if r[1] == groups.COUNTDOWN_QUEUE]
            if countdowns:  # applied at the groups' home, not inserted
                _, bad = groups.count_down_at_home(target, name, countdowns)
                for row, why in bad:
                    self._refuse(conn, source, name, row, why)
            messages = [r for r in moved if r[1] != groups.COUNTDOWN_QUEUE]
            if not messages:
                continue
            ids = [str(r[0]) for r in messages]
            _relay_hook("taken", name, target_name, ids)
            refused = self._put(target, name, messages)
            _relay_hook("inserted", name, target_name, ids)
            for message_id in refused:
                self.relay_conflicts += 1
                self.logger.warning(
                    "Message %s, relayed from database %r, was not inserted in %r: a message with its id is "
                    "there already, or another holds its unique key (counted in relay_conflicts).",
                    message_id,
                    name,
                    target_name,
                )

    @staticmethod
    def _put(target: PostgresBroker, name: str, messages: list[tuple[Any, ...]]) -> list[str]:
        """Insert in *target* the messages taken from database *name*'s outbox, each once (``relay_put``,
        one durable statement); returns the ids it refused (their id or unique key taken there)."""
        columns = [list(c) for c in zip(*messages, strict=True)]
        with target.database.connection() as there:  # autocommit: the statement is its transaction
            put = there.execute(target.statements.relay_put, [*columns, name, target.channel, target.listen])
            return list((put.fetchone() or (0, 0, []))[2])

    def _refuse(
        self, conn: psycopg.Connection, source: PostgresBroker, name: str, row: tuple[Any, ...], why: str
    ) -> None:
        """Dead-letter in *source* (in the relay's transaction there, *conn*) an outbox row its target
        cannot take, and count it with the conflicts: a relay that failed on it would fail again at
        every turn and hold up every row behind it."""
        conn.execute(
            source.statements.relay_dead,
            {"id": row[0], "queue": row[1], "actor": row[2], "priority": row[3], "payload": row[5], "error": why},
        )
        self.relay_conflicts += 1
        self.logger.error(
            "Message %s of database %r was dead-lettered there: %s (counted in relay_conflicts).", row[0], name, why
        )


class Relay:
    """One process's relay of one database's outbox (see :meth:`RoutedBroker.relay`): a daemon thread
    woken by the doorbell as a row of a foreign queue commits there, at once, in the process that
    listens for its set of queues (turns.py: one at a time; the relays share the rows with ``SKIP LOCKED``).

    Its idle look (every ``relay_poll`` seconds: the paused queues, then the outbox) is a safety net
    for a lost ring, and is taken in turns (turns.py): the listening processes take seats in the
    :data:`RELAY_GROUP` of the database, and only the one on duty looks, so the idle cost of the
    relays no longer grows with processes.  While its turns are unknown (not listening yet, LISTEN
    lost, ``listen=False``) a relay looks every ``relay_poll`` seconds, as each did before turns.
    """

    def __init__(self, router: RelayMethods, name: str) -> None:
        self.router = router
        self.name = name
        self.shard = router.shards[name]
        self.pid = os.getpid()
        self.moved = 0  #: rows this relay moved
        self.looks = 0  #: idle looks (a pass no ring asked for)
        #: When (wall clock) its last idle looks were decided: for operators and tests.
        self.looked_at: deque[float] = deque(maxlen=256)
        self._turns: turns.Turns | None = None
        self._purged = -RELAYED_PURGE_EVERY
        self._event = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"dramatiq-pg-relay-{name}", daemon=True)

    def start(self) -> None:
        if self.shard.listen:
            parts = self.shard.parts
            parts.turns.join(RELAY_GROUP)
            self._turns = parts.turns
            doorbell = self.shard.database.doorbell(self.shard.channel, timed=True)
            doorbell.attend(parts.turns)  # its seats are taken on the LISTEN connection (once per process)
            for queue in self.router.foreign_queues(self.name):
                doorbell.subscribe(queue, event=self._event)
        self._thread.start()

    def alive(self) -> bool:
        return self.pid == os.getpid() and self._thread.is_alive()

    def halt(self) -> None:
        """Ask the thread to end after its current pass, without waiting for it."""
        self._stopped = True
        self._event.set()

    def stop(self, timeout: float = 10.0) -> None:
        """End the thread and wait (at most *timeout* seconds) for a pass under way, which would
        otherwise go on on a closed database and open a pool of its own again."""
        self.halt()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _purge(self) -> None:
        """Old ``relayed`` rows of this relay's database go (every :data:`RELAYED_PURGE_EVERY` seconds)."""
        now = time.monotonic()
        if now - self._purged < RELAYED_PURGE_EVERY:
            return
        self._purged = now
        keep = max(RELAYED_KEEP, self.shard.dead_message_ttl)
        with self.shard.database.connection() as conn:
            conn.execute(self.shard.statements.relay_purge, [keep])

    def until_look(self) -> float:
        """Seconds until this relay's next idle look may be due: its next point on duty, looked at again
        after at most one duty window (who is on duty may change meanwhile)."""
        every = self.router.relay_poll
        if self._turns is None:
            return every
        return max(0.0, min(self._turns.next_turn("relay", every, group=RELAY_GROUP), turns.DUTY))

    def on_duty(self, at: float) -> bool:
        """Is the idle look at wall-clock time *at* this process's (yes while its turns are unknown)?"""
        if self._turns is None:
            return True
        return self._turns.on_duty(self.router.relay_poll, at, group=RELAY_GROUP)

    def _pass(self) -> None:
        while (moved := self.router.relay(self.name)) > 0:
            self.moved += moved
            if moved < RELAY_BATCH:
                break
        self._purge()

    def _run(self) -> None:
        failing = False
        look = True  # the first pass: whatever waits already
        while not self._stopped:
            wait = self.until_look()
            if look:
                try:
                    self._pass()
                    if failing:
                        self.router.logger.info("The relay of database %r works again.", self.name)
                    failing = False
                except (psycopg.Error, ConnectionClosed) as e:
                    if not failing:
                        self.router.logger.warning(
                            "The relay of database %r failed (%s); it tries again.", self.name, e
                        )
                    failing, wait = True, RETRY_INTERVAL
                except Exception:
                    self.router.logger.exception("The relay of database %r failed; it tries again.", self.name)
                    failing, wait = True, RETRY_INTERVAL
            rang = self._event.wait(wait)
            self._event.clear()
            at = time.time()
            look = rang or failing or self.on_duty(at)
            if look and not rang and not failing:
                self.looks += 1
                self.looked_at.append(at)
