"""A cancel's interrupt held back while the database layer's calls run: :func:`shielded`.

An interruptible actor (``interrupt_on_cancel``, see ``core/interrupt.py``) gets
:class:`MessageCancelled` at its next Python instruction when its message is
cancelled.  Inside a :func:`shielded` block (every call of :class:`~.database.Database`
is one) it gets it as the block ends instead, so a connection pool is never left
half-way.  This module holds what a worker thread knows of the interruptible body
it runs (:class:`Running`); the :class:`~dramatiq_pg_fenced.core.interrupt.Interrupter`
registers it and sends the interrupt.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from dramatiq.middleware.threading import Interrupt


class MessageCancelled(Interrupt):
    """Raised in an actor (``interrupt_on_cancel``) whose message was cancelled while it ran.

    A ``BaseException`` (Dramatiq's ``Interrupt``), so ``except Exception`` in
    the actor does not swallow it; ``finally`` blocks and context managers run.
    """


class Running:
    """An interruptible delivery whose actor body runs on a worker thread.

    A plain class, not a dataclass: making a dataclass's methods took half a millisecond of every
    process's ``import dramatiq_pg_fenced``.
    """

    __slots__ = (
        "message_id",
        "attempt",
        "delivery",
        "thread_id",
        "lock",
        "interrupted",
        "shields",
        "deferred",
        "wake",
        "cancel",
    )

    def __init__(
        self,
        message_id: str,
        attempt: int,
        delivery: str,
        thread_id: int,
        lock: threading.Lock,
        cancel: Callable[[], object] | None = None,
    ) -> None:
        self.message_id = message_id
        self.attempt = attempt
        self.delivery = delivery  # the fence token
        self.thread_id = thread_id
        self.lock = lock  # its interrupter's
        self.interrupted = False  #: an interrupt was sent, or raised at the end of a shield (once per delivery)
        self.shields = 0  #: nested shielded() blocks the thread is in
        self.deferred = False  #: cancelled inside a shield: raised as the outermost one ends
        self.wake = threading.Event()  #: set on cancel: ends a sleep() at once
        #: An async actor's coroutine: cancels its task on the event loop (no exception sent to a thread).
        self.cancel = cancel

    def __repr__(self) -> str:
        return f"Running({self.message_id!r}, attempt={self.attempt}, thread_id={self.thread_id})"


class _Here(threading.local):
    """Per worker thread: the Running entry of the body it runs, if any (the class holds the default
    every other thread reads: no ``getattr`` with a default, which raised and caught an AttributeError
    at every checkout of a pooled connection)."""

    entry: Running | None = None


_here = _Here()


@contextmanager
def shielded() -> Iterator[None]:
    """Inside the block a cancel does not interrupt this thread; it does as the block ends.

    For code that must not stop half-way (a connection pool's bookkeeping, a
    write and its cleanup).  The broker's own database calls are shielded
    (``Database.connection`` and ``run``: a send, ``is_cancelled``, a result
    read from an actor); wrap your own pools and clients in it.  Outside an
    interruptible actor it does nothing.
    """
    entry = _here.entry
    if entry is None:
        yield
        return
    with entry.lock:
        entry.shields += 1
    fire = False
    try:
        yield
    finally:
        with entry.lock:
            entry.shields -= 1
            if entry.shields == 0 and entry.deferred and not entry.interrupted:
                entry.interrupted = fire = True
        if fire and sys.exc_info()[1] is None:
            raise MessageCancelled(describe(entry.message_id, entry.attempt))


def sleep(seconds: float) -> None:
    """``time.sleep(seconds)`` that a cancel ends at once, in an interruptible actor.

    ``time.sleep`` is a C call: an interrupt waits for it to return.  This
    waits on an event the cancel sets, so ``MessageCancelled`` is raised
    within milliseconds however long the sleep.  Elsewhere it is ``time.sleep``.
    """
    entry = _here.entry
    if entry is None:
        time.sleep(seconds)
    else:
        entry.wake.wait(seconds)


def describe(message_id: str, attempt: int) -> str:
    return f"message {message_id} was cancelled while its actor ran (attempt {attempt})"
