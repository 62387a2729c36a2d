"""The console as people use it (issue 42): a search by a value as typed, a message's whole story, and
running told from prefetched; in a real headless Chromium where a browser decides.

``DASHBOARD_SCREENSHOTS=DIR`` keeps the screenshots taken on the way (docs/ has them)."""

from __future__ import annotations

import json
import re
from datetime import datetime, timedelta, timezone
from typing import Any

from test_dashboard import chrome, some_messages  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import enqueue, screenshot, serving, wait

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app


def test_a_value_typed_in_the_search_finds_the_messages_whose_arguments_hold_it(
    dramatiq_pg_broker: PostgresBroker, chrome: Any  # noqa: F811
) -> None:
    """Given messages sent with an address and a number, I expect typing the address, or the number, in
    "arguments hold" to find the message that holds it (a keyword's value or a positional argument), and
    a JSON list to keep its containment meaning."""
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    m = some_messages(broker)

    def search(text: str) -> list[str]:
        d.get(url + "/search")
        d.find_element(By.ID, "s-args").send_keys(text)
        d.find_element(By.ID, "search").click()
        wait(d, lambda: "args=" in d.current_url and bool(d.find_elements(By.CSS_SELECTOR, "table.found, #empty")))
        return [a.text for a in d.find_elements(By.CSS_SELECTOR, "table.found a.mid")]

    with serving(dashboard_app(broker, live=0)) as url:  # (no live update between a find and a read)
        assert search("bob@example.com") == [m["dead"].message_id]
        assert search("7") == [m["report"].message_id]
        assert search("[7]") == [m["report"].message_id]
        assert search("nobody@example.com") == []
        assert not d.find_elements(By.ID, "search-error")
        search("bob@example.com")
        screenshot(d, "dashboard-search-value.png")


def test_a_running_message_shows_its_run_time_and_a_prefetched_one_says_it_waits(
    dramatiq_pg_broker: PostgresBroker, chrome: Any  # noqa: F811
) -> None:
    """Given two messages claimed by a worker process whose heartbeat says the actor of one started 30 s
    ago and the other waits in its prefetch, I expect the running list and each message's page to say
    "running, 30 s so far" for the one and "prefetched" for the other, as the queues page counts them."""
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    broker.declare_queue("emails")
    for _ in range(2):
        enqueue(broker)
    consumer = broker.consume("emails", prefetch=2, timeout=1000)
    try:
        first, second = next(consumer), next(consumer)
        assert first is not None and second is not None
        row = {"id": "web-1:4242:abc", "host": "web-1", "pid": 4242, "queues": ["emails"], "threads": 4, "busy": 1,
               "prefetched": 1, "per_queue": json.dumps({"emails": [1, 1]}), "version": "9.9",
               "running": [first.message_id], "running_since": [datetime.now(timezone.utc) - timedelta(seconds=30)],
               "beat_seconds": 10}  # fmt: skip
        broker.database.run(lambda conn: conn.execute(broker.statements.process_beat, row))
        with serving(dashboard_app(broker, live=0)) as url:  # (no live update between a find and a read)
            d.get(url + "/messages?queue=emails&state=running")
            wait(d, lambda: bool(d.find_elements(By.CSS_SELECTOR, "table.messages")))
            text = d.find_element(By.CSS_SELECTOR, "table.messages").text
            lines = {mid: line for line in text.splitlines() for mid in (first.message_id, second.message_id)
                     if line.startswith(mid)}  # fmt: skip
            assert re.search(r"running, 3\d\.\d s so far", lines[first.message_id]), lines
            assert "prefetched" in lines[second.message_id], lines
            screenshot(d, "dashboard-running.png")
            d.get(url + f"/message/{first.message_id}")
            wait(d, lambda: "so far" in d.find_element(By.ID, "run-state").text)
            d.get(url + f"/message/{second.message_id}")
            wait(d, lambda: "prefetched" in d.find_element(By.ID, "run-state").text)
            d.get(url + "/")
            cells = d.find_element(By.CSS_SELECTOR, "table.queues").text
            assert "emails 0 0 1 1" in cells, cells
    finally:
        consumer.close()


def test_a_messages_page_tells_its_whole_story_in_order_with_dates_to_an_operator_and_a_read_only_user(
    dramatiq_pg_broker_factory: Any, chrome: Any  # noqa: F811
) -> None:
    """Given a message that a real worker fails twice (dead-lettered), that operators re-drive, cancel and
    re-drive again, whose next delivery's worker stops renewing its lease (maintenance takes it back; its
    late retry is fenced out) and whose last delivery is acked, I expect its page to list, oldest first:
    attempt 1 retried and attempt 2 dead with their errors (the tracebacks folded away), the three actions
    with who did them, attempt 3's lost lease and its fenced-out retry, and attempt 4's ack; times as UTC
    dates, with run times and processes; the same to a read-only user; on a phone, cards that need no
    horizontal scroll, in light and dark."""
    import dramatiq
    from helpers import expire_and_rescue, running_worker, wait_for
    from selenium.webdriver.common.by import By
    from test_attempt_log import deliver, retry_late
    from test_console_actions import AUTH, basic, call
    from test_dashboard_console import emulate

    broker = dramatiq_pg_broker_factory()
    other = dramatiq_pg_broker_factory(schema=broker.schema)
    runs: list[int] = []

    def charge_card(order: int) -> None:
        raise ValueError(f"card declined for order {order} (try {len(runs)})")

    @dramatiq.actor(broker=broker, queue_name="payments", max_retries=1, min_backoff=1, max_backoff=5)
    def charge(order: int) -> None:
        runs.append(order)
        charge_card(order)

    other.declare_queue("payments")
    sent = charge.send(1042)
    with running_worker(broker, threads=1):
        wait_for(lambda: broker.inspect(sent.message_id)["state"] == "dead", 30, "the dead letter")
    for who, action in (("alice", "redrive"), ("alice", "cancel"), ("bob", "redrive")):
        assert broker.bulk(action, who=who, ids=[sent.message_id]).touched == 1
    stalled = deliver(broker, "payments")  # attempt 3: its worker stops renewing the lease
    expire_and_rescue(broker)
    last = deliver(other, "payments")  # attempt 4, in another process
    retry_late(broker, stalled, "gateway timed out")  # attempt 3 comes back, too late
    last.consumer.ack(last)  # type: ignore[attr-defined]
    assert other.flush_outcomes(10)
    expected = ["1 retried", "2 dead", "re-drive", "cancel", "re-drive", "3 lease lost", "3 fenced out", "4 done"]
    date = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC")

    def check_rows() -> list[Any]:
        rows = d.find_elements(By.CSS_SELECTOR, "#story tbody tr")
        cells = [[td.get_attribute("textContent").strip() for td in tr.find_elements(By.TAG_NAME, "td")] for tr in rows]
        badges = [tr.find_element(By.CSS_SELECTOR, ".badge").get_attribute("textContent") for tr in rows]
        said = [f"{c[0]} {badge}" if c[0] else badge for c, badge in zip(cells, badges, strict=True)]
        assert said == expected, said
        assert all(date.search(c[2]) for c in cells), "every event's time is a UTC date"
        assert date.search(cells[0][1]) and cells[0][3].endswith(("ms", " s")), "claimed, and run time"
        assert cells[0][4].startswith(broker.consumer_id) and cells[7][4].startswith(other.consumer_id)
        assert "ValueError: card declined for order 1042 (try 1)" in cells[0][6]
        assert [c[4] for c in cells[2:5]] == ["alice", "alice", "bob"]
        assert "attempt 4 holds it now" in cells[6][6] or "the row is gone" in cells[6][6]
        return rows

    d = chrome
    # (live=0: no live update replaces the rows between a find and a read)
    with serving(dashboard_app(broker, actions=True, live=0)) as url:
        emulate(d, dark=False)
        d.get(url + f"/message/{sent.message_id}")
        wait(d, lambda: bool(d.find_elements(By.ID, "story")))
        rows = check_rows()
        folded = rows[0].find_element(By.TAG_NAME, "details")
        assert folded.get_attribute("open") is None and not folded.find_element(By.TAG_NAME, "pre").is_displayed()
        folded.find_element(By.TAG_NAME, "summary").click()
        assert "Traceback (most recent call last)" in folded.find_element(By.TAG_NAME, "pre").text
        folded.find_element(By.TAG_NAME, "summary").click()  # folded again for the picture
        d.execute_script("document.querySelector('#story-title').scrollIntoView()")
        screenshot(d, "dashboard-message-story.png")
        emulate(d, dark=True, width=390)
        d.get(url + f"/message/{sent.message_id}")
        wait(d, lambda: bool(d.find_elements(By.ID, "story")))
        check_rows()
        assert d.execute_script("return window.innerWidth") == 390
        assert d.execute_script("return document.documentElement.scrollWidth") <= 390, "no horizontal scroll"
        assert d.execute_script("return document.querySelector('#story').scrollWidth") <= 390
        d.execute_script("document.querySelector('#story-title').scrollIntoView()")
        screenshot(d, "dashboard-message-story-phone-dark.png")
        emulate(d, dark=False)
    read_only = dashboard_app(broker, actions=True, auth=AUTH)
    status, _, body = call(read_only, f"/message/{sent.message_id}", authorization=basic("bob", "pw-bob"))
    assert status == "200 OK" and "id=story" in body and body.count("<tr class=") == len(expected)
    assert "fenced out" in body and "lease lost" in body and "<form method=post" not in body
