"""The console's actions where the rows are (issue 42): the messages list's arguments, tick boxes and
"all N matching" asking first; the schedules page's pause, resume and run now; read-only and operator
credentials side by side; the theme toggle that remembers."""

from __future__ import annotations

import base64
import logging
from pathlib import Path
from typing import Any

import dramatiq
from helpers import query
from test_dashboard import call, chrome, some_messages, state  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import fresh, screenshot, serving, wait

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import Dashboard, dashboard_app
from dramatiq_pg_fenced.features.scheduler import Scheduler

AUTH = "# operators act, the others look\noperator alice:pw-alice\nread-only bob:pw-bob\nread-only t0ken-for-scripts\n"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_given_read_only_and_operator_credentials_I_expect_the_read_only_one_to_see_no_action_and_get_403(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    some = dramatiq_pg_broker.enqueue(dramatiq.Message(queue_name="emails", actor_name="x", args=(), kwargs={},
                                                       options={}))  # fmt: skip
    app = dashboard_app(dramatiq_pg_broker, actions=True, auth=AUTH)
    assert isinstance(app, Dashboard)
    pause = {"token": app.token, "action": "pause", "queue": "emails", "confirm": "yes"}
    for who in (basic("bob", "pw-bob"), "Bearer t0ken-for-scripts"):
        status, _, body = call(app, "/", authorization=who)
        assert status == "200 OK" and "read-only" in body and "pause-emails" not in body and "/confirm" not in body
        assert "Cancel" not in call(app, f"/message/{some.message_id}", authorization=who)[2]
        status, _, body = call(app, "/action", "POST", pause, authorization=who)
        assert status.startswith("403") and "read-only" in body
        assert call(app, "/bulk?action=cancel&scope=filter&queue=emails", authorization=who)[0].startswith("403")
    assert query(dramatiq_pg_broker, "SELECT queue_name FROM {schema}.paused_queue") == []
    assert call(app, "/", authorization=basic("bob", "pw-alice"))[0].startswith("401")  # another's password
    status, _, body = call(app, "/", authorization=basic("alice", "pw-alice"))
    assert "actions on" in body and "/confirm?action=pause" in body
    assert call(app, "/action", "POST", pause, authorization=basic("alice", "pw-alice"))[0] == "303 See Other"
    assert query(dramatiq_pg_broker, "SELECT queue_name FROM {schema}.paused_queue") == [("emails",)]
    # A session keeps the role it logged in with; a one-line file without a role is an operator's, as before.
    login = dashboard_app(dramatiq_pg_broker, actions=True, auth=AUTH, login=True, secret="s")
    status, headers, _ = call(login, "/login", "POST", {"user": "bob", "password": "pw-bob"})
    cookie = dict(headers)["Set-Cookie"].split(";")[0]
    assert "/confirm" not in call(login, "/", cookie=cookie)[2]
    assert call(login, "/action", "POST", {**pause, "token": login.token}, cookie=cookie)[0].startswith("403")
    legacy = dashboard_app(dramatiq_pg_broker, actions=True, auth="carol:pw-carol")
    assert "/confirm?action=resume" in call(legacy, "/", authorization=basic("carol", "pw-carol"))[2]


def test_in_a_browser_the_messages_list_acts_on_the_rows_ticked_or_all_matching_after_asking_with_the_count(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
    tmp_path: Path,
) -> None:
    from selenium.webdriver.common.by import By

    broker = dramatiq_pg_broker
    m = some_messages(broker)
    d = chrome
    d.set_window_size(1280, 900)
    # live=0: no live update replaces an element between a find and a click
    with serving(dashboard_app(broker, actions=True, live=0)) as url:
        d.get(url + "/messages?queue=emails&state=queued")
        table = d.find_element(By.CSS_SELECTOR, "table.messages").text
        assert '"cy@example.com"' in table and '"dee@example.com"' in table  # the arguments, shortened
        assert d.find_element(By.ID, "bulk-all").text == "On all 2 matching…"
        screenshot(d, "dashboard-messages-actions.png")
        # The rows ticked: one queued message cancelled, after the question.
        fresh(lambda: d.find_element(By.CSS_SELECTOR, f"input[value='{m['queued'].message_id}']").click())
        fresh(lambda: d.find_element(By.ID, "bulk-selected").click())
        wait(d, lambda: d.find_element(By.ID, "question").text.startswith("Cancel 1 message"))
        assert "danger" in d.find_element(By.CSS_SELECTOR, "button[value=bulk]").get_attribute("class")
        assert state(broker, m["queued"]) == "queued"  # asked, not yet done
        screenshot(d, "dashboard-bulk-question.png")
        d.find_element(By.CSS_SELECTOR, "button[value=bulk]").click()
        wait(d, lambda: "cancel" in d.find_element(By.ID, "flash").text.lower())
        assert state(broker, m["queued"]) == "cancelled" and state(broker, m["other"]) == "queued"
        # All matching: the dead letters of emails, re-driven after "Re-drive 1 message".
        d.get(url + "/messages?queue=emails&state=dead")
        fresh(lambda: d.find_element(By.ID, "bulk-all").click())
        wait(d, lambda: d.find_element(By.ID, "question").text == "Re-drive 1 dead message of queue emails?")
        d.find_element(By.CSS_SELECTOR, "button[value=bulk]").click()
        wait(d, lambda: "re-drive" in d.find_element(By.ID, "flash").text.lower())
        assert state(broker, m["dead"]) == "queued"
        who = query(broker, "SELECT action, touched FROM {schema}.audit ORDER BY id")
        assert who == [("cancel", 1), ("redrive", 1)]
        # The queues page's buttons ask first, with the count.
        d.get(url + "/")
        fresh(lambda: d.find_element(By.ID, "pause-emails").click())
        wait(d, lambda: d.find_element(By.ID, "question").text.startswith("Pause queue emails? Its 2 queued"))
        assert query(broker, "SELECT queue_name FROM {schema}.paused_queue") == []


def test_in_a_browser_a_schedule_is_paused_resumed_and_run_now_once_per_click_and_the_theme_is_remembered(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    broker = dramatiq_pg_broker

    @dramatiq.actor(broker=broker, queue_name="reports")
    def nightly(kind: str) -> None: ...

    broker.schedules.add(nightly, "0 3 * * *", name="nightly", args=["full"])
    scheduler = Scheduler(broker.schedules, broker.database, broker.statements, broker.settings,
                          logging.getLogger("test.scheduler"), row=broker.enqueuer.row)  # fmt: skip
    scheduler.declare(list(broker.schedules))
    d = chrome
    d.set_window_size(1280, 900)
    app = dashboard_app(broker, actions=True, live=0)  # no live update between a find and a click
    with serving(app) as url:
        d.get(url + "/schedules")
        fresh(lambda: d.find_element(By.CSS_SELECTOR, "button[value=schedule_pause]").click())
        wait(d, lambda: "paused (on every process)" in d.find_element(By.ID, "flash").text)
        assert query(broker, "SELECT paused_at IS NOT NULL FROM {schema}.schedule") == [(True,)]
        assert "paused" in d.find_element(By.CSS_SELECTOR, "table.schedules").text
        fresh(lambda: d.find_element(By.CSS_SELECTOR, "button[value=schedule_run_now]").click())
        wait(d, lambda: "run now asked" in d.find_element(By.ID, "flash").text)
        wait(d, lambda: "run now: 1 pending" in d.find_element(By.CSS_SELECTOR, "table.schedules").text)
        screenshot(d, "dashboard-schedules-actions.png")
        # The same form sent again (a double click, a resent request): still one click.
        click = d.find_element(By.CSS_SELECTOR, "button[value=schedule_run_now]").find_element(By.XPATH, "..")
        form = {i.get_attribute("name"): i.get_attribute("value")
                for i in click.find_elements(By.CSS_SELECTOR, "input[type=hidden]")}  # fmt: skip
        for note in ("run+now+asked", "taken+already"):
            status, headers, _ = call(app, "/action", "POST", form)
            assert status == "303 See Other" and note in headers["Location"]
        scheduler.run_once(list(broker.schedules))
        scheduler.run_once(list(broker.schedules))
        rows = query(broker, "SELECT actor_name FROM {schema}.message WHERE queue_name = 'reports'")
        assert rows == [("nightly",), ("nightly",)]  # two clicks (the button's, the form's), two messages
        fresh(lambda: d.find_element(By.CSS_SELECTOR, "button[value=schedule_resume]").click())
        wait(d, lambda: "resumed" in d.find_element(By.ID, "flash").text)
        audit = query(broker, "SELECT who, action, touched FROM {schema}.audit ORDER BY id")
        assert [a for _, a, _ in audit] == ["schedule_pause", "schedule_run_now", "schedule_run_now", "schedule_resume"]
        assert audit[1][2] == 1 and audit[0][0].startswith("(no login)")
        # The theme: the system's by default, the other one remembered once picked.
        first = d.execute_script("return document.documentElement.dataset.theme")
        d.find_element(By.ID, "theme-toggle").click()
        other = "light" if first == "dark" else "dark"
        assert d.execute_script("return document.documentElement.dataset.theme") == other
        d.get(url + "/")
        assert d.execute_script("return document.documentElement.dataset.theme") == other
        background = d.execute_script("return getComputedStyle(document.body).backgroundColor")
        assert background == ("rgb(18, 21, 27)" if other == "dark" else "rgb(246, 247, 249)")
