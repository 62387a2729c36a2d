"""A delivery: one claim of a message row, known by its attempt number.

The attempt and the fence token live on the proxy
(:attr:`PostgresMessageProxy.attempt`, :attr:`PostgresMessageProxy.delivery`),
which is what every fenced write reads; ``options["attempt"]`` is a copy for
actors and middleware (``CurrentMessage``) and is never read back for a
delivery.  The token is what fences: attempts can repeat (a message id
inserted again after its row was acked starts at 1 again).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from ..config import MAX_ERROR_BYTES
from ..errors import PayloadTooLarge
from .fencing import Write

#: A message ready for the enqueue statement: (id, queue, actor, priority, delay ms, payload,
#: unique key, unique until, fairness key, fairness weight).  Unique key and until are ``None`` for
#: a send without a unique key (see unique.py); fairness key and weight ``None`` outside a fair
#: queue, the weight also when the queue's table decides (see fairness.py).
Row = tuple[str, str, str, int, int, bytes, str | None, str | None, str | None, float | None]


def keyed(row: Row) -> bool:
    """Does *row* need the keyed enqueue (a unique key or a fairness key)?"""
    return row[6] is not None or row[8] is not None


def fair(rows: list[Row]) -> bool:
    """Do some of *rows* carry a fairness key (the fair enqueue; else the unique one takes 8 columns)?"""
    return any(row[8] is not None for row in rows)


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
    delivery: str | None = None  # the delivery's token, when the writer knows it
    failure: Callable[[str], bytes] | None = field(default=None, repr=False, compare=False)


@dataclass
class Countdown:
    """A group member counting down its group's barrier (``FencedGroupCallbacks``).

    Written with the member's ack, only if the ack applies: the barrier at
    *key* goes down by one, and the member that finds it at its last party
    clears it, rings ``key@events`` and enqueues *completions*, all in that
    transaction.  A redelivered member therefore counts once, and the
    completion messages are sent once.
    """

    key: str
    ttl_ms: int
    completions: list[Row]


@dataclass
class Outcome:
    """One delivery's outcome, on its way to the database, with what it causes."""

    kind: Write  # ACK, NACK, RETRY or RESULT
    message_id: str
    attempt: int
    delivery: str  # the fence token
    error: str | None = None
    payload: bytes | None = None  # RETRY: the message as it goes back to the queue
    delay_ms: int = 0  # RETRY: its backoff
    queue_name: str = ""
    exception: BaseException | None = field(default=None, repr=False)  # NACK: for join(fail_fast=True)
    result: ResultWrite | None = field(default=None, repr=False)
    #: Messages this delivery's middleware sent (next pipeline step, callbacks): enqueued with the outcome.
    follow_ups: list[Row] = field(default_factory=list, repr=False)
    countdowns: list[Countdown] = field(default_factory=list, repr=False)
    #: ACK only: the delivery's fenced transaction committed the ack already; this writes what the
    #: delivery caused afterwards, fenced on its ``committed`` row (exactly_once.py).
    committed: bool = False

    def __post_init__(self) -> None:
        self.error = storable_text(self.error)

    @property
    def effects(self) -> int:
        """How many things this outcome causes besides itself."""
        return len(self.follow_ups) + len(self.countdowns) + (self.result is not None)


def storable_text(text: str | None, limit: int = MAX_ERROR_BYTES) -> str | None:
    """*text* as a text column takes it: NUL and invalid Unicode replaced by U+FFFD, at most *limit* bytes.

    Lone surrogates (which no UTF-8 text can hold) become U+FFFD; a surrogate
    pair becomes the character it encodes.  A text over *limit* bytes of
    UTF-8 keeps its first quarter and its end (where a traceback names the
    exception) around a note of how much was cut.  Storable text comes back
    unchanged (and at no cost but a length check and one encode).
    """
    if text is None:
        return None
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
        data = text.encode("utf-8")
    if b"\x00" in data:
        text = text.replace("\x00", "\ufffd")
        data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    note = f"\n[... {len(data)} bytes cut here ...]\n"  # an upper bound of the count: never longer than the real note
    room = max(limit - len(note.encode()), 0)
    head, tail = data[: room // 4], data[len(data) - (room - room // 4) :] if room else b""
    cut = len(data) - len(head) - len(tail)
    # "ignore" drops the bytes of a character split at either cut.
    return head.decode("utf-8", "ignore") + f"\n[... {cut} bytes cut here ...]\n" + tail.decode("utf-8", "ignore")


class PostgresMessageProxy(MessageProxy):
    """A delivered message: knows its attempt and whether it was settled.

    ``settled`` is set once this delivery's outcome (ack, nack or retry) was
    handed to the outcome writer.  ``pending_result`` is set by the results
    backend: the result is written in the transaction of this attempt's ack,
    and only if the ack applies.  ``decided`` holds a retry (or the dead
    letter that replaces an impossible one) decided by the Retries middleware
    until Dramatiq's ack or nack hands it over, together with the follow-up
    messages and group countdowns the other middleware added meanwhile.
    """

    def __init__(self, message: Message, attempt: int, delivery: str) -> None:
        message.options["attempt"] = attempt
        super().__init__(message)
        # The message's fields, as attributes: read through MessageProxy.__getattr__, each read first
        # failed the normal lookup (about 26 reads per delivery in Dramatiq's worker and ours; 5-8% of
        # the worker's CPU in a drain, profiled).  The message is frozen, and ``options`` is its dict.
        self.queue_name = message.queue_name
        self.actor_name = message.actor_name
        self.message_id = message.message_id
        self.message_timestamp = message.message_timestamp
        self.args = message.args
        self.kwargs = message.kwargs
        self.options = message.options
        self.attempt = attempt
        self.delivery = delivery  #: the fence token of this delivery (unique, unlike the attempt)
        self.settled = False
        self.pending_result: ResultWrite | None = None
        self.decided: Outcome | None = None
        self.follow_ups: list[Row] = []  #: sent by the middleware after the actor: ride any outcome
        self.ack_sends: list[Row] = []  #: sent inside ``with broker.with_ack():``: ride only an ack
        self.countdowns: list[Countdown] = []
        self.exception_stored = False  #: its stored exception rides its nack (see results.py)
        #: its actor re-enqueued it itself (outside the middleware's hooks): that retry was handed over at
        #: once, and a result stored after it is no part of it (see results.py)
        self.retried_at_once = False
        #: Its fenced transaction committed its ack (exactly_once.py): what it causes later rides a
        #: ``committed`` outcome, and it is never retried nor dead-lettered.
        self.committed = False
        self.claimed_at = time.monotonic()
        self.not_started: str | None = None  #: why it was skipped before its actor started, if it was

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


def failed_after_its_commit(logger: logging.Logger, message: PostgresMessageProxy, what: str) -> None:
    """A delivery whose fenced transaction committed fails afterwards (*what*: it would be retried, or
    dead-lettered): the message is done, so neither happens.  Logged as an error, with the error."""
    logger.error(
        "Message %s (attempt %d) failed after its fenced transaction committed its writes and its ack; it is "
        "done and is not %s: %s",
        message.message_id,
        message.attempt,
        what,
        message.error_text("an error"),
    )


def attempt_of(message: Any) -> int | None:
    """The attempt a message belongs to: a delivery's own; for a copy, the one in its options; else ``None``."""
    if isinstance(message, PostgresMessageProxy):
        return message.attempt
    attempt = message.options.get("attempt")
    return int(attempt) if attempt is not None else None


class _Pending(threading.local):
    """Per worker thread: a write that waits for the delivery's ack (none, by default)."""

    write: Callable[[], None] | None = None


_pending = _Pending()


def defer_pending(write: Callable[[], None]) -> None:
    """Remember *write* (a result waiting for this thread's ack) until :func:`write_pending` or the next one."""
    _pending.write = write


def write_pending() -> None:
    """Write now the result this thread's delivery still holds for its ack.

    Called before anything another process acts on as "this message is
    done": enqueueing a follow-up message, or counting down a group's
    barrier.  If the database is away, the ack still carries the result.
    """
    write = _pending.write
    if write is not None:
        _pending.write = None
        write()


# -- the delivery running on this thread -----------------------------------------------
#: What a delivery's sends wait for (``_deferring``): nothing (sent at once), any outcome (the
#: middleware's, after the actor: the next pipeline step, callbacks), or an ack (``with_ack()``).
AT_ONCE, OUTCOME, ACK = "", "outcome", "ack"


#: This worker's delivery and what its sends wait for: per thread and per asyncio task, not per thread
#: alone.  Dramatiq runs every ``async def`` actor of a worker on one event loop thread; its coroutine
#: is scheduled in a copy of the worker thread's context (``run_coroutine_threadsafe``), so it reads the
#: delivery its worker thread runs, and two coroutines on that loop read their own (a
#: ``threading.local`` there would be the loop's, the same for all: ``with_ack()`` sent at once).
_delivery: ContextVar[PostgresMessageProxy | None] = ContextVar("dramatiq_pg_fenced.delivery", default=None)
_deferring: ContextVar[str] = ContextVar("dramatiq_pg_fenced.deferring", default=AT_ONCE)


def start(delivery: PostgresMessageProxy | None) -> None:
    """Called as *delivery* starts on this worker thread (``None``: nothing runs here)."""
    _delivery.set(delivery)
    _deferring.set(AT_ONCE)


def running() -> PostgresMessageProxy | None:
    """The delivery this worker thread (or the coroutine of its async actor) runs, if it is one of ours."""
    return _delivery.get()


def defer_effects() -> None:
    """From now until its outcome, messages this thread sends belong to its delivery (see :func:`deferring`)."""
    _deferring.set(OUTCOME)


def deferring() -> PostgresMessageProxy | None:
    """The delivery whose outcome this thread's sends are tied to, if any.

    Set for the middleware's ``after_process_message`` hooks (the next
    pipeline step, callbacks, group completion) and inside
    :meth:`PostgresBroker.with_ack`; the actor body's own sends are enqueued
    at once.
    """
    return _delivery.get() if _deferring.get() != AT_ONCE else None


def tied_sends() -> list[Row] | None:
    """Where this thread's sends go when they belong to its delivery (``None``: they do not).

    Inside ``with_ack()``, a list that only an ack writes (a retry or a dead
    letter drops it, counted); in the middleware's hooks, one that any
    outcome writes (an ``on_failure`` callback rides the dead letter).
    """
    delivery = deferring()
    if delivery is None:
        return None
    return delivery.ack_sends if _deferring.get() == ACK else delivery.follow_ups


@contextmanager
def deferred(until: str = ACK) -> Iterator[PostgresMessageProxy | None]:
    """Tie this thread's sends to its running delivery inside the block: to its ack, or (*until*
    ``OUTCOME``) to any outcome; with ``AT_ONCE``, untie them (an explicit transaction inside)."""
    before = _deferring.get()
    _deferring.set(until)
    try:
        yield running()
    finally:
        _deferring.set(before)


# -- a retry's outcome ---------------------------------------------------------------
def retry_outcome(
    message: PostgresMessageProxy, delay: int | None, encode: Callable[[Message], bytes], logger: logging.Logger
) -> Outcome:
    """The outcome of Dramatiq's Retries re-enqueueing *message*: back to the
    queue with its new options, or dead-lettered if it can no longer be stored
    or cannot be built at all (the encoder raises): never left held."""
    try:
        return _retry_outcome(message, delay, encode, logger)
    except Exception as e:
        logger.error(
            "The retry of message %s (attempt %d) could not be built; dead-lettering it.",
            message.message_id,
            message.attempt,
            exc_info=True,
        )
        return Outcome(
            Write.NACK,
            message.message_id,
            message.attempt,
            message.delivery,
            error=f"the retry of attempt {message.attempt} could not be built: {type(e).__name__}: {e}\n"
            f"{message.error_text('')}",
            queue_name=message.queue_name,
            exception=message.exception,
        )


def _retry_outcome(
    message: PostgresMessageProxy, delay: int | None, encode: Callable[[Message], bytes], logger: logging.Logger
) -> Outcome:
    error = message.error_text()
    try:
        payload = encode(message.message)
    except PayloadTooLarge:
        # Dramatiq's traceback option made it grow; last_error keeps the traceback anyway.
        slim = {k: v for k, v in message.options.items() if k != "traceback"}
        try:
            payload = encode(dataclasses.replace(message.message, options=slim))
        except PayloadTooLarge as e:
            # Raising here would let the ack that follows drop the message: dead-letter it instead.
            logger.error("Message %s cannot be retried: %s", message.message_id, e)
            return Outcome(
                Write.NACK,
                message.message_id,
                message.attempt,
                message.delivery,
                error=f"retry refused: {e}\n{error}",
                queue_name=message.queue_name,
                exception=message.exception,
            )
    return Outcome(
        Write.RETRY,
        message.message_id,
        message.attempt,
        message.delivery,
        payload=payload,
        delay_ms=max(int(delay or 0), 0),
        error=error,
        queue_name=message.queue_name,
    )
