"""Counters (``..._total``) of finished, dead-lettered and retried messages: right, and never going
down when the per-minute tallies they come from are purged."""

from __future__ import annotations

import dramatiq
from helpers import query

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.ops import metrics


def scrape(broker: PostgresBroker) -> str:
    return metrics.exposition(metrics.registry(broker.database, broker.statements)).decode()


def test_finished_dead_lettered_and_retried_totals_survive_the_purge_of_their_tallies(
    dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker
) -> None:
    broker = dramatiq_pg_broker

    @dramatiq.actor(queue_name="c", max_retries=0)
    def fine() -> None:
        pass

    @dramatiq.actor(queue_name="c", max_retries=2, min_backoff=1, max_backoff=1)
    def broken() -> None:
        raise ValueError("boom")

    # Given 3 acked messages and 2 that failed three times (2 retries each, then dead)
    for _ in range(3):
        fine.send()
    broken.send()
    broken.send()
    broker.join("c", timeout=30_000, fail_fast=False)
    broker.flush_outcomes(10)
    expected = {"finished_total": 3, "dead_total": 2, "retried_total": 4}
    assert broker.outcome_totals() == {"c": expected}
    (row,) = [q for q in broker.queue_overview() if q["queue"] == "c"]
    assert {k: row[k] for k in expected} == expected
    text = scrape(broker)
    assert "# TYPE dramatiq_pg_finished_total counter" in text
    assert 'dramatiq_pg_finished_total{queue="c"} 3.0' in text
    assert 'dramatiq_pg_dead_lettered_total{queue="c"} 2.0' in text
    assert 'dramatiq_pg_retried_total{queue="c"} 4.0' in text

    # When their tallies are older than two hours and the maintenance purge runs
    query(broker, "UPDATE {schema}.throughput SET minute = minute - interval '3 hours'")
    broker.parts.maintenance.purge()
    assert query(broker, "SELECT count(*) FROM {schema}.throughput") == [(0,)]
    # Then the totals are the same, and go on from there
    assert broker.outcome_totals() == {"c": expected}
    fine.send()
    broker.join("c", timeout=30_000, fail_fast=False)
    broker.flush_outcomes(10)
    assert broker.outcome_totals() == {"c": {**expected, "finished_total": 4}}
    assert 'dramatiq_pg_finished_total{queue="c"} 4.0' in scrape(broker)
    # (and a second purge of the same, already purged, minutes adds nothing)
    broker.parts.maintenance.purge()
    assert broker.outcome_totals()["c"]["finished_total"] == 4
