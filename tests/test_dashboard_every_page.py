"""Every page of the dashboard as people see it: light and dark, at a desktop's width and a phone's, over
the data a real worker left (done, retried, dead with their errors, running and prefetched, queued,
delayed, a fair queue's keys, schedules, operators' actions in the audit log); in a real headless Chromium.

For each page and view: the page itself (200, its heading), the theme asked for, every text readable on
what is behind it and not drawn tiny, a chart's lines as lines; at a desktop's width no table scrolling
sideways, and at a phone's no page wider than the phone (a list is a card per row; another wide table
scrolls in its own box).  ``DASHBOARD_SCREENSHOTS=DIR`` keeps a picture of each, named
``dashboard-page-<page>-<light|dark>-<desktop|phone>.png`` (docs/dashboard.md shows two views of each)."""

from __future__ import annotations

import contextlib
import os
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import dramatiq
from helpers import query, running_worker, wait_for
from test_dashboard import chrome  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import beat, emulate, screenshot, serving

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.features import schedule_control

#: The body's background in each theme (style.css's --bg).
BACKGROUND = {"light": "rgb(246, 247, 249)", "dark": "rgb(18, 21, 27)"}
PHONE = 390

#: What a page shows: its heading (an error page's is its status), the body's background, the document's
#: width (wider than the viewport: the page scrolls sideways), the charts' and sparklines' lines drawn as
#: filled shapes (a line is never filled), and every text too close in colour to what is behind it, as
#: [text, colour, background, ratio]: the background is the nearest ancestor's that is not transparent,
#: the ratio WCAG's contrast ratio, and 4.5 its floor for body text; and every text drawn smaller than
#: 9 px (a chart's, scaled down to a phone's width) or, in a chart, cut off at its edge.
LOOK = """
function rgb(s) { return (s.match(/[\\d.]+/g) || []).map(Number); }
function lum(c) {
  var v = c.slice(0, 3).map(function (x) { x /= 255; return x <= 0.03928 ? x / 12.92 : Math.pow((x + 0.055) / 1.055, 2.4); });
  return 0.2126 * v[0] + 0.7152 * v[1] + 0.0722 * v[2];
}
function behind(el) {
  for (var e = el; e; e = e.parentElement) {
    var c = rgb(getComputedStyle(e).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c;
  }
  return rgb(getComputedStyle(document.body).backgroundColor);
}
var unreadable = [], small = [], clipped = [];
document.querySelectorAll("body *").forEach(function (el) {
  var own = Array.prototype.some.call(el.childNodes, function (n) { return n.nodeType === 3 && n.textContent.trim(); });
  if (!own || !el.getClientRects().length || getComputedStyle(el).visibility === "hidden") return;
  var size = parseFloat(getComputedStyle(el).fontSize), svg = el.closest("svg");
  if (svg) size *= svg.getScreenCTM().a;  // a chart's text is in its drawing's units, scaled to its width
  if (size < 9) small.push([el.textContent.trim().slice(0, 40), size.toFixed(1)]);
  if (svg) {  // a chart's text must lie within its drawing (beyond it is cut off)
    var box = svg.getBoundingClientRect(), r = el.getBoundingClientRect();
    if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
      clipped.push(el.textContent.trim().slice(0, 40));
  }
  if (svg) return;  // the charts' series are drawn in their own colours, named in the key above
  var fg = rgb(getComputedStyle(el).color), bg = behind(el);
  var a = lum(fg) + 0.05, b = lum(bg) + 0.05, ratio = Math.max(a, b) / Math.min(a, b);
  if (ratio < 4.5) unreadable.push([el.textContent.trim().slice(0, 40), getComputedStyle(el).color, bg.join(","), ratio.toFixed(2)]);
});
var h1 = document.querySelector("h1");
return {
  heading: h1 ? h1.textContent : null,
  background: getComputedStyle(document.body).backgroundColor,
  unreadable: unreadable,
  small: small,
  clipped: clipped,
  sideways: Array.prototype.filter.call(document.querySelectorAll(".scroll"), function (box) {
    return box.scrollWidth > box.clientWidth + 1;
  }).map(function (box) { return box.firstElementChild.className; }),
  filled: Array.prototype.filter.call(document.querySelectorAll("svg .line"), function (l) {
    return getComputedStyle(l).fill !== "none";
  }).length,
  width: document.documentElement.scrollWidth,
};
"""


@contextlib.contextmanager
def a_days_work(broker: PostgresBroker) -> Iterator[dict[str, str]]:
    """What a day of a small application leaves, made by a real worker that goes on running while the
    pages are looked at (two imports running, two prefetched): yields the ids the pages are asked about."""
    release = threading.Event()

    @dramatiq.actor(broker=broker, queue_name="emails", max_retries=1, min_backoff=10, max_backoff=20)
    def send_email(to: str, subject: str = "", fail: bool = False) -> None:
        if fail:
            raise RuntimeError(f"mailbox {to} is full: 552 5.2.2 the recipient's storage quota is exceeded, try later")

    @dramatiq.actor(broker=broker, queue_name="reports")
    def build_report(kind: str, day: int = 0) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name="imports")
    def import_file(path: str) -> None:
        release.wait(60)

    @dramatiq.actor(broker=broker, queue_name="tenants", fairness_key=lambda tenant, n=0: tenant)
    def sync_tenant(tenant: str | None, n: int = 0) -> None:
        pass

    broker.schedules.add(build_report, every=3600, name="hourly-report", args=["hourly"])
    broker.schedules.add(build_report, "0 3 * * *", tz="Europe/Paris", name="nightly-report", args=["full"])
    broker.pause("tenants", create=True)  # its messages stay due: their fairness keys are seen waiting
    with running_worker(broker, threads=2, prefetch=4):
        try:
            done = [send_email.send(f"user{i}@example.com", subject="Your invoice") for i in range(3)]
            dead = [send_email.send(f"{who}@example.com", subject="Welcome", fail=True) for who in ("bob", "carol")]
            reports = [build_report.send("daily", day) for day in range(5)]
            for m in [*done, *dead, *reports]:
                final = "dead" if m in dead else "done"
                wait_for(lambda m=m, f=final: (broker.inspect(m.message_id) or {}).get("state") == f, 30, final)  # type: ignore[misc]
            # An operator runs a schedule now (its scheduler, in the worker, enqueues it) and pauses another
            declared = "SELECT count(*) FROM {schema}.schedule"
            wait_for(lambda: query(broker, declared) == [(2,)], 30, "the schedules declared")
            schedule_control.run_now(broker.database, broker.statements, "hourly-report", who="carol")
            ran = "SELECT message_id FROM {schema}.schedule_run WHERE message_id IS NOT NULL"
            ((tick,),) = wait_for(lambda: query(broker, ran), 30, "the run now taken")
            wait_for(lambda: (broker.inspect(str(tick)) or {}).get("state") == "done", 30, "the run now done")
            schedule_control.pause(broker.database, broker.statements, "nightly-report", who="alice")
            for n in range(4):  # two run (two threads), two wait in the prefetch
                import_file.send(f"s3://uploads/2026/customers-{n}.csv")

            def counted() -> bool:
                with broker.database.connection() as conn:
                    broker.parts.heartbeat.beat(conn)  # the maintenance loop's heartbeat (every 10 s), now
                (per_queue,) = query(broker, "SELECT per_queue FROM {schema}.process WHERE pid = %s", [os.getpid()])[0]
                return bool(per_queue.get("imports") == [2, 2])

            wait_for(counted, 30, "two imports running, two prefetched")
            # A worker process that died five minutes ago, without a clean shutdown: shown stale
            beat(broker, "web-2:31337:9c1e", busy=1, prefetched=0, queue="reports")
            query(broker, "UPDATE {schema}.process SET heartbeat_at = now() - interval '5 minutes' WHERE pid = 31337")
            broker.pause("emails")
            queued = [send_email.send(f"dee{i}@example.com", subject="Reminder") for i in range(3)]
            send_email.send_with_options(args=("eve@example.com",), kwargs={"subject": "Later"}, delay=3_600_000)
            for tenant, n in (("acme", 6), ("globex", 3), ("initech", 2), (None, 1)):
                for i in range(n):
                    sync_tenant.send(tenant, i)
            query(broker, "INSERT INTO {schema}.fairness_weight VALUES ('tenants', 'acme', 3)")
            # Operators' actions, in the audit log
            broker.bulk("cancel", who="alice", ids=[queued[0].message_id])
            broker.bulk("purge", who="bob", queue="emails", state="cancelled")
            # An hour of the charts' samples, as the maintenance loop takes them once a minute
            query(broker, """
                INSERT INTO {schema}.queue_minute (queue_name, minute, due, oldest_due_seconds, done, dead, retried)
                SELECT q, date_trunc('minute', now()) - i * interval '1 minute',
                       (20 + 15 * sin(i / 9.0))::bigint, 5 + 40 * (1 + cos(i / 7.0)),
                       (60 + 30 * sin(i / 5.0))::bigint, (i % 17 = 0)::int * 3, (i % 6 = 0)::int * 2
                  FROM generate_series(2, 59) AS i, unnest(ARRAY['', 'emails']) AS q
                 WHERE i NOT BETWEEN 30 AND 39
                ON CONFLICT DO NOTHING""")  # fmt: skip
            yield {"dead": dead[0].message_id}
        finally:
            release.set()  # the imports finish: the worker stops


def pages(ids: dict[str, str]) -> list[tuple[str, str, str]]:
    """Every page: (its name in the screenshots, its path, its heading)."""
    return [
        ("queues", "/", "Queues"),
        ("messages", "/messages?queue=emails&state=dead", "Messages"),
        ("running", "/messages?queue=imports&state=running", "Messages"),
        ("fair-keys", "/messages?queue=tenants&state=queued", "Messages"),
        ("message", f"/message/{ids['dead']}", f"Message {ids['dead']}"),
        ("search", "/search?queue=emails", "Search"),
        ("charts", "/charts?queue=emails", "Charts"),
        ("processes", "/processes", "Processes"),
        ("schedules", "/schedules", "Schedules"),
        ("schedule", "/schedules?name=hourly-report", "Schedule hourly-report"),
        ("database", "/database", "Database"),
        ("audit", "/audit", "Audit log"),
        ("bulk", "/bulk?action=redrive&scope=filter&queue=emails&state=dead", "Bulk action"),
        ("purge", "/purge?queue=emails&state=dead", "Purge"),
        ("pause", "/confirm?action=pause&queue=reports", "Pause queue"),
    ]


VIEWS = [(theme, device) for device in ("desktop", "phone") for theme in ("light", "dark")]


# ~18-21 s: 16 pages x 4 views in one headless Chromium, each page's contrast and width measured by
# script and its screenshot written (64 page loads).
def test_every_page_in_light_and_dark_at_a_desktops_and_a_phones_width(
    dramatiq_pg_broker: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    """Given the queues, messages, processes, schedules and actions a real worker and operators left, I
    expect every page, in light and dark at 1400 and 390 px: answered (200) with its heading, in the theme
    asked for, every text readable on its background and 9 px or more, no chart line filled; at 1400 px
    every table within the page, at 390 px the page never wider than the phone."""
    broker, d = dramatiq_pg_broker, chrome
    d.set_window_size(1400, 900)
    with (
        a_days_work(broker) as ids,
        serving(dashboard_app(broker, actions=True, live=0)) as url,
        serving(dashboard_app(broker, actions=True, live=0, auth="ops:s3cret", login=True)) as login_url,
    ):
        every = [(name, url + path, heading) for name, path, heading in pages(ids)]
        every.append(("login", login_url + "/login", "Log in"))
        for _, address, _ in every:
            with urllib.request.urlopen(address) as answer:  # (the browser does not tell the status)
                assert answer.status == 200, address
        problems: list[Any] = []  # every page's, then one assert: a change that breaks several pages names them all
        for theme, device in VIEWS:
            emulate(d, dark=theme == "dark", width=PHONE if device == "phone" else None)
            for name, address, heading in every:
                d.get(address)
                screenshot(d, f"dashboard-page-{name}-{theme}-{device}.png")
                seen = d.execute_script(LOOK)
                wanted: dict[str, Any] = {"heading": heading, "background": BACKGROUND[theme], "unreadable": [],
                                          "small": [], "clipped": [], "filled": 0}  # fmt: skip
                if device == "phone":  # as wide as the phone: a list is cards, another table scrolls in its box
                    wanted["width"] = PHONE
                    wanted["sideways"] = [c for c in seen["sideways"] if "cards" not in c]
                else:  # every table fits
                    wanted["sideways"] = []
                    seen.pop("width")
                if seen != wanted:
                    problems.append((name, theme, device, {k: v for k, v in seen.items() if v != wanted[k]}))
        assert problems == [], "\n".join(map(str, problems))
        emulate(d, dark=False)
