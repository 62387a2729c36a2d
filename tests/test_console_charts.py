"""The charts' data: outcomes per minute from the tallies and the samples, depth and age sampled once a
minute by one process at a time, kept a day."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import query

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import maintenance, samples


def message(queue: str) -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue, actor_name="a", args=(), kwargs={}, options={})


def early_in_a_minute(broker: PostgresBroker) -> None:
    """Wait for the next minute if this one (by the database clock) ends within 15 s: what the test
    does and reads must fall in one minute."""
    ((second,),) = query(broker, "SELECT extract(second FROM now())::float8")
    if second > 45:
        time.sleep(60.5 - second)


def sample(broker: PostgresBroker) -> bool:
    with broker.database.connection() as conn:
        return samples.take_sample(conn, broker.statements)


def test_series_per_minute_from_the_tallies_and_the_samples_over_an_hour_and_a_day(
    dramatiq_pg_broker: PostgresBroker, dramatiq_pg_worker: dramatiq.Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = dramatiq_pg_broker
    monkeypatch.setattr(samples, "SAMPLE_EVERY", float("inf"))  # the worker's loop samples no more: the test does
    # (nor at the next minute's start, which a loop that took this minute's sample has set already)
    monkeypatch.setattr(samples, "until_next_minute", lambda now=None: float("inf"))
    monkeypatch.setattr(broker.parts.maintenance, "_next_sample", float("inf"))
    # nor purges: a purge between the shift below and the test's sample took the tallies before they were copied
    monkeypatch.setattr(maintenance, "PURGE_EVERY", float("inf"))
    query(broker, "DELETE FROM {schema}.queue_minute")  # (one it may have taken already)

    @dramatiq.actor(queue_name="ch", max_retries=1, min_backoff=1, max_backoff=1)
    def job(fail: bool) -> None:
        if fail:
            raise ValueError("no")

    # Given 3 messages done and 1 retried then dead this minute, and 2 due and 1 delayed in another queue
    for fail in (False, False, False, True):
        job.send(fail)
    broker.join("ch", timeout=30_000, fail_fast=False)
    broker.flush_outcomes(10)
    broker.declare_queue("other")
    broker.pause("other")  # (the worker would take them)
    broker.enqueue_many([message("other"), message("other")])
    broker.enqueue(message("other"), delay=600_000)
    query(broker, "UPDATE {schema}.message SET available_at = now() - interval '100 s' WHERE queue_name = 'other'"
          " AND available_at <= now()")  # fmt: skip
    # When a process takes this minute's sample (another one finds it taken)
    assert sample(broker) is True
    assert sample(broker) is False
    # Then the hour's series has 60 minutes, with its outcomes and its depth at their minutes: the tallies'
    # (one, or two if a minute began while the messages ran) and the sample's (this one, or the one
    # before if a minute began since: found by value, not as the last point)
    ((taken,),) = query(broker, "SELECT max(minute) FROM {schema}.queue_minute")
    tallied = [m for (m,) in query(broker, "SELECT DISTINCT minute FROM {schema}.throughput WHERE queue_name = 'ch'")]

    def outcomes(series: Any, minutes: list[Any]) -> tuple[int, int, int]:
        at = [series.minutes.index(m) for m in minutes]
        return tuple(sum(getattr(series, name)[i] for i in at) for name in ("finished", "failed", "retried"))  # type: ignore[return-value]

    hour = broker.series(queue="ch")
    assert len(hour.minutes) == len(hour.finished) == len(hour.due) == 60
    s = hour.minutes.index(taken)
    assert outcomes(hour, tallied) == (3, 1, 1)
    assert sum(hour.finished) == 3 and hour.due[s] == 0 and hour.due[0] is None
    other = broker.series(queue="other")
    assert other.due[s] == 2 and 99 < other.oldest_due_seconds[s] < 200 and sum(other.finished) == 0
    overall = broker.series()
    assert outcomes(overall, tallied)[:2] == (3, 1) and overall.due[s] == 2
    assert overall.oldest_due_seconds[s] == other.oldest_due_seconds[s]
    day = broker.series(span="day")
    assert len(day.minutes) == 1440 and day.minutes[-1] == hour.minutes[-1] and sum(day.finished) == 3

    # When the minute is three hours old (its tallies purged after the next sample copied them)
    query(broker, "UPDATE {schema}.throughput SET minute = minute - interval '3 hours'")
    query(broker, "UPDATE {schema}.queue_minute SET minute = minute - interval '3 hours'")
    assert sample(broker) is True  # copies the tallies' minute that is over, then they go
    broker.parts.maintenance.purge()
    assert query(broker, "SELECT count(*) FROM {schema}.throughput") == [(0,)]
    # Then the day's series still has them, at their minutes, from the samples alone
    day = broker.series(queue="ch", span="day")
    three_hours = timedelta(hours=3)
    assert outcomes(day, [m - three_hours for m in tallied]) == (3, 1, 1)
    assert sum(day.finished) == 3 and day.due[day.minutes.index(taken - three_hours)] == 0
    assert broker.series(queue="ch").finished == [0] * 60  # not in the last hour

    # And samples older than a day are purged
    query(broker, "UPDATE {schema}.queue_minute SET minute = minute - interval '1 day'")
    broker.parts.maintenance.purge()
    assert query(broker, "SELECT count(*) FROM {schema}.queue_minute") == [(0,)]


def test_one_process_samples_at_a_time(dramatiq_pg_broker: PostgresBroker, dramatiq_pg_url: str) -> None:
    broker = dramatiq_pg_broker
    early_in_a_minute(broker)
    # Given another session holds the samplers' lock (a sample being taken)
    with psycopg.connect(dramatiq_pg_url) as other:
        other.execute(broker.statements.sample_claim)
        # Then this process skips the minute without waiting
        assert sample(broker) is False
    # And takes it once the other is done
    assert sample(broker) is True


def test_a_series_of_an_unknown_span_or_a_bad_queue_name_is_refused(dramatiq_pg_broker: PostgresBroker) -> None:
    with pytest.raises(ValueError, match="span"):
        dramatiq_pg_broker.series(span="week")
    with pytest.raises(ValueError, match="queue name"):
        dramatiq_pg_broker.series(queue="no spaces")


def test_a_depth_past_its_budget_is_left_out_and_the_minutes_outcomes_are_sampled_all_the_same(
    dramatiq_pg_broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an overview that cannot end within the sample's budget (here it waits for a lock another
    session holds; under a pinned horizon its scans step over every dead entry); when the minute's
    sample is taken, I expect the minute's outcomes sampled, no depth for it (a gap, not a stale or
    partial figure), the sample counted as taken, and the rest of its transaction under the
    session's own statement timeout again."""
    broker = dramatiq_pg_broker
    monkeypatch.setattr(samples, "SAMPLE_BUDGET_MS", 200)
    early_in_a_minute(broker)
    broker.enqueue(message("bud"))
    query(broker, "DELETE FROM {schema}.queue_minute")
    query(broker, "INSERT INTO {schema}.throughput (queue_name, minute, writer, done, dead, retried)"
          " VALUES ('bud', date_trunc('minute', now()) - interval '1 minute', 'w', 7, 0, 0)")  # fmt: skip
    url = broker.database.conninfo
    with psycopg.connect(url, autocommit=True) as holder:
        holder.execute("BEGIN")
        holder.execute(f"LOCK TABLE {broker.schema}.paused_queue IN ACCESS EXCLUSIVE MODE")
        with broker.database.connection() as conn:
            conn.execute("SET statement_timeout = '31s'")
            seen: list[str] = []
            original = conn.execute

            def execute(statement: Any, *args: Any, **kwargs: Any) -> Any:
                if statement is broker.statements.overview:
                    seen.append(original("SHOW statement_timeout").fetchone()[0])
                cursor = original(statement, *args, **kwargs)
                if statement is broker.statements.sample_outcomes:
                    seen.append(original("SHOW statement_timeout").fetchone()[0])
                return cursor

            monkeypatch.setattr(conn, "execute", execute)
            assert samples.take_sample(conn, broker.statements) is True
            monkeypatch.undo()
            assert samples.take_sample(conn, broker.statements) is False  # nor tried again in that minute
            conn.execute("RESET statement_timeout")
        holder.execute("ROLLBACK")
    assert seen == ["200ms", "31s"]  # the overview under the budget, the outcomes under the session's own
    rows = query(broker, "SELECT queue_name, due, done FROM {schema}.queue_minute ORDER BY queue_name, minute")
    assert ("bud", None, 7) in rows and all(due is None for _, due, _ in rows)
    # And a sample that fits its budget is taken in full
    query(broker, "DELETE FROM {schema}.queue_minute")
    assert sample(broker) is True
    assert ("bud", 1) in query(broker, "SELECT queue_name, due FROM {schema}.queue_minute WHERE due IS NOT NULL")
