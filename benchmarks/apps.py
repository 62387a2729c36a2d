"""The benchmark's actor module, loaded by real ``dramatiq`` worker processes.

The same two actors run on every broker; which broker is chosen by
environment variables, so one module serves ``dramatiq benchmarks.apps``
for Redis, RabbitMQ and PostgreSQL alike:

``BENCH_BROKER``      ``postgres`` | ``redis`` | ``redis-aof`` | ``rabbitmq`` | ``rabbitmq-confirms``
``BENCH_REDIS_URL``   the Redis server (``redis-aof``: the benchmark's own, ``appendfsync always``)
``BENCH_PG_URL``      DSN of the PostgreSQL server (127.0.0.1 only)
``BENCH_PG_SCHEMA``   schema of this run
``BENCH_PG_OPTIONS``  JSON of extra ``PostgresBroker`` keyword arguments
``BENCH_LATENCY_FILE`` where ``stamp`` appends ``sent received`` lines
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import dramatiq
from dramatiq.broker import Broker

QUEUE = "bench"
REDIS_URL = "redis://127.0.0.1:6379/0"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
PG_URL = "postgresql://postgres@127.0.0.1:5432/test"
REDIS_NAMESPACE = "dramatiq-bench"


def pg_url(url: str, application_name: str) -> str:
    """*url* with ``application_name`` set, so pg_stat_activity tells processes apart."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query["application_name"] = application_name
    return urlunsplit(parts._replace(query=urlencode(query)))


def make_broker(
    kind: str,
    *,
    schema: str = "bench",
    application_name: str | None = None,
    redis_url: str | None = None,
    **options: Any,
) -> Broker:
    """A broker of *kind* with Dramatiq's default middleware."""
    if kind in ("redis", "redis-aof"):
        from dramatiq.brokers.redis import RedisBroker

        # redis-aof: the same broker on a server of the benchmark's own that fsyncs every write
        # (``appendfsync always``) before it answers: a durable send, as ours is.
        if kind == "redis-aof":
            redis_url = redis_url or os.environ["BENCH_REDIS_URL"]
        return RedisBroker(url=redis_url or REDIS_URL, namespace=REDIS_NAMESPACE)
    if kind in ("rabbitmq", "rabbitmq-confirms"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        # rabbitmq-confirms: send() returns once the server confirmed the message (publisher confirms).
        return RabbitmqBroker(url=RABBITMQ_URL, confirm_delivery=kind == "rabbitmq-confirms")
    if kind == "postgres":
        from dramatiq_pg_fenced import PostgresBroker

        url = os.environ.get("BENCH_PG_URL") or PG_URL
        name = application_name or f"bench-worker-{os.getpid()}"
        return PostgresBroker(pg_url(url, name), schema=schema, **options)
    raise ValueError(f"unknown broker {kind!r}")


def noop() -> None:
    """The measured work: nothing, so the figures are the broker's."""


_latency_fd: int | None = None


def stamp(sent: float) -> None:
    """Record when the actor started next to when the message was sent.

    One ``O_APPEND`` write per message: atomic for short lines across
    processes, and the same cheap store for every broker.
    """
    now = time.time()
    global _latency_fd
    if _latency_fd is None:
        _latency_fd = os.open(os.environ["BENCH_LATENCY_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_latency_fd, f"{sent!r} {now!r}\n".encode())


def declare(broker: Broker) -> dict[str, dramatiq.Actor]:
    """Register the benchmark's actors on *broker* (the controller and the workers share this)."""
    fns: list[Callable[..., None]] = [noop, stamp]
    return {fn.__name__: dramatiq.actor(fn, broker=broker, queue_name=QUEUE, max_retries=0) for fn in fns}  # type: ignore[call-overload]


if os.environ.get("BENCH_BROKER"):  # imported by a worker process
    broker = make_broker(
        os.environ["BENCH_BROKER"],
        schema=os.environ.get("BENCH_PG_SCHEMA", "bench"),
        **json.loads(os.environ.get("BENCH_PG_OPTIONS") or "{}"),
    )
    dramatiq.set_broker(broker)
    actors = declare(broker)
