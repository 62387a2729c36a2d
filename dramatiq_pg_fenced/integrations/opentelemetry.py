"""OpenTelemetry traces of messages, after the OpenTelemetry messaging semantic conventions.

::

    from dramatiq_pg_fenced.integrations.opentelemetry import OpenTelemetry

    broker = PostgresBroker(url)
    broker.add_middleware(OpenTelemetry())   # opt-in; needs opentelemetry-api (the ``otel`` extra)

Needs ``opentelemetry-api`` only (the ``otel`` extra); the SDK and an exporter are the
application's.  Nothing of the package imports this module: a broker without the middleware
neither imports OpenTelemetry nor writes anything into its messages.

What it records (``messaging.system`` = ``"dramatiq"``, ``messaging.destination.name`` = the queue,
``messaging.message.id``, ``messaging.operation.type``/``.name``; ours under ``messaging.dramatiq.*``):

- **send**: a ``PRODUCER`` span ``send <queue>`` around the broker's enqueue, a child of the
  current span: the caller's, or inside an actor the delivery's ``process`` span (the sends of
  ``with_ack()``, of ``transaction(conn)``, of ``fenced_transaction()`` and the outbox, and the
  middleware's follow-ups: next pipeline step, callbacks).  Its context goes into the message's
  options (``options["otel_context"]``: W3C ``traceparent``, via the global propagator), which the
  row stores.  A message that carries a context already keeps it (the conventions: a creation
  context is never replaced); a retry (Dramatiq's Retries sends the same delivery back) creates no
  send span: it keeps its options, so every later delivery is tied to the original send.
- **process**: a ``CONSUMER`` span ``process <queue>`` per delivery, *linked* to the send's context
  (the conventions: a process span SHOULD link to the message's creation context) and, by default,
  its *child* as well (``child_of_send=True``): one message is one trace, its send, every delivery,
  retry and redelivery in it, which is what Jaeger and Tempo show as one waterfall.  With
  ``child_of_send=False`` each delivery starts a trace of its own, linked to the send (for long
  delays or fan-out, where one trace per message grows too long).  It is the current span while the
  actor and the other middleware run, and ends when the delivery's outcome is written (or fenced out)
  by the outcome writer, so its ``messaging.dramatiq.outcome`` is what the database decided:

  ``acked``, ``retried``, ``dead_lettered``; ``stale`` (fenced out: its lease lapsed and the message
  was redelivered, or ``fenced_transaction()`` found it no longer this delivery's); ``cancelled``
  (cancelled by an operator while it ran); ``not_started`` (skipped before its actor started:
  cancelled or lost while it waited in the prefetch, ``messaging.dramatiq.reason`` says which).
  Also ``messaging.dramatiq.attempt`` (the delivery's attempt number, the fence),
  ``messaging.dramatiq.retries`` and ``messaging.dramatiq.actor``; the actor's exception is recorded
  (``error.type``, status ``ERROR``).
- **fenced_transaction**: an ``INTERNAL`` span ``fenced_transaction <queue>`` around the block,
  a child of the process span; ``DeliveryLost`` recorded, with ``messaging.dramatiq.outcome`` = ``stale``.

As a worker boots, the middleware puts itself first in the broker's list, so that its process span
begins before every other middleware's work and stays current until the last one's (Retries,
Pipelines, Callbacks send from their ``after_process_message``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dramatiq.middleware import Middleware
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import get_global_textmap
from opentelemetry.propagators.textmap import TextMapPropagator
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from ..config import __version__
from ..core.delivery import Outcome, PostgresMessageProxy
from ..core.fencing import Write
from ..errors import DeliveryLost

#: The message option that carries the send's trace context (W3C ``traceparent``, ``tracestate``).
OPTIONS_KEY = "otel_context"
SYSTEM = "dramatiq"
#: A delivery's outcome, from the outcome writer's verdict on its write (see ``StaleWrites.settled``).
OUTCOMES = {Write.ACK: "acked", Write.NACK: "dead_lettered", Write.RETRY: "retried"}
#: Sends whose enqueue never came back (it raised: no ``after_enqueue``) kept per thread before the
#: oldest is ended as unfinished.
MAX_OPEN_SENDS = 1000


class _Thread(threading.local):
    sends: dict[int, Span]  # id(message) -> its send span, until after_enqueue
    delivery: tuple[Any, Span, object] | None = None  # (message, process span, context token)

    def __init__(self) -> None:
        self.sends = {}


class OpenTelemetry(Middleware):
    """Spans of sends, deliveries and fenced transactions (see the module's docstring).

    Parameters:
      tracer_provider: the provider to trace with (default: the global one).
      propagator: how the context is written into the options (default: the global propagator,
        W3C trace context and baggage unless configured otherwise).
      child_of_send: ``True`` (default): a delivery's process span is a child of the send, and
        linked to it; ``False``: a root span of its own, linked to it.
    """

    def __init__(
        self,
        tracer_provider: trace.TracerProvider | None = None,
        propagator: TextMapPropagator | None = None,
        *,
        child_of_send: bool = True,
    ) -> None:
        self.tracer = trace.get_tracer(__name__, __version__, tracer_provider=tracer_provider)
        self.propagator = propagator
        self.child_of_send = child_of_send
        self._thread = _Thread()
        self._lock = threading.Lock()
        self._waiting: dict[str, Span] = {}  # delivery token -> its process span, until its outcome is written

    # -- wiring -------------------------------------------------------------------------
    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        if broker.middleware and broker.middleware[0] is not self:
            broker.middleware.remove(self)
            broker.middleware.insert(0, self)  # first: see the module's docstring
        for target in [broker, *getattr(broker, "shards", {}).values()]:
            observers = getattr(target, "outcome_observers", None)
            if observers is not None and self._settled not in observers:
                observers.append(self._settled)
            hooks = getattr(target, "fenced_transaction_hooks", None)
            if hooks is not None and self._fenced_span not in hooks:
                hooks.append(self._fenced_span)

    def _observed(self, broker: Any) -> bool:
        """Does *broker* tell this middleware its deliveries' outcomes (a PostgresBroker, or its router's shards)?"""
        targets = [broker, *getattr(broker, "shards", {}).values()]
        return any(self._settled in getattr(t, "outcome_observers", ()) for t in targets)

    def _propagator(self) -> TextMapPropagator:
        return self.propagator if self.propagator is not None else get_global_textmap()

    # -- send -----------------------------------------------------------------------------
    def before_enqueue(self, broker: Any, message: Any, delay: int | None) -> None:
        if isinstance(message, PostgresMessageProxy):
            # A delivery sent back (Dramatiq's Retries, or the actor itself): the same message, its
            # options (the original send's context) kept; the process span tells its outcome.
            with self._lock:
                span = self._waiting.get(message.delivery)
            if span is not None and span.is_recording():
                span.add_event("retry", {"messaging.dramatiq.delay_ms": int(delay or 0)})
            return
        carried = message.options.get(OPTIONS_KEY)
        links = []
        if isinstance(carried, dict):  # a creation context already: kept, and linked
            linked = trace.get_current_span(self._propagator().extract(carried)).get_span_context()
            if linked.is_valid:
                links.append(Link(linked))
        span = self.tracer.start_span(
            f"send {message.queue_name}",
            kind=SpanKind.PRODUCER,
            links=links,
            attributes={
                **self._message_attributes(message, "send"),
                "messaging.dramatiq.delay_ms": int(delay or 0),
            },
        )
        if not isinstance(carried, dict):
            carrier: dict[str, str] = {}
            self._propagator().inject(carrier, context=trace.set_span_in_context(span))
            message.options[OPTIONS_KEY] = carrier
        sends = self._thread.sends
        if len(sends) >= MAX_OPEN_SENDS:
            oldest = next(iter(sends))
            unfinished = sends.pop(oldest)
            unfinished.set_status(Status(StatusCode.ERROR, "the enqueue did not finish"))
            unfinished.end()
        sends[id(message)] = span

    def after_enqueue(self, broker: Any, message: Any, delay: int | None) -> None:
        span = self._thread.sends.pop(id(message), None)
        if span is not None:
            span.end()

    # -- process ----------------------------------------------------------------------------
    def before_process_message(self, broker: Any, message: Any) -> None:
        carried = message.options.get(OPTIONS_KEY)
        sent = self._propagator().extract(carried) if isinstance(carried, dict) else otel_context.Context()
        send = trace.get_current_span(sent).get_span_context()
        attributes = self._message_attributes(message, "process")
        attempt = message.attempt if isinstance(message, PostgresMessageProxy) else message.options.get("attempt")
        if attempt is not None:
            attributes["messaging.dramatiq.attempt"] = int(attempt)
        attributes["messaging.dramatiq.retries"] = int(message.options.get("retries", 0))
        span = self.tracer.start_span(
            f"process {message.queue_name}",
            context=sent if self.child_of_send else otel_context.Context(),
            kind=SpanKind.CONSUMER,
            links=[Link(send)] if send.is_valid else [],
            attributes=attributes,
        )
        token = otel_context.attach(trace.set_span_in_context(span))
        self._thread.delivery = (message, span, token)
        if isinstance(message, PostgresMessageProxy) and self._observed(broker):
            with self._lock:
                self._waiting[message.delivery] = span

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None, exception: Any = None) -> None:
        span = self._leave(message)
        if span is None:
            return
        if exception is not None and span.is_recording():
            span.record_exception(exception)
            span.set_attribute("error.type", type(exception).__qualname__)
            span.set_status(Status(StatusCode.ERROR, str(exception)))
        if not (isinstance(message, PostgresMessageProxy) and self._observed(broker)):
            # not a delivery whose outcome the writer tells: ends now (else it ends as it is written)
            span.set_attribute("messaging.dramatiq.outcome", "failed" if exception is not None else "processed")
            span.end()

    def after_skip_message(self, broker: Any, message: Any) -> None:
        span = self._leave(message)
        if span is None:
            return
        with self._lock:
            self._waiting.pop(getattr(message, "delivery", ""), None)
        span.set_attribute("messaging.dramatiq.outcome", "not_started")
        reason = getattr(message, "not_started", None)
        if reason:
            span.set_attribute("messaging.dramatiq.reason", reason)
        span.end()

    def _leave(self, message: Any) -> Span | None:
        """This thread's process span of *message*, no longer current."""
        current = self._thread.delivery
        if current is None or current[0] is not message:
            return None
        self._thread.delivery = None
        otel_context.detach(current[2])  # type: ignore[arg-type]
        return current[1]

    def _settled(self, outcome: Outcome, verdict: str) -> None:
        """The outcome writer wrote (or fenced out) a delivery's outcome: its process span ends."""
        with self._lock:
            span = self._waiting.pop(outcome.delivery, None)
        if span is None:
            return
        said = OUTCOMES[outcome.kind] if verdict == "applied" else verdict
        if outcome.committed and verdict == "applied":
            said = "acked"  # its fenced transaction committed the ack
        span.set_attribute("messaging.dramatiq.outcome", said)
        span.end()

    # -- fenced_transaction() ----------------------------------------------------------------
    @contextmanager
    def _fenced_span(self, message: PostgresMessageProxy) -> Iterator[None]:
        attributes = self._message_attributes(message, "fenced_transaction")
        attributes["messaging.dramatiq.attempt"] = message.attempt
        with self.tracer.start_as_current_span(
            f"fenced_transaction {message.queue_name}", kind=SpanKind.INTERNAL, attributes=attributes
        ) as span:
            try:
                yield
            except DeliveryLost:
                span.set_attribute("messaging.dramatiq.outcome", "stale")
                raise

    @staticmethod
    def _message_attributes(message: Any, operation: str) -> dict[str, Any]:
        kind = {"send": "send", "process": "process"}.get(operation)
        attributes: dict[str, Any] = {
            "messaging.system": SYSTEM,
            "messaging.destination.name": message.queue_name,
            "messaging.message.id": message.message_id,
            "messaging.operation.name": operation,
            "messaging.dramatiq.actor": message.actor_name,
        }
        if kind is not None:
            attributes["messaging.operation.type"] = kind
        return attributes


__all__ = ["OPTIONS_KEY", "OpenTelemetry"]
