"""The bulk actions' pages: the question before a bulk action (how many messages it touches, counted now),
and the audit log of those done (:mod:`..bulk`).

A bulk action starts on the search page (:func:`.console_pages.search_page`): on the rows
ticked there, or on every message its filters match.  Its button leads here, to
``GET /bulk``, which counts (:func:`..bulk.bulk_preview`, on the primary) and asks; only
the question's own form (``POST /action``, ``action=bulk``, with the page's token and
``confirm=yes``) acts, through :func:`..bulk.bulk`, which records who did what in the
audit table before acting.  ``/audit`` lists those records, newest first.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable
from typing import Any

from ..ops import bulk
from ..ops.fleet import Fleet
from .console_pages import BULK_LABELS, SEARCH_FIELDS, search_query
from .render import PAGE_SIZE, away_note, esc, href, html_table, none_answered, utc_time

#: The buttons' words for each action.
LABELS = BULK_LABELS
#: The audit log's words for each action it records: the bulk actions' and the schedules' (schedule_control).
AUDIT_WORDS = {**LABELS, "schedule_pause": "Pause schedule", "schedule_resume": "Resume schedule",
               "schedule_run_now": "Run schedule now"}  # fmt: skip
#: What each action applies to, said in the question.
APPLIES = {
    "redrive": "dead or cancelled",
    "cancel": "queued or running",
    "purge": "queued, dead, cancelled or kept (done)",
    "run_now": "delayed (queued, due later)",
}


def selection(query: dict[str, str], ids: list[str]) -> dict[str, Any]:
    """The keywords of :func:`..bulk.bulk` for a request: the ticked *ids* (``scope=selected``), or the search's
    filters (``scope=filter``).  ``ValueError`` when there is nothing to act on."""
    if query.get("scope") == "selected":
        if not ids:
            raise ValueError("no row selected: tick the rows to act on, or act on every message of the search")
        return {"ids": ids}
    if query.get("scope") != "filter":
        raise ValueError("scope is 'selected' (the rows ticked) or 'filter' (every message the search matches)")
    wanted = search_query(query)
    wanted.pop("message_id", None)
    if not wanted:
        raise ValueError("give the search a filter (queue, actor, state, args, kwargs): nothing selects every message")
    return wanted


def request_ids(query_string: str) -> list[str]:
    """Every ``ids`` of a query string or form (repeated, or comma-separated), in order, once each."""
    found: list[str] = []
    for name, value in urllib.parse.parse_qsl(query_string):
        if name == "ids":
            found += [v.strip() for v in value.split(",") if v.strip()]
    return list(dict.fromkeys(found))


def question(action: str, count: str, plural: str, chosen: dict[str, Any]) -> str:
    """The question itself: "Re-drive 137 dead messages of queue work?" (issue 42, point 3)."""
    if "ids" in chosen:
        return f"{LABELS[action]} {count} message{plural}: the {APPLIES[action]} ones of {describe(action, chosen)}?"
    rest = {k: v for k, v in chosen.items() if k not in ("state", "queue")}
    kind = f"{chosen['state']} " if chosen.get("state") else ""
    text = f"{LABELS[action]} {count} {kind}message{plural}"
    text += f" of queue {chosen['queue']}" if chosen.get("queue") else ""
    if rest:
        text += ", " + ", ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in rest.items())
    return text + ("?" if kind else f" ({APPLIES[action]})?")


def describe(action: str, chosen: dict[str, Any]) -> str:
    """The selection in words: "the 3 selected messages" or "messages of queue emails, state dead"."""
    if "ids" in chosen:
        n = len(chosen["ids"])
        return f"the {n} selected message{'' if n == 1 else 's'}"
    parts = [f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in chosen.items()]
    return "messages of " + ", ".join(parts)


def bulk_page(
    targets: Callable[[dict[str, Any]], list[tuple[Any, str, dict[str, Any]]]],
    query: dict[str, str],
    ids: list[str],
    form: Callable[..., str],
) -> str:
    """``GET /bulk``: how many messages the action would touch now, and the button that does it.
    *targets*: the selection per database, as (site, its label, its part of the selection)
    (``Dashboard._bulk_targets``); with several, the count is said per database."""
    action = query.get("action", "")
    if action not in bulk.ACTIONS:
        raise ValueError(f"unknown action {action!r}: one of {', '.join(bulk.ACTIONS)}")
    chosen = selection(query, ids)
    counted = [
        (label, bulk.bulk_preview(site.database, site.statements, action, **mine))
        for site, label, mine in targets(chosen)
    ]
    preview = bulk.Preview(action, sum(p.count for _, p in counted), any(p.more for _, p in counted))
    per_database = ", ".join(f"{p.count:,} in {label}" for label, p in counted if label and p.count)
    back = href("/search", **{f: query[f] for f in SEARCH_FIELDS if query.get(f)})
    what = describe(action, chosen)
    if not preview.count:
        return (
            f"<p id=nothing>Nothing to {esc(LABELS[action].lower())}: none of {esc(what)} is "
            f'{esc(APPLIES[action])}.</p><p><a href="{back}">Back to the search</a></p>'
        )
    count = f"{preview.count:,}"
    more = (
        f"<p class=note id=more>More than {bulk.MAX_BULK:,} match: this touches the first {bulk.MAX_BULK:,} "
        "(in key order); ask again for the rest.</p>"
        if preview.more
        else ""
    )
    fields = {"bulk_action": action, "scope": query["scope"], "confirm": "yes"}
    if "ids" in chosen:
        fields["ids"] = ",".join(chosen["ids"])
    else:
        fields.update({f: query[f] for f in SEARCH_FIELDS if f != "id" and query.get(f)})
    plural = "" if preview.count == 1 else "s"
    button = form("bulk", f"{LABELS[action]} {count} message{plural}", fields, "/audit", danger=True)
    where = f" ({per_database}; each database's action is recorded in its own audit log)" if per_database else ""
    return (
        f"<p id=question class=question>{esc(question(action, count, plural, chosen))}{esc(where)}</p>{more}"
        "<p class=note>Counted just now; messages that change meanwhile are acted on as they are then (each "
        "step checks the state again), and what is done is recorded in the audit log with your name.</p>"
        f'<p class=actions>{button} <a href="{back}" id=back>Back, doing nothing</a></p>'
    )


def audit_page(fleet: Fleet, query: dict[str, str]) -> str:
    """``/audit``: the bulk actions done, newest first: who, when, what, on which selection, how many.
    Of several databases, each database's log (kept where its actions touched), or one's (``database=``)."""
    if not fleet.several:
        return _audit_log(fleet.sites[0], query) + AUDIT_NOTE
    named = query.get("database") or None
    shown = [fleet.site(named)] if named is not None else list(fleet)
    read, away = fleet.each(lambda s: _audit_log(s, query if named else {}), shown)
    if not read:
        raise none_answered(away)
    return away_note(away) + "".join(f"<h2>Database {esc(s.name)}</h2>" + log for s, log in read) + AUDIT_NOTE


def _audit_log(site: Any, query: dict[str, str]) -> str:
    """One database's audit log, a page at a time."""
    page = bulk.audit_log(site.reader, site.statements, after=query.get("after") or None, limit=PAGE_SIZE)
    heads = ["#", "when", "who", "action", "selection", "counted", "touched", "skipped", "ended"]
    rows = [
        [
            str(r["id"]),
            utc_time(r["at"], short=True),
            esc(r["who"]),
            esc(AUDIT_WORDS.get(r["action"], r["action"])),
            f"<code>{esc(_selection_text(r['selection']))}</code>",
            f"{r['previewed']:,}",
            "" if r["touched"] is None else f"{r['touched']:,}",
            "" if r["skipped"] is None else f"{r['skipped']:,}",
            utc_time(r["ended_at"], short=True) if r["ended_at"] else "<span class='badge stale'>not finished</span>",
        ]
        for r in page.rows
    ]
    body = html_table(heads, rows, cls="audit", cards=True) if rows else "<p id=empty>No bulk action yet.</p>"
    if page.next:
        body += f'<p><a id=next href="{href("/audit", after=page.next, database=site.name)}">Older</a></p>'
    return body


AUDIT_NOTE = (
    "<p class=note>Every bulk action of the console (and <code>broker.bulk()</code>), recorded before it "
    "acts: a row without an end never finished (the process stopped). Times in UTC.</p>"
)


def _selection_text(selection: Any) -> str:
    if isinstance(selection, str):
        selection = json.loads(selection)
    shown = dict(selection)
    ids = shown.pop("ids", None)
    count = shown.pop("ids_count", None)
    text = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in shown.items())
    if count is not None:
        first = ", ".join(i[:8] for i in (ids or [])[:3])
        text += (", " if text else "") + f"{count} id{'' if count == 1 else 's'} ({first}{', …' if count > 3 else ''})"
    return text
