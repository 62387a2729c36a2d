"""Enqueueing: messages as rows, written in one statement.

The broker decides where a send goes (the caller's transaction, a batch, the
outcome of the delivery that sent it, or at once); this module turns messages
into rows and writes them.  An id that exists already is not inserted again:
the sender is told once per send, and it is counted.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg
from dramatiq.common import current_millis
from dramatiq.message import Message

from .config import Settings
from .delivery import Row
from .errors import PayloadTooLarge
from .sql import Statements, check_queue


class Enqueuer:
    def __init__(
        self,
        statements: Statements,
        settings: Settings,
        *,
        priority_of: Callable[[str], int],
        max_payload_bytes: int,
        synchronous_commit: bool,
        logger: logging.Logger,
    ) -> None:
        self.statements = statements
        self.settings = settings
        self.priority_of = priority_of
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
        data = message.encode()
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
        message in memory until then and re-enqueue it under the same id.
        """
        check_queue(message.queue_name)
        delay_ms = max(int(delay or 0), 0)
        eta = message.options.get("eta")
        if "eta" in message.options:  # (Message.copy merges options: it cannot drop one)
            message = dataclasses.replace(message, options={k: v for k, v in message.options.items() if k != "eta"})
            if isinstance(eta, (int, float)):
                delay_ms = max(delay_ms, int(eta) - current_millis())
        priority = self.priority_of(message.actor_name)
        return (message.message_id, message.queue_name, message.actor_name, priority, delay_ms, self.encode(message))

    def write(self, conn: psycopg.Connection, rows: list[Row]) -> None:
        """Insert *rows* in one statement (idempotent by id: safe to run again)."""
        relaxed = not self.synchronous_commit
        channel, listen = self.settings.channel, self.settings.listen
        if len(rows) == 1:  # a plain send(): one row of scalars is cheaper than unnest
            statement = self.statements.enqueue_one_relaxed if relaxed else self.statements.enqueue_one
            params: list[Any] = [*rows[0], channel, listen]
        else:
            statement = self.statements.enqueue_relaxed if relaxed else self.statements.enqueue
            params = [*map(list, zip(*rows, strict=True)), channel, listen]
        inserted = conn.execute(statement, params).fetchone()
        if inserted is not None and inserted[0] < len(rows):
            self._not_inserted(rows, len(rows) - inserted[0])

    def _not_inserted(self, rows: list[Row], count: int) -> None:
        with self._lock:
            self.duplicates += count
        which = f"message {rows[0][0]}" if len(rows) == 1 else f"{count} of {len(rows)} messages"
        self.logger.warning(
            "%s not enqueued: a message with the same id is still queued, running, dead or cancelled. "
            "Re-drive a dead or cancelled message with broker.redrive(id); send anew with a new id.",
            which[0].upper() + which[1:],
        )
