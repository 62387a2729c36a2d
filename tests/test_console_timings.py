"""The charts' wait and run times (p50, p95, p99 per queue and minute, from the history), values on hover,
labelled axes, and the queues page's sparklines; in a real headless Chromium with real workers."""

from __future__ import annotations

import math
import re
from datetime import datetime, timedelta, timezone
from typing import Any

import dramatiq
import pytest
from helpers import Factory, query, running_worker, wait_for
from test_dashboard import call, chrome  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import emulate, screenshot, serving

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app, svg
from dramatiq_pg_fenced.ops import timings
from dramatiq_pg_fenced.ops.fleet import Fleet

UTC = timezone.utc


def finished(broker: PostgresBroker, queue: str, n: int, *, minutes_ago: int, wait: float, run: float) -> None:
    """*n* history rows of *queue*, finished *minutes_ago* minutes ago (a second into that minute), the i-th
    (1..n) having waited i * *wait* and run i * *run* seconds."""
    query(broker, """
        INSERT INTO {schema}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,
                                      claimed_at, finished_at, payload)
        SELECT gen_random_uuid(), i, %(queue)s, 'a', 0, 1, f - i * (%(wait)s + %(run)s) * interval '1 s',
               f - i * %(run)s * interval '1 s', f, '\\x00'
          FROM generate_series(1, %(n)s) AS i,
               LATERAL (SELECT date_trunc('minute', now()) - %(ago)s * interval '1 minute' + interval '1 s') AS t(f)
    """, {"queue": queue, "n": n, "wait": wait, "run": run, "ago": minutes_ago})  # fmt: skip


def test_wait_and_run_percentiles_per_minute_and_over_the_span_from_the_history(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given 100 messages of queue tq finished two minutes ago, waits 0.1 .. 10 s and runs 0.01 .. 1 s, 10 of
    another queue, and 50 of tq three hours ago, I expect tq's hour to have them in one minute with the
    percentiles percentile_cont gives (p50 5.05 s, p95 9.505 s, p99 9.901 s), the other queue's apart, all
    queues' together, and the day to count the older ones too."""
    broker = dramatiq_pg_broker
    finished(broker, "tq", 100, minutes_ago=2, wait=0.1, run=0.01)
    finished(broker, "other", 10, minutes_ago=2, wait=100, run=100)
    finished(broker, "tq", 50, minutes_ago=180, wait=1, run=1)
    hour = timings.timings(broker.reader, broker.statements, queue="tq")
    assert len(hour.minutes) == len(hour.count) == len(hour.wait["p99"]) == 60 and hour.finished == 100
    (at,) = [i for i, n in enumerate(hour.count) if n]
    assert at in (57, 56)  # two minutes ago (three, if a minute began since the rows were written)
    assert hour.wait["p50"][at] == pytest.approx(5.05) and hour.wait["p95"][at] == pytest.approx(9.505)
    assert hour.wait["p99"][at] == pytest.approx(9.901) and hour.run["p50"][at] == pytest.approx(0.505)
    assert hour.overall_wait == pytest.approx({"p50": 5.05, "p95": 9.505, "p99": 9.901})
    assert hour.wait["p50"][:at] == [None] * at and hour.run["p99"][-1] is None
    everything = timings.timings(broker.reader, broker.statements)
    assert everything.finished == 110 and everything.overall_run is not None
    assert everything.overall_run["p99"] == pytest.approx(891)  # the other queue's 100 .. 1000 s on top
    day = timings.timings(broker.reader, broker.statements, queue="tq", span="day")
    assert len(day.minutes) == 1440 and day.finished == 150
    none = timings.timings(broker.reader, broker.statements, queue="empty")
    assert none.finished == 0 and none.overall_wait is None and set(none.wait["p50"]) == {None}
    with pytest.raises(ValueError, match="span"):
        timings.timings(broker.reader, broker.statements, span="week")
    with pytest.raises(ValueError, match="queue name"):
        timings.timings(broker.reader, broker.statements, queue="no spaces")


def test_a_chart_shows_each_minutes_values_on_hover_and_names_its_axes() -> None:
    """Given a chart of six minutes and one of a day, I expect a hover band per minute (of the day's: per
    12 minutes, their largest values), each titled with the time and every series' value, and axis titles."""
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    minutes = [t0 + timedelta(minutes=i) for i in range(6)]
    chart = svg.line_chart("t", minutes, [("p50", [1, 2, None, 4, 5, 0.5]), ("p99", [3, 4, None, 8, 9, 1])],
                           unit=lambda v: f"{v:g} s", y_label="seconds")  # fmt: skip
    titles = re.findall(r"<rect class=hover [^>]*><title>([^<]*)</title>", chart)
    assert len(titles) == 6
    assert titles[0] == "12:00 UTC: p50 1 s, p99 3 s" and titles[2] == "12:02 UTC: p50 none, p99 none"
    assert ">seconds</text>" in chart and ">time (UTC)</text>" in chart
    day = [t0 + timedelta(minutes=i) for i in range(1440)]
    chart = svg.line_chart("d", day, [("due", [float(i % 12) for i in range(1440)])])
    titles = re.findall(r"<rect class=hover [^>]*><title>([^<]*)</title>", chart)
    assert len(titles) == svg.HOVER_BANDS and titles[0] == "01-01 12:00–12:11 UTC: due max 11"
    spark = svg.sparkline([0, 3, 1], "finished per minute")
    assert spark.count("<polyline") == 1 and "<title>finished per minute</title>" in spark


def test_the_charts_page_and_the_queues_sparklines_with_real_workers(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    """Given messages run by a real worker (some slow), I expect the charts page to draw wait and run time
    percentiles with a value for the minute on hover, and the queues page a sparkline of the queue's hour
    linking to its charts; the same when the history is off, saying why the charts are empty."""
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(pause: float) -> None:
        import time

        time.sleep(pause)

    # (a day of samples and history rows for the screenshot; the last minutes by the real worker)
    query(broker, """
        INSERT INTO {schema}.queue_minute (queue_name, minute, due, oldest_due_seconds, done, dead, retried)
        SELECT q, date_trunc('minute', now()) - i * interval '1 minute', (20 + 15 * sin(i / 9.0))::bigint,
               1 + 4 * (1 + cos(i / 7.0)), (60 + 30 * sin(i / 5.0))::bigint, (i % 17 = 0)::int, (i % 6 = 0)::int
          FROM generate_series(3, 59) AS i, unnest(ARRAY['', 'work']) AS q""")  # fmt: skip
    for ago in range(3, 58):  # (58: inside the hour even when a minute or two begins before the page is read)
        finished(broker, "work", 20, minutes_ago=ago, wait=0.03 + 0.02 * math.sin(ago / 6), run=0.006 + 0.003 * math.cos(ago / 8))
    sent = [job.send(0.05 * (i % 4)) for i in range(12)]
    with running_worker(broker, threads=4):
        for m in sent:
            wait_for(lambda m=m: (broker.inspect(m.message_id) or {}).get("state") == "done", 30, "the acks")
    broker.flush_outcomes(10)
    with serving(dashboard_app(broker)) as url:
        d.get(url + "/charts?queue=work")
        charts_shown = d.find_elements(By.CSS_SELECTOR, "svg.chart")
        assert len(charts_shown) == 5 and all(c.size["width"] > 300 for c in charts_shown)
        text = d.find_element(By.ID, "timings").text
        assert "Of the 1,112 messages finished in the last hour" in text and "wait p50" in text, text
        assert len(d.find_elements(By.CSS_SELECTOR, "#run polyline")) == 3  # p50, p95, p99
        bands = d.find_elements(By.CSS_SELECTOR, "#run rect.hover")
        assert len(bands) == 60
        said = d.execute_script("return arguments[0].textContent", bands[-1].find_element(By.TAG_NAME, "title"))
        assert re.fullmatch(r"\d\d:\d\d UTC: p50 [\d.]+ (ms|s), p95 [\d.]+ (ms|s), p99 [\d.]+ (ms|s)", said) or (
            said.endswith("p50 none, p95 none, p99 none")  # (a minute began since the acks)
        ), said
        axes = [e.text for e in d.find_elements(By.CSS_SELECTOR, "#wait text.label")]
        assert axes == ["seconds", "time (UTC)"]
        d.set_window_size(1400, 1250)
        for dark in (False, True):
            emulate(d, dark=dark)
            d.get(url + "/charts?queue=work")
            screenshot(d, f"dashboard-charts{'-dark' if dark else ''}.png")
        emulate(d, dark=True, width=390)
        d.get(url + "/charts?queue=work")
        assert d.execute_script("return document.documentElement.scrollWidth") <= 390
        screenshot(d, "dashboard-charts-phone-dark.png")
        emulate(d, dark=False)
        d.set_window_size(1400, 900)
        d.get(url + "/")
        spark = d.find_element(By.CSS_SELECTOR, "table.queues svg.spark")
        title = d.execute_script("return arguments[0].querySelector('title').textContent", spark)
        assert title.startswith("finished per minute, last hour: ") and "1,112" not in title  # the tallies'
        link = spark.find_element(By.XPATH, "./..").get_attribute("href")
        assert link.endswith("/charts?queue=work")
        assert spark.size["width"] == 120


def test_without_history_the_charts_say_why_and_several_databases_show_the_slowest(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    """Given one database keeping no history and another with finished messages, I expect the first's charts
    to say the history is off, and the two together to show the slower database's percentiles."""
    off = dramatiq_pg_broker_factory(keep_finished=0)
    page = call(dashboard_app(off), "/charts")[2]
    assert "keep_finished=0" in page
    one, two = dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()
    finished(one, "q", 10, minutes_ago=2, wait=1, run=1)
    finished(two, "q", 10, minutes_ago=2, wait=10, run=10)
    fleet = Fleet.of_brokers({"one": one, "two": two})
    page = call(dashboard_app(fleet), "/charts")[2]
    assert "Of the 20 messages finished in the last hour" in page and "(the slowest database's, per minute)" in page
    assert "wait p50 55.0 s" in page  # two's: 10 .. 100 s
