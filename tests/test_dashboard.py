"""The dashboard: its guards, called as a WSGI app, then every page and action in a real headless Chromium."""

from __future__ import annotations

import io
import os
import re
import shutil
import threading
import traceback
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import Factory, query, running_worker, wait_for
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import Dashboard, dashboard_app, make_dashboard_server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def call(app: Dashboard, path: str, method: str = "GET", form: dict[str, str] | None = None, **headers: str):
    """One request through the WSGI app: (status, headers, body)."""
    path, _, qs = path.partition("?")
    body = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": method, "PATH_INFO": path, "QUERY_STRING": qs, "wsgi.input": io.BytesIO(body),
        "CONTENT_LENGTH": str(len(body)), "HTTP_HOST": "127.0.0.1:8080", "SERVER_NAME": "127.0.0.1",
    }  # fmt: skip
    environ.update({f"HTTP_{k.upper()}": v for k, v in headers.items()})
    seen: dict[str, Any] = {}

    def start_response(status: str, hdrs: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(hdrs)

    data = b"".join(app(environ, start_response))
    return seen["status"], seen["headers"], data.decode()


def some_messages(broker: PostgresBroker) -> dict[str, dramatiq.Message]:
    """A done, a dead, a cancelled and two queued messages on queue 'emails', one queued on 'reports'."""

    @dramatiq.actor(broker=broker, queue_name="emails", max_retries=0)
    def send_email(to: str, fail: bool = False) -> None:
        if fail:
            raise RuntimeError(f"mailbox {to} is full")

    @dramatiq.actor(broker=broker, queue_name="reports")
    def build_report(n: int) -> None:
        pass

    done = send_email.send("ann@example.com")
    dead = send_email.send("bob@example.com", fail=True)
    with running_worker(broker):
        wait_for(lambda: (broker.inspect(dead.message_id) or {}).get("state") == "dead", 30, "the dead letter")
        wait_for(lambda: (broker.inspect(done.message_id) or {}).get("state") == "done", 30, "the ack")
    queued = send_email.send("cy@example.com")
    other = send_email.send("dee@example.com")
    cancelled = send_email.send("eve@example.com")
    broker.cancel(cancelled.message_id)
    report = build_report.send(7)
    return {"done": done, "dead": dead, "queued": queued, "other": other, "cancelled": cancelled, "report": report}


def state(broker: PostgresBroker, message: dramatiq.Message) -> str | None:
    info = broker.inspect(message.message_id)
    return None if info is None else info["state"]


# -- the guards, without a browser ---------------------------------------------------------------
def test_read_only_unless_actions_are_on(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    m = dramatiq.Message(queue_name="emails", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(m)
    app = dashboard_app(broker)
    status, _, page = call(app, f"/message/{m.message_id}")
    assert status == "200 OK" and "Cancel" not in page and app.token not in page
    status, _, _ = call(app, "/action", "POST", {"token": app.token, "action": "cancel", "message_id": m.message_id})
    assert status.startswith("403")
    assert state(broker, m) == "queued"


def test_actions_need_this_process_token_and_the_same_origin(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    m = dramatiq.Message(queue_name="emails", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(m)
    app = dashboard_app(broker, actions=True)
    form = {"action": "cancel", "message_id": m.message_id, "next": f"/message/{m.message_id}"}
    assert call(app, "/action", "POST", form)[0].startswith("403")  # no token
    assert call(app, "/action", "POST", {**form, "token": "guess"})[0].startswith("403")
    evil = {"token": app.token, **form}
    assert call(app, "/action", "POST", evil, origin="https://evil.example")[0].startswith("403")
    assert call(app, "/action", "POST", evil, sec_fetch_site="cross-site")[0].startswith("403")
    assert state(broker, m) == "queued"
    status, headers, _ = call(
        app, "/action", "POST", {**evil, "next": "//evil.example/"}, origin="http://127.0.0.1:8080"
    )
    assert status == "303 See Other" and headers["Location"].startswith("/?note=")  # never redirected off-site
    assert state(broker, m) == "cancelled"
    assert "frame-ancestors 'none'" in headers["Content-Security-Policy"]


def test_processes_given_one_secret_accept_each_others_forms(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    one, two = dashboard_app(broker, actions=True, secret="s"), dashboard_app(broker, actions=True, secret="s")
    other = dashboard_app(broker, actions=True, secret="t")
    assert one.token == two.token != other.token
    assert dashboard_app(broker).token != dashboard_app(broker).token  # no secret: one per app
    broker.enqueue(dramatiq.Message(queue_name="q", actor_name="x", args=(), kwargs={}, options={}))
    assert call(two, "/action", "POST", {"token": one.token, "action": "pause", "queue": "q"})[0] == "303 See Other"
    assert call(other, "/action", "POST", {"token": one.token, "action": "resume", "queue": "q"})[0].startswith("403")


def test_no_page_shows_the_connection_string(dramatiq_pg_url: str, dramatiq_pg_broker_factory: Factory) -> None:
    info = conninfo_to_dict(dramatiq_pg_url)
    if info.get("password"):
        pytest.skip("the test server's URL has a password of its own")
    secret = "s3cret-Pa55word"
    # trust authentication ignores the password, so the broker works with it in its URL
    url = make_conninfo(dramatiq_pg_url, password=secret)
    try:
        psycopg.connect(url).close()
    except psycopg.OperationalError:
        pytest.skip("the test server checks passwords")
    probe = dramatiq_pg_broker_factory()
    broker = dramatiq_pg_broker_factory(schema=probe.schema)
    broker.database = type(broker.database)(url, schema=broker.schema, connect_timeout=5, pool_max_size=2)
    messages = some_messages(broker)
    app = dashboard_app(broker, actions=True)
    pages = ["/", "/messages?queue=emails&state=dead", f"/message/{messages['dead'].message_id}", "/metrics",
             "/message/00000000-0000-0000-0000-000000000000", "/message/nope"]  # fmt: skip
    for path in pages:
        status, _, body = call(app, path)
        assert secret not in body and "postgresql://" not in body and "5432" not in body, path
    broker.database.close()


def test_metrics_page_and_unknown_pages(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    broker.enqueue(dramatiq.Message(queue_name="emails", actor_name="x", args=(), kwargs={}, options={}))
    app = dashboard_app(broker)
    status, headers, body = call(app, "/metrics")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/plain")
    assert 'dramatiq_pg_messages{queue="emails",state="queued"} 1.0' in body
    assert "dramatiq_pg_up 1.0" in body
    assert call(app, "/nowhere")[0].startswith("404")
    assert call(app, "/message/not-a-uuid")[0].startswith("400")
    assert call(app, "/messages?queue=emails&state=bogus")[0].startswith("400")


def test_a_form_acts_only_on_the_message_its_page_showed(dramatiq_pg_broker: PostgresBroker) -> None:
    """Given a message's page with its Re-drive (or Cancel) button; when, before the click, the
    dead letter it showed was purged and its id sent again and dead-lettered at the same attempt
    (or the queued message it showed was acked and its id sent again), I expect the click to
    leave the new message alone and say so."""
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    app = dashboard_app(broker, actions=True)
    old = dramatiq.Message(queue_name="emails", actor_name="x", args=(1,), kwargs={}, options={})
    new = dramatiq.Message(queue_name="emails", actor_name="x", args=(2,), kwargs={}, options={},
                           message_id=old.message_id)  # fmt: skip
    dead = "UPDATE {schema}.message SET state = 'dead', attempt = 1, finished_at = now() WHERE message_id = %s"

    def form(action: str) -> dict[str, str]:
        page = call(app, f"/message/{old.message_id}")[2]
        (inputs,) = [f for f in page.split("<form")[1:] if f'name="action" value="{action}"' in f]
        return dict(re.findall(r'<input type=hidden name="([^"]+)" value="([^"]*)">', inputs))

    broker.enqueue(old)
    query(broker, dead, [old.message_id])
    redrive = form("redrive")
    broker.purge_queue("emails", ("dead",))
    broker.enqueue(new)
    query(broker, dead, [new.message_id])
    status, headers, _ = call(app, "/action", "POST", redrive)
    assert status == "303 See Other" and "not+re-driven" in headers["Location"]
    info = broker.inspect(old.message_id)
    assert (info["state"], list(info["args"])) == ("dead", [2])

    broker.purge_queue("emails", ("dead",))
    broker.enqueue(old)
    cancel = form("cancel")
    query(broker, "DELETE FROM {schema}.message WHERE message_id = %s", [old.message_id])  # acked
    broker.enqueue(new)
    status, headers, _ = call(app, "/action", "POST", cancel)
    assert status == "303 See Other" and "not_found" in headers["Location"]
    assert state(broker, new) == "queued"


# -- a real browser --------------------------------------------------------------------------------
@pytest.fixture
def chrome(tmp_path: Path) -> Iterator[Any]:
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        if os.environ.get("CI"):
            pytest.fail("CI needs chromium and chromium-driver (.ci/run installs them)")
        pytest.skip("no chromium / chromedriver (apt-get install chromium chromium-driver)")
    os.environ.setdefault("SE_OFFLINE", "true")  # Selenium must never download a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1400,900",
        f"--user-data-dir={tmp_path / 'chrome'}",
    ):
        options.add_argument(flag)  # fmt: skip
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture
def served(dramatiq_pg_broker: PostgresBroker) -> Iterator[str]:
    server = make_dashboard_server(dashboard_app(dramatiq_pg_broker, actions=True), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# ~13-16 s: a headless Chromium started (~2 s), every page opened and every action clicked through, each
# waiting for the page it leads to.
def test_every_page_and_action_in_headless_chromium(
    dramatiq_pg_broker: PostgresBroker, served: str, chrome: Any, tmp_path: Path
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    broker = dramatiq_pg_broker
    m = some_messages(broker)
    d = chrome

    def button(xpath: str) -> None:
        """Click, and wait until the next page has replaced this one and finished loading."""
        page = d.find_element(By.TAG_NAME, "html")
        d.find_element(By.XPATH, xpath).click()

        def replaced(_: Any) -> bool:
            try:
                page.is_enabled()
            except StaleElementReferenceException:
                return d.execute_script("return document.readyState") == "complete"
            except WebDriverException:
                pass  # mid-navigation, the driver may say other things: ask again
            return False

        WebDriverWait(d, 15).until(replaced)

    def flash() -> str:
        return d.find_element(By.ID, "flash").text

    # Queues page: both queues and their figures
    d.get(served + "/")
    assert d.title.startswith("Queues")
    rows = {
        r.find_element(By.XPATH, "td[1]/a").text: r for r in d.find_elements(By.CSS_SELECTOR, "table.queues tbody tr")
    }
    assert set(rows) == {"emails", "reports"}
    cells = [c.text for c in rows["emails"].find_elements(By.TAG_NAME, "td")]
    # queued, delayed, running, prefetched, expired, dead, cancelled
    assert cells[1:8] == ["2", "0", "0", "0", "0", "1", "1"]
    assert cells[9] == "1"  # done in the last hour
    shot = tmp_path / "dashboard.png"
    d.save_screenshot(str(shot))
    if os.environ.get("DASHBOARD_SCREENSHOT"):
        shutil.copy(shot, os.environ["DASHBOARD_SCREENSHOT"])

    # Messages page: filter by queue and state, then by actor
    d.get(served + "/messages")
    Select(d.find_element(By.ID, "queue")).select_by_visible_text("emails")
    Select(d.find_element(By.ID, "state")).select_by_visible_text("dead")
    button("//button[@id='filter']")
    ids = [a.text for a in d.find_elements(By.CSS_SELECTOR, "a.mid")]
    assert ids == [m["dead"].message_id]
    assert "is full" in d.find_element(By.CSS_SELECTOR, "table.messages").text
    Select(d.find_element(By.ID, "state")).select_by_visible_text("queued")
    d.find_element(By.ID, "actor").send_keys("build_report")
    button("//button[@id='filter']")
    assert d.find_elements(By.CSS_SELECTOR, "a.mid") == [] and d.find_element(By.ID, "empty")
    d.find_element(By.ID, "actor").clear()
    d.find_element(By.ID, "actor").send_keys("send_email")
    button("//button[@id='filter']")
    assert [a.text for a in d.find_elements(By.CSS_SELECTOR, "a.mid")] == [
        m["queued"].message_id,
        m["other"].message_id,
    ]
    Select(d.find_element(By.ID, "state")).select_by_visible_text("done")
    button("//button[@id='filter']")
    assert [a.text for a in d.find_elements(By.CSS_SELECTOR, "a.mid")] == [m["done"].message_id]

    # One message: the dead letter, with its error; re-drive it
    d.get(served + "/messages?queue=emails&state=dead")
    button(f"//a[text()='{m['dead'].message_id}']")
    assert d.find_element(By.ID, "state").text == "dead"
    assert "bob@example.com" in d.find_element(By.ID, "args").text
    assert "mailbox bob@example.com is full" in d.find_element(By.CSS_SELECTOR, "pre.err").text
    button("//button[@value='redrive']")
    assert flash() == "re-driven" and d.find_element(By.ID, "state").text == "queued"
    assert state(broker, m["dead"]) == "queued"

    # Cancel a queued message
    d.get(served + f"/message/{m['queued'].message_id}")
    button("//button[@value='cancel']")
    assert flash() == "cancel: cancelled_queued"
    assert state(broker, m["queued"]) == "cancelled"

    # Pause, then resume, a queue
    d.get(served + "/")
    button("//a[@id='pause-reports']")  # asks first, with the count (issue 42, point 3)
    assert d.find_element(By.ID, "question").text.startswith("Pause queue reports? Its ")
    assert query(broker, "SELECT queue_name FROM {schema}.paused_queue") == []  # asked, not yet done
    button("//button[@value='pause']")
    assert flash() == "paused"
    assert query(broker, "SELECT queue_name FROM {schema}.paused_queue") == [("reports",)]
    assert "paused" in d.find_element(By.XPATH, "//tr[td/a[text()='reports']]/td[1]").text
    button("//a[@id='resume-reports']")
    button("//button[@value='resume']")
    assert flash() == "resumed"
    assert query(broker, "SELECT queue_name FROM {schema}.paused_queue") == []

    # Re-drive a queue's dead letters (none left: it says so), then purge its cancelled messages
    button("//a[@id='redrive-emails']")
    assert d.find_element(By.ID, "nothing").text.startswith("Nothing to re-drive")
    d.get(served + "/")
    row = "//tr[td/a[text()='emails']]"
    Select(d.find_element(By.XPATH, row + "//select[@name='state']")).select_by_visible_text("cancelled")
    button(row + "//form[@action='/purge']//button")
    assert d.find_element(By.ID, "question").text == "Delete 2 cancelled messages of queue emails?"
    assert state(broker, m["cancelled"]) == "cancelled"  # asked, not yet done
    button("//button[@value='purge']")
    assert flash() == "purged: cancelled 2"
    assert state(broker, m["cancelled"]) is None and state(broker, m["queued"]) is None
    assert state(broker, m["other"]) == "queued" and state(broker, m["done"]) == "done"

    # Metrics
    d.get(served + "/metrics")
    assert 'dramatiq_pg_messages{queue="emails",state="queued"}' in d.find_element(By.TAG_NAME, "body").text


def test_lists_and_pages_name_the_exception_first(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("errs")
    m = dramatiq.Message(queue_name="errs", actor_name="x", args=("café",), kwargs={}, options={})
    broker.enqueue(m)
    try:
        raise ValueError("boom\nsecond line")
    except ValueError:
        text = traceback.format_exc()
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now(), last_error = %s"
          " WHERE message_id = %s", [text, m.message_id])  # fmt: skip
    app = dashboard_app(broker)
    _, _, page = call(app, "/messages?queue=errs&state=dead")
    assert "ValueError: boom ⏎ second line" in page
    _, _, page = call(app, f"/message/{m.message_id}")
    assert "<p class=err id=error>ValueError: boom ⏎ second line</p>" in page


def test_actions_on_an_unknown_queue_are_refused(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.enqueue(dramatiq.Message(queue_name="mail", actor_name="x", args=(), kwargs={}, options={}))
    app = dashboard_app(broker, actions=True)
    for action in ("pause", "resume", "purge", "redrive_queue"):
        form = {"token": app.token, "action": action, "queue": "nosuchqueue", "confirm": "yes", "state": "dead"}
        status, _, page = call(app, "/action", "POST", form)
        assert status.startswith("400") and "no queue &#x27;nosuchqueue&#x27;" in page and "known: mail" in page
    assert query(broker, "SELECT count(*) FROM {schema}.paused_queue") == [(0,)]
    status, _, page = call(app, "/messages?queue=nosuchqueue&state=dead")
    assert status.startswith("404") and "known: mail" in page


def test_purge_defaults_to_dead_letters_and_asks_with_the_count_first(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    queued = [dramatiq.Message(queue_name="p", actor_name="x", args=(), kwargs={}, options={}) for _ in range(3)]
    dead = [dramatiq.Message(queue_name="p", actor_name="x", args=(), kwargs={}, options={}) for _ in range(2)]
    broker.enqueue_many(queued + dead)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now() WHERE message_id = ANY(%s::uuid[])",
          [[m.message_id for m in dead]])  # fmt: skip
    app = dashboard_app(broker, actions=True)
    # The queues page offers dead letters first, and no one-click purge
    _, _, page = call(app, "/")
    purge = page[page.index('action="/purge"') :]
    purge = purge[: purge.index("</form>")]
    assert "<option selected>dead</option>" in purge and "confirm" not in purge
    # Asked first: how many rows it will delete
    status, _, page = call(app, "/purge?queue=p&state=dead")
    assert status == "200 OK" and "Delete 2 dead messages of queue p?" in page and app.token in page
    _, _, everything = call(app, "/purge?queue=p&state=all")
    assert "Delete 5 messages of queue p (queued 3, dead 2, cancelled 0, done 0)?" in everything
    # A purge that did not go through the question deletes nothing
    status, _, _ = call(app, "/action", "POST", {"token": app.token, "action": "purge", "queue": "p"})
    assert status.startswith("400") and query(broker, "SELECT count(*) FROM {schema}.message") == [(5,)]
    # Confirmed without a state: dead letters only
    form = {"token": app.token, "action": "purge", "queue": "p", "confirm": "yes"}
    status, headers, _ = call(app, "/action", "POST", form)
    assert status == "303 See Other" and "purged%3A+dead+2" in headers["Location"]
    assert query(broker, "SELECT state, count(*) FROM {schema}.message GROUP BY state") == [("queued", 3)]
    assert call(dashboard_app(broker), "/purge?queue=p&state=dead")[0].startswith("403")  # read-only: no question
    # A list filtered by actor asks about that actor's messages (the bulk question, issue 42)
    _, _, page = call(app, "/messages?queue=p&state=queued&actor=x")
    assert 'action="/bulk"' in page and '<input type=hidden name="actor" value="x">' in page
    assert "Delete 3 queued messages of queue p of actor x?" in call(app, "/purge?queue=p&state=queued&actor=x")[2]
    assert "Nothing to purge" in call(app, "/purge?queue=p&state=queued&actor=y")[2]
