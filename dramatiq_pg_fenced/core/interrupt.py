"""Cancel that stops a running actor (opt-in: ``interrupt_on_cancel``).

An actor declared with ``interrupt_on_cancel=True`` (or every actor, with
``PostgresBroker(interrupt_on_cancel=True)``) runs inside :func:`interruptible`.
While its body runs, the :class:`Interrupter` knows which thread runs which
delivery (by its fence token).  When that delivery's row is cancelled, the
thread gets :class:`MessageCancelled` at its next Python instruction, as
Dramatiq's ``TimeLimit`` does it (``raise_thread_exception``): a thread in a C
call (``time.sleep``, a socket read, a lock) gets it when the call returns;
:func:`sleep` is a sleep that a cancel ends at once.  An ``async def`` actor
is stopped on its event loop instead: its task is cancelled
(:func:`interruptible_async`), nothing is sent to the worker thread.

How the process hears of it, first to last:

- the ``!interrupt <message id> <delivery>`` notification the ``cancel``
  statement sends with ``!cancel <message id>`` (the doorbell's listener thread
  calls :meth:`Interrupter.cancelled`);
- without LISTEN (``listen=False``, PgBouncer), the :class:`~.leases.CancelWatch` reads
  the rows of the interruptible deliveries running here every
  ``poll_interval``, only while one runs;
- a notification lost while the LISTEN connection was down: the lease keeper,
  whose extension finds the row cancelled under its token (every
  ``lease_seconds / 3``).

Races, and why none hurts:

- *Cancelled before the body starts*: the start gate skips a delivery whose
  cancellation was heard; a token cancelled after the gate but before
  :meth:`Interrupter.enter` is remembered, and ``enter`` raises at once.
- *Cancelled as the body returns* (or as it is registered): an interrupt is
  sent only to a delivery registered on its thread, at most once, under the
  registry's lock; :meth:`Interrupter.leave` unregisters it and clears an
  interrupt still pending.  The exception may land anywhere between the
  body's end and that unregistering, in the wrapper or at the entry of
  ``leave`` itself: :func:`interruptible` registers and unregisters inside
  one ``try``/``finally`` and calls ``leave`` again until it has run through
  (at most once more per interrupt sent), so no entry outlives its delivery,
  and the exception lands inside the actor call or not at all, never in the
  worker's own code or in the next message the thread runs.  A body that
  returned, or swallowed the exception, while it was interrupted still ends
  with :class:`MessageCancelled`.
- *Cancelled inside a* :func:`shielded` *block* (the broker's own database
  calls are): the thread raises the exception itself as the block ends, so a
  connection pool is never left half-way.
- *Two deliveries of one message in this process* (an old one that lost its
  lease still runs): each is known by its own token; only the cancelled one is
  stopped.

The exception is added to the actor's ``throws``, so Dramatiq's Retries does
not retry it and the worker logs it as expected, not as a failure.  The
delivery is nacked; its row is ``cancelled``, so the nack and everything the
delivery causes (result, pipeline successor, callbacks, group countdown) are
fenced out and counted as ``cancelled_writes``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any

from dramatiq.middleware.threading import Interrupt, current_platform, raise_thread_exception

from ..db.shield import MessageCancelled, Running, _here, describe
from ..db.shield import shielded as shielded
from ..db.shield import sleep as sleep
from . import delivery as running_delivery


class Interrupter:
    """Which interruptible delivery runs on which thread; interrupts the cancelled ones.

    Thread-safe: worker threads enter and leave, the doorbell's listener, the
    lease keeper and the cancel watch report cancellations.
    """

    #: Cancelled tokens remembered for a delivery that has not entered yet.
    REMEMBERED = 1000

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._lock = threading.Lock()
        self._running: dict[str, Running] = {}  # by delivery token
        self._cancelled: OrderedDict[str, None] = OrderedDict()  # tokens heard cancelled, not running here
        self.interrupts = 0  #: interrupts sent since the process started

    def enter(self, message_id: str, attempt: int, delivery: str, cancel: Callable[[], object] | None = None) -> bool:
        """The body of *delivery*'s actor starts on this thread; ``False``: it already runs here (a nested call).

        Raises :class:`MessageCancelled` at once if the delivery was heard cancelled already.
        From the moment it registers, an interrupt may land: call it where
        :meth:`leave` is sure to follow (see :func:`interruptible`).  *cancel*: the
        body is a coroutine, stopped by this call (its task cancelled), not by an
        exception sent to the thread (see :func:`interruptible_async`).
        """
        with self._lock:
            if delivery in self._running:
                return False
            if delivery in self._cancelled:
                del self._cancelled[delivery]
                raise MessageCancelled(describe(message_id, attempt))
            thread_id = threading.get_ident()
            entry = self._running[delivery] = Running(message_id, attempt, delivery, thread_id, self._lock, cancel)
            if cancel is None:
                _here.entry = entry  # the event loop's thread runs many coroutines: no entry of its own
        return True

    def runs_here(self, delivery: str) -> bool:
        """Is *delivery*'s body registered on this thread (an actor called from the body of one that runs)?"""
        with self._lock:
            entry = self._running.get(delivery)
            return entry is not None and entry.thread_id == threading.get_ident()

    def leave(self, delivery: str) -> bool:
        """The body of *delivery*'s actor ended on this thread: no interrupt reaches it from now on.

        Returns whether it was interrupted.  An interrupt sent but not yet
        raised is cleared; one that lands in here, before that, is caught.
        """
        interrupted = False
        for _ in range(2):  # one interrupt at most per delivery: a second pass cannot be disturbed
            try:
                with self._lock:
                    entry = self._running.get(delivery)
                    if entry is not None and entry.thread_id == threading.get_ident():
                        del self._running[delivery]
                        if entry.cancel is not None:
                            return entry.interrupted  # nothing was sent to the thread
                        _here.entry = None
                        if entry.interrupted:
                            interrupted = True
                            clear_pending(entry.thread_id)
                return interrupted
            except MessageCancelled:
                interrupted = True  # it landed here: nothing is pending any more
        return interrupted

    def cancelled(self, message_id: str, delivery: str) -> bool:
        """*delivery* of *message_id* was cancelled: interrupt its actor if it runs here (returns whether it did)."""
        with self._lock:
            entry = self._running.get(delivery)
            if entry is None or entry.message_id != message_id:
                self._cancelled[delivery] = None
                while len(self._cancelled) > self.REMEMBERED:
                    self._cancelled.popitem(last=False)
                return False
            if entry.interrupted or entry.deferred:
                return False
            self.interrupts += 1
            if entry.cancel is not None:
                entry.interrupted = True
                entry.cancel()  # the coroutine's task, cancelled on its loop: CancelledError at its await
            elif entry.shields:
                entry.deferred = True  # raised by the thread itself as its shield ends
            else:
                entry.interrupted = True
                raise_thread_exception(entry.thread_id, MessageCancelled)
            entry.wake.set()  # a sleep() returns: the exception lands, or the shield ends sooner
        self.logger.info(
            "Message %s was cancelled while its actor ran (attempt %d): %s.",
            message_id,
            entry.attempt,
            "it stops as its database call returns" if entry.deferred else "interrupted",
        )
        return True

    def command(self, arg: str) -> None:
        """The ``!interrupt <message id> <delivery>`` notification (see :meth:`.doorbell.Doorbell.on`)."""
        message_id, _, delivery = arg.partition(" ")
        if delivery:
            self.cancelled(message_id, delivery)

    def running(self) -> dict[str, str]:
        """The interruptible deliveries whose actors run here, not interrupted yet: token -> message id."""
        with self._lock:
            return {token: r.message_id for token, r in self._running.items() if not (r.interrupted or r.deferred)}


def clear_pending(thread_id: int) -> None:
    """Withdraw an exception sent to *thread_id* and not raised yet (CPython; nothing to do elsewhere)."""
    if current_platform == "CPython":
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), None)


def interruptible(fn: Callable[..., Any], interrupter: Callable[[], Interrupter]) -> Callable[..., Any]:
    """*fn* as an actor body that a cancel of its delivery interrupts (see the module docstring).

    Called outside a delivery of ours (directly, in a test, on another broker),
    it is *fn*.  An ``async def`` actor (*fn* is Dramatiq's ``async_to_sync`` of
    it) is :func:`interruptible_async`.
    """
    coroutine_fn = _async_actor_body(fn)
    if coroutine_fn is not None:
        return interruptible_async(coroutine_fn, interrupter)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        message = running_delivery.running()
        if message is None or _on_an_event_loop():
            # On the event loop's thread (an async actor's coroutine calls this function): an exception
            # sent to that thread would land in whichever coroutine runs there; the coroutine's own
            # delivery is stopped through its task (interruptible_async), if it is interruptible.
            return fn(*args, **kwargs)
        registry = interrupter()
        if registry.runs_here(message.delivery):
            return fn(*args, **kwargs)  # an actor called from the body of one that runs
        interrupted = False
        try:
            registry.enter(message.message_id, message.attempt, message.delivery)
            return fn(*args, **kwargs)
        finally:
            # From enter() on an interrupt may land anywhere up to leave()'s unregistering: here, or
            # at the entry of leave() before its lock.  Each sender sends at most one per delivery, so
            # this ends with the entry gone and nothing pending for what the thread runs next.
            landed: Interrupt | None = None
            while True:
                try:
                    interrupted = registry.leave(message.delivery) or interrupted
                    break
                except Interrupt as exc:
                    if isinstance(exc, MessageCancelled):
                        interrupted = True
                    else:
                        landed = landed or exc  # another interrupt (Dramatiq's time limit): raised after
            if interrupted:
                raise MessageCancelled(describe(message.message_id, message.attempt))
            if landed is not None:
                raise landed

    run.interrupts_on_cancel = True  # type: ignore[attr-defined]
    return run


def interruptible_async(
    coroutine_fn: Callable[..., Coroutine[Any, Any, Any]], interrupter: Callable[[], Interrupter]
) -> Callable[..., Any]:
    """An ``async def`` actor body that a cancel of its delivery stops: its task is cancelled.

    Dramatiq runs a coroutine on its event loop's thread while the worker
    thread waits for it, and stops it (a time limit, a shutdown) by raising in
    the worker thread, which then cancels the coroutine's future.  That
    exception may land before the wait has begun (``run_coroutine`` between
    scheduling the coroutine and its ``try``, where a busy machine preempts a
    thread): it leaves the worker thread and the coroutine runs on, unowned.
    So a cancel sends nothing to the worker thread: the coroutine registers
    itself from the loop, and a cancel calls its task's ``cancel()`` there
    (``asyncio.CancelledError`` at its ``await``).  The delivery ends with
    :class:`MessageCancelled`, as a thread's does, also if the coroutine
    returned or swallowed the cancel while it was cancelled.
    """
    import asyncio

    from dramatiq.asyncio import async_to_sync, get_event_loop_thread

    plain = async_to_sync(coroutine_fn)

    @functools.wraps(coroutine_fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        message = running_delivery.running()  # on the worker thread: the loop's thread has no delivery
        loop_thread = get_event_loop_thread()
        if message is None or loop_thread is None:
            return plain(*args, **kwargs)
        registry = interrupter()

        async def body() -> Any:
            task = asyncio.current_task()
            loop = asyncio.get_running_loop()
            assert task is not None

            def cancel() -> None:
                try:
                    loop.call_soon_threadsafe(task.cancel)
                except RuntimeError:  # the loop is closed (the worker stops): the coroutine ends with it
                    pass

            if not registry.enter(message.message_id, message.attempt, message.delivery, cancel):
                return await coroutine_fn(*args, **kwargs)
            try:
                result = await coroutine_fn(*args, **kwargs)
            except BaseException as exc:
                if registry.leave(message.delivery):
                    cause = None if isinstance(exc, asyncio.CancelledError) else exc
                    raise MessageCancelled(describe(message.message_id, message.attempt)) from cause
                raise  # not ours: Dramatiq's own cancel (a time limit, a shutdown) or the actor's error
            if registry.leave(message.delivery):
                raise MessageCancelled(describe(message.message_id, message.attempt))
            return result

        return loop_thread.run_coroutine(body())

    run.interrupts_on_cancel = True  # type: ignore[attr-defined]
    return run


def _on_an_event_loop() -> bool:
    """Does this thread run an asyncio event loop now?  (``asyncio`` not imported: it cannot.)"""
    asyncio = sys.modules.get("asyncio")
    if asyncio is None:
        return False
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _async_actor_body(fn: Callable[..., Any]) -> Callable[..., Coroutine[Any, Any, Any]] | None:
    """The ``async def`` function of which *fn* is Dramatiq's ``async_to_sync`` wrapper, if it is one
    (known by the wrapper's code: a function of the user's that wraps a coroutine is left alone)."""
    import inspect

    from dramatiq.asyncio import async_to_sync

    wrapped = getattr(fn, "__wrapped__", None)
    if wrapped is None or not inspect.iscoroutinefunction(wrapped):
        return None
    if getattr(fn, "__code__", None) is not getattr(async_to_sync(wrapped), "__code__", ()):
        return None
    return wrapped


def with_throws(throws: Any) -> tuple[type[BaseException], ...]:
    """An actor's ``throws`` option with :class:`MessageCancelled` added (Dramatiq's Retries never retries those)."""
    if throws is None:
        existing: tuple[type[BaseException], ...] = ()
    elif isinstance(throws, tuple):
        existing = throws
    else:
        existing = (throws,)
    return existing if MessageCancelled in existing else (*existing, MessageCancelled)
