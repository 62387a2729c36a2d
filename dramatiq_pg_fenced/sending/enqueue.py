"""Enqueueing: messages as rows, written in one statement.

The broker decides where a send goes (the caller's transaction, a batch, the
outcome of the delivery that sent it, or at once); this module turns messages
into rows and writes them.  An id that exists already is not inserted again:
the sender is told once per send, and it is counted.  A send whose unique key
another message holds is not inserted either; the writer returns the
holder's id for it (see unique.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
from collections.abc import Callable
from itertools import islice
from typing import Any

import psycopg
from dramatiq import get_encoder
from dramatiq.common import current_millis
from dramatiq.message import Message

from ..config import Settings
from ..core.delivery import Row, fair
from ..core.delivery import keyed as needs_keyed
from ..db.statements import Statements, check_message_id, check_queue
from ..errors import PayloadTooLarge
from . import fairness
from .unique import key_of

#: A message id as Dramatiq makes them (``str(uuid.uuid4())``): a UUID in canonical form.
_CANONICAL_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


#: The longest delay a send may ask for (milliseconds, about 31,700 years): what PostgreSQL's
#: timestamps can hold from now, with room to spare.
MAX_DELAY_MS = 10**15


def _milliseconds(message: Message, what: str, value: float) -> int:
    """*value* (a delay of *message*, named *what*) in whole milliseconds; ``ValueError`` in one line
    for one that is no finite number of at most ``MAX_DELAY_MS`` (the server's own error otherwise)."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or (isinstance(value, float) and not math.isfinite(value)) or value > MAX_DELAY_MS:
        raise ValueError(
            f"message {message.message_id} for actor {message.actor_name!r}: {what} of {value!r} ms is out of range "
            f"(a finite number of at most {MAX_DELAY_MS} ms)"
        )
    return int(value)


def check_canonical_id(message: Message) -> None:
    """Refuse, in one line, a message whose id is not a UUID in canonical form.  PostgreSQL takes
    ``"{...}"``, upper case or no hyphens as the same UUID, but the worker knows its deliveries by the
    id as the row gives it back (canonical): a message sent under another spelling was stored and
    then skipped at every delivery.  An id that is no UUID at all failed with the server's error.
    (The regular expression, not :func:`.admin.check_message_id`, on this hot path: it only matches.)"""
    message_id = message.message_id
    if isinstance(message_id, str) and _CANONICAL_ID.fullmatch(message_id):
        return
    try:
        hint = f": {check_message_id(message_id)} is its canonical form"
    except ValueError:
        hint = ""
    raise ValueError(
        f"message id {message_id!r} of actor {message.actor_name!r} is not a UUID in canonical form "
        f"(lower case, hyphenated, as Dramatiq makes them){hint}"
    )


#: Rows per statement when many messages are written at once: the client
#: encodes the next chunk while the server inserts this one (see write_messages).
CHUNK = 500

#: How often a send with a key is tried again when its key was freed between
#: the insert that found it held and the read of its holder.
UNIQUE_TRIES = 5


#: The field names of each Message class, in order (``Message.asdict`` reads them anew each time).
_FIELDS: dict[type, tuple[str, ...]] = {}


def encode(message: Message) -> bytes:
    """``message.encode()``, without looking up the dataclass fields on every message (bulk enqueue feels it)."""
    cls = type(message)
    if cls.encode is not Message.encode or cls.asdict is not Message.asdict:
        return message.encode()  # a subclass that encodes its own way
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(field.name for field in dataclasses.fields(cls))
    return get_encoder().encode({name: getattr(message, name) for name in names})


class Enqueuer:
    def __init__(
        self,
        statements: Statements,
        settings: Settings,
        *,
        actor_of: Callable[[str], Any],
        fair_queues: set[str] | frozenset[str] = frozenset(),
        max_payload_bytes: int,
        synchronous_commit: bool,
        logger: logging.Logger,
    ) -> None:
        self.statements = statements
        self.settings = settings
        self.actor_of = actor_of  # the declared actor of a name, or None
        self.fair_queues = fair_queues  # the queues of actors that declare fairness_key (fairness.py)
        self.max_payload_bytes = max_payload_bytes
        self.synchronous_commit = synchronous_commit
        self.logger = logger
        self._lock = threading.Lock()
        self.duplicates = 0  #: sends not inserted because their id exists

    def encode(self, message: Message) -> bytes:
        """The stored payload: without this delivery's ``attempt``, at most ``max_payload_bytes``."""
        if "attempt" in message.options:
            message = message.copy()
            message.options.pop("attempt", None)
        data = encode(message)
        if len(data) > self.max_payload_bytes:
            raise PayloadTooLarge(
                f"message {message.message_id} for actor {message.actor_name!r} encodes to {len(data)} bytes, "
                f"over max_payload_bytes={self.max_payload_bytes}; pass large data by reference"
            )
        return data

    def row(self, message: Message, delay: int | None) -> Row:
        """*message* as the enqueue statement takes it.

        Dramatiq's ``eta`` option (an absolute time in ms) becomes a server-side
        delay, and leaves the stored message: a worker would otherwise hold the
        message in memory until then and re-enqueue it under the same id.  The
        message's own ``delay`` option (``actor.message_with_options(delay=ms)``,
        what Dramatiq's pipelines read) delays it too, however it is sent; the
        longest of the three wins.  A ``delay`` option that is no number is refused, and so is an
        id that is not a canonical UUID (:func:`check_canonical_id`).
        """
        check_queue(message.queue_name)
        check_canonical_id(message)
        delay_ms = max(_milliseconds(message, "delay", delay or 0), 0)
        own = message.options.get("delay")
        if own is not None:
            if isinstance(own, bool) or not isinstance(own, (int, float)):
                raise ValueError(
                    f"message {message.message_id} for actor {message.actor_name!r}: options['delay'] must be a "
                    f"number of milliseconds, not {own!r}"
                )
            delay_ms = max(delay_ms, _milliseconds(message, "options['delay']", own))
        eta = message.options.get("eta")
        if "eta" in message.options:  # (Message.copy merges options: it cannot drop one)
            message = dataclasses.replace(message, options={k: v for k, v in message.options.items() if k != "eta"})
            if isinstance(eta, (int, float)) and not isinstance(eta, bool):
                delay_ms = max(delay_ms, _milliseconds(message, "options['eta']", eta - current_millis()))
        actor = self.actor_of(message.actor_name)
        priority, actor_options = (actor.priority, actor.options) if actor is not None else (0, None)
        if not -(2**31) <= priority < 2**31:
            raise ValueError(f"actor {message.actor_name!r} has priority {priority}: the broker keeps a 32-bit integer")
        key, until = key_of(message, actor_options)
        fkey, weight = fairness.key_of(message, actor_options, message.queue_name in self.fair_queues)
        return (
            message.message_id,
            message.queue_name,
            message.actor_name,
            priority,
            delay_ms,
            self.encode(message),
            key,
            until,
            fkey,
            weight,
        )

    def write_messages(self, conn: psycopg.Connection, items: list[tuple[Message, int | None]]) -> list[str] | None:
        """Encode and insert more than :data:`CHUNK` *items* as :meth:`write` does, in one transaction.

        They go :data:`CHUNK` at a time in pipeline mode: the server inserts
        one chunk while this thread encodes the next, and one commit ends them
        all, so nothing is written if any message cannot be encoded.
        """
        if len(items) <= CHUNK or not psycopg.Pipeline.is_supported():
            return self.write(conn, [self.row(message, delay) for message, delay in items])
        ids: list[str] = []
        keyed = False
        pending: list[tuple[list[Row], psycopg.Cursor[Any]]] = []
        with conn.pipeline(), conn.transaction():
            for start in range(0, len(items), CHUNK):
                rows = [self.row(message, delay) for message, delay in items[start : start + CHUNK]]
                if any(map(needs_keyed, rows)):
                    ids.extend(self.write_unique(conn, rows))  # reads its holders back: not pipelined
                    keyed = True
                else:
                    pending.append((rows, conn.execute(*self._statement(rows))))
                    ids.extend(row[0] for row in rows)
        for rows, cursor in pending:
            inserted = cursor.fetchone()
            if inserted is not None and inserted[0] < len(rows):
                self._not_inserted(rows, len(rows) - inserted[0])
        return ids if keyed else None

    def write(self, conn: psycopg.Connection, rows: list[Row]) -> list[str] | None:
        """Insert *rows* in one statement (idempotent by id: safe to run again).

        Returns ``None`` when no row carries a unique key; else, per row, the
        id of the message it stands for: its own, or that of the message
        holding its key.
        """
        if any(map(needs_keyed, rows)):
            return self.write_unique(conn, rows)
        inserted = conn.execute(*self._statement(rows)).fetchone()
        if inserted is not None and inserted[0] < len(rows):
            self._not_inserted(rows, len(rows) - inserted[0])
        return None

    def _statement(self, rows: list[Row]) -> tuple[bytes, list[Any]]:
        """The enqueue statement for *rows* without unique keys, and its parameters."""
        relaxed = not self.synchronous_commit
        channel, listen = self.settings.channel, self.settings.listen
        if len(rows) == 1:  # a plain send(): one row of scalars is cheaper than unnest
            statement = self.statements.enqueue_one_relaxed if relaxed else self.statements.enqueue_one
            return statement, [*rows[0][:6], channel, listen]
        statement = self.statements.enqueue_relaxed if relaxed else self.statements.enqueue
        return statement, [*map(list, islice(zip(*rows, strict=True), 6)), channel, listen]

    def write_unique(self, conn: psycopg.Connection, rows: list[Row], *, tries: int = UNIQUE_TRIES) -> list[str]:
        """Insert *rows*, some with a unique key or a fairness key; per row, the id it stands for (see :meth:`write`).

        One round trip, unless a holder committed while the insert ran (then
        its id is read again) or was acked, dead-lettered or cancelled in
        between (then those sends are tried again, at most *tries* times).
        """
        st, relaxed = self.statements, not self.synchronous_commit
        if fair(rows):  # a fair queue's: the unique enqueue, plus the keys' places in line (fairness.py)
            statement = st.enqueue_fair_relaxed if relaxed else st.enqueue_fair
            columns = list(map(list, zip(*rows, strict=True)))
        else:
            statement = st.enqueue_unique_relaxed if relaxed else st.enqueue_unique
            columns = list(map(list, islice(zip(*rows, strict=True), 8)))
        params = [*columns, self.settings.channel, self.settings.listen]
        ids: list[str] = []
        duplicates: list[Row] = []
        unseen: list[int] = []  # sends with a key, not inserted, whose holder was not visible
        for i, (row, (inserted, holder, _)) in enumerate(zip(rows, conn.execute(statement, params), strict=True)):
            ids.append(row[0] if inserted or holder is None else str(holder))
            if inserted:
                continue
            if holder is None and row[6] is not None:
                unseen.append(i)
            elif holder is None or str(holder) == row[0]:
                duplicates.append(row)  # its id exists already (holding its key or not)
        if unseen:
            again: list[int] = []
            params = [[rows[i][0] for i in unseen], [rows[i][2] for i in unseen], [rows[i][6] for i in unseen]]
            for i, (holder, exists) in zip(unseen, conn.execute(self.statements.unique_holders, params), strict=True):
                if holder is not None:
                    ids[i] = str(holder)
                    if ids[i] == rows[i][0]:
                        duplicates.append(rows[i])
                elif exists:
                    duplicates.append(rows[i])
                else:
                    again.append(i)  # the key was freed meanwhile: send it again
            if again and tries > 1:
                for i, sent in zip(
                    again, self.write_unique(conn, [rows[i] for i in again], tries=tries - 1), strict=True
                ):
                    ids[i] = sent
            elif again:
                self.logger.warning(
                    "%d send(s) with a unique key neither inserted nor deduplicated after %d tries "
                    "(their key was freed and taken again each time); not enqueued.",
                    len(again),
                    UNIQUE_TRIES,
                )
        if duplicates:
            self._not_inserted(duplicates, len(duplicates))
        return ids

    def _not_inserted(self, rows: list[Row], count: int) -> None:
        with self._lock:
            self.duplicates += count
        which = f"message {rows[0][0]}" if len(rows) == 1 else f"{count} of {len(rows)} messages"
        self.logger.warning(
            "%s not enqueued: a message with the same id is still queued, running, dead or cancelled. "
            "Re-drive a dead or cancelled message with broker.redrive(id); send anew with a new id.",
            which[0].upper() + which[1:],
        )
