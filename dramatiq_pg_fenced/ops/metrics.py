"""Prometheus metrics from the database side, with the official ``prometheus_client``.

Dramatiq's own ``Prometheus`` middleware counts what each worker process does
(messages processed, errors, durations).  These are the queue's side, read
from the tables on each scrape, whoever runs the workers: the same figures in
every scrape of every replica, so scrape one of them.

=====================================  =======  ==========================================
name                                   type     meaning (labels)
=====================================  =======  ==========================================
``dramatiq_pg_up``                     gauge    1 if the database answered this scrape
``dramatiq_pg_messages``               gauge    messages by ``queue`` and ``state``: queued,
                                                running (its actor started), prefetched
                                                (claimed, waiting in a worker's prefetch),
                                                dead, cancelled
``dramatiq_pg_delayed_messages``       gauge    queued messages due later (``queue``;
                                                counted in ``state="queued"`` too)
``dramatiq_pg_oldest_due_age_seconds`` gauge    how long the oldest due message has waited
                                                (``queue``; 0 when none is due)
``dramatiq_pg_expired_leases``         gauge    running messages whose lease has expired
                                                and which the next rescue puts back (``queue``)
``dramatiq_pg_queue_paused``           gauge    1 while the ``queue`` is paused
``dramatiq_pg_done_last_minute``       gauge    messages acked in the last 60 s (``queue``)
``dramatiq_pg_done_last_hour``         gauge    messages acked in the last hour (``queue``)
``dramatiq_pg_dead_last_hour``         gauge    messages dead-lettered in the last hour (``queue``)
``dramatiq_pg_finished_total``         counter  messages acked (``queue``), ever
``dramatiq_pg_dead_lettered_total``    counter  messages dead-lettered by a nack (``queue``)
``dramatiq_pg_retried_total``          counter  retries written (``queue``)
``dramatiq_pg_redeliveries_total``     counter  expired leases put back for redelivery
``dramatiq_pg_stale_writes_total``     counter  fenced-out writes of stale deliveries (``queue``;
                                                ``""``: queue not known or not listed)
``dramatiq_pg_relay_conflicts_total``  counter  messages relayed here from another database
                                                (routing.py) and refused: id or unique key taken
``dramatiq_pg_fair_keys``              gauge    fairness keys with messages due (``queue``)
``dramatiq_pg_fair_key_due``           gauge    due messages of a key (``queue``, ``key``), for
                                                the top ``fair_top`` keys of each queue only
``dramatiq_pg_fair_key_oldest_wait_``  gauge    how long the key's oldest due message has
``seconds``                                     waited (``queue``, ``key``; the same keys)
=====================================  =======  ==========================================

Counts are exact (each scrape reads the claim index of every queue); the
"last minute / hour" figures come from per-minute tallies the ack, nack and
retry statements keep (see ``db/queries/``), history kept or not, and so do the
``_total`` counters: the tallies of two hours and more ago are folded into
``outcome_total`` as they are purged, so the counters never go down
(``rate()`` over any window works).  A queue appears in them once it has had
an outcome.

The fairness keys' figures (docs/fairness.md) appear for a queue while it has
messages due with a fairness key, and name its top ``fair_top`` keys by due
messages (:data:`.admin.FAIR_TOP`, 10; ``registry(..., fair_top=N)``): the
``key`` label stays bounded however many tenants a queue serves; the keys
beyond them count in ``dramatiq_pg_fair_keys`` only.  The keyless messages of
a fair queue are the key ``""``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..db.database import Database
from ..db.statements import Statements
from . import admin

try:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
    from prometheus_client.registry import Collector
except ImportError as e:  # pragma: no cover - the 'prometheus' extra
    raise ImportError(
        "dramatiq_pg_fenced.metrics needs prometheus_client: pip install 'dramatiq-pg-fenced[prometheus]'"
    ) from e

#: Content type of the text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
#: The states of ``dramatiq_pg_messages``: a message's, as everywhere (``delayed`` is a part of ``queued``).
STATES = ("queued", "running", "prefetched", "dead", "cancelled")

logger = logging.getLogger(__name__)


class QueueCollector(Collector):
    """Reads the queues' figures from the database on every ``collect()``."""

    def __init__(self, database: Database, statements: Statements, *, fair_top: int = admin.FAIR_TOP) -> None:
        self.database = database
        self.statements = statements
        self.fair_top = fair_top

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("dramatiq_pg_up", "1 if the database answered this scrape")
        try:
            queues = admin.overview(self.database, self.statements, fair_top=self.fair_top)
            counters = admin.counters(self.database, self.statements)
            totals = admin.outcome_totals(self.database, self.statements)
        except Exception as e:  # a scrape must still answer: up 0 says why there is nothing else
            logger.warning("Metrics: cannot read the queues: %s", e)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families(queues, counters, totals)


def families(
    queues: list[dict[str, Any]], counters: dict[str, int], totals: dict[str, dict[str, int]] | None = None
) -> Iterator[Metric]:
    """The metric families for an :func:`.admin.overview`, the counters and the
    :func:`.admin.outcome_totals` (pure: no database)."""
    messages = GaugeMetricFamily("dramatiq_pg_messages", "Messages by queue and state", labels=["queue", "state"])
    delayed = GaugeMetricFamily(
        "dramatiq_pg_delayed_messages", "Queued messages due later (counted in state=queued too)", labels=["queue"]
    )
    oldest = GaugeMetricFamily("dramatiq_pg_oldest_due_age_seconds", "Age of the oldest due message", labels=["queue"])
    expired = GaugeMetricFamily(
        "dramatiq_pg_expired_leases", "Running messages with an expired lease", labels=["queue"]
    )
    paused = GaugeMetricFamily("dramatiq_pg_queue_paused", "1 while the queue is paused", labels=["queue"])
    done_1m = GaugeMetricFamily("dramatiq_pg_done_last_minute", "Messages acked in the last 60 s", labels=["queue"])
    done_1h = GaugeMetricFamily("dramatiq_pg_done_last_hour", "Messages acked in the last hour", labels=["queue"])
    dead_1h = GaugeMetricFamily(
        "dramatiq_pg_dead_last_hour", "Messages dead-lettered in the last hour", labels=["queue"]
    )
    for q in queues:
        name = q["queue"]
        for state in STATES:
            messages.add_metric([name, state], q[state])
        delayed.add_metric([name], q["delayed"])
        oldest.add_metric([name], q["oldest_due_seconds"] or 0.0)
        expired.add_metric([name], q["expired_leases"])
        paused.add_metric([name], 1 if q["paused_since"] is not None else 0)
        done_1m.add_metric([name], q["done_last_minute"])
        done_1h.add_metric([name], q["done_last_hour"])
        dead_1h.add_metric([name], q["dead_last_hour"])
    yield from (messages, delayed, oldest, expired, paused, done_1m, done_1h, dead_1h)
    redeliveries = CounterMetricFamily("dramatiq_pg_redeliveries", "Expired leases put back for redelivery")
    redeliveries.add_metric([], counters.get("redeliveries", 0))
    stale = CounterMetricFamily("dramatiq_pg_stale_writes", "Fenced-out writes of stale deliveries", labels=["queue"])
    known = 0
    for q in queues:
        stale.add_metric([q["queue"]], q["stale_writes"])
        known += q["stale_writes"]
    # Writes whose queue was not known (result writes) or whose queue has no rows left.
    stale.add_metric([""], max(counters.get("stale_writes", 0) - known, 0))
    # Messages a relay of a RoutedBroker moved here that this database refused (routing.py).
    conflicts = CounterMetricFamily(
        "dramatiq_pg_relay_conflicts", "Relayed messages not inserted: their id or unique key was taken"
    )
    conflicts.add_metric([], counters.get("relay_conflicts", 0))
    yield from (redeliveries, stale, conflicts)
    ever = (
        ("finished_total", CounterMetricFamily("dramatiq_pg_finished", "Messages acked", labels=["queue"])),
        ("dead_total", CounterMetricFamily("dramatiq_pg_dead_lettered", "Messages dead-lettered", labels=["queue"])),
        ("retried_total", CounterMetricFamily("dramatiq_pg_retried", "Retries written", labels=["queue"])),
    )
    for key, family in ever:
        for name, figures in sorted((totals or {}).items()):
            family.add_metric([name], figures[key])
        yield family
    yield from fair_families(queues)


def fair_families(queues: list[dict[str, Any]]) -> Iterator[Metric]:
    """The fairness keys' families: of each queue with keyed messages due (its ``fair_keys``, see
    :func:`.admin.overview`), the number of keys, and the due messages and oldest wait of its top keys
    only (the overview read no more: the ``key`` label's values stay bounded)."""
    keys = GaugeMetricFamily("dramatiq_pg_fair_keys", "Fairness keys with messages due", labels=["queue"])
    due = GaugeMetricFamily(
        "dramatiq_pg_fair_key_due",
        "Due messages of a fairness key (the top keys of each queue)",
        labels=["queue", "key"],
    )
    wait = GaugeMetricFamily(
        "dramatiq_pg_fair_key_oldest_wait_seconds",
        "How long the oldest due message of a fairness key has waited (the top keys of each queue)",
        labels=["queue", "key"],
    )
    for q in queues:
        fair = q.get("fair_keys")
        if not fair:
            continue
        keys.add_metric([q["queue"]], fair["keys"])
        for k in fair["top"]:
            due.add_metric([q["queue"], k["key"]], k["due"])
            wait.add_metric([q["queue"], k["key"]], k["oldest_wait_seconds"])
    yield from (keys, due, wait)


def registry(database: Database, statements: Statements, *, fair_top: int = admin.FAIR_TOP) -> CollectorRegistry:
    """A registry holding only the queue collector (not this process's own metrics); *fair_top*: the
    fairness keys named per queue (see the table above)."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(QueueCollector(database, statements, fair_top=fair_top))
    return reg


def exposition(reg: CollectorRegistry) -> bytes:
    """The text exposition of *reg*, as ``/metrics`` serves it."""
    return generate_latest(reg)


class DatabasesCollector:
    """The :class:`~.metrics.QueueCollector` of each database, one family per metric, every sample
    labelled with its ``database`` (a database that does not answer says so in ``dramatiq_pg_up``).
    *router*: a :class:`~.routing.RoutedBroker`, or anything whose ``shards`` have a ``reader`` and ``statements``
    (a :class:`~.fleet.Fleet`: the CLI's ``--url NAME=URL``, repeated)."""

    def __init__(self, router: Any) -> None:
        self.collectors = {name: QueueCollector(shard.reader, shard.statements) for name, shard in router.shards.items()}

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for name, collector in self.collectors.items():
            for family in collector.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                for sample in family.samples:
                    merged.add_sample(sample.name, {**sample.labels, "database": name}, sample.value)
        yield from families.values()


def databases_registry(owner: Any) -> Any:
    """A registry of :class:`DatabasesCollector` over *owner*'s ``shards`` (a
    :class:`~.routing.RoutedBroker` or a :class:`~.fleet.Fleet`): every sample labelled with its
    ``database``; serve it with :func:`exposition`."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(DatabasesCollector(owner))
    return reg
