"""The console's pages over :mod:`..console`'s data: worker processes, charts, search (more as the data side lands).

Each page is a function of the reader and the bound statements returning its body; the
app (:mod:`.app`) routes to it and wraps it in the layout.  Costs: the process table has
a row per worker process (purged an hour after its last heartbeat), read in one statement.
"""

from __future__ import annotations

import json
from typing import Any

from ..core.processes import processes
from ..ops import admin, charts, search
from ..ops.fleet import Fleet
from . import svg
from .render import PAGE_SIZE, ROOT, HTTPError, age_text, away_note, esc, href, html_table, none_answered, utc_time
from .timing_pages import timing_charts


def processes_page(fleet: Fleet) -> str:
    """Every worker process: where it runs, its queues and threads, how many actors run now (busy) and how
    many deliveries wait in its prefetch, since when, its last heartbeat; stale ones marked.  Of every
    database, each process under the database it registered in (a process consuming queues of two
    databases is a row in each)."""
    read, away = fleet.each(lambda site: processes(site.reader, site.statements))
    found = [{**p, "database": site.name} for site, rows in read for p in rows]
    if not found:
        return away_note(away) + (
            "<p id=empty>No worker process has registered (workers register when they start, and every "
            "heartbeat after).</p>"
        )
    live = [p for p in found if not p["stale"]]
    stale = len(found) - len(live)
    summary = (
        f"<p id=summary>{len(live)} process{'' if len(live) == 1 else 'es'} alive: "
        f"{sum(p['busy'] for p in live)} busy of {sum(p['threads'] for p in live)} threads, "
        f"{sum(p['prefetched'] for p in live)} prefetched"
        + (f"; <span class='badge stale'>{stale} stale</span>" if stale else "")
        + ".</p>"
    )
    heads = ["process", "host", "pid", "queues", "threads", "busy", "prefetched", "per queue (busy / prefetched)",
             "version", "started", "last heartbeat", "status"]  # fmt: skip
    if fleet.several:
        heads.insert(0, "database")
    rows = []
    for p in found:
        per_queue = ", ".join(f"{esc(q)} {c['busy']} / {c['prefetched']}" for q, c in sorted(p["per_queue"].items()))
        rows.append([
            f"<span class=mid>{esc(p['process_id'])}</span>",
            f"<span class=nowrap>{esc(p['host'])}</span>",
            str(p["pid"]),
            esc(", ".join(sorted(p["queues"]))),
            str(p["threads"]),
            str(p["busy"]),
            str(p["prefetched"]),
            per_queue,
            esc(p["version"]),
            utc_time(p["started_at"], short=True),
            f"{age_text(p['heartbeat_age'])} ago",
            "<span class='badge stale'>stale</span> no heartbeat: stopped, or hung" if p["stale"] else "alive",
        ])  # fmt: skip
        if fleet.several:
            rows[-1].insert(0, f"<span class=database>{esc(p['database'])}</span>")
    note = (
        "<p class=note>Busy and prefetched as of each process's last heartbeat (every few seconds). A stale "
        "process's row goes an hour after its last heartbeat; the messages it held come back when their "
        "leases expire. Times in UTC.</p>"
    )
    return away_note(away) + summary + html_table(heads, rows, cls="processes", cards=True) + note


def charts_page(fleet: Fleet, queues: list[str], query: dict[str, str]) -> str:
    """Per queue or overall, over the last hour or day, one point per minute: finished, failed and retried
    messages, due depth, oldest due age (:func:`..charts.series`: what the broker keeps, sampled a minute
    at a time by the workers' maintenance loop).  Of several databases: summed over them (the oldest due
    age: the oldest of them), or one database's (``database=``)."""
    queue = query.get("queue") or None
    named = query.get("database") or None
    shown = [fleet.site(named)] if named is not None else list(fleet)
    span = query.get("span") or "hour"
    if span not in charts.SPANS:
        raise ValueError(f"span is one of {', '.join(charts.SPANS)}, not {span!r}")
    if queue is not None and queue not in queues:
        raise HTTPError("404 Not Found", f"no queue {queue!r} (known: {', '.join(queues) or 'none'})")
    read, away = fleet.each(lambda s: charts.series(s.reader, s.statements, queue=queue, span=span), shown)
    if not read:
        raise none_answered(away)
    data = _summed([series for _, series in read])
    options = "<option value=''>all queues</option>" + "".join(
        f"<option{' selected' if q == queue else ''}>{esc(q)}</option>" for q in queues
    )
    spans = "".join(
        f'<a href="{href("/charts", queue=queue or "", span=s, database=named or "")}"'
        f"{' aria-current=page' if s == span else ''}>last {s}</a>"
        for s in charts.SPANS
    )
    databases = ""
    if fleet.several:
        choices = "<option value=''>all databases, summed</option>" + "".join(
            f"<option{' selected' if s.name == named else ''}>{esc(s.name)}</option>" for s in fleet
        )
        databases = f"<label>database <select name=database id=database>{choices}</select></label> "
    form = (
        f'<form method=get action="{ROOT.get()}/charts" class=filters><label>queue <select name=queue id=queue>'
        f"{options}</select></label> {databases}<input type=hidden name=span value={esc(span)}> "
        f"<button id=show>Show</button> <span class=spans>{spans}</span></form>"
    )
    what = f"queue {queue}" if queue else "all queues"
    if fleet.several:
        what += f", database {named}" if named else f", {len(shown)} databases summed"
    totals = (
        f"<p id=totals>In the last {span}, {what}: {sum(data.finished):,} finished, {sum(data.failed):,} failed "
        f"(dead-lettered), {sum(data.retried):,} retried.</p>"
    )
    outcomes = svg.line_chart(
        "Outcomes per minute",
        data.minutes,
        [("finished", data.finished), ("failed", data.failed), ("retried", data.retried)],
        chart_id="outcomes",
        y_label="messages / minute",
    )
    depth = svg.line_chart(
        "Due messages (depth)", data.minutes, [("due", data.due)], chart_id="depth", y_label="messages"
    )
    age = svg.line_chart(
        "Oldest due message's age", data.minutes, [("oldest due", data.oldest_due_seconds)], unit=lambda v: age_text(v) if v else "0",
        chart_id="age", y_label="age",
    )  # fmt: skip
    times, times_line, times_note, slow = timing_charts(fleet, [s for s, _ in read], queue, span, data.minutes)
    note = (
        "<p class=note>One point per minute, times in UTC. Depth and age are sampled as each minute begins by a "
        "running worker's maintenance loop: a gap is a minute without a sample (no worker ran). Kept a day.</p>"
    )
    away += [name for name in slow if name not in away]
    return (
        away_note(away) + form + totals + times_line
        + f"<div class=charts>{outcomes}{depth}{age}{times}</div>" + note + times_note
    )  # fmt: skip


def _summed(each: list[charts.Series]) -> charts.Series:
    """One series of several databases' (a minute's points added up; the oldest due age: the largest).
    The minutes are the first database's: the others' points are added by position (each database counts
    its last hour or day by its own clock, one point a minute)."""
    first = each[0]
    if len(each) == 1:
        return first

    def add(lists: list[list[Any]], pick: Any = sum) -> list[Any]:
        out = []
        for i in range(len(first.minutes)):
            values = [v[i] for v in lists if i < len(v) and v[i] is not None]
            out.append(pick(values) if values else None)
        return out

    return charts.Series(
        queue=first.queue,
        span=first.span,
        minutes=first.minutes,
        finished=[n or 0 for n in add([s.finished for s in each])],
        failed=[n or 0 for n in add([s.failed for s in each])],
        retried=[n or 0 for n in add([s.retried for s in each])],
        due=add([s.due for s in each]),
        oldest_due_seconds=add([s.oldest_due_seconds for s in each], max),
    )


#: The search form's fields, as the query string carries them.
SEARCH_FIELDS = ("id", "queue", "actor", "state", "args", "kwargs")


def search_query(query: dict[str, str]) -> dict[str, Any]:
    """The search's keywords from the form (``ValueError``, said on the page, for a bad one)."""
    wanted: dict[str, Any] = {}
    if query.get("id", "").strip():
        wanted["message_id"] = query["id"].strip()
    for field in ("queue", "actor", "state"):
        if query.get(field, "").strip():
            wanted[field] = query[field].strip()
    for field, kind, example in (("args", list, "[42]"), ("kwargs", dict, '{"user": 7}')):
        text = query.get(field, "").strip()
        if not text:
            continue
        if field == "args" and text[:1] not in ("[", "{"):  # a plain value, as people type it
            wanted["value"] = text
            continue
        try:
            value = json.loads(text)
        except ValueError:
            raise ValueError(f"{field}: not JSON ({example}, say)") from None
        if not isinstance(value, kind):
            raise ValueError(f"{field}: a JSON {'list' if kind is list else 'object'}, such as {example}")
        wanted[field] = value
    return wanted


def search_page(fleet: Fleet, queues: list[str], query: dict[str, str], *, actions: bool = False) -> str:
    """``/search``: messages by id, queue, actor, state and argument values (JSON containment), in the message
    table and the history, a keyset page at a time (:func:`..search.search`).  With *actions*, a tick box per
    row and the bulk actions, on the rows ticked or on every message the search matches (they ask first:
    ``/bulk``).  Of several databases: one page in key order across them, each row naming its database."""
    queue_options = "<option value=''>any</option>" + "".join(
        f"<option{' selected' if q == query.get('queue') else ''}>{esc(q)}</option>" for q in queues
    )
    state_options = "<option value=''>any</option>" + "".join(
        f"<option{' selected' if s == query.get('state') else ''}>{s}</option>" for s in admin.LISTABLE
    )
    form = (
        f'<form method=get action="{ROOT.get()}/search" class="filters search">'
        f'<label>message id <input name=id id=s-id value="{esc(query.get("id", ""))}" size=36></label> '
        f"<label>queue <select name=queue id=s-queue>{queue_options}</select></label> "
        f'<label>actor <input name=actor id=s-actor value="{esc(query.get("actor", ""))}" placeholder=any></label> '
        f"<label>state <select name=state id=s-state>{state_options}</select></label> "
        f'<label>arguments hold <input name=args id=s-args value="{esc(query.get("args", ""))}" placeholder="alice, 42 or [42]"></label> '
        f'<label>kwargs contain <input name=kwargs id=s-kwargs value="{esc(query.get("kwargs", ""))}" '
        "placeholder='{\"user\": 7}'></label> <button id=search>Search</button></form>"
    )
    if not any(query.get(f, "").strip() for f in SEARCH_FIELDS) and "go" not in query:
        hint = (
            "<p class=note>Every field is optional; all those given must match. <b>arguments hold</b>: a value "
            "(<code>alice</code>, <code>42</code>, an id; <code>\"42\"</code> quoted: that string only) that one "
            "of the arguments, positional or keyword, equals, at any depth; or a JSON list of values the positional "
            "arguments include (<code>[42, \"a\"]</code>); <b>kwargs contain</b>: a JSON object the keyword "
            "arguments include (JSON containment). Queued, running, dead and cancelled messages, and the finished "
            "ones kept in the history.</p>"
        )
        return form + hint
    away: list[str] = []
    try:
        wanted = search_query(query)
        if fleet.several:
            sources = [(s.name, s.reader, s.statements) for s in fleet]
            page = search.search_many(sources, after=query.get("after") or None, limit=PAGE_SIZE, away=away, **wanted)
            if len(away) == len(sources):
                raise none_answered(away)
        else:
            site = fleet.sites[0]
            page = search.search(
                site.reader, site.statements, after=query.get("after") or None, limit=PAGE_SIZE, **wanted
            )
    except ValueError as e:
        return form + f"<p class=error id=search-error>{esc(e)}</p>"
    heads = ["message", "queue", "actor", "state", "attempt", "enqueued", "finished", "arguments", "last error"]
    rows = [
        [
            f'<a class=mid href="{ROOT.get()}/message/{esc(r["message_id"])}">{esc(r["message_id"])}</a>',
            esc(r["queue_name"]),
            esc(r["actor_name"]),
            esc(r["state"]),
            str(r["attempt"]),
            utc_time(r["enqueued_at"], short=True),
            utc_time(r["finished_at"], short=True),
            "" if r.get("decode_error") else f"<code>{esc(_short_json(r['args'], r['kwargs']))}</code>",
            f"<span class=err>{esc(admin.error_summary(r['last_error'], limit=120))}</span>" if r["last_error"] else "",
        ]
        for r in page.rows
    ]
    if fleet.several:
        heads.insert(1, "database")
        for r, cells in zip(page.rows, rows, strict=True):
            cells.insert(1, f"<span class=database>{esc(r['database'])}</span>")
    if actions and rows:
        heads.insert(0, "")
        for r, cells in zip(page.rows, rows, strict=True):
            mid = esc(r["message_id"])
            cells.insert(0, f'<input type=checkbox name=ids value="{mid}" form=bulk aria-label="select {mid}">')
    body = (
        form
        + away_note(away)
        + (html_table(heads, rows, cls="found", cards=True) if rows else "<p id=empty>No message matches.</p>")
    )
    if actions and rows:
        body += _bulk_form(query)
    if page.searched:
        body += f"<p class=note id=searched>Read {page.searched:,} messages without filling the page; more may match further on.</p>"
    if page.next:
        kept = {f: query[f] for f in SEARCH_FIELDS if query.get(f)}
        body += f'<p><a id=next href="{href("/search", **kept, after=page.next)}">Next page</a></p>'
    body += "<p class=note>In key order (message id), not by time; times in UTC.</p>"
    return body


def _short_json(args: Any, kwargs: Any, limit: int = 120) -> str:
    text = json.dumps(args, ensure_ascii=False, default=repr)[1:-1]
    if kwargs:
        text += (", " if text else "") + ", ".join(
            f"{k}={json.dumps(v, ensure_ascii=False, default=repr)}" for k, v in kwargs.items()
        )
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _bulk_form(query: dict[str, str]) -> str:
    """The bulk actions under a search's results: an action, on the rows ticked or on all the search matches."""
    kept = "".join(
        f'<input type=hidden name="{f}" value="{esc(query[f])}">' for f in SEARCH_FIELDS if f != "id" and query.get(f)
    )
    actions = "".join(f'<option value="{a}">{label}</option>' for a, label in BULK_LABELS.items())
    filtered = any(query.get(f, "").strip() for f in SEARCH_FIELDS if f != "id")
    every = (
        "<button name=scope value=filter id=bulk-filter>On every message of this search…</button>" if filtered else ""
    )
    return (
        f'<form method=get action="{ROOT.get()}/bulk" id=bulk class=actions>{kept}'
        f"<label>Bulk action <select name=action id=bulk-action>{actions}</select></label> "
        f"<button name=scope value=selected id=bulk-selected>On the rows ticked…</button> {every}"
        "<span class=note> Each asks first, saying how many messages it touches.</span></form>"
    )


#: The bulk actions, as the search page offers them.
BULK_LABELS = {"redrive": "Re-drive", "cancel": "Cancel", "run_now": "Run now", "purge": "Purge"}
