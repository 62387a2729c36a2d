"""FencedDelivery: what fencing needs on the worker's side.

The broker installs it (``PostgresBroker(...).middleware`` shows it) and keeps
it last in the list, so its ``before_process_message`` runs after every other
middleware's and its ``after_process_message`` before every other's.

- **Before a delivery starts**, it asks the broker whether the delivery may
  start: not if its lease was lost (redelivered elsewhere) or its message
  was cancelled while it waited in the prefetch.  Such a delivery is
  skipped (Dramatiq's ``SkipMessage``): the actor never runs, nothing is
  written for it.
- **After the actor**, the messages the other middleware send for this
  delivery (the next pipeline step, ``on_success`` / ``on_failure``
  callbacks, a group's completion) and its group countdown are tied to its
  outcome: written in the transaction of its ack (or nack, or retry), and
  only if that applies.  A delivery that was fenced out causes nothing; what
  it would have caused is counted as ``dropped_effects``.

- **An actor declared with** ``interrupt_on_cancel=True`` (or every actor,
  with the broker's ``interrupt_on_cancel=True``) is stopped when its running
  message is cancelled: :class:`~.interrupt.MessageCancelled` is raised in
  its thread (see :mod:`.interrupt`; added to the actor's ``throws``, so it is
  not retried), and the delivery ends as cancelled, causing nothing.

- **When a worker starts**, it checks once that the broker's database can
  work as configured (see :mod:`.startup`): a role, password, database or
  schema that can never work stops a ``dramatiq`` worker process at once
  (one line, exit code 3), and makes ``Worker.start()`` raise
  :class:`~.startup.StartupError`; a server that cannot be reached now is
  waited for.

- **When the worker begins to shut down** (SIGTERM), the deliveries it
  holds in its prefetch but has not started go back to their queue at once
  (fenced, the attempt kept), for other workers, instead of after the
  running actors finish; the process claims nothing more.

Messages the actor body itself sends are enqueued at once, as with any
broker; inside ``with broker.with_ack():`` they wait for the ack too.
"""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import GroupCallbacks, Middleware, SkipMessage

from .core import delivery
from .core.delivery import PostgresMessageProxy
from .core.interrupt import interruptible, with_throws
from .db.startup import StartupError

#: How a ``dramatiq`` worker process ends when its broker fails at start-up (``dramatiq.cli.RET_CONNECT``).
EXIT_BROKER_FAILED = 3


class FencedDelivery(Middleware):
    """Skips deliveries that were cancelled or lost before they started; ties
    a delivery's effects to its outcome; stops actors that opted in when their
    message is cancelled.  Installed by :class:`PostgresBroker`."""

    @property
    def actor_options(self) -> set[str]:
        return {"interrupt_on_cancel"}

    def after_declare_actor(self, broker: Any, actor: Any) -> None:
        settings = getattr(broker, "settings", None)
        default = getattr(settings, "interrupt_on_cancel", False)
        if not actor.options.get("interrupt_on_cancel", default) or getattr(actor.fn, "interrupts_on_cancel", False):
            return
        actor.fn = interruptible(actor.fn, lambda: broker.interrupter)
        actor.options["throws"] = with_throws(actor.options.get("throws"))

    def after_process_boot(self, broker: Any) -> None:
        """Sent only in a ``dramatiq`` worker process, before it loads the other modules: a configuration
        that can never work ends the process here, after one line (not a traceback, and not a worker
        that says it is ready and waits forever)."""
        check = getattr(broker, "check_startup", None)
        if check is None:
            return
        try:
            check()
        except StartupError as e:
            broker.logger.error("%s", e)
            raise SystemExit(EXIT_BROKER_FAILED) from None  # past Dramatiq's emit_after, which logs Exceptions

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        check = getattr(broker, "check_startup", None)
        if check is not None:
            check()  # a worker of your own: Worker.start() raises StartupError (once per process)
        for actor in list(broker.actors.values()):
            self.after_declare_actor(broker, actor)  # declared before this middleware was added
        for m in broker.middleware:
            if isinstance(m, GroupCallbacks) and not getattr(m, "counts_with_the_ack", False):
                broker.logger.warning(
                    "%s counts group members down before their ack: a redelivered member counts twice. "
                    "Use dramatiq_pg_fenced.rate_limits.FencedGroupCallbacks (results.setup() does).",
                    type(m).__name__,
                )

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        register = getattr(broker, "worker_started", None)
        if register is not None:  # this process's row in the process table (processes.py)
            register(worker)

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        unregister = getattr(broker, "worker_stopped", None)
        if unregister is not None:
            unregister()

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        release = getattr(broker, "release_unstarted", None)
        if release is not None:
            release()  # prefetched messages go back now, not after the running ones finish

    def before_process_message(self, broker: Any, message: Any) -> None:
        if not isinstance(message, PostgresMessageProxy):
            delivery.start(None)
            return
        delivery.start(message)
        reason = broker.why_not_start(message)
        if reason is not None:
            delivery.start(None)
            message.not_started = reason
            raise SkipMessage(f"message {message.message_id} (attempt {message.attempt}) does not start: {reason}")

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None, exception: Any = None) -> None:
        if isinstance(message, PostgresMessageProxy) and delivery.running() is message:
            delivery.defer_effects()

    def after_skip_message(self, broker: Any, message: Any) -> None:
        if isinstance(message, PostgresMessageProxy) and delivery.running() is message:
            delivery.defer_effects()
