"""Moving from Dramatiq's RedisBroker or RabbitmqBroker to PostgreSQL, while messages keep coming
(docs/migrating.md, "From Redis or RabbitMQ").

    pip install -e '.[embedded,migrate]'   # from a checkout: the embedded PostgreSQL, Dramatiq's redis and pika
    python examples/migrate_from_dramatiq.py redis      # REDIS_URL, else redis://127.0.0.1:6379/0
    python examples/migrate_from_dramatiq.py rabbitmq   # RABBITMQ_URL, else amqp://guest:guest@127.0.0.1:5672/

PostgreSQL: ``DATABASE_URL``, else an embedded one. The steps, as the guide gives them:

1. The old application sends on the old broker: messages ready now, and one delayed.
2. Switch: the new code sends on PostgreSQL, where new workers run them, while the old workers
   go on draining the old broker (here a worker of each, in this process).
3. Once the old queue has no ready message left, stop the old workers: they put back what they
   held (the delayed message waits in the delay queue).
4. Move what is left (:func:`move`): each message is enqueued on PostgreSQL with its id and its
   due time, then acked on the old broker.
5. Check: every message ran once, the delayed one on PostgreSQL and not before it was due.

It uses a queue, a Redis namespace and a PostgreSQL schema of its own, removed at the end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Broker
from dramatiq.common import current_millis, dq_name, q_name, xq_name
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

QUEUE = f"migrate_{uuid.uuid4().hex[:8]}"
#: message id -> [(which broker ran it, when, in ms)]
RUNS: dict[str, list[tuple[str, int]]] = {}
_lock = threading.Lock()


def declare(broker: Broker, side: str) -> dramatiq.Actor:
    """The application's actor, as each side declares it (same name, same queue)."""

    def work(n: int) -> None:
        message = dramatiq.middleware.CurrentMessage.get_current_message()
        assert message is not None
        with _lock:
            RUNS.setdefault(message.message_id, []).append((side, current_millis()))

    broker.add_middleware(dramatiq.middleware.CurrentMessage())
    return dramatiq.actor(work, broker=broker, actor_name="work", queue_name=QUEUE)


def move(old: Broker, new: PostgresBroker, queue_name: str, *, idle_ms: int = 1000) -> int:
    """Move every message left on *old* in *queue_name* (its delay queue included) to *new*.

    Each keeps its ``message_id`` and options (a delayed one its ``eta``: it is due on PostgreSQL when
    it was due on the old broker). It is acked on the old broker only once its row is committed on
    PostgreSQL; an enqueue of an id PostgreSQL already holds is a no-op, so a move stopped half-way
    can be run again. Run it with the old workers stopped. Returns the number moved.
    """
    moved = 0
    for name in (queue_name, dq_name(queue_name)):
        consumer = old.consume(name, prefetch=1, timeout=idle_ms)
        try:
            while (proxy := next(consumer)) is not None:
                new.enqueue(proxy._message.copy(queue_name=q_name(proxy.queue_name)))
                consumer.ack(proxy)
                moved += 1
        finally:
            consumer.close()
    return moved


def old_broker(kind: str) -> tuple[Broker, Any]:
    """The old broker, and how to remove what this run made on it."""
    if kind == "redis":
        from dramatiq.brokers.redis import RedisBroker

        redis = RedisBroker(url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"), namespace=QUEUE)

        def clean() -> None:
            keys = list(redis.client.scan_iter(f"{QUEUE}:*"))
            if keys:
                redis.client.delete(*keys)

        return redis, clean
    if kind == "rabbitmq":
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        rabbit = RabbitmqBroker(url=os.environ.get("RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/"))

        def clean() -> None:
            for name in (QUEUE, dq_name(QUEUE), xq_name(QUEUE)):
                rabbit.channel.queue_delete(name)

        return rabbit, clean
    raise SystemExit(f"usage: {sys.argv[0]} redis|rabbitmq")


def wait_for(what: str, done: Any, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.05)


def migrate(kind: str, url: str) -> None:
    old, clean = old_broker(kind)
    schema = f"migrate_{uuid.uuid4().hex[:8]}"
    new = PostgresBroker(url, schema=schema)
    try:
        new.migrate()
        old_work, new_work = declare(old, kind), declare(new, "postgres")

        # 1. The old application sends on the old broker.
        before = [old_work.send(n).message_id for n in range(5)]
        delayed = old_work.send_with_options(args=(99,), delay=3000)
        print(f"1. sent on {kind}: {len(before)} ready, 1 delayed by 3 s")

        # 2. Switch: new sends go to PostgreSQL; old and new workers run side by side.
        old_worker, new_worker = dramatiq.Worker(old, worker_threads=2), dramatiq.Worker(new, worker_threads=2)
        old_worker.start()
        new_worker.start()
        after = [new_work.send(n).message_id for n in range(5, 10)]
        print(f"2. switched: {len(after)} sent on PostgreSQL; both workers run")

        # 3. The old queue drained of its ready messages: stop the old workers.
        wait_for("the old ready messages", lambda: all(m in RUNS for m in before))
        old_worker.stop()
        print(f"3. the old workers ran {len(before)} and stopped (the delayed one put back)")

        # 4. Move what is left, delayed messages included.
        moved = move(old, new, QUEUE)
        print(f"4. moved {moved} message(s) to PostgreSQL, ids and due times kept")
        assert moved == 1, moved

        # 5. Everything ran once; the delayed one on PostgreSQL, when it was due.
        new.join(QUEUE, timeout=60_000)
        new_worker.stop()
        ran = {m: [side for side, _ in RUNS.get(m, [])] for m in [*before, *after, delayed.message_id]}
        assert all(len(sides) == 1 for sides in ran.values()), ran
        assert all(ran[m] == [kind] for m in before) and all(ran[m] == ["postgres"] for m in after), ran
        assert ran[delayed.message_id] == ["postgres"], ran
        eta = delayed.options["eta"]
        ran_at = RUNS[delayed.message_id][0][1]
        assert ran_at >= eta - 50, (ran_at, eta)  # this machine's clock and the database's, a few ms apart
        print(f"5. every message ran once: {len(before)} on {kind}, {len(after) + 1} on PostgreSQL "
              "(the delayed one when it was due)")  # fmt: skip
    finally:
        clean()
        old.close()
        new.close()
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) == 2 else ""
    if kind not in ("redis", "rabbitmq"):
        raise SystemExit(f"usage: {sys.argv[0]} redis|rabbitmq")
    url, stop_server = os.environ.get("DATABASE_URL"), None
    if not url:
        from dramatiq_pg_fenced.embedded import start_embedded

        url, stop_server = start_embedded()
    try:
        migrate(kind, url)
    finally:
        if stop_server is not None:
            stop_server()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
