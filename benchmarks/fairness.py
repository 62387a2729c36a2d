"""Fair shares between keys (issue 44), measured at the claim: the broker's own claim statements.

    python -m benchmarks.fairness [--flood 20000] [--keys 10000] [--batch 16]

Not a test: figures to read, from one run on one machine (compare ratios, not times).  Each part
enqueues through the broker (fair queue: an actor with ``fairness_key``; plain queue: the same
actor without it), then drains the queue as one consumer would, claim after claim of ``--batch``
rows through ``PostgresConsumer._claim_rows`` (the statement a worker runs), each claimed row acked
by a DELETE as the outcome writer does, the claim and the ack timed together.

1. flood: key A enqueues ``--flood`` messages at once, then keys B..E ``--late`` each.  The wait of
   B..E is counted in claims: how many claims go by before each of their messages is claimed (p99),
   fair queue vs the same messages on an idle queue (B..E alone) and on a plain queue.
2. throughput: seconds per message to drain ``--flood`` messages of one key, fair vs plain (the
   whole drain, claims and acks).
3. weights 3:1: two busy keys, shares over each window of 10 claims.
4. many keys: ``--keys`` distinct keys with 3 messages each, drained: seconds per message, fair vs
   plain (the same messages without keys).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Callable

import dramatiq
from psycopg import sql

from benchmarks import apps
from dramatiq_pg_fenced import PostgresBroker

FAIR, PLAIN = "fair", "plain"


def _broker(url: str) -> PostgresBroker:
    broker = PostgresBroker(url, schema=f"bench_{uuid.uuid4().hex[:8]}", durable_outcomes=False)
    broker.migrate()
    dramatiq.set_broker(broker)
    return broker


def _send(actor: dramatiq.Actor, tenants: list[tuple[str, int]]) -> None:
    with actor.broker.batch():
        for tenant, count in tenants:
            for n in range(count):
                actor.send(tenant, n)


def _drain(
    broker: PostgresBroker, queue: str, batch: int, on_claim: Callable[[list[str]], None] | None = None
) -> tuple[int, float]:
    """Claim and ack until empty; (messages, seconds)."""
    consumer = broker.consume(queue, prefetch=batch)
    table = sql.SQL("DELETE FROM {}.message WHERE message_id = ANY(%s::uuid[])").format(sql.Identifier(broker.schema))
    done, t0 = 0, time.perf_counter()
    with broker.database.connection(raw=True) as conn:
        while True:
            ids = [r[0] for r in consumer._claim_rows(conn, batch)]
            if not ids:
                break
            conn.execute(table, [ids])
            done += len(ids)
            if on_claim is not None:
                on_claim(ids)
    return done, time.perf_counter() - t0


def _keys(broker: PostgresBroker, queue: str) -> dict[str, str]:
    with broker.database.connection() as conn:
        return dict(
            conn.execute(
                sql.SQL(
                    "SELECT message_id::text, args FROM (SELECT message_id, convert_from(payload, 'UTF8')::json->'args'->>0 AS args FROM {}.message WHERE queue_name = %s) AS s"
                ).format(sql.Identifier(broker.schema)),
                [queue],
            ).fetchall()
        )


def _claims_waited(broker: PostgresBroker, queue: str, batch: int, late: set[str]) -> list[int]:
    key_of = _keys(broker, queue)
    waits: list[int] = []
    claims = 0

    def seen(ids: list[str]) -> None:
        nonlocal claims
        claims += 1
        waits.extend(claims for i in ids if key_of.get(i) in late)

    _drain(broker, queue, batch, seen)
    return waits


def _p99(values: list[int]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else float(values[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=20_000)
    parser.add_argument("--late", type=int, default=20)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args(argv)
    url = os.environ.get("BENCH_PG_URL") or apps.PG_URL
    broker = _broker(url)

    @dramatiq.actor(queue_name=FAIR, fairness_key=lambda tenant, n=0: tenant)
    def fair(tenant: str, n: int = 0) -> None:
        pass

    @dramatiq.actor(queue_name=PLAIN)
    def plain(tenant: str, n: int = 0) -> None:
        pass

    @dramatiq.actor(
        queue_name=FAIR,
        actor_name="weighted",
        fairness_key=lambda tenant, n=0: tenant,
        fairness_weight=lambda key: 3 if key == "heavy" else 1,
    )
    def weighted(tenant: str, n: int = 0) -> None:
        pass

    late = [(k, args.late) for k in "BCDE"]
    try:
        print(f"claims of {args.batch} rows, durable_outcomes=False")
        # 1. flood
        _send(fair, late)
        idle = _claims_waited(broker, FAIR, args.batch, set("BCDE"))
        _send(fair, [("A", args.flood)])
        _send(fair, late)
        flooded = _claims_waited(broker, FAIR, args.batch, set("BCDE"))
        _send(plain, [("A", args.flood)])
        _send(plain, late)
        unfair = _claims_waited(broker, PLAIN, args.batch, set("BCDE"))
        print(
            f"flood: p99 wait of B..E in claims: idle queue {_p99(idle):.0f}, fair under A's flood "
            f"{_p99(flooded):.0f}, plain under the flood {_p99(unfair):.0f}"
        )
        # 2. throughput, one key
        rates = {}
        for name, actor, queue in (("plain", plain, PLAIN), ("fair", fair, FAIR)):
            _send(actor, [("A", args.flood)])
            n, secs = _drain(broker, queue, args.batch)
            rates[name] = secs / n * 1e6
        print(
            f"drain of {args.flood} one-key messages: plain {rates['plain']:.1f} µs/msg, fair {rates['fair']:.1f} "
            f"µs/msg: fair keeps {rates['plain'] / rates['fair']:.0%} of plain's throughput"
        )
        # 3. weights 3:1
        _send(weighted, [("heavy", 3000), ("light", 3000)])
        windows: list[Counter[str]] = []
        key_of = _keys(broker, FAIR)

        def count(ids: list[str]) -> None:
            if not windows or sum(windows[-1].values()) >= 10 * args.batch:
                windows.append(Counter())
            windows[-1].update(key_of[i] for i in ids)

        _drain(broker, FAIR, args.batch, count)
        both = [w for w in windows if w["light"] and w["heavy"] and sum(w.values()) == 10 * args.batch]
        ratios = [w["heavy"] / w["light"] for w in both]
        print(
            f"weights 3:1: {len(both)} windows of 10 claims with both busy, heavy:light from "
            f"{min(ratios):.2f} to {max(ratios):.2f}"
        )
        # 4. many keys
        costs = {}
        for name, actor, queue in (("plain", plain, PLAIN), ("fair", fair, FAIR)):
            _send(actor, [(f"k{i}", 3) for i in range(args.keys)])
            n, secs = _drain(broker, queue, args.batch)
            costs[name] = secs / n * 1e6
        print(
            f"{args.keys} keys x 3 messages: plain {costs['plain']:.1f} µs/msg, fair {costs['fair']:.1f} µs/msg: "
            f"{costs['fair'] / costs['plain']:.2f}x"
        )
    finally:
        broker.close()
        with broker.database.connection() as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(broker.schema)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
