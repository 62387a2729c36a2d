"""Where an idle message's latency goes, step by step: the send, then the delivery.

    python -m benchmarks.latency_steps [--url URL] [--messages 300] [--rate 50]

A producer process sends paced messages (``--rate`` a second, as the idle-latency
test of ``benchmarks/run.py`` does) to a worker of 8 threads in this process;
both are timed at the broker's steps, with wall-clock marks (one machine):

the send      Dramatiq's ``actor.send()`` until it calls the broker; the broker until
              it builds the row; building it (checks, encoding); taking a pooled
              connection (and its checkout check); the statement (its round trip and
              durable commit, the NOTIFY's included); the rest (giving the connection
              back, Dramatiq's ``after_enqueue``).
the delivery  from ``send()`` called to the ring heard by the listener thread; to the
              consumer thread's claim beginning (woken, its checks); a pooled connection
              taken (and its checkout check); to the claim's call; the claim's round
              trip; the rows made messages and handed to Dramatiq; Dramatiq's hand-off
              to a worker thread and its middleware, to the actor's first line.

The marks wrap the broker's methods here, so each step carries a few microseconds of
the wrapping.  Paced sends find the machine cold (the CPU's caches, the threads asleep):
a step costs several times what it costs in a loop, for this broker as for the floor
``benchmarks/run.py`` measures in the same way (its paced INSERT, NOTIFY-woken claim and
hand-off).  Compare steps with each other and with that floor, run by run.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
from psycopg import sql

from benchmarks import apps

Marks = dict[str, list[float]]


def wrap(owner: Any, name: str, marks: Marks, label: str, *, returned: bool = True) -> None:
    """Record the wall time at each call of *owner.name* (``label>``) and at its return (``label<``)."""
    real = getattr(owner, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        marks[label + ">"].append(time.time())
        try:
            return real(*args, **kwargs)
        finally:
            if returned:
                marks[label + "<"].append(time.time())

    setattr(owner, name, timed)


def produce(url: str, schema: str, messages: int, rate: float, out: str) -> None:
    """The producer: paced sends, each with its marks."""
    from dramatiq_pg_fenced import PostgresBroker

    broker = PostgresBroker(apps.pg_url(url, "latency-steps-producer"), schema=schema)
    dramatiq.set_broker(broker)
    stamp = dramatiq.actor(lambda sent: None, actor_name="stamp", queue_name=apps.QUEUE)
    marks: Marks = collections.defaultdict(list)
    wrap(type(broker), "enqueue", marks, "enqueue")
    wrap(broker.enqueuer, "row", marks, "row")
    wrap(broker.enqueuer, "write", marks, "write")
    wrap(psycopg.Connection, "execute", marks, "statement")
    stamp.send(0.0)  # the pool's first connection, outside the figures
    sends = []
    start = time.monotonic()
    for i in range(messages):
        pause = start + (i + 1) / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        for values in marks.values():
            values.clear()
        sent = time.time()
        stamp.send(sent)
        # The last mark of each: the send's statement is the last execute (a checkout's check may come first).
        sends.append({"sent": sent, "returned": time.time(), **{k: v[-1] for k, v in marks.items() if v}})
    broker.close()
    Path(out).write_text(json.dumps(sends))


SEND_STEPS = [
    ("Dramatiq's send() until the broker's enqueue", "sent", "enqueue>"),
    ("enqueue until the row is built", "enqueue>", "row>"),
    ("the row (checks, encoding)", "row>", "row<"),
    ("a pooled connection and its checkout check", "row<", "write>"),
    ("the statement: round trip, durable commit, NOTIFY", "statement>", "statement<"),
    ("the connection back, after_enqueue", "statement<", "returned"),
]
DELIVERY_STEPS = [
    ("send() called until the listener hears the ring", "sent", "ring"),
    ("the ring until the consumer thread begins its claim", "ring", "take>"),
    ("to a pooled connection (taken, checked)", "take>", "getconn<"),
    ("from the connection to the claim's call", "getconn<", "claim>"),
    ("the claim: its parameters, round trip and rows", "claim>", "claim<"),
    ("rows to messages, handed to Dramatiq", "claim<", "next"),
    ("Dramatiq's hand-off and middleware, to the actor", "next", "actor"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("DRAMATIQ_PG_TEST_URL") or apps.PG_URL)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--produce", nargs=2, metavar=("SCHEMA", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.produce:
        produce(args.url, args.produce[0], args.messages, args.rate, args.produce[1])
        return 0

    from dramatiq_pg_fenced import PostgresBroker
    from dramatiq_pg_fenced.core import consumer as consumer_module
    from dramatiq_pg_fenced.db import doorbell as doorbell_module
    from dramatiq_pg_fenced.db import reconnect as reconnect_module

    schema = f"bench_steps_{uuid.uuid4().hex[:8]}"
    broker = PostgresBroker(apps.pg_url(args.url, "latency-steps-worker"), schema=schema)
    broker.migrate()
    dramatiq.set_broker(broker)
    started: dict[float, float] = {}

    def stamp(sent: float) -> None:
        started[sent] = time.time()

    dramatiq.actor(stamp, actor_name="stamp", queue_name=apps.QUEUE)
    marks: Marks = collections.defaultdict(list)
    wrap(doorbell_module.Doorbell, "ring", marks, "ring", returned=False)
    wrap(consumer_module.PostgresConsumer, "_claim", marks, "take", returned=False)
    wrap(reconnect_module.PacedPool, "getconn", marks, "getconn")
    wrap(consumer_module.PostgresConsumer, "_claim_rows", marks, "claim")
    real_next = consumer_module.PostgresConsumer.__next__

    def next_message(self: consumer_module.PostgresConsumer) -> Any:
        message = real_next(self)
        if message is not None:
            marks["next"].append(time.time())
        return message

    consumer_module.PostgresConsumer.__next__ = next_message  # type: ignore[method-assign]
    worker = dramatiq.Worker(broker, worker_threads=8)
    worker.start()
    try:
        time.sleep(2.0)  # idle: the listener and the consumer wait
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "sends.json")
            subprocess.run(
                [sys.executable, "-m", "benchmarks.latency_steps", "--url", args.url, "--messages",
                 str(args.messages), "--rate", str(args.rate), "--produce", schema, out],
                check=True, cwd=Path(__file__).resolve().parent.parent,
            )  # fmt: skip
            sends = json.loads(Path(out).read_text())
        deadline = time.monotonic() + 30
        while len(started) < len(sends) + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
        broker.close()
        with psycopg.connect(args.url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    report(sends, started, marks)
    return 0


def report(sends: list[dict[str, float]], started: dict[float, float], marks: Marks) -> None:
    """Each step's p50, p90 and p99 in microseconds, and the steps of the slowest deliveries (where the
    tail goes); the delivery's steps matched to each send by time."""
    for values in marks.values():
        values.sort()

    def first_after(label: str, t: float | None) -> float | None:
        values = marks[label]
        i = bisect.bisect_left(values, t) if t is not None else len(values)
        return values[i] if i < len(values) else None

    send_steps: dict[str, list[float]] = collections.defaultdict(list)
    delivery_steps: dict[str, list[float]] = collections.defaultdict(list)
    unmatched = 0
    for send in sends:
        for title, a, b in SEND_STEPS:
            if a in send and b in send:
                send_steps[title].append((send[b] - send[a]) * 1e6)
        send_steps["send() in all"].append((send["returned"] - send["sent"]) * 1e6)
        point: dict[str, float | None] = {"sent": send["sent"]}
        point["ring"] = first_after("ring>", point["sent"])
        point["take>"] = first_after("take>", point["ring"])
        point["getconn<"] = first_after("getconn<", point["take>"])
        point["claim>"] = first_after("claim>", point["getconn<"])
        point["claim<"] = first_after("claim<", point["claim>"])
        point["next"] = first_after("next", point["claim<"])
        point["actor"] = started.get(send["sent"])
        times = [point[k] for k in ("sent", "ring", "take>", "getconn<", "claim>", "claim<", "next", "actor")]
        if any(t is None for t in times) or times != sorted(times):  # type: ignore[type-var]
            unmatched += 1  # a claim of another moment (an idle poll, a look back) came between
            continue
        for title, a, b in DELIVERY_STEPS:
            delivery_steps[title].append((point[b] - point[a]) * 1e6)  # type: ignore[operator]
        delivery_steps["send() called until the actor starts"].append((point["actor"] - point["sent"]) * 1e6)  # type: ignore[operator]

    def table(title: str, steps: dict[str, list[float]]) -> None:
        print(f"\n| {title} | p50 us | p90 us | p99 us | n |\n|---|---|---|---|---|")
        for name, values in steps.items():
            values = sorted(values)
            n = len(values)
            print(f"| {name} | {values[n // 2]:.0f} | {values[int(n * 0.9)]:.0f} | {values[int(n * 0.99)]:.0f} | {n} |")

    def slowest(title: str, steps: dict[str, list[float]], total: str) -> None:
        """The tail: each step of the slowest 1% (at least 3) by *total*, slowest first (where p99 goes)."""
        n = len(steps[total])
        worst = sorted(range(n), key=lambda i: steps[total][i], reverse=True)[: max(3, n // 100)]
        print(
            f"\n| {title}: the slowest {len(worst)}, us | " + " | ".join(f"#{k + 1}" for k in range(len(worst))) + " |"
        )
        print("|---|" + "---|" * len(worst))
        for name, values in steps.items():
            print(f"| {name} | " + " | ".join(f"{values[i]:.0f}" for i in worst) + " |")

    table("the send", send_steps)
    table("the delivery", delivery_steps)
    slowest("the delivery", delivery_steps, "send() called until the actor starts")
    print(f"\n{len(sends)} sends; {unmatched} not matched to one ring and one claim (left out of the delivery's steps)")


if __name__ == "__main__":
    sys.exit(main())
