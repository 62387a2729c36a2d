"""A delivery: one claim of a message row, known by its attempt number.

The attempt lives on the proxy (:attr:`PostgresMessageProxy.attempt`), which
is what every fenced write reads; ``options["attempt"]`` is a copy for
actors and middleware (``CurrentMessage``) and is never read back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message


@dataclass
class ResultWrite:
    """An actor's result for the results table (see results.py).

    Attached to an ack, it is written in the ack's transaction and only if the
    ack applies.  As a ``result`` outcome (a stored exception, submitted right
    after its nack) it is fenced on the row being at that attempt, running or
    dead, so it lands only if its attempt's nack did.

    ``failure`` encodes, in the backend's format, what is stored in its place
    if the database refuses ``data``: a failure that gives the reason.
    """

    key: str
    message_id: str
    attempt: int | None  # None: stored outside a delivery, not fenced
    data: bytes
    ttl_ms: int
    failure: Callable[[str], bytes] | None = field(default=None, repr=False, compare=False)


class PostgresMessageProxy(MessageProxy):
    """A delivered message: knows its attempt and whether it was settled.

    ``settled`` is set once this delivery's outcome (ack, nack or retry) was
    handed to the outcome writer, so the ack Dramatiq sends after a retry is
    a quiet no-op.  ``pending_result`` is set by the results backend: the
    result is written in the transaction of this attempt's ack, and only if
    the ack applies.
    """

    def __init__(self, message: Message, attempt: int) -> None:
        message.options["attempt"] = attempt
        super().__init__(message)
        self.attempt = attempt
        self.settled = False
        self.pending_result: ResultWrite | None = None

    @property
    def message(self) -> Message:
        """The Dramatiq message this proxy wraps."""
        return self._message

    @property
    def exception(self) -> BaseException | None:
        """The exception the actor raised (Dramatiq's ``stuff_exception``), if any."""
        return self._exception

    def error_text(self, default: str | None = None) -> str | None:
        """What the row's ``last_error`` gets: Dramatiq's traceback option, else the exception's repr."""
        exc = self._exception
        return self.options.get("traceback") or (repr(exc) if exc is not None else default)


def attempt_of(message: Any) -> int | None:
    """The attempt a message belongs to: a delivery's own; for a copy, the one in its options; else ``None``."""
    if isinstance(message, PostgresMessageProxy):
        return message.attempt
    attempt = message.options.get("attempt")
    return int(attempt) if attempt is not None else None


_pending = threading.local()  # per worker thread: a write that waits for the delivery's ack


def defer_pending(write: Callable[[], None]) -> None:
    """Remember *write* (a result waiting for this thread's ack) until :func:`write_pending` or the next one."""
    _pending.write = write


def write_pending() -> None:
    """Write now the result this thread's delivery still holds for its ack.

    Called before anything another process acts on as "this message is
    done": enqueueing a follow-up message, or counting down a group's
    barrier.  If the database is away, the ack still carries the result.
    """
    write = getattr(_pending, "write", None)
    if write is not None:
        _pending.write = None
        write()
