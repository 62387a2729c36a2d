"""The schedules pages: every schedule with its last and next tick, and one schedule's recent ticks.

What an operator asks of a schedule: does it still tick (its next tick; ``stale`` when no
running scheduler declares it), what did its last tick send (that message, linked), and
were ticks missed.  Two kinds of missed ticks are shown: **overdue** ones, due more than
the schedule's grace ago and not enqueued (no scheduler runs it now), and **gaps**
between the recorded ticks of one schedule (ticks no scheduler enqueued then: skipped,
or collapsed into one by ``missed="once"``).  Both are counted from the schedule's
timing by :func:`missed_between`, capped at :data:`MISSED_CAP` per interval.

Reads: the ``schedule_list`` statement (one row per schedule, as the CLI's ``schedules``
command), and for one schedule ``schedule_ticks`` (its newest :data:`TICKS_SHOWN` tick
records, by the table's primary key).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

from ..db.database import Database
from ..db.statements import Statements
from ..features import schedules
from ..ops.fleet import Fleet
from .render import ROOT, HTTPError, away_note, esc, href, html_table, utc_time

#: Missed ticks are counted up to here, per interval (shown as "1000+").
MISSED_CAP = 1000
#: A schedule's page lists this many of its newest recorded ticks.
TICKS_SHOWN = 30


def missed_between(timing: schedules.Timing, since: datetime, until: datetime, cap: int = MISSED_CAP) -> int:
    """How many ticks of *timing* fall strictly after *since* and strictly before *until*, up to *cap* + 1."""
    count = 0
    try:
        tick = timing.after(since)
        while tick is not None and tick < until and count <= cap:
            count += 1
            tick = timing.after(tick)
    except ValueError:  # (schedules.CronError too) a definition stored by another version of the rules
        return 0
    return count


def _missed_text(n: int) -> str:
    return f"{MISSED_CAP:,}+" if n > MISSED_CAP else f"{n:,}"


def _timing(row: dict[str, Any]) -> schedules.Timing:
    return schedules.Timing(row["cron"], row["timezone"], row["every_ms"])


def overdue(row: dict[str, Any], now: datetime) -> int:
    """Ticks of a schedule (a row of :func:`.schedules.overview`) due more than its grace before *now* and
    not enqueued: counted from its last tick, or from its last change (earlier ticks never count)."""
    if row.get("paused_at"):
        return 0  # paused by an operator: nothing is owed
    start = max(row["changed_at"], row.get("resumed_at") or row["changed_at"])  # a resume owes nothing before it
    since = max(row["last_tick"] or start, start)
    cut = now - timedelta(milliseconds=row["grace_ms"])
    return missed_between(_timing(row), since, cut + timedelta(microseconds=1)) if since < cut else 0


def _status(row: dict[str, Any]) -> str:
    pending = row.get("runs_pending") or 0
    run = f"; <span class=badge id=runs-pending>run now: {pending} pending</span>" if pending else ""
    if row.get("paused_at"):
        by = f" by {esc(row['paused_by'])}" if row.get("paused_by") else ""
        return f"<span class='badge paused'>paused</span>{by} since {utc_time(row['paused_at'], short=True)}{run}"
    return _running_status(row) + run


def _running_status(row: dict[str, Any]) -> str:
    if row["stale"]:
        return "<span class='badge stale'>stale</span> no scheduler declares it"
    if row["outdated"]:
        return "active; an older definition is still declared"
    return "active"


def _message_link(message_id: str | None) -> str:
    if not message_id:
        return ""
    return f'<a class=mid href="{ROOT.get()}/message/{esc(message_id)}">{esc(message_id)}</a>'


Buttons = Callable[[Any, dict[str, Any], str], str]


def schedules_page(fleet: Fleet, query: dict[str, str], buttons: Buttons | None = None) -> tuple[str, str]:
    """``/schedules`` (every schedule), or ``/schedules?name=N`` (one, with its recent ticks): (title, body).
    Of several databases, every database's schedules (each kept with its queue's database), named."""
    read, away = fleet.each(lambda site: schedules.overview(site.reader, site.statements))
    sited = [(site, r) for site, rows in read for r in rows]
    now = datetime.now(timezone.utc)  # this server's clock: it only counts what to show
    name = query.get("name")
    if name is not None:
        found = [(site, r) for site, r in sited if r["name"] == name]
        if not found:
            raise HTTPError("404 Not Found", f"no schedule {name!r}")
        site, row = found[0]
        one = _one(site.reader, site.statements, row, now, site.name)
        if buttons is not None:
            one = f"<p class=actions>{buttons(site, row, f'/schedules?name={name}')}</p>" + one
        return f"Schedule {name}", one
    heads = ["schedule", "actor", "queue", "when", "missed ticks", "last tick", "its message", "next tick",
             "overdue", "status"] + ([""] if buttons is not None else [])  # fmt: skip
    if fleet.several:
        heads.insert(0, "database")
    body = []
    for site, r in sited:
        late = 0 if r["stale"] else overdue(r, now)
        body.append([
            f'<a href="{href("/schedules", name=r["name"])}">{esc(r["name"])}</a>',
            esc(r["actor_name"]),
            f'<a href="{href("/messages", queue=r["queue_name"], database=site.name)}">{esc(r["queue_name"])}</a>',
            esc(r["schedule"]) + (f" (version {esc(r['version'])})" if r["version"] else ""),
            esc(r["missed"]),
            utc_time(r["last_tick"], short=True),
            _message_link(r["last_message_id"]),
            utc_time(r["next_tick"], short=True),
            f"<span class='badge stale'>{_missed_text(late)} missed</span>" if late else "",
            _status(r),
            *([buttons(site, r, "/schedules")] if buttons is not None else []),
        ])  # fmt: skip
        if fleet.several:
            body[-1].insert(0, f"<span class=database>{esc(site.name)}</span>")
    if not body:
        return "Schedules", away_note(away) + "<p id=empty>No schedules (declare them with <code>@schedule</code>; see the docs).</p>"
    note = (
        "<p class=note>Times in UTC. <b>missed ticks</b>: the policy for ticks missed while no scheduler ran "
        "(once: the latest of them is enqueued; skip: none). <b>overdue</b>: ticks due longer ago than the "
        "schedule's grace and not enqueued. <b>stale</b>: no running scheduler declares it (removed from the "
        "code): nobody enqueues it; <code>dramatiq-pg-fenced schedules --forget NAME</code> removes it.</p>"
    )
    return "Schedules", away_note(away) + html_table(heads, body, cls="schedules", cards=True) + note


def _one(reader: Database, statements: Statements, row: dict[str, Any], now: datetime, database: str = "") -> str:
    late = 0 if row["stale"] else overdue(row, now)
    fields = [*([("database", esc(database))] if database else []),
        ("actor", esc(row["actor_name"])),
        ("queue", f'<a href="{href("/messages", queue=row["queue_name"], database=database)}">{esc(row["queue_name"])}</a>'),
        ("when", esc(row["schedule"])),
        ("missed ticks", f"{esc(row['missed'])}; grace {row['grace_ms'] / 1000:g} s"),
        ("version", esc(row["version"])),
        ("declared first", utc_time(row["created_at"])),
        ("definition since", utc_time(row["changed_at"])),
        ("last declared", utc_time(row["seen_at"])),
        ("last tick", utc_time(row["last_tick"])),
        ("its message", _message_link(row["last_message_id"])),
        ("next tick", utc_time(row["next_tick"])),
        ("overdue", f"<span class='badge stale' id=overdue>{_missed_text(late)} missed</span>" if late else "none"),
        ("status", _status(row)),
    ]
    body = "<div class=scroll><table class=fields>"
    body += "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in fields) + "</table></div>"
    ticks = reader.run(lambda conn: conn.execute(statements.schedule_ticks, [row["name"], TICKS_SHOWN]).fetchall())
    timing = _timing(row)
    heads = ["tick", "message", "enqueued", "late by", "missed before it"]
    lines = []
    for i, (tick, message_id, enqueued_at) in enumerate(ticks):
        older = ticks[i + 1][0] if i + 1 < len(ticks) else None
        gap = missed_between(timing, older, tick) if older is not None else 0
        lines.append([
            utc_time(tick),
            _message_link(str(message_id)),
            utc_time(enqueued_at),
            f"{(enqueued_at - tick).total_seconds():.1f} s",
            f"<span class='badge stale'>{_missed_text(gap)}</span>" if gap else "",
        ])  # fmt: skip
    body += f"<h2>Recent ticks</h2><p class=note>The newest {TICKS_SHOWN} recorded (kept a day); times in UTC.</p>"
    body += html_table(heads, lines, cls="ticks") if lines else "<p id=no-ticks>No tick recorded.</p>"
    return body
