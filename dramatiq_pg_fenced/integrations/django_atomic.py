"""Django: a send made inside ``transaction.atomic()`` on the broker's database is a row of that transaction.

:class:`~.django.DjangoPostgresBroker` (``join_atomic=True``, the default) asks :class:`AtomicSends`
for the connection of a send that no block of the broker decides (not ``outbox()``,
``fenced_atomic()``, ``with_ack()`` or ``batch()``): while a ``transaction.atomic()`` block is open
on its database in this thread (``ATOMIC_REQUESTS``, a ``TestCase``'s test), it is Django's
``psycopg.Connection``, and the row is written there, in Django's current transaction and
savepoint: it commits with the block, and a block rolled back (to its savepoint) takes it away.
Outside any block a send is written at once, as before; so is a ``transaction.on_commit()`` send
(Django runs the callbacks after the commit, outside the block).

A send inside an atomic block open on *another* database only (or inside any block, for a broker
connected by ``url=``/``pool=``, whose database Django does not name) is written at once, on the
broker's own connection, whatever that block does: logged once per database, at warning.
:func:`at_once` writes the sends of its block at once, as before, even inside an atomic block.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from django.db import connections


class _AtOnce(threading.local):
    on: bool = False


_AT_ONCE = _AtOnce()


@contextmanager
def at_once() -> Iterator[None]:
    """Sends of this thread inside the block are written at once, on the broker's own connection, even
    inside ``transaction.atomic()`` (they exist whatever the block does): e.g. a message the
    dashboard or a worker must see while a ``TestCase``'s transaction is open."""
    previous, _AT_ONCE.on = _AT_ONCE.on, True
    try:
        yield
    finally:
        _AT_ONCE.on = previous


class AtomicSends:
    """Which transaction a send joins: Django's atomic block on database *alias* (``None``: none)."""

    def __init__(self, alias: str | None, logger: logging.Logger | logging.LoggerAdapter) -> None:
        self.alias = alias
        self.logger = logger
        self._said: set[str] = set()
        self._lock = threading.Lock()

    def connection(self, *, quiet: bool = False) -> psycopg.Connection | None:
        """Django's connection if an atomic block is open on *alias* in this thread, else ``None`` (and,
        unless *quiet*, the warning about an atomic block on another database, once per database)."""
        if _AT_ONCE.on:
            return None
        if self.alias is not None:
            wrapper = connections[self.alias]
            if wrapper.in_atomic_block:
                wrapper.validate_no_broken_transaction()  # Django's error for a block that must roll back
                wrapper.ensure_connection()  # Django's error for one closed in the block
                conn = wrapper.connection
                if not isinstance(conn, psycopg.Connection):
                    raise TypeError(f"Django's connection is a {type(conn).__module__}.{type(conn).__name__}: "
                                    "a send in transaction.atomic() needs Django on psycopg 3 "
                                    "(pip install 'psycopg[binary]'), or join_atomic=False")  # fmt: skip
                return conn
        if not quiet:
            self._say_elsewhere()
        return None

    def _say_elsewhere(self) -> None:
        for wrapper in connections.all(initialized_only=True):
            if wrapper.alias == self.alias or not wrapper.in_atomic_block or wrapper.alias in self._said:
                continue
            with self._lock:
                if wrapper.alias in self._said:
                    continue
                self._said.add(wrapper.alias)
            mine = f"the broker's is {self.alias!r}" if self.alias is not None else "the broker connects by url="
            self.logger.warning(
                "A message was sent inside transaction.atomic() on database %r (%s): it is written at once, "
                "on the broker's own connection, whatever that block does (said once for this database).",
                wrapper.alias, mine,
            )  # fmt: skip
