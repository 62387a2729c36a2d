"""The console's pages beyond the lists: live updates, dark mode and a phone's width, the schedules
pages, and the login of a dashboard served alone; in a real headless Chromium where a browser decides.

``DASHBOARD_SCREENSHOTS=DIR`` keeps the screenshots taken on the way (docs/ has them)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import dramatiq
from helpers import Factory, query
from test_dashboard import call, chrome, some_messages, state  # noqa: F401 (chrome: the fixture)

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import samples
from dramatiq_pg_fenced.dashboard import Dashboard, dashboard_app, make_dashboard_server, svg
from dramatiq_pg_fenced.dashboard.guards import SESSION_COOKIE, Sessions
from dramatiq_pg_fenced.dashboard.render import static_name
from dramatiq_pg_fenced.dashboard.schedule_pages import missed_between
from dramatiq_pg_fenced.features.scheduler import Scheduler
from dramatiq_pg_fenced.features.schedules import Timing

UTC = timezone.utc


@contextlib.contextmanager
def serving(app: Dashboard) -> Iterator[str]:
    server = make_dashboard_server(app, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def screenshot(driver: Any, name: str) -> None:
    where = os.environ.get("DASHBOARD_SCREENSHOTS")
    if where:
        driver.save_screenshot(str(Path(where) / name))


def replaced(error: BaseException) -> bool:
    """Whether *error* says the element, or its whole document, was replaced between a find and a use.

    A live update replaces an element (stale reference); a click that submits a form replaces the
    document, and a read that lands while it does is refused by Chromium with "Node with given id does
    not belong to the document" (a plain WebDriverException): both mean "find it again"."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    if isinstance(error, StaleElementReferenceException):
        return True
    return isinstance(error, WebDriverException) and "does not belong to the document" in (error.msg or "")


def wait(driver: Any, what: Callable[[], bool], timeout: float = 15) -> None:
    """Until *what* is true, *timeout* seconds at most.  An element *what* reads may be replaced (a live
    update, the page a click leads to) or not there yet (that page still loading): read again.  At the
    deadline *what* runs once more, so that a failure shows its own error."""
    from selenium.common.exceptions import NoSuchElementException

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if what():
                return
        except NoSuchElementException:
            pass
        except Exception as error:
            if not replaced(error):
                raise
        time.sleep(0.05)
    assert what(), f"not true within {timeout} s"


def fresh(action: Callable[[], Any], timeout: float = 30.0) -> Any:
    """*action* (a find and a use of an element) again if a live update replaced the element in between:
    a page stops updating once a control is changed, not between the test's find and its click.  Until
    *timeout* seconds, not a number of tries: under load one try may outlast several updates."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return action()
        except Exception as error:
            if not replaced(error):
                raise
            time.sleep(0.05)
    return action()


def enqueue(broker: PostgresBroker, queue: str = "emails") -> None:
    broker.enqueue(dramatiq.Message(queue_name=queue, actor_name="x", args=(), kwargs={}, options={}))


# -- the package's own files ---------------------------------------------------------------------
def test_the_style_and_the_script_are_served_from_the_package_and_nothing_else(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    app = dashboard_app(dramatiq_pg_broker, auth="ops:pw", login=True)
    status, headers, body = call(app, "/static/live.js")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/javascript") and "live-toggle" in body
    status, headers, body = call(app, "/static/style.css")
    assert status == "200 OK" and headers["Content-Type"].startswith("text/css") and "prefers-color-scheme" in body
    for other in ("/static/../app.py", "/static/app.py", "/static/", "/static/style.css/x"):
        assert call(app, other)[0].startswith("404"), other
    # pages name them with their digest, and allow no other script or style
    _, headers, page = call(dashboard_app(dramatiq_pg_broker), "/")
    assert f'src="/static/{static_name("live.js")}"' in page and f'href="/static/{static_name("style.css")}"' in page
    policy = headers["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "style-src 'self'" in policy and "unsafe-inline" not in policy
    assert call(dashboard_app(dramatiq_pg_broker), "/static/live.js", host="evil.example")[0].startswith("400")


# -- login, when served alone --------------------------------------------------------------------
def cookie_of(headers: dict[str, str]) -> str:
    name, _, rest = headers["Set-Cookie"].partition("=")
    assert name == SESSION_COOKIE
    return rest.split(";")[0]


def test_a_login_page_gives_a_signed_session_cookie_for_the_right_credentials_only(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    broker = dramatiq_pg_broker
    enqueue(broker)
    app = dashboard_app(broker, actions=True, auth="ops:s3cret", login=True, secret="k")
    # Given no credentials: sent to the login page, which names nothing of this server
    status, headers, _ = call(app, "/messages?queue=emails")
    assert status == "303 See Other"
    assert headers["Location"] == "/login?" + urllib.parse.urlencode({"next": "/messages?queue=emails"})
    status, _, page = call(app, "/login?next=/messages")
    assert status == "200 OK" and '<form method=post action="/login"' in page
    assert app.token not in page and broker.schema not in page and "emails" not in page
    assert call(app, "/action", "POST", {"token": app.token, "action": "pause", "queue": "emails"})[0].startswith("401")
    # Refused: a wrong password, a wrong user, a token-style login of user:password credentials, another site's form
    for user, password in (("ops", "wrong"), ("root", "s3cret"), ("", "ops:s3cret"), ("ops", "")):
        status, headers, page = call(app, "/login", "POST", {"user": user, "password": password})
        assert status == "401 Unauthorized" and "Set-Cookie" not in headers and "id=refused" in page, user
    status, headers, _ = call(
        app, "/login", "POST", {"user": "ops", "password": "s3cret"}, origin="https://evil.example"
    )
    assert status.startswith("403") and "Set-Cookie" not in headers
    # Accepted: a cookie script cannot read and no other site sends, and back where it was going
    form = {"user": "ops", "password": "s3cret", "next": "/messages?queue=emails"}
    status, headers, _ = call(app, "/login", "POST", form, origin="http://127.0.0.1:8080")
    assert status == "303 See Other" and headers["Location"] == "/messages?queue=emails"
    attributes = [a.strip() for a in headers["Set-Cookie"].split(";")]
    assert "HttpOnly" in attributes and "SameSite=Strict" in attributes and "Path=/" in attributes
    assert "Secure" not in attributes  # plain HTTP here; over HTTPS:
    assert app.sessions is not None
    assert "; Secure" in app.sessions.set_cookie("v", {"wsgi.url_scheme": "https"}, "/")[1]
    session = cookie_of(headers)
    status, _, page = call(app, "/", cookie=f"{SESSION_COOKIE}={session}")
    assert status == "200 OK" and "emails" in page and "id=logout" in page
    status, headers, _ = call(app, "/login?next=/messages", cookie=f"{SESSION_COOKIE}={session}")
    assert status == "303 See Other" and headers["Location"] == "/messages"  # logged in already
    # An open redirect is not offered: a login's next is a path here
    status, headers, _ = call(app, "/login", "POST", {**form, "next": "//evil.example/"})
    assert headers["Location"] == "/"


def test_a_forged_expired_or_foreign_session_cookie_is_refused(dramatiq_pg_broker: PostgresBroker) -> None:
    app = dashboard_app(dramatiq_pg_broker, auth="ops:s3cret", login=True, secret="k")
    assert app.sessions is not None
    good = app.sessions.issue("ops")
    expires, nonce, user, signature = good.split(".")
    flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
    forged = [
        f"{expires}.{nonce}.{user}.{flipped}",  # a signature changed
        f"{int(expires) + 86400}.{nonce}.{user}.{signature}",  # a later expiry, the old signature
        f"{expires}.{nonce}.cm9vdA.{signature}",  # another user ("root"), the old signature
        f"{expires}.{nonce}.{user}",  # no signature
        "",
        "x" * 5000,
        app.sessions.issue("ops", now=time.time() - 13 * 3600),  # expired
        Sessions(app.auth, "another secret").issue(),  # signed by another key  # type: ignore[arg-type]
        dashboard_app(dramatiq_pg_broker, auth="ops:changed", login=True, secret="k").sessions.issue(),  # type: ignore[union-attr]
    ]
    for value in forged:
        status, headers, _ = call(app, "/", cookie=f"{SESSION_COOKIE}={value}")
        assert status == "303 See Other" and headers["Location"].startswith("/login"), value[:40]
    assert call(app, "/", cookie=f"{SESSION_COOKIE}={good}")[0] == "200 OK"
    assert app.sessions.user(good) == "ops"
    # A process given the same secret and credentials accepts it (gunicorn workers, replicas)
    twin = dashboard_app(dramatiq_pg_broker, auth="ops:s3cret", login=True, secret="k")
    assert call(twin, "/", cookie=f"{SESSION_COOKIE}={good}")[0] == "200 OK"


def test_logout_clears_the_cookie_and_scripts_still_authenticate_by_header(dramatiq_pg_broker: PostgresBroker) -> None:
    app = dashboard_app(dramatiq_pg_broker, auth="t0ken", login=True)
    # A token: the password of the login form, under any user name
    status, headers, _ = call(app, "/login", "POST", {"user": "anyone", "password": "t0ken"})
    assert status == "303 See Other"
    cookie = f"{SESSION_COOKIE}={cookie_of(headers)}"
    assert call(app, "/logout", "POST", {}, cookie=cookie)[0].startswith("403")  # no form token: not logged out
    status, headers, _ = call(app, "/logout", "POST", {"token": app.token}, cookie=cookie)
    assert status == "303 See Other" and headers["Location"] == "/login"
    assert "Max-Age=0" in headers["Set-Cookie"] and cookie_of(headers) == ""
    assert call(app, "/", authorization="Bearer t0ken")[0] == "200 OK"
    assert call(app, "/", authorization="Bearer wrong")[0] == "401 Unauthorized"  # a script: no login page
    # Without login=True (mounted behind an application's own login, or basic authentication): no login page
    basic = dashboard_app(dramatiq_pg_broker, auth="t0ken")
    status, headers, _ = call(basic, "/login", "POST", {"password": "t0ken"})
    assert status == "401 Unauthorized" and headers["WWW-Authenticate"].startswith("Basic")


# -- processes, running and prefetched ------------------------------------------------------------
def beat(broker: PostgresBroker, process_id: str, busy: int, prefetched: int, queue: str = "emails") -> None:
    """A worker process's heartbeat, as its maintenance loop writes it (the same statement)."""
    host, pid, _ = process_id.split(":")
    row = {"id": process_id, "host": host, "pid": int(pid), "queues": [queue], "threads": 4, "busy": busy,
           "prefetched": prefetched, "per_queue": json.dumps({queue: [busy, prefetched]}), "version": "9.9",
           "running": [], "running_since": [], "beat_seconds": 10}  # fmt: skip
    broker.database.run(lambda conn: conn.execute(broker.statements.process_beat, row))


def test_running_and_prefetched_are_shown_apart_and_stale_processes_marked(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    for _ in range(4):
        enqueue(broker)
    consumer = broker.consume("emails", prefetch=3, timeout=1000)
    try:
        claimed = [next(consumer) for _ in range(3)]
        assert all(m is not None for m in claimed)
        # Given a live process running one of them, two in its prefetch, and a process silent for 5 minutes
        beat(broker, "web-1:4242:abc", busy=1, prefetched=2)
        beat(broker, "web-2:77:def", busy=3, prefetched=0)
        query(broker, "UPDATE {schema}.process SET heartbeat_at = now() - interval '5 minutes' WHERE pid = 77")
        app = dashboard_app(broker)
        _, _, page = call(app, "/")
        row = page[page.index('href="/messages?queue=emails&amp;state=queued"') :].split("</tr>")[0]
        cells = re.findall(r"<td>(.*?)</td>", "<td>" + row.split("<td>", 1)[1])
        # queued, delayed, running, prefetched: the stale process's three busy actors are not believed
        assert [re.sub("<[^>]+>", "", c) for c in cells[:4]] == ["1", "0", "1", "2"]
        status, _, page = call(app, "/processes")
        assert status == "200 OK"
        assert "1 process alive: 1 busy of 4 threads, 2 prefetched" in page and "1 stale" in page
        rows = page[page.index('class="processes cards"') : page.index("</table>")].split("<tr>")[2:]
        assert "web-1:4242:abc" in rows[0] and "alive" in rows[0] and "emails 1 / 2" in rows[0]
        assert "web-2:77:def" in rows[1] and "badge stale" in rows[1] and "5 min ago" in rows[1]
        assert len(rows) == 2 and "badge stale" not in rows[0]
    finally:
        consumer.close()


def test_no_process_yet(dramatiq_pg_broker: PostgresBroker) -> None:
    assert "id=empty" in call(dashboard_app(dramatiq_pg_broker), "/processes")[2]


# -- charts -------------------------------------------------------------------------------------
def test_a_chart_is_svg_with_a_gap_where_a_minute_has_no_sample_and_escaped_labels() -> None:
    t0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    minutes = [t0 + timedelta(minutes=i) for i in range(6)]
    chart = svg.line_chart("<b>title</b>", minutes, [("a<", [1, 2, None, 4, 5, None]), ("b", [0, 0, 0, 0, 0, 0])])
    assert chart.count("<polyline") == 3 and chart.count("<circle") == 0  # a: two runs; b: one
    assert "&lt;b&gt;title&lt;/b&gt;" in chart and "<b>" not in chart and "a&lt;" in chart
    assert ">5<" in chart and ">12:00<" in chart and ">12:05<" in chart  # y axis to 5, the first and last minute
    lone = svg.line_chart("t", minutes[:3], [("a", [None, 3, None])])
    assert lone.count("<circle") == 1 and "<polyline" not in lone
    assert [svg.nice_ceiling(v) for v in (0, 0.3, 1, 7, 11, 240, 260)] == [1, 0.5, 1, 10, 20, 250, 500]


def test_the_charts_page_draws_outcomes_depth_and_age_per_queue_and_overall(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    some_messages(broker)  # emails: one done, one dead (then queued ones); reports: one queued
    broker.flush_outcomes(10)
    # The worker's maintenance may have sampled this minute already, before the last sends: sample anew.
    query(broker, "DELETE FROM {schema}.queue_minute")
    with broker.database.connection() as conn:
        assert samples.take_sample(conn, broker.statements)
    app = dashboard_app(broker)
    status, _, page = call(app, "/charts")
    assert status == "200 OK" and "all queues: 1 finished, 1 failed (dead-lettered), 0 retried" in page
    for chart in ("outcomes", "depth", "age"):
        assert f'<svg class=chart viewBox="0 0 720 170" role=img aria-labelledby="{chart}-t" id="{chart}">' in page
    assert page.count("<polyline") == 3  # the outcomes over the hour; depth and age: one sample, a dot each
    # (and the wait and run charts: the one message finished this hour, a dot per percentile)
    assert page.count("<circle") == 2 + 6 and "Of the 1 messages finished in the last hour" in page
    _, _, page = call(app, "/charts?queue=reports&span=day")
    assert (
        "In the last day, queue reports: 0 finished, 0 failed" in page and "<option selected>reports</option>" in page
    )
    assert call(app, "/charts?queue=nope")[0].startswith("404")
    assert call(app, "/charts?span=week")[0].startswith("400")


# -- search -------------------------------------------------------------------------------------
def found_ids(page: str) -> list[str]:
    return re.findall(r'<a class=mid href="/message/([0-9a-f-]+)">', page)


def test_search_by_id_queue_actor_state_and_argument_values(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    m = some_messages(broker)
    app = dashboard_app(broker)
    assert "id=empty" not in call(app, "/search")[2] and found_ids(call(app, "/search")[2]) == []  # a form first
    by = {k: v.message_id for k, v in m.items()}
    assert found_ids(call(app, f"/search?id={by['dead']}")[2]) == [by["dead"]]
    assert found_ids(call(app, "/search?args=%5B7%5D")[2]) == [by["report"]]  # args=[7]
    assert found_ids(call(app, "/search?kwargs=%7B%22fail%22%3A+true%7D")[2]) == [by["dead"]]  # {"fail": true}
    assert sorted(found_ids(call(app, "/search?args=%5B%22cy%40example.com%22%5D&queue=emails")[2])) == [by["queued"]]
    assert found_ids(call(app, "/search?state=done")[2]) == [by["done"]]
    assert sorted(found_ids(call(app, "/search?queue=emails&state=queued")[2])) == sorted([by["queued"], by["other"]])
    assert found_ids(call(app, "/search?actor=build_report")[2]) == [by["report"]]
    assert "id=empty" in call(app, "/search?actor=nobody")[2]
    # Bad input is said on the page, escaped
    page = call(app, "/search?args=%7B%22a%22%3A1%7D")[2]  # {"a":1}
    assert "id=search-error>args: a JSON list" in page
    page = call(app, "/search?kwargs=%3Cscript%3E")[2]
    assert "kwargs: not JSON" in page and "<script>" not in page.split("</head>")[1]
    assert "id=search-error" in call(app, "/search?state=lost")[2]


def test_search_pages_by_key_without_repeating_or_losing_a_message(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    sent = [dramatiq.Message(queue_name="bulk", actor_name="x", args=(i,), kwargs={}, options={}) for i in range(60)]
    broker.enqueue_many(sent)
    app = dashboard_app(broker)
    page = call(app, "/search?queue=bulk")[2]
    first = found_ids(page)
    (after,) = re.findall(r'<a id=next href="([^"]+)">', page)
    assert len(first) == 50 and "queue=bulk" in after
    page = call(app, after.replace("&amp;", "&"))[2]
    second = found_ids(page)
    assert "id=next" not in page and len(second) == 10
    assert sorted(first + second) == sorted(s.message_id for s in sent)


# -- bulk actions and the audit log -------------------------------------------------------------
def hidden_form(page: str, action: str) -> dict[str, str]:
    """The hidden fields of the page's form for *action* (as the browser would post them)."""
    (inputs,) = [f for f in page.split("<form")[1:] if f'name="action" value="{action}"' in f]
    return dict(re.findall(r'<input type=hidden name="([^"]+)" value="([^"]*)">', inputs))


def test_a_bulk_action_says_how_many_it_touches_then_acts_and_is_audited(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    m = some_messages(broker)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now(), attempt = 1"
                  " WHERE message_id = %s", [m["other"].message_id])  # fmt: skip
    app = dashboard_app(broker, actions=True)
    # The search offers it, with a tick box per row; read-only, neither
    page = call(app, "/search?queue=emails&state=dead")[2]
    assert page.count('type=checkbox name=ids value="') == 2 and "id=bulk-filter" in page
    read_only = call(dashboard_app(broker), "/search?queue=emails&state=dead")[2]
    assert "checkbox" not in read_only and "id=bulk" not in read_only
    assert call(dashboard_app(broker), "/bulk?action=redrive&scope=filter&queue=emails")[0].startswith("403")
    # Asked first, with the count; nothing done yet
    status, _, page = call(app, "/bulk?action=redrive&scope=filter&queue=emails&state=dead")
    assert status == "200 OK"
    assert "Re-drive 2 dead messages of queue emails?" in page  # as the issue words it (issue 42)
    assert state(broker, m["dead"]) == state(broker, m["other"]) == "dead"
    form = hidden_form(page, "bulk")
    assert call(app, "/action", "POST", {**form, "confirm": "no"})[0].startswith("400")
    assert call(app, "/action", "POST", {**form, "token": "guess"})[0].startswith("403")
    status, headers, _ = call(app, "/action", "POST", form, origin="http://127.0.0.1:8080")
    assert status == "303 See Other" and headers["Location"].startswith("/audit?note=Re-drive%3A+2+touched+of+2")
    assert state(broker, m["dead"]) == state(broker, m["other"]) == "queued"
    # Nothing selected, or no filter at all: refused, said why
    assert "no row selected" in call(app, "/bulk?action=cancel&scope=selected")[2]
    assert "nothing selects every message" in call(app, "/bulk?action=purge&scope=filter")[2]
    assert "unknown action" in call(app, "/bulk?action=drop&scope=filter&queue=emails")[2]
    # The rows ticked only: two of the three queued
    ids = [m["queued"].message_id, m["dead"].message_id]
    page = call(app, "/bulk?action=cancel&scope=selected&" + "&".join(f"ids={i}" for i in ids))[2]
    assert "Cancel 2 messages: the queued or running ones of the 2 selected messages?" in page
    status, headers, _ = call(app, "/action", "POST", hidden_form(page, "bulk"))
    assert status == "303 See Other"
    assert (
        state(broker, m["queued"]) == state(broker, m["dead"]) == "cancelled" and state(broker, m["other"]) == "queued"
    )
    # The audit log: who, what, on which selection, how many
    page = call(app, "/audit")[2]
    rows = page[page.index('class="audit cards"') : page.index("</table>")].split("<tr>")[2:]
    assert len(rows) == 2 and "Cancel" in rows[0] and "Re-drive" in rows[1]
    assert "2 ids (" in rows[0] and "queue=&quot;emails&quot;, state=&quot;dead&quot;" in rows[1]
    assert "(no login)" in rows[0]


def test_the_audit_log_names_the_user_who_logged_in_and_a_delayed_message_can_run_now(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    broker = dramatiq_pg_broker
    broker.declare_queue("emails")
    later = dramatiq.Message(queue_name="emails", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(later, delay=3_600_000)
    app = dashboard_app(broker, actions=True, auth="alice:pw", login=True)
    _, headers, _ = call(app, "/login", "POST", {"user": "alice", "password": "pw"})
    cookie = f"{SESSION_COOKIE}={cookie_of(headers)}"
    page = call(app, f"/message/{later.message_id}", cookie=cookie)[2]
    (link,) = re.findall(r'<a id=run-now href="([^"]+)">', page)
    page = call(app, link.replace("&amp;", "&"), cookie=cookie)[2]
    assert "Run now 1 message: the delayed (queued, due later) ones of the 1 selected message?" in page
    status, _, _ = call(app, "/action", "POST", hidden_form(page, "bulk"), cookie=cookie)
    assert status == "303 See Other"
    ((due_now,),) = query(broker, "SELECT available_at <= now() FROM {schema}.message WHERE message_id = %s",
                          [later.message_id])  # fmt: skip
    assert due_now is True
    page = call(app, "/audit", cookie=cookie)[2]
    assert 'data-label="who">alice</td>' in page and "Run now" in page
    assert "id=run-now" not in call(app, f"/message/{later.message_id}", cookie=cookie)[2]  # due now: no button


# -- schedules -----------------------------------------------------------------------------------
def test_missed_ticks_are_counted_between_two_moments_strictly_and_capped() -> None:
    hourly = Timing.parse(every=3600)
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    assert missed_between(hourly, t0, t0 + timedelta(hours=3)) == 2  # 01:00, 02:00
    assert missed_between(hourly, t0, t0 + timedelta(hours=1)) == 0
    assert missed_between(hourly, t0, t0 + timedelta(days=365), cap=10) == 11  # shown as "10+"
    nightly = Timing.parse(cron="0 3 * * *", tz="Europe/Paris")
    assert missed_between(nightly, t0, t0 + timedelta(days=3)) == 3


def scheduled(factory: Factory) -> tuple[PostgresBroker, Scheduler]:
    """A broker with three schedules declared: ``hourly`` (grace 5 s), ``cleanup`` (every 5 min) and ``gone``
    (then removed from the code)."""
    broker = factory()

    @dramatiq.actor(broker=broker, queue_name="reports")
    def report() -> None: ...

    broker.schedules.add(report, every=3600, name="hourly", grace=5)
    broker.schedules.add(report, cron="0 3 * * *", tz="Europe/Paris", name="gone")
    broker.schedules.add(report, every=300, name="cleanup")
    scheduler = Scheduler(broker.schedules, broker.database, broker.statements, broker.settings,
                          __import__("logging").getLogger("test"), row=broker.enqueuer.row)  # fmt: skip
    scheduler.declare(list(broker.schedules))
    query(broker, "UPDATE {schema}.schedule SET seen_at = now() - interval '1 hour' WHERE name = 'gone'")
    return broker, scheduler


def test_the_schedules_page_shows_overdue_ticks_stale_declarations_and_the_last_ticks_message(
    dramatiq_pg_broker_factory: Factory,
) -> None:
    broker, scheduler = scheduled(dramatiq_pg_broker_factory)
    hourly = [s for s in broker.schedules if s.name == "hourly"]
    # Given every scheduler down for ten hours
    query(broker, "UPDATE {schema}.schedule SET changed_at = date_trunc('hour', now()) - interval '10 hours',"
                  " last_tick = date_trunc('hour', now()) - interval '10 hours' WHERE name = 'hourly'")  # fmt: skip
    now, base = query(broker, "SELECT clock_timestamp(), date_trunc('hour', now())")[0]
    owed = sum(1 for k in range(-9, 1) if base + timedelta(hours=k) <= now - timedelta(seconds=5))
    app = dashboard_app(broker)
    status, _, page = call(app, "/schedules")
    assert status == "200 OK"
    row = page[page.index('href="/schedules?name=hourly"') :].split("</tr>")[0]
    assert f"{owed} missed" in row and "every 3600s" in row and "reports" in row
    gone = page[page.index('href="/schedules?name=gone"') :].split("</tr>")[0]
    assert "stale" in gone and "missed" not in gone.replace("missed ticks", "")  # stale: nobody owes its ticks
    # When a scheduler comes back (missed="once": the latest missed tick is enqueued)
    scheduler.run_once(hourly)
    (message_id,) = [str(r[0]) for r in query(broker, "SELECT message_id FROM {schema}.message")]
    status, _, page = call(app, "/schedules")
    row = page[page.index('href="/schedules?name=hourly"') :].split("</tr>")[0]
    assert "missed</span>" not in row and f'href="/message/{message_id}"' in row
    # Its page: the ticks recorded, and the ones missed between them
    query(broker, "INSERT INTO {schema}.schedule_tick (name, tick, message_id)"
                  " VALUES ('hourly', %s, %s)", [base - timedelta(hours=20), uuid.uuid4()])  # fmt: skip
    status, _, page = call(app, "/schedules?name=hourly")
    assert status == "200 OK" and "id=overdue" not in page
    ticks = page[page.index("class=ticks") :]
    assert ticks.count("<tr>") == 3 and f'href="/message/{message_id}"' in ticks  # a head and two ticks
    gap = sum(1 for k in range(-19, 1) if base - timedelta(hours=20) < base + timedelta(hours=k) < base
              + timedelta(hours=-10 + owed))  # fmt: skip
    assert f"<span class='badge stale'>{gap}</span>" in ticks
    assert call(app, "/schedules?name=nope")[0].startswith("404")
    assert "no schedule &#x27;&lt;b&gt;&#x27;" in call(app, "/schedules?name=%3Cb%3E")[2]  # escaped


# -- in a browser --------------------------------------------------------------------------------
def queued_cell(driver: Any, queue: str) -> str:
    """The queued count of *queue* on the queues page (read again if an update replaced the row meanwhile)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    while True:
        try:
            row = driver.find_element(By.XPATH, f"//table[contains(@class,'queues')]//tr[td/a[text()='{queue}']]")
            return str(row.find_elements(By.TAG_NAME, "td")[1].text)
        except StaleElementReferenceException:
            continue


def test_a_page_shows_a_change_in_the_database_without_reload_and_not_while_paused(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    enqueue(broker)
    with serving(dashboard_app(broker, live=0.25)) as url:
        d.get(url + "/")
        d.execute_script("window.sameDocument = true")  # gone if the page were loaded again
        assert queued_cell(d, "emails") == "1"
        toggle = d.find_element(By.ID, "live-toggle")
        assert toggle.is_displayed() and toggle.text == "Pause live"
        # When a message is enqueued, I expect the page to show it without a reload
        enqueue(broker)
        wait(d, lambda: queued_cell(d, "emails") == "2")
        assert d.execute_script("return window.sameDocument") is True
        # Paused: a change is not shown, however many intervals pass
        toggle.click()
        assert toggle.text == "Resume live" and d.find_element(By.ID, "live-status").text == "paused"
        updates = d.execute_script("return document.body.dataset.updates")
        enqueue(broker)
        time.sleep(2.0)  # eight intervals
        assert queued_cell(d, "emails") == "2"
        assert d.execute_script("return document.body.dataset.updates") == updates
        # Resumed: shown
        toggle.click()
        wait(d, lambda: queued_cell(d, "emails") == "3")
        assert d.execute_script("return window.sameDocument") is True
        # The pause is remembered across pages of this browser
        toggle = d.find_element(By.ID, "live-toggle")
        toggle.click()
        d.get(url + "/")
        assert d.find_element(By.ID, "live-toggle").text == "Resume live"
        d.find_element(By.ID, "live-toggle").click()


def emulate(driver: Any, *, dark: bool, width: int | None = None) -> None:
    scheme = [{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}]
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": scheme})
    if width is None:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    else:
        driver.execute_cdp_cmd(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": 844, "deviceScaleFactor": 1, "mobile": True},
        )


def test_dark_mode_follows_the_system_and_a_phone_scrolls_tables_not_the_page(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    broker, d = dramatiq_pg_broker, chrome
    some_messages(broker)
    background = "return getComputedStyle(document.body).backgroundColor"
    with serving(dashboard_app(broker, actions=True)) as url:
        emulate(d, dark=False)
        d.get(url + "/")
        light = d.execute_script(background)
        emulate(d, dark=True)
        d.get(url + "/")
        dark = d.execute_script(background)
        assert light == "rgb(246, 247, 249)" and dark == "rgb(18, 21, 27)"
        screenshot(d, "dashboard-dark.png")
        # A phone: the viewport is the device's, the page never wider than it; the queues' wide table scrolls
        # inside its box, a list of messages is a card per message (render.html_table's cards)
        for dark_mode in (False, True):
            emulate(d, dark=dark_mode, width=390)
            d.get(url + "/")
            assert d.execute_script("return window.innerWidth") == 390
            assert d.execute_script("return document.documentElement.scrollWidth") <= 390
            wide = "const s = document.querySelector('.scroll'); return [s.scrollWidth, s.clientWidth]"
            inner, shown = d.execute_script(wide)
            assert inner > shown  # the table is wider than the phone: it scrolls in its box
            d.get(url + "/messages?queue=emails&state=dead")
            assert d.execute_script("return document.documentElement.scrollWidth") <= 390
            inner, shown = d.execute_script(wide)
            assert inner <= shown  # cards: nothing to scroll sideways
            row = "return getComputedStyle(document.querySelector('table.messages tbody tr')).display"
            assert d.execute_script(row) == "block"
            screenshot(d, f"dashboard-phone{'-dark' if dark_mode else ''}.png")
        emulate(d, dark=False)


def test_login_in_a_browser_and_the_cookie_is_out_of_scripts_reach(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    enqueue(broker)
    with serving(dashboard_app(broker, auth="ops:s3cret", login=True)) as url:
        d.get(url + "/messages?queue=emails")
        assert d.title.startswith("Log in")
        d.find_element(By.ID, "user").send_keys("ops")
        d.find_element(By.ID, "password").send_keys("nope")
        d.find_element(By.ID, "login").click()
        wait(d, lambda: bool(d.find_elements(By.ID, "refused")))
        screenshot(d, "dashboard-login.png")
        d.find_element(By.ID, "user").clear()
        d.find_element(By.ID, "user").send_keys("ops")
        d.find_element(By.ID, "password").send_keys("s3cret")
        d.find_element(By.ID, "login").click()
        wait(d, lambda: d.title.startswith("Messages"))
        assert d.execute_script("return document.cookie") == ""  # HttpOnly
        assert d.get_cookie(SESSION_COOKIE)["httpOnly"] is True
        d.find_element(By.ID, "logout").click()
        wait(d, lambda: d.title.startswith("Log in"))
        d.get(url + "/")
        assert d.title.startswith("Log in")


def test_the_schedules_page_in_a_browser(dramatiq_pg_broker_factory: Factory, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    broker, scheduler = scheduled(dramatiq_pg_broker_factory)
    query(broker, "UPDATE {schema}.schedule SET changed_at = now() - interval '3 hours',"
                  " last_tick = date_trunc('hour', now()) - interval '3 hours' WHERE name = 'hourly'")  # fmt: skip
    scheduler.run_once([s for s in broker.schedules if s.name == "hourly"])
    # cleanup: no scheduler for an hour (ticks owed since then; the page counts them)
    query(broker, "UPDATE {schema}.schedule SET changed_at = now() - interval '1 hour',"
                  " last_tick = now() - interval '1 hour' WHERE name = 'cleanup'")  # fmt: skip
    with serving(dashboard_app(broker)) as url:
        d = chrome
        d.get(url + "/schedules")
        names = [a.text for a in d.find_elements(By.CSS_SELECTOR, "table.schedules td:first-child a")]
        assert names == ["cleanup", "gone", "hourly"]
        overdue = d.find_element(By.XPATH, "//tr[td/a[text()='cleanup']]/td[9]").text
        assert overdue in ("11 missed", "12 missed")  # every 5 min, for an hour, less the grace (60 s)
        assert "stale" in d.find_element(By.XPATH, "//tr[td/a[text()='gone']]").text
        screenshot(d, "dashboard-schedules.png")
        d.find_element(By.XPATH, "//tr[td/a[text()='hourly']]//a[contains(@href,'/message/')]").click()
        wait(d, lambda: d.title.startswith("Message "))
        assert d.find_element(By.ID, "state").text == "queued"


def test_the_processes_and_queues_pages_in_a_browser(dramatiq_pg_broker: PostgresBroker, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    some_messages(broker)
    consumer = broker.consume("emails", prefetch=2, timeout=1000)
    try:
        assert next(consumer) is not None and next(consumer) is not None
        beat(broker, "worker-a:4242:7f3a", busy=1, prefetched=1)
        beat(broker, "worker-b:5151:c01d", busy=2, prefetched=0, queue="reports")
        query(broker, "UPDATE {schema}.process SET heartbeat_at = now() - interval '4 minutes' WHERE pid = 5151")
        with serving(dashboard_app(broker, actions=True)) as url:
            d.get(url + "/")
            row = d.find_element(By.XPATH, "//tr[td/a[text()='emails']]")
            assert [c.text for c in row.find_elements(By.TAG_NAME, "td")][3:5] == ["1", "1"]  # running, prefetched
            screenshot(d, "dashboard.png")
            d.get(url + "/processes")
            rows = d.find_elements(By.CSS_SELECTOR, "table.processes tbody tr")
            assert [r.find_element(By.TAG_NAME, "td").text for r in rows] == [
                "worker-a:4242:7f3a",
                "worker-b:5151:c01d",
            ]
            assert rows[1].find_element(By.CSS_SELECTOR, ".badge.stale").is_displayed()
            assert rows[0].find_elements(By.CSS_SELECTOR, ".badge.stale") == []
            screenshot(d, "dashboard-processes.png")
            d.get(url + "/messages?queue=emails&state=dead")
            screenshot(d, "dashboard-messages.png")
    finally:
        consumer.close()


def test_the_charts_page_in_a_browser(dramatiq_pg_broker: PostgresBroker, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    broker.declare_queue("emails")
    # An hour of samples, as the workers' maintenance loop takes them (a gap of ten minutes: no worker ran)
    query(broker, """
        INSERT INTO {schema}.queue_minute (queue_name, minute, due, oldest_due_seconds, done, dead, retried)
        SELECT q, date_trunc('minute', now()) - i * interval '1 minute',
               (200 + 150 * sin(i / 9.0))::bigint, 5 + 40 * (1 + cos(i / 7.0)),
               (60 + 30 * sin(i / 5.0))::bigint, (i % 17 = 0)::int * 3, (i % 6 = 0)::int * 2
          FROM generate_series(1, 59) AS i, unnest(ARRAY['', 'emails']) AS q
         WHERE i NOT BETWEEN 30 AND 39""")  # fmt: skip
    with serving(dashboard_app(broker)) as url:
        d.get(url + "/charts?queue=emails")
        charts_shown = d.find_elements(By.CSS_SELECTOR, "svg.chart")
        assert len(charts_shown) == 5 and all(c.size["width"] > 600 for c in charts_shown)  # (wait, run: 5 more)
        assert len(d.find_elements(By.CSS_SELECTOR, "#depth polyline")) == 2  # broken where no sample
        # (docs/dashboard-charts.png: test_console_timings.py's, with wait and run times)


def test_an_update_never_undoes_a_filter_being_chosen(dramatiq_pg_broker: PostgresBroker, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    broker, d = dramatiq_pg_broker, chrome
    enqueue(broker)
    with serving(dashboard_app(broker, live=0.25)) as url:
        d.get(url + "/messages")
        wait(d, lambda: d.execute_script("return document.body.dataset.updates") is not None)  # it updates
        # Given a state chosen but not yet filtered, the focus elsewhere
        # (in one script: under load a find and a select through the driver took longer than the 0.25 s
        # between two updates, and each try met an element an update had just replaced)
        d.execute_script("""
            var s = document.getElementById("state");
            s.selectedIndex = Array.prototype.findIndex.call(s.options, function (o) { return o.text === "dead"; });
            s.dispatchEvent(new Event("change", { bubbles: true }));""")
        fresh(lambda: d.find_element(By.TAG_NAME, "h1").click())
        enqueue(broker)
        before = d.execute_script("return document.body.dataset.updates")
        time.sleep(1.5)  # six intervals
        # I expect the choice kept (no update meanwhile), and the filter to apply it
        assert d.execute_script("return document.body.dataset.updates") == before
        assert Select(d.find_element(By.ID, "state")).first_selected_option.text == "dead"
        d.find_element(By.ID, "filter").click()
        wait(d, lambda: "state=dead" in d.current_url)
        wait(d, lambda: d.execute_script("return document.body.dataset.updates") is not None)  # updates again


def test_the_search_page_in_a_browser(dramatiq_pg_broker: PostgresBroker, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    broker, d = dramatiq_pg_broker, chrome
    m = some_messages(broker)
    with serving(dashboard_app(broker)) as url:
        d.get(url + "/search")
        Select(d.find_element(By.ID, "s-queue")).select_by_visible_text("emails")
        d.find_element(By.ID, "s-kwargs").send_keys('{"fail": true}')
        d.find_element(By.ID, "search").click()
        wait(d, lambda: "kwargs=" in d.current_url and bool(d.find_elements(By.CSS_SELECTOR, "table.found")))
        ids = [a.text for a in d.find_elements(By.CSS_SELECTOR, "table.found a.mid")]
        assert ids == [m["dead"].message_id]
        assert "fail=true" in d.find_element(By.CSS_SELECTOR, "table.found").text
        d.get(url + "/search?queue=emails")
        screenshot(d, "dashboard-search.png")


def test_a_bulk_action_in_a_browser(dramatiq_pg_broker: PostgresBroker, chrome: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    broker, d = dramatiq_pg_broker, chrome
    m = some_messages(broker)
    with serving(dashboard_app(broker, actions=True, live=0.25)) as url:
        d.get(url + "/search?queue=emails&state=queued")
        for which in ("queued", "other"):
            fresh(lambda: d.find_element(By.CSS_SELECTOR, f"input[value='{m[which].message_id}']").click())  # noqa: B023
        time.sleep(1.0)  # four intervals: ticked rows stay ticked (no update replaces them)
        assert len(d.find_elements(By.CSS_SELECTOR, "input[name=ids]:checked")) == 2
        fresh(lambda: Select(d.find_element(By.ID, "bulk-action")).select_by_visible_text("Cancel"))
        fresh(lambda: d.find_element(By.ID, "bulk-selected").click())
        wait(d, lambda: d.title.startswith("Bulk action"))
        assert fresh(lambda: d.find_element(By.ID, "question").text).startswith("Cancel 2 messages")
        assert state(broker, m["queued"]) == "queued"  # asked, not done
        screenshot(d, "dashboard-bulk.png")
        fresh(lambda: d.find_element(By.XPATH, "//button[@value='bulk']").click())  # the question page updates too
        wait(d, lambda: d.title.startswith("Audit log"))
        flash = fresh(lambda: d.find_element(By.ID, "flash").text)  # the audit log updates every 0.25 s
        assert flash.startswith("Cancel: 2 touched of 2 counted, 0 skipped")
        assert state(broker, m["queued"]) == state(broker, m["other"]) == "cancelled"
        screenshot(d, "dashboard-audit.png")


def test_a_page_that_failed_recovers_by_itself_heading_and_title_included(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    broker, d = dramatiq_pg_broker, chrome
    enqueue(broker)  # a queue "emails", so that "later" is unknown, not the only one
    with serving(dashboard_app(broker, live=0.25)) as url:
        d.get(url + "/messages?queue=later&state=queued")
        assert fresh(lambda: d.find_element(By.TAG_NAME, "h1").text) == "404 Not Found"  # it updates too
        d.execute_script("window.sameDocument = true")
        enqueue(broker, "later")
        wait(d, lambda: d.find_element(By.TAG_NAME, "h1").text == "Messages")
        assert d.title.startswith("Messages") and len(d.find_elements(By.CSS_SELECTOR, "table.messages a.mid")) == 1
        assert d.execute_script("return window.sameDocument") is True
