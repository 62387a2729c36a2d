"""Sends inside a routed broker's transactions: rows of that transaction, whatever their queue's database.

Inside :meth:`RoutedBroker.transaction(conn) <.routing.RoutedBroker.transaction>`,
:meth:`~.routing.RoutedBroker.fenced_transaction` (and the framework integrations, which open one of
them: Django's ``outbox()`` and ``fenced_atomic()``, SQLAlchemy's ``outbox()`` and
``fenced_transaction()``), every message this thread sends goes to the *open* database: the one the
transaction's connection is connected to.  A message of one of its queues is a row there, as with
one database; a message of a queue of another database is a queued row of that queue there, an
outbox row, which the relay moves to its database once the transaction committed, as it moves a
delivery's cross-database follow-ups.  So every send of the block commits with it or not at all,
and arrives once: a block that raises and is retried leaves nothing of its failed attempts, a
rolled-back transaction nothing at all.  Before, such a send went to its queue's database at once,
in a transaction of its own (or, in ``transaction(conn)``, through the other database's statements
on *conn*: a schema that is not there).

What the outbox row keeps: its priority (the actor's) and its delay (what is left of it when it is
moved; each server counts by its own clock).  A unique key is checked in the open database as the
row is written (two sends with one key in the block make one row) and again in the queue's
database as it is moved: if a message there holds the key, the moved one is refused, logged and
counted (``relay_conflicts``), as any relayed message.

The open database of a connection: for a fenced block, the delivery's (its fence took the row
there); for ``transaction(conn)``, read once per connection from *conn*: the databases whose schema
*conn* sees, the one whose connection string names *conn*'s database and port if several do (two
schemas of one database: each is right, the rows land where *conn* writes and the relay of that
schema moves the foreign ones).  A connection to none of them is refused
(:class:`~.routing.RouteError`).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..features.exactly_once import Fence

if TYPE_CHECKING:
    from ..broker import PostgresBroker


_SCHEMAS_SEEN = "SELECT s FROM unnest(%s::text[]) AS s WHERE to_regclass(format('%%I.message', s)) IS NOT NULL"


class OpenTransactions:
    """Which database's transaction this thread's sends go to (see the module's docstring)."""

    def __init__(self, shards: Mapping[str, PostgresBroker], error: type[Exception]) -> None:
        self.shards = shards
        self.error = error
        #: Per thread and per asyncio task (the coroutines of async actors share the event loop's
        #: thread: see ``sending/sends.py``): the database whose transaction is open, the innermost.
        self._open: ContextVar[str | None] = ContextVar("dramatiq_pg_fenced.open_transaction", default=None)
        self._lock = threading.Lock()
        #: connection -> the database it is connected to (a psycopg connection never moves).
        self._known: weakref.WeakKeyDictionary[psycopg.Connection, str] = weakref.WeakKeyDictionary()

    def open(self) -> PostgresBroker | None:
        """The shard whose transaction is open on this thread, if any."""
        name = self._open.get()
        return None if name is None else self.shards[name]

    @contextmanager
    def opened(self, name: str) -> Iterator[None]:
        """This thread's sends go to database *name* inside the block (the innermost block decides)."""
        previous = self._open.get()
        self._open.set(name)
        try:
            yield
        finally:
            self._open.set(previous)

    def learn(self, conn: psycopg.Connection, name: str) -> None:
        with self._lock:
            self._known[conn] = name

    def database_of(self, conn: psycopg.Connection) -> str:
        """The name of the database *conn* is connected to (see the module's docstring)."""
        with self._lock:
            known = self._known.get(conn)
        if known is not None:
            return known
        names = list(self.shards)
        seen = {str(r[0]) for r in conn.execute(_SCHEMAS_SEEN, [sorted({s.schema for s in self.shards.values()})])}
        candidates = [n for n in names if self.shards[n].schema in seen]
        if not candidates:
            raise self.error(
                f"the connection (database {conn.info.dbname!r}) is connected to none of this broker's databases "
                f"{names}: none of their schemas is there"
            )
        exact = [n for n in candidates if _names(self.shards[n], conn)]
        name = (exact or candidates)[0]
        self.learn(conn, name)
        return name

    def fence(self, fence: Fence, name: str) -> Fence:
        """*fence* (of database *name*'s delivery), telling this which database its connection is in."""
        return _RoutedFence(fence, lambda conn: self.learn(conn, name))


def _names(shard: PostgresBroker, conn: psycopg.Connection) -> bool:
    """Does *shard*'s connection string name *conn*'s database and port (no string: no)?"""
    try:
        url = shard.database.url
        params = conninfo_to_dict(url) if url else {}
    except Exception:  # a string psycopg cannot read: no answer
        return False
    if not params.get("dbname"):
        return False
    return params["dbname"] == conn.info.dbname and str(params.get("port") or 5432) == str(conn.info.port)


class _RoutedFence(Fence):
    """A shard's :class:`~.exactly_once.Fence` that, as it begins on a connection, records its database
    (the framework integrations then open ``router.transaction(conn)`` on it)."""

    def __init__(self, fence: Fence, began: Callable[[psycopg.Connection], None]) -> None:
        super().__init__(fence._methods, fence.message)
        self._began = began

    def begin(self, conn: psycopg.Connection, *, explicit: bool) -> None:
        super().begin(conn, explicit=explicit)
        self._began(conn)


__all__ = ["OpenTransactions"]
