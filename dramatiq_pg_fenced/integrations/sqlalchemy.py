"""SQLAlchemy 2: sends in a ``Session``'s (or a ``Connection``'s) transaction.

::

    with Session(engine) as session, session.begin():
        with outbox(session):
            session.add(order)
            session.flush()
            confirm_order.send(order.id)   # a row of the session's transaction
    # committed: the order and its message; rolled back: neither

The engine must use the psycopg 3 driver (``postgresql+psycopg://``); the broker's tables must
be in that database.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from ..broker import PostgresBroker
from ..errors import NestedSendError

__all__ = ["outbox"]


@contextmanager
def outbox(session: Session | Connection, broker: PostgresBroker | None = None) -> Iterator[psycopg.Connection]:
    """Inside the block, sends are written on *session*'s connection, in its current transaction
    (begun if none is): the messages exist if and only if that transaction commits, and are then
    claimed, fenced and counted like any other.  A savepoint (``begin_nested()``) rolled back takes
    the messages sent inside it with it.

    The block does not commit: commit after it (``session.commit()``, or the end of
    ``session.begin()``).  A commit inside it is refused (:class:`~.errors.NestedSendError`): the
    connection would go back to the pool, and a send after the commit would be written on a
    connection another request may hold.

    *broker*: Dramatiq's global broker by default.  Yields the ``psycopg.Connection``.
    """
    found = broker if broker is not None else dramatiq.get_broker()
    if not isinstance(found, PostgresBroker):
        raise TypeError(f"the broker is a {type(found).__name__}, not a PostgresBroker")
    if isinstance(session, Session):
        connection = session.connection()  # begins the session's transaction if none is
        target: Any = session
        when = "before_commit"
    else:
        connection = session
        if not connection.in_transaction():
            connection.begin()
        target, when = connection, "commit"
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(
            f"the engine's driver connection is a {type(driver).__module__}.{type(driver).__name__}: outbox() "
            "needs psycopg 3 (postgresql+psycopg://), and a synchronous Session or Connection"
        )

    def refuse(*args: Any) -> None:
        raise NestedSendError(
            "commit inside outbox(): end the block first, then commit (a send after the commit would be "
            "written on a connection back in the pool)"
        )

    event.listen(target, when, refuse)
    try:
        with found.transaction(driver):
            yield driver
    finally:
        event.remove(target, when, refuse)
