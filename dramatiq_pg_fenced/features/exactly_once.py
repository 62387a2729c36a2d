"""The fenced transaction: an actor's own writes commit with its delivery's ack, under its fence.

::

    @dramatiq.actor
    def pay(order_id):
        with broker.fenced_transaction() as conn:
            conn.execute("UPDATE orders SET paid = true WHERE id = %s", [order_id])
            receipt.send(order_id)  # a row of the same transaction

The block, on a connection of the broker's pool (or one you pass):

1. begins a transaction and moves the delivery's row from ``running`` to ``committed``, under its
   fence token (one simple query with the ``BEGIN``: one round trip, as a ``BEGIN`` alone).  If
   the delivery no longer holds it (its lease lapsed and it went back to the queue or to another
   worker, or it was cancelled), :class:`~.errors.DeliveryLost` is raised before the block's body
   runs: nothing of it is written;
2. runs the body: the actor's statements on the connection, and its sends (written on it, as in
   ``broker.transaction(conn)``).  The row stays locked: no rescue, claim, cancel or other
   delivery can take the message until the block ends;
3. writes the messages sent earlier in ``with_ack()`` and commits: the row's new state commits
   with the actor's writes, or rolls back with them and leaves the delivery running (a plain
   ``COMMIT``; the ack needs nothing more).

A ``committed`` row is done: the rescue never takes it, a cancel finds it finished.  Its lease
goes on: the lease keeper of the delivery's process extends it (fenced on its token) as long as
the actor runs on after its block, and until its outcome is written.  The outcome writer finishes
it as it finishes an ack, batched with others (its history row, the throughput tally), and writes
what the delivery caused after the block (the result the Results middleware stores, the next
pipeline step, callbacks, a group's countdown) in the same transaction, only if it takes the row,
so at most once; ``join()`` waits for it meanwhile.  Only when its process stops extending the
lease (it dies, or is stopped or cut off from the database, for longer than the lease and a grace
of ``COMMITTED_GRACE_LEASES`` leases) does maintenance finish the row without those effects, and
say so: the message is done, what it caused after its block is lost.  Put what must happen exactly
once inside the block.

An exception inside the block rolls it back and leaves the actor: the delivery takes the normal
path (retry, dead letter).  An exception after the block cannot undo it: the message is done, the
error is logged, and nothing is retried or dead-lettered (see :func:`~.delivery.failed_after_its_commit`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, suppress
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import TransactionStatus

from ..config import Settings
from ..core import delivery
from ..core.delivery import PostgresMessageProxy
from ..core.interrupt import shielded
from ..db.database import Database
from ..db.doorbell import look_back
from ..db.statements import Statements
from ..errors import DeliveryLost, FencedTransactionError

if TYPE_CHECKING:
    from ..sending.enqueue import Enqueuer


#: Called with the delivery as its ``fenced_transaction()`` begins; the context manager it returns
#: wraps the block (the connection's checkout included) and sees its exception (``DeliveryLost``).
FencedTransactionHook = Callable[[PostgresMessageProxy], AbstractContextManager[Any]]


class Fence:
    """One delivery's fenced transaction on one connection: :meth:`begin` takes the row, :meth:`end`
    writes the ack in the transaction, :meth:`committed` is called once the transaction committed.
    For frameworks that own the transaction (Django's ``atomic``, a SQLAlchemy ``Session``) the
    integrations call these steps themselves; :meth:`FencedTransactions.fenced_transaction` does it
    all on a psycopg connection."""

    def __init__(self, methods: FencedTransactions, message: PostgresMessageProxy) -> None:
        self._methods = methods
        self.message = message

    def begin(self, conn: psycopg.Connection, *, explicit: bool) -> None:
        """Take the delivery's row in *conn*'s transaction, moving it to ``committed`` (*explicit*:
        send the ``BEGIN`` too, in the same query)."""
        m, stmts = self.message, self._methods.statements
        if explicit:
            cur: psycopg.Cursor = psycopg.ClientCursor(conn)
            cur.execute(stmts.fence_begin, [m.message_id, m.delivery])
            cur.nextset()
        else:
            cur = conn.execute(stmts.fence_lock, [m.message_id, m.delivery])
        if cur.fetchone() is None:
            raise DeliveryLost(
                f"message {m.message_id}: attempt {m.attempt} no longer holds it (its lease lapsed and it was "
                "redelivered, or it was cancelled); nothing of the fenced transaction is written"
            )

    def end(self, conn: psycopg.Connection, *, commit: bool) -> None:
        """Write the sends made earlier in ``with_ack()`` in *conn*'s transaction; with *commit*,
        commit it.  The row has been this delivery's, locked, since :meth:`begin`: the ack is the
        state the transaction commits."""
        m, methods = self.message, self._methods
        stmts, settings = methods.statements, methods.settings
        if m.ack_sends:
            rows, m.ack_sends = m.ack_sends, []
            if settings.listen:
                conn.execute(stmts.notify, [settings.channel, look_back(sorted({r[1] for r in rows}), ring=False)])
            methods.enqueuer.write(conn, rows)
        if commit:
            conn.commit()

    def committed(self) -> None:
        """The transaction committed: the message is done, and what the delivery causes from now on
        rides a ``committed`` outcome.  The delivery stays held (not settled) while its actor runs on:
        the lease keeper extends its committed row (fenced on its token) until that outcome is
        written, and its worker thread still counts as busy."""
        self.message.committed = True

    def committed_after_all(self) -> bool:
        """After a connection lost at the commit: did it commit?  (Read on a fresh connection.)"""
        token = self.message.delivery
        try:
            return bool(
                self._methods.database.run(
                    lambda c: c.execute(self._methods.statements.committed_seen, [token]).fetchone()
                )
            )
        except Exception as e:  # cannot tell: the error stands, and a retry of this delivery is fenced out if it did
            self._methods.logger.warning(
                "Could not read whether message %s's fenced transaction committed: %s", self.message.message_id, e
            )
            return False


class FencedTransactions:
    """``fenced_transaction()`` (a mixin of :class:`~.broker.PostgresBroker`)."""

    database: Database
    statements: Statements
    settings: Settings
    enqueuer: Enqueuer
    logger: logging.Logger
    fenced_transaction_hooks: list[FencedTransactionHook]

    if TYPE_CHECKING:

        @contextmanager
        def transaction(
            self, conn: psycopg.Connection, *, block: str = ""
        ) -> Iterator[psycopg.Connection]: ...  # SendMethods's

    def fence(self) -> Fence:
        """The fence of the delivery running on this thread (for the framework integrations).

        Raises :class:`~.errors.FencedTransactionError` outside an actor this broker delivered, or
        when this delivery's fenced transaction committed already.
        """
        message = delivery.running()
        if message is None:
            raise FencedTransactionError(
                "fenced_transaction() outside an actor delivered by a PostgresBroker: there is no delivery "
                "whose ack it could commit"
            )
        if message.committed:
            raise FencedTransactionError(
                f"message {message.message_id}: a fenced transaction of this delivery committed already, with "
                "its ack; one block per delivery"
            )
        return Fence(self, message)

    @contextmanager
    def fenced_transaction(self, conn: psycopg.Connection | None = None) -> Iterator[psycopg.Connection]:
        """Inside an actor: a transaction whose writes commit together with this delivery's ack, or not
        at all (see :mod:`.exactly_once`).  Yields the connection to write on.

        *conn*: a psycopg connection of yours, not in a transaction (the block begins and commits
        it); by default, one of the broker's pool.  The messages the actor sends inside are written
        on it.  Raises :class:`~.errors.DeliveryLost` as it begins, before its body runs, when the
        delivery no longer holds its message; an exception out of the body rolls everything back.
        """
        fence = self.fence()
        with ExitStack() as stack:
            for hook in self.fenced_transaction_hooks:
                stack.enter_context(hook(fence.message))
            if conn is None:
                conn = stack.enter_context(self.database.connection())  # shielded: a cancel waits for the block
            else:
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    raise FencedTransactionError(
                        "fenced_transaction(conn): the connection is in a transaction already; the block must "
                        "begin and commit it (commit or roll back first)"
                    )
                stack.enter_context(shielded())
            try:
                fence.begin(conn, explicit=conn.autocommit)
                with self.transaction(conn, block="fenced_transaction()"):
                    yield conn
                fence.end(conn, commit=True)
            except (psycopg.OperationalError, psycopg.InterfaceError) as e:
                if conn.info.transaction_status == TransactionStatus.UNKNOWN and fence.committed_after_all():
                    self.logger.info(
                        "The connection broke as message %s's fenced transaction committed; it did commit (%s).",
                        fence.message.message_id,
                        e,
                    )
                    fence.committed()
                    return
                with suppress(psycopg.Error):
                    conn.rollback()
                raise
            except BaseException:
                with suppress(psycopg.Error):
                    conn.rollback()
                raise
            fence.committed()


__all__ = ["Fence", "FencedTransactionHook", "FencedTransactions"]
