"""Reindex: give back the index pages a pinned horizon left, without a lock that stops the queue.

While another session holds an old snapshot (a report, ``pg_dump``, a forgotten ``BEGIN``), no
vacuum may remove the row versions of the messages acked since, and each leaves its entries in the
message table's indexes: 30 minutes at 200 messages/s took the table and its indexes from 7 MB to
367 MB (docs/performance.md, "The pinned soak").  Once the snapshot is gone, vacuum empties those
pages and truncates the heap, but an index keeps its emptied pages for reuse: 56 MB five minutes
after that pin, eight times the size before it, and every scan of a range still crosses them.

``REINDEX INDEX CONCURRENTLY`` builds a fresh copy of an index beside it and swaps it in, taking no
lock that stops a send, a claim or an ack (Oban's Reindexer does it on a schedule; this chore does
it when an index is bloated).  The process on duty checks every :data:`CHECK_EVERY` seconds (turns.py; every
:data:`CHECK_HELD_EVERY` while an old transaction holds a rebuild back),
on a thread and a connection of its own: a reindex waits for every transaction older than itself, and
neither the rescue nor a pooled connection waits with it.  An index is rebuilt when it is larger than
:data:`MIN_BYTES` and than :data:`FACTOR` times what its live rows would take (:data:`BYTES_PER_ROW`
each), with it every other index bloated as much and larger than :data:`WITH_OTHERS_BYTES`, once vacuum has removed the dead rows (:data:`DEAD_ROWS`), and only while no client
transaction of the database is older than :data:`OLD_TRANSACTION`:
under the pin that bloated it a reindex would wait for the pin, and keep its dead entries.  A reindex
that fails (a connection lost, the server stopped, a statement cancelled) leaves an invalid copy,
``<index>_ccnew``, that PostgreSQL updates on every write and no query reads: each check drops such
copies first (``DROP INDEX CONCURRENTLY``).  A rebuild waits at most :data:`LOCK_TIMEOUT` for a
transaction that began during it.  It needs the table's owner (as vacuum); another role
leaves the indexes as they are, and the maintenance says so once.
"""

from __future__ import annotations

import logging
import threading

import psycopg
from psycopg import sql

from ..db.database import Database
from ..db.statements import Statements

#: Seconds between two checks (of the process on duty).
CHECK_EVERY = 300.0
#: An index smaller than this is never rebuilt: the pages are not worth a reindex.
MIN_BYTES = 16 * 2**20
#: ... but once one is (and is bloated), the others bloated as much and larger than this go with it: the
#: same pin left its entries in them (a 30-minute pin at 200 messages/s left 7 MB in indexes under
#: MIN_BYTES, twice the table's clean size; docs/performance.md, run 6 of the pinned soak).
WITH_OTHERS_BYTES = 2**20
#: An index is rebuilt when larger than this many times what its live rows would take.
FACTOR = 4
#: What one live row takes in an index, generously: an entry of the widest index (the claim index:
#: queue name, priority, due time, sequence), its line pointer, and the page's free space.
BYTES_PER_ROW = 64
#: While the table holds more dead rows than this (and than live ones), no reindex starts: vacuum comes
#: first (a reindex reads the whole heap, and a vacuum soon after a pin ends empties it).
DEAD_ROWS = 100_000
#: Seconds: while a client transaction of the database is older than this, no reindex starts.
OLD_TRANSACTION = 60.0
#: Seconds a rebuild or a drop waits for another transaction (a reindex waits for every one older than
#: each of its phases, a lock on its virtual transaction): past it, cancelled (the copy it leaves is
#: dropped at the next check).
LOCK_TIMEOUT = 60.0
#: Seconds between two checks while bloated indexes wait for an old transaction to end: rebuilt
#: within about a minute of its end.
CHECK_HELD_EVERY = 60.0


class Reindexer:
    """The reindex chore of one process (see the module's docstring)."""

    def __init__(self, database: Database, statements: Statements, schema: str, logger: logging.Logger) -> None:
        self.database = database
        self.statements = statements
        self.schema = schema
        self.logger = logger
        self._thread: threading.Thread | None = None
        #: Indexes rebuilt by this process, and invalid copies it dropped (for tests and operators).
        self.rebuilt: list[str] = []
        self.dropped: list[str] = []
        #: Did the last check find bloated indexes held back by an old transaction?  (Then the next
        #: check comes after CHECK_HELD_EVERY, not CHECK_EVERY.)
        self.held = False

    def every(self) -> float:
        """Seconds until the next check should be due."""
        return CHECK_HELD_EVERY if self.held else CHECK_EVERY

    def start(self, names: frozenset[str] | None = None) -> None:
        """Check (and rebuild what is bloated), or rebuild the indexes *names*, on a thread of its own,
        unless the last one still runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(target=self._run, args=(names,), name="dramatiq-pg-reindex", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, names: frozenset[str] | None = None) -> None:
        try:
            self.check() if names is None else self.rebuild(names)
        except psycopg.Error as e:  # the database away, a statement refused: the next check tries again
            self.logger.warning("The reindex of %s.message failed: %s", self.schema, e)

    def _connect(self) -> psycopg.Connection:
        """A connection of its own in autocommit (``REINDEX CONCURRENTLY`` refuses a transaction block)."""
        conn = self.database.connect()
        conn.autocommit = True
        # A session setting on a connection of its own, closed after its use: nothing outlives it.
        conn.execute(sql.SQL("SET lock_timeout = {}").format(sql.Literal(f"{round(LOCK_TIMEOUT * 1000)}ms")))
        return conn

    def rebuild(self, names: frozenset[str] | set[str] | list[str]) -> list[str]:
        """``REINDEX INDEX CONCURRENTLY`` each of the message table's indexes *names*; returns them."""
        with self._connect() as conn:
            return self._rebuild(conn, list(names))

    def _rebuild(self, conn: psycopg.Connection, names: list[str]) -> list[str]:
        done = []
        for name in names:
            qualified = sql.Identifier(self.schema, name)
            size_of = "SELECT pg_relation_size(to_regclass(%s))"
            (before,) = conn.execute(size_of, [qualified.as_string(conn)]).fetchone() or (0,)
            conn.execute(sql.SQL("REINDEX INDEX CONCURRENTLY {}").format(qualified))
            (after,) = conn.execute(size_of, [qualified.as_string(conn)]).fetchone() or (0,)
            done.append(name)
            self.rebuilt.append(name)
            self.logger.info(
                "Rebuilt %s.%s (REINDEX CONCURRENTLY): %.1f MB -> %.1f MB.",
                self.schema, name, (before or 0) / 2**20, (after or 0) / 2**20,
            )  # fmt: skip
        return done

    def check(self) -> list[str]:
        """Drop the invalid copies a failed reindex left, then rebuild each bloated index; returns the
        names of those rebuilt."""
        table = f'"{self.schema}".message'
        with self._connect() as conn:
            indexes = conn.execute(self.statements.reindex_indexes, {"table": table}).fetchall()
            for name, _, valid, _, _ in indexes:
                if not valid and "_ccnew" in name:
                    conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(sql.Identifier(self.schema, name)))
                    self.dropped.append(name)
                    self.logger.info("Dropped %s.%s, the invalid copy a failed reindex left.", self.schema, name)
            bloated = [
                (name, size)
                for name, size, valid, live, _ in indexes
                if valid and size > WITH_OTHERS_BYTES and size > FACTOR * BYTES_PER_ROW * live
            ]
            if not any(size > MIN_BYTES for _, size in bloated):
                bloated = []  # the smaller ones wait for a bloat worth a rebuild (then go with it)
            self.held = False
            if not bloated:
                return []
            live, dead = indexes[0][3], indexes[0][4]
            if dead > max(DEAD_ROWS, live):
                self.held = True
                self.logger.info(
                    "Indexes of %s.message are bloated, but it holds %d dead rows: no reindex before a vacuum.",
                    self.schema,
                    dead,
                )
                return []
            (old,) = conn.execute(self.statements.reindex_old_transactions, {"old": OLD_TRANSACTION}).fetchone() or (0,)
            if old:
                self.held = True
                self.logger.info(
                    "Indexes of %s.message are bloated (%s), but %d transaction(s) older than %g s hold back the "
                    "horizon: no reindex until they end.",
                    self.schema,
                    ", ".join(f"{name} {size / 2**20:.0f} MB" for name, size in bloated),
                    old,
                    OLD_TRANSACTION,
                )
                return []
            return self._rebuild(conn, [name for name, _ in bloated])
