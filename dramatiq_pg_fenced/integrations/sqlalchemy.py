"""SQLAlchemy 2: sends in a ``Session``'s (or a ``Connection``'s) transaction.

::

    with Session(engine) as session, session.begin():
        with outbox(session):
            session.add(order)
            session.flush()
            confirm_order.send(order.id)   # a row of the session's transaction
    # committed: the order and its message; rolled back: neither

Inside an actor, :func:`fenced_transaction` commits the session's writes together with the
delivery's ack, under its fence, or not at all::

    @dramatiq.actor
    def pay(order_id):
        with Session(engine) as session, fenced_transaction(session):
            session.get(Order, order_id).paid = True
    # committed with the ack; DeliveryLost (nothing written) if this delivery lost its message

The engine must use the psycopg 3 driver (``postgresql+psycopg://``); the broker's tables must
be in that database.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import dramatiq
import psycopg
from sqlalchemy import event
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from ..broker import PostgresBroker
from ..core.interrupt import shielded
from ..errors import FencedTransactionError, NestedSendError
from ..routing.router import RoutedBroker

__all__ = ["fenced_transaction", "outbox"]


def _driver(connection: Connection, what: str) -> psycopg.Connection:
    driver = connection.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(
            f"the engine's driver connection is a {type(driver).__module__}.{type(driver).__name__}: {what} "
            "needs psycopg 3 (postgresql+psycopg://), and a synchronous Session or Connection"
        )
    return driver


def _broker(broker: PostgresBroker | RoutedBroker | None) -> Any:
    """*broker*, or Dramatiq's global one: a PostgresBroker or a RoutedBroker (whose sends in the block
    are rows of it whatever their queue's database: outbox rows, relayed after the commit)."""
    found = broker if broker is not None else dramatiq.get_broker()
    if not isinstance(found, (PostgresBroker, RoutedBroker)):
        raise TypeError(f"the broker is a {type(found).__name__}, not a PostgresBroker or a RoutedBroker")
    return found


@contextmanager
def outbox(
    session: Session | Connection, broker: PostgresBroker | RoutedBroker | None = None
) -> Iterator[psycopg.Connection]:
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
    found = _broker(broker)
    if isinstance(session, Session):
        connection = session.connection()  # begins the session's transaction if none is
        target: Any = session
        when = "before_commit"
    else:
        connection = session
        if not connection.in_transaction():
            connection.begin()
        target, when = connection, "commit"
    driver = _driver(connection, "outbox()")

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


@contextmanager
def fenced_transaction(
    session: Session | Connection, broker: PostgresBroker | RoutedBroker | None = None
) -> Iterator[psycopg.Connection]:
    """Inside an actor: a transaction of *session* (a ``Session`` or a ``Connection``) whose writes
    commit together with this delivery's ack, under its fence, or not at all (the fenced transaction
    of :mod:`dramatiq_pg_fenced.exactly_once`).

    The block begins the transaction and takes the delivery's row in it, locked, as its ack (the row
    moves to ``committed`` in the transaction); if the delivery no longer holds its message (its
    lease lapsed and it was redelivered, or it was cancelled),
    :class:`~dramatiq_pg_fenced.errors.DeliveryLost` is raised before the body runs.  As the body
    ends, the session is flushed (and the sends made earlier in ``with_ack()`` written), and the
    block commits.  An exception out of the body
    rolls it all back and takes the delivery's normal path (retry, dead letter).  Sends inside are
    rows of the transaction.

    The block owns the transaction: *session* must not be in one (commit or roll back first, or use
    a fresh session), and a commit inside the body is refused
    (:class:`~dramatiq_pg_fenced.errors.NestedSendError`), as it would commit the writes without the
    ack.  :class:`~dramatiq_pg_fenced.errors.FencedTransactionError` outside an actor, in a
    transaction already, or a second time in one delivery.  *broker*: Dramatiq's global broker by
    default.  Yields the ``psycopg.Connection``.
    """
    found = _broker(broker)
    fence = found.fence()
    if session.in_transaction():
        raise FencedTransactionError(
            "fenced_transaction(session): the session is in a transaction already; the block must begin and "
            "commit it (commit or roll back first)"
        )
    is_session = isinstance(session, Session)
    target: Any = session
    when = "before_commit" if is_session else "commit"
    ours = False

    def refuse(*args: Any) -> None:
        if not ours:
            raise NestedSendError(
                "commit inside fenced_transaction(): it would commit the block's writes without the delivery's "
                "ack; the block commits as it ends"
            )

    ended = False
    event.listen(target, when, refuse)
    try:
        with shielded():
            trans = session.begin()
            driver: psycopg.Connection | None = None
            try:
                connection = session.connection() if isinstance(session, Session) else session
                driver = _driver(connection, "fenced_transaction()")
                fence.begin(driver, explicit=driver.autocommit)
                with found.transaction(driver, block="fenced_transaction(session)"):
                    yield driver
                if isinstance(session, Session):
                    session.flush()
                fence.end(driver, commit=False)
                ended, ours = True, True
                trans.commit()
            except BaseException:
                if trans.is_active:
                    with suppress(Exception):
                        trans.rollback()
                if driver is not None:  # a commit refused inside leaves SQLAlchemy's transaction ended, not ours
                    with suppress(psycopg.Error):
                        driver.rollback()
                raise
    except DBAPIError:
        if ended and fence.committed_after_all():  # the connection broke as it committed: it did
            found.logger.info("The connection broke as message %s's fenced_transaction(session) committed; it "
                              "did commit.", fence.message.message_id)  # fmt: skip
            fence.committed()
            return
        raise
    finally:
        event.remove(target, when, refuse)
    fence.committed()
