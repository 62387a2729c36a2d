"""OpenTelemetry traces of messages (issue 43, point 2): a send span, a process span per delivery tied
to it, the delivery's outcome as the database decided it, sends made inside a delivery parented by it,
and a fenced transaction's own span.  Real PostgreSQL, an in-process worker, the SDK's in-memory exporter."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import dramatiq
import pytest
from helpers import Factory, expire_and_rescue, running_worker, wait_for

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from dramatiq_pg_fenced import PostgresBroker  # noqa: E402
from dramatiq_pg_fenced.integrations.opentelemetry import OPTIONS_KEY, OpenTelemetry  # noqa: E402


class Traces:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("test")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def wait(self, name: str, n: int = 1) -> list[ReadableSpan]:
        return wait_for(lambda: len(self.spans(name)) >= n and self.spans(name), 30, f"{n} span(s) {name!r}")


@pytest.fixture
def traces() -> Iterator[Traces]:
    t = Traces()
    yield t
    t.provider.shutdown()


def traced(factory: Factory, traces: Traces, **options: Any) -> PostgresBroker:
    broker = factory(**options)
    broker.add_middleware(OpenTelemetry(tracer_provider=traces.provider))
    return broker


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def test_a_send_and_its_delivery_are_a_producer_span_and_a_consumer_span_linked_and_parented_to_it(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given a message sent inside a request's span, I expect a PRODUCER span "send <queue>" child of the
    request, its context in the message's options, and a CONSUMER span "process <queue>" child of the
    send and linked to it, with the queue, the message id, the attempt and the outcome "acked"."""
    broker = traced(dramatiq_pg_broker_factory, traces)

    @dramatiq.actor(broker=broker, queue_name="mail")
    def send_mail(to: str) -> None:
        pass

    with traces.tracer.start_as_current_span("request") as request:
        sent = send_mail.send("a@example.com")
    assert "traceparent" in sent.options[OPTIONS_KEY]
    with running_worker(broker):
        broker.join("mail", timeout=10_000)
        (process,) = traces.wait("process mail")
    (send,) = traces.spans("send mail")
    assert send.kind is SpanKind.PRODUCER and parent_of(send) == request.get_span_context().span_id
    assert dict(send.attributes or {}).items() >= {
        "messaging.system": "dramatiq",
        "messaging.destination.name": "mail",
        "messaging.message.id": sent.message_id,
        "messaging.operation.type": "send",
    }.items()
    assert send.context is not None and sent.options[OPTIONS_KEY]["traceparent"].split("-")[2] == (
        f"{send.context.span_id:016x}"
    )
    assert process.kind is SpanKind.CONSUMER
    assert parent_of(process) == send.context.span_id and process.context.trace_id == send.context.trace_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]
    assert dict(process.attributes or {}).items() >= {
        "messaging.system": "dramatiq",
        "messaging.destination.name": "mail",
        "messaging.message.id": sent.message_id,
        "messaging.operation.type": "process",
        "messaging.dramatiq.attempt": 1,
        "messaging.dramatiq.outcome": "acked",
    }.items()


def test_one_message_across_a_retry_and_a_stale_redelivery_is_one_send_and_three_deliveries_tied_to_it(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given a message whose attempt 1 fails (retried), whose attempt 2 stalls past its lease (fenced out
    when it finishes) and whose attempt 3 succeeds, I expect one send span and three process spans, each
    a child of the send and linked to it, with the outcomes "retried", "acked" and "stale"."""
    broker = traced(dramatiq_pg_broker_factory, traces)
    stalled, release = threading.Event(), threading.Event()
    runs: list[int] = []

    @dramatiq.actor(broker=broker, max_retries=3, min_backoff=10, max_backoff=20)
    def flaky() -> None:
        runs.append(len(runs) + 1)
        if len(runs) == 1:
            raise RuntimeError("first try fails")
        if len(runs) == 2:
            stalled.set()
            release.wait(30)

    sent = flaky.send()
    with running_worker(broker, threads=2):
        assert stalled.wait(30)
        expire_and_rescue(broker)  # attempt 2 loses its lease while it runs: attempt 3 takes the message
        wait_for(lambda: len(runs) == 3, 30, "attempt 3")
        traces.wait("process default", 2)
        release.set()  # attempt 2 ends now: its ack is fenced out
        spans = traces.wait("process default", 3)
    (send,) = traces.spans("send default")
    assert send.context is not None
    by_attempt = {s.attributes["messaging.dramatiq.attempt"]: s for s in spans if s.attributes}
    assert {a: s.attributes["messaging.dramatiq.outcome"] for a, s in by_attempt.items() if s.attributes} == {
        1: "retried",
        2: "stale",
        3: "acked",
    }
    for s in spans:
        assert s.context is not None and s.context.trace_id == send.context.trace_id
        assert parent_of(s) == send.context.span_id
        assert [link.context.span_id for link in s.links] == [send.context.span_id]
        assert s.attributes is not None and s.attributes["messaging.message.id"] == sent.message_id
    assert by_attempt[1].attributes is not None and by_attempt[1].attributes["error.type"] == "RuntimeError"
    assert [e.name for e in by_attempt[1].events if e.name == "retry"] == ["retry"]


def test_a_message_cancelled_while_it_runs_ends_its_delivery_span_as_cancelled(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given a running message an operator cancels, I expect its process span's outcome "cancelled"."""
    broker = traced(dramatiq_pg_broker_factory, traces)
    started, release = threading.Event(), threading.Event()

    @dramatiq.actor(broker=broker)
    def long_job() -> None:
        started.set()
        release.wait(30)

    sent = long_job.send()
    with running_worker(broker):
        assert started.wait(30)
        broker.cancel(sent.message_id)
        release.set()
        (process,) = traces.wait("process default")
    assert process.attributes is not None and process.attributes["messaging.dramatiq.outcome"] == "cancelled"


def test_sends_inside_a_delivery_and_its_fenced_transaction_are_children_of_its_spans(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given an actor that sends one message with its ack (``with_ack()``) and one inside its fenced
    transaction, I expect the first send span a child of the delivery's process span, a
    "fenced_transaction <queue>" span child of the process span, the second send span its child, and
    each sent message's own delivery a child of its send."""
    broker = traced(dramatiq_pg_broker_factory, traces)

    @dramatiq.actor(broker=broker, queue_name="children")
    def child(tag: str) -> None:
        pass

    @dramatiq.actor(broker=broker)
    def parent() -> None:
        with broker.with_ack():
            child.send("with_ack")
        with broker.fenced_transaction():
            child.send("fenced")

    parent.send()
    with running_worker(broker):
        broker.join("default", timeout=10_000)
        broker.join("children", timeout=10_000)
        children = traces.wait("process children", 2)
        (process,) = traces.wait("process default")
    (fenced,) = traces.spans("fenced_transaction default")
    sends = traces.spans("send children")
    assert process.context is not None and fenced.context is not None and len(sends) == 2
    assert parent_of(fenced) == process.context.span_id and fenced.kind is SpanKind.INTERNAL
    assert sorted(parent_of(s) or 0 for s in sends) == sorted([process.context.span_id, fenced.context.span_id])
    assert {parent_of(c) for c in children} == {s.context.span_id for s in sends if s.context is not None}
    assert all(c.context is not None and c.context.trace_id == process.context.trace_id for c in children)
    assert process.attributes is not None and process.attributes["messaging.dramatiq.outcome"] == "acked"


def test_a_delivery_span_may_start_a_trace_of_its_own_linked_to_the_send(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given ``child_of_send=False``, I expect the process span a root of a new trace, linked to the send."""
    broker = dramatiq_pg_broker_factory()
    broker.add_middleware(OpenTelemetry(tracer_provider=traces.provider, child_of_send=False))

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    job.send()
    with running_worker(broker):
        (process,) = traces.wait("process default")
    (send,) = traces.spans("send default")
    assert process.parent is None and send.context is not None and process.context is not None
    assert process.context.trace_id != send.context.trace_id
    assert [link.context.span_id for link in process.links] == [send.context.span_id]


def test_a_broker_without_the_middleware_writes_no_context_into_its_messages(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given a broker without the middleware, I expect no trace context in a sent message, and no span."""
    broker = dramatiq_pg_broker_factory()

    @dramatiq.actor(broker=broker)
    def job() -> None:
        pass

    with traces.tracer.start_as_current_span("request"):
        sent = job.send()
    assert OPTIONS_KEY not in sent.options
    with running_worker(broker):
        broker.join("default", timeout=10_000)
    assert [s.name for s in traces.spans()] == ["request"]


def test_a_message_that_fails_for_good_ends_its_delivery_span_as_dead_lettered(
    dramatiq_pg_broker_factory: Factory, traces: Traces
) -> None:
    """Given an actor that fails with no retries left, I expect its process span's outcome "dead_lettered",
    its exception recorded and its status an error."""
    broker = traced(dramatiq_pg_broker_factory, traces)

    @dramatiq.actor(broker=broker, max_retries=0)
    def broken() -> None:
        raise ValueError("no")

    broken.send()
    with running_worker(broker):
        (process,) = traces.wait("process default")
    assert process.attributes is not None and process.attributes["messaging.dramatiq.outcome"] == "dead_lettered"
    assert process.attributes["error.type"] == "ValueError" and not process.status.is_ok
    assert [e.name for e in process.events] == ["exception"]
