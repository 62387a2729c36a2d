"""Where a send goes: the blocks that decide it, the innermost first.

A message sent in this thread is written

- inside ``broker.transaction(conn)``: on *conn*, in the caller's transaction (it
  exists if and only if that transaction commits), whatever block is open around it;
- inside ``with_ack()`` (an actor body), or in a middleware's ``after_process_message``
  hook: with the delivery's outcome, in the outcome writer's transaction, only if that
  outcome applies; ``with_ack()`` sends only with an ack (a retry or a dead letter
  drops them, counted), the middleware's with any outcome (an ``on_failure`` callback
  rides the dead letter);
- inside ``broker.batch()``: at the block's end, in one round trip (or not at all if
  the block raises), through whatever decides around the block;
- else in the transaction the broker joins by default, if one is open
  (:meth:`SendMethods.joined_transaction`: none for a plain broker; for
  ``DjangoPostgresBroker``, Django's ``transaction.atomic()`` block on its database);
- else at once, durably, in a transaction of its own.

The innermost block decides, so a caller's rolled-back transaction never produces a
message.  The one nesting that cannot keep both promises, ``with_ack()`` inside
``transaction(conn)``, is refused (:class:`~.errors.NestedSendError`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.message import Message

from ..core import delivery
from ..core.delivery import Row
from ..db.database import Database
from ..db.doorbell import look_back
from ..db.statements import Statements
from ..errors import NestedSendError
from .enqueue import CHUNK, Enqueuer

#: An open batch's list, the caller's connection, the transaction block's name.
_Open = tuple[list[tuple[Message, int | None]] | None, psycopg.Connection | None, str]
_CLOSED: _Open = (None, None, "")


class SendsOfThisThread:
    """Per thread and per asyncio task: an open ``batch()`` (its list) and ``transaction()`` (the
    caller's connection and the block's name).

    A ``ContextVar``, not a ``threading.local``: Dramatiq runs every ``async def`` actor of a worker
    on one event loop thread, and one coroutine's open block, while it awaits, must not take the
    sends of another (see ``core/delivery.py``).  One variable per broker, made with it (a worker
    makes one broker; the contexts that set it keep it alive as long as they live)."""

    def __init__(self) -> None:
        self._state: ContextVar[_Open] = ContextVar("dramatiq_pg_fenced.sends", default=_CLOSED)

    @property
    def batch(self) -> list[tuple[Message, int | None]] | None:
        return self._state.get()[0]

    @batch.setter
    def batch(self, batch: list[tuple[Message, int | None]] | None) -> None:
        _, conn, block = self._state.get()
        self._state.set((batch, conn, block))

    @property
    def conn(self) -> psycopg.Connection | None:
        return self._state.get()[1]

    @property
    def block(self) -> str:
        return self._state.get()[2]

    def swap(self, state: _Open) -> _Open:
        """Set all three (a transaction block opens, or ends); returns what they were."""
        previous = self._state.get()
        self._state.set(state)
        return previous


class SendMethods:
    """``enqueue_many``, ``batch``, ``transaction`` and ``with_ack`` (a mixin of :class:`~.broker.PostgresBroker`)."""

    _local: SendsOfThisThread
    database: Database
    statements: Statements
    enqueuer: Enqueuer
    listen: bool
    channel: str

    if TYPE_CHECKING:  # the broker's

        def emit_for_each(self, signal: str, items: list[Any], *args: Any) -> None: ...

        def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None: ...

        def row(self, message: Message, delay: int | None) -> Row: ...

    def enqueue_many(self, messages: Iterable[Message], *, delay: int | None = None) -> list[Message]:
        """Store many messages in one transaction: one statement, or pipelined
        chunks of ``enqueue.CHUNK`` (the next encoded while the server inserts
        this one), and one commit.

        Returns the messages; one whose unique key another message holds (or
        an earlier one of this call) comes back as a copy with the holder's id.
        Like :meth:`enqueue`, inside :meth:`with_ack` (or a middleware's
        ``after_process_message``) the messages wait for the delivery's
        outcome, and inside :meth:`batch` for the block's end; they are then
        returned as sent.
        """
        messages = list(messages)
        self.emit_for_each("before_enqueue", messages, delay)
        ids = None
        if (tied := delivery.tied_sends()) is not None:
            tied.extend(self.row(m, delay) for m in messages)  # written with its outcome (with_ack: its ack)
        elif (batch := self._local.batch) is not None:
            batch.extend((m, delay) for m in messages)  # written, and emit_after sent, when the block ends
            return messages
        else:
            ids = self._insert([(m, delay) for m in messages])
        self.emit_for_each("after_enqueue", messages, delay)
        if ids is None:
            return messages
        return [
            m if i == m.message_id else dataclasses.replace(m, message_id=i) for m, i in zip(messages, ids, strict=True)
        ]

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Collect every message sent in this thread inside the block; insert them in one round trip at its end.

        ``with broker.batch(): group(...).run()`` enqueues a whole group at
        once.  If the block raises, nothing is enqueued.
        """
        if self._local.batch is not None:
            yield  # nested: the outer block writes
            return
        items: list[tuple[Message, int | None]] = []
        self._local.batch = items
        try:
            yield
        finally:
            self._local.batch = None
        self._insert(items)
        for message, delay in items:
            self.emit_after("enqueue", message, delay)

    @contextmanager
    def transaction(self, conn: psycopg.Connection, *, block: str = "") -> Iterator[psycopg.Connection]:
        """Enqueue on *conn*, inside the caller's own transaction (the outbox pattern).

        Messages sent in this thread inside the block are written with the
        caller's connection: they become visible only if the caller's
        transaction commits and vanish if it rolls back.  The doorbell rings at
        commit (NOTIFY is transactional).  The innermost block decides: inside
        this one, a send is written on *conn* even within :meth:`with_ack` or
        :meth:`batch` (which would otherwise write it outside the caller's
        transaction, whatever that transaction does); ``with_ack()`` inside it
        is refused (:class:`~.errors.NestedSendError`).

        *block*: what the caller's code opened (``fenced_transaction()``...), for that error's message.
        """
        previous = self._local.swap((None, conn, block or "broker.transaction(conn)"))
        try:
            with delivery.deferred(delivery.AT_ONCE):
                yield conn
        finally:
            self._local.swap(previous)

    def joined_transaction(self, *, quiet: bool = False) -> psycopg.Connection | None:
        """The connection whose open transaction a send joins when no block of ours decides (its rows
        then commit or roll back with it): ``None`` here, a send is written at once.  A framework's
        broker names its own (``DjangoPostgresBroker``: Django's, inside ``transaction.atomic()`` on
        its database).  *quiet*: only asking (the routed broker looks through its databases); else the
        send is written at once if this returns ``None``, and the broker may say why."""
        return None

    def _insert(self, items: list[tuple[Message, int | None]]) -> list[str] | None:
        """Write *items*; ``None``, or with unique keys the id each send stands for (see Enqueuer.write)."""
        if not items:
            return None
        caller_conn = self._local.conn
        if caller_conn is None:
            caller_conn = self.joined_transaction()
        if caller_conn is None and len(items) > CHUNK:
            # Encoded chunk by chunk while the server inserts the previous one, in one transaction.
            return self.database.run(lambda conn: self.enqueuer.write_messages(conn, items))
        rows = [self.enqueuer.row(message, delay) for message, delay in items]
        if caller_conn is None:
            # Idempotent by message_id (ON CONFLICT DO NOTHING): safe to run again.
            # One statement, so autocommit makes it one round trip and one commit.
            return self.database.run(lambda conn: self.enqueuer.write(conn, rows))
        if self.listen:
            # The rows carry the caller's transaction's start as their place in line, and appear
            # only at its commit: consumers must look back at the head for them (floor.Floor).
            # Sent first, delivered with the enqueue's own ring at commit (NOTIFY is transactional).
            queues = sorted({r[1] for r in rows})
            caller_conn.execute(self.statements.notify, [self.channel, look_back(queues, ring=False)])
        return self.enqueuer.write(caller_conn, rows)  # the caller's transaction decides

    @contextmanager
    def with_ack(self) -> Iterator[None]:
        """Inside an actor: messages sent in the block are enqueued with this delivery's ack, and only if
        it applies.  A retry or a dead letter drops them (counted in ``dropped_effects``); to send on
        failure, use Dramatiq's ``on_failure`` callback, which rides the dead letter.

        By default what an actor sends is enqueued at once (as with every
        broker), so a delivery that is later fenced out has sent it anyway.
        Inside :meth:`~.broker.PostgresBroker.transaction` it is refused: its
        sends would be written with the ack whether the caller's transaction
        commits or not (:class:`~.errors.NestedSendError`).
        """
        if self._local.conn is not None:
            block = self._local.block
            raise NestedSendError(
                f"with_ack() inside {block}: its messages would be sent with the delivery's ack whether or not "
                f"{block}'s transaction commits. Send them in the block (they commit with it), or open "
                f"with_ack() outside {block}."
            )
        with delivery.deferred(delivery.ACK):
            yield
