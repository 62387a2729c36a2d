"""The dashboard's queue and message pages (the queues, a purge's question, the messages of a
queue, one message) and the layout every page shares: :class:`QueuePages`, a part of
:class:`~.app.Dashboard`."""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..config import Settings
from ..db.database import Database
from ..db.statements import FINISHED_STATES, Statements, check_queue
from ..ops import admin, listing, timings
from ..ops.fleet import Fleet, Site
from . import row_actions
from .guards import Sessions
from .health_pages import health_summary
from .render import (
    COUNT_CAP,
    PAGE_SIZE,
    PURGE_COUNT_CAP,
    ROOT,
    HTTPError,
    age_text,
    away_note,
    count_text,
    esc,
    flash_note,
    href,
    html_table,
    many_text,
    pretty_json,
    purge_question,
    static_name,
    utc_time,
)
from .running import running_badge
from .story import story_section
from .timing_pages import queue_sparkline

#: The header's links: (path, name).
PAGES = (("/", "Queues"), ("/messages", "Messages"), ("/search", "Search"), ("/charts", "Charts"), ("/processes", "Processes"),
         ("/schedules", "Schedules"), ("/database", "Database"), ("/audit", "Audit"), ("/metrics", "Metrics"))  # fmt: skip


def fair_keys_section(fair: dict[str, Any] | None) -> str:
    """A queue's "Fairness keys" (:func:`.admin.fair_keys`): its top keys by due messages, each with its
    oldest wait and its weight if the ``fairness_weight`` table sets one, then the other keys summed up;
    nothing for a queue without keyed messages due."""
    if not fair:
        return ""
    rows = [
        [
            f"<code>{esc(k['key'])}</code>" if k["key"] else "<em>(no key)</em>",
            f"{k['due']:,}",
            age_text(k["oldest_wait_seconds"]),
            "" if k["weight"] is None else f"{k['weight']:g}",
        ]
        for k in fair["top"]
    ]
    if fair["other_keys"]:
        rows.append([f"<em>{fair['other_keys']:,} other key{'s' if fair['other_keys'] != 1 else ''}</em>",
                     f"{fair['other_due']:,}", "", ""])  # fmt: skip
    keys = fair["keys"]
    rest = f"; the {len(fair['top'])} with the most due first, the others summed up" if fair["other_keys"] else ""
    note = (
        f"<p class=note>{keys:,} key{'s' if keys != 1 else ''} with messages due ({fair['due']:,} messages){rest}. "
        "Weight: the key's row in <code>fairness_weight</code> (blank: none there, so the actor's "
        "<code>fairness_weight</code> or 1).</p>"
    )
    table = html_table(["key", "due", "oldest wait", "weight"], rows, cls="fair-keys")
    return f"<section id=fair-keys><h2>Fairness keys</h2>{note}{table}</section>"


class QueuePages:
    """The queue and message pages of the :class:`~.app.Dashboard` (which holds what they read)."""

    fleet: Fleet
    database: Database
    reader: Database
    statements: Statements
    settings: Settings
    actions: bool
    declared: Callable[[], Iterable[str]]
    live: float
    sessions: Sessions | None
    token: str

    if TYPE_CHECKING:

        def _reading_site(self, queue: str, named: str | None) -> Site: ...

    def _form(
        self, action: str, label: str, fields: dict[str, str], next_url: str, extra: str = "", danger: bool = False
    ) -> str:
        if not self.actions:
            return ""
        hidden = "".join(
            f'<input type=hidden name="{esc(k)}" value="{esc(v)}">'
            for k, v in {"token": self.token, "action": action, "next": next_url, **fields}.items()
        )
        return f'<form method=post action="{ROOT.get()}/action" class=inline>{hidden}{extra}<button name=do value="{esc(action)}"{" class=danger" if danger else ""}>{esc(label)}</button></form>'

    def queues_page(self, query: dict[str, str]) -> str:
        several = self.fleet.several
        # (no fairness keys here: the queue's own page shows them)
        read, away = self.fleet.each(
            lambda site: admin.overview(site.reader, site.statements, cap=COUNT_CAP + 1, fair_top=0)
        )
        queues = [(site, q) for site, found in read for q in found]
        lines = {s.name: ln for s, ln in self.fleet.each(lambda s: timings.sparklines(s.reader, s.statements))[0]}
        heads = ["queue", "queued", "delayed", "running", "prefetched", "expired leases", "dead", "cancelled", "done 1 min",
                 "done 1 h", "last hour", "dead 1 h", "stale writes", "oldest due", ""]  # fmt: skip
        if several:
            heads.insert(0, "database")
        rows = []
        for site, q in queues:
            name, db = q["queue"], site.name
            link = href("/messages", queue=name, state="queued", database=db)
            paused = " <span class=badge>paused</span>" if q["paused_since"] else ""
            actions = ""
            if self.actions:
                toggle = ("resume", "Resume") if q["paused_since"] else ("pause", "Pause")
                # Each asks first, with the count (row_actions.queue_question, bulk_pages.bulk_page).
                redrive = href("/bulk", action="redrive", scope="filter", queue=name, state="dead")
                actions = (
                    row_actions.ask_link(toggle[0], toggle[1], name, db)
                    + f'<a class=button-link id="redrive-{esc(name)}" href="{redrive}">Re-drive dead…</a> '
                    + purge_question(name, db)
                )
            cells = [
                f'<a href="{link}">{esc(name)}</a>{paused}',
                count_text(q["queued"]),
                count_text(q["delayed"]),
                count_text(q["running"]),
                f'<a href="{ROOT.get()}/processes">{count_text(q["prefetched"])}</a>' if q["prefetched"] else "0",
                count_text(q["expired_leases"]),
                f'<a href="{href("/messages", queue=name, state="dead", database=db)}">{count_text(q["dead"])}</a>',
                f'<a href="{href("/messages", queue=name, state="cancelled", database=db)}">{count_text(q["cancelled"])}</a>',
                count_text(q["done_last_minute"]),
                f'<a href="{href("/messages", queue=name, state="done", database=db)}">{count_text(q["done_last_hour"])}</a>',
                f'<a href="{href("/charts", queue=name, database=db)}">{queue_sparkline(lines.get(db, {}).get(name))}</a>',
                count_text(q["dead_last_hour"]),
                count_text(q["stale_writes"]),
                age_text(q["oldest_due_seconds"]),
                actions,
            ]
            rows.append([f"<span class=database>{esc(db)}</span>", *cells] if several else cells)
        table = html_table(heads, rows, cls="queues") if rows else "<p>No messages in any queue.</p>"
        table = away_note(away) + table
        note = f"<p class=note>Counts above {COUNT_CAP:,} show as {COUNT_CAP:,}+. Queued includes delayed messages (due later). Running: claimed and its actor started; prefetched: claimed, waiting in a worker's prefetch (as of the workers' last heartbeats, see Processes).</p>"
        return self.layout("Queues", flash_note(query) + health_summary(self.fleet) + table + note)

    def purge_page(self, query: dict[str, str]) -> str:
        """The question before a purge: how many rows of which states it deletes (counted now)."""
        if not self.actions:
            raise HTTPError("403 Forbidden", "actions are off: start the dashboard with actions enabled")
        queue, state = query.get("queue", ""), query.get("state") or "dead"
        actor = query.get("actor", "").strip()
        site = self.fleet.queue_site(queue, database=query.get("database") or None)
        if state != "all" and state not in admin.PURGEABLE:
            raise ValueError(f"cannot purge state {state!r}: one of all, {', '.join(admin.PURGEABLE)}")
        states = admin.PURGEABLE if state == "all" else (state,)
        counts = admin.purge_counts(
            site.database, site.statements, queue, states, actor=actor or None, cap=PURGE_COUNT_CAP + 1
        )
        total = sum(counts.values())
        what = f"{many_text(total)} {'' if state == 'all' else state + ' '}message{'' if total == 1 else 's'}"
        what += f" of queue {queue}" + (f" of actor {actor}" if actor else "") + (f" in {site.label}" if site.name else "")
        if state == "all":
            what += " (" + ", ".join(f"{s} {many_text(n)}" for s, n in counts.items()) + ")"
        if not total:
            return self.layout(
                "Purge", f'<p id=nothing>Nothing to purge: {esc(what)}.</p><p><a href="{ROOT.get()}/">Back</a></p>'
            )
        fields = {"queue": queue, "state": state, "actor": actor, "confirm": "yes", **({"database": site.name} if site.name else {})}
        body = (
            f"<p id=question class=question>Delete {esc(what)}?</p>"
            "<p class=note>Counted just now; running messages are never deleted, and any that arrive meanwhile in "
            "these states are deleted too. This cannot be undone.</p>"
            f'<p class=actions>{self._form("purge", f"Delete {many_text(total)}", fields, "/", danger=True)} <a href="{ROOT.get()}/">Cancel</a></p>'
        )
        return self.layout("Purge", body)

    def queue_names(self) -> list[str]:
        """The queues known (a message, a pause) or declared (the broker's actors), sorted; of every database."""
        return self.fleet.queue_names()

    def messages_page(self, query: dict[str, str]) -> str:
        queue = query.get("queue", "")
        state = query.get("state", "queued")
        actor = query.get("actor", "").strip()
        names = self.queue_names()
        if not queue and names:
            queue = names[0]
        if queue and queue not in names:
            raise HTTPError("404 Not Found", str(admin.unknown_queue(check_queue(queue), names)))
        named = query.get("database") or None
        site = self._reading_site(queue, named) if queue else self.fleet.sites[0]
        options = "".join(f"<option{' selected' if n == queue else ''}>{esc(n)}</option>" for n in names)
        states = "".join(f"<option{' selected' if s == state else ''}>{s}</option>" for s in admin.LISTABLE)
        databases = ""
        if self.fleet.several:
            choices = "<option value=''>the queue's</option>" + "".join(
                f"<option{' selected' if s.name == named else ''}>{esc(s.name)}</option>" for s in self.fleet
            )
            databases = f"<label>database <select name=database id=database>{choices}</select></label> "
        form = (
            f'<form method=get action="{ROOT.get()}/messages" class=filters>'
            f"<label>queue <select name=queue id=queue>{options}</select></label> {databases}"
            f"<label>state <select name=state id=state>{states}</select></label> "
            f'<label>actor <input name=actor id=actor value="{esc(actor)}" placeholder="any"></label> '
            "<button id=filter>Filter</button></form>"
        )
        if not queue:
            return self.layout("Messages", form + "<p>No queues yet.</p>")
        check_queue(queue)
        page = admin.list_messages(
            site.reader, site.statements, queue, state, actor=actor or None, after=query.get("after"), limit=PAGE_SIZE
        )
        db = site.name
        when = {"queued": "due", "running": "lease until", "done": "claimed"}.get(state, "due")
        heads = [
            "message",
            "actor",
            "state",
            "attempt",
            "priority",
            "enqueued",
            when,
            "finished",
            "holder",
            "arguments",
            "last error",
        ]
        shown = row_actions.arguments(site.reader, site.settings.schema, [str(r["message_id"]) for r in page.rows])
        rows = [
            [
                f'<a href="{ROOT.get()}/message/{esc(r["message_id"])}" class=mid>{esc(r["message_id"])}</a>',
                esc(r["actor_name"]),
                (running_badge(r["started"], r["started_at"]) if "started" in r else esc(r["state"]))
                + (
                    f"<br><small class=note>{esc(admin.still_running_note(r['lease_holder'], r['running_since']))}</small>"
                    if r["still_running"]
                    else ""
                ),
                str(r["attempt"]),
                str(r["priority"]),
                utc_time(r["enqueued_at"], short=True),
                utc_time(r["at"], short=True),
                "" if r["still_running"] else utc_time(r["finished_at"], short=True),
                esc(r["lease_holder"] or "").replace("/", "/<wbr>"),  # (host:pid:id/queue/n: breaks at a slash)
                f"<code>{esc(shown.get(str(r['message_id']), ''))}</code>",
                f"<span class=err>{esc(admin.error_summary(r['last_error'], limit=160))}</span>" if r["last_error"] else "",
            ]
            for r in page.rows
        ]
        if self.actions and rows:  # tick boxes for the bulk form below (row_actions.bulk_buttons)
            heads.insert(0, "")
            for r, cells in zip(page.rows, rows, strict=True):
                cells.insert(0, row_actions.tick_box(str(r["message_id"])))
        order = {
            "queued": "next to run first",
            "running": "newest first; claimed: running (its actor started, its run time so far) or prefetched "
            "(waiting in a worker's prefetch), as of the workers' last heartbeats, as the Processes page counts",
        }.get(state, "most recently finished first")
        body = form
        if state == "queued":  # the queue's own view: who is waiting, by fairness key
            body += fair_keys_section(admin.fair_keys(site.reader, site.statements, queue=queue).get(queue))
        body += f"<p class=note>{esc(queue)}{esc(' in ' + site.label) if db else ''}, {esc(state)}: {order}; times in UTC.</p>"
        body += html_table(heads, rows, cls="messages", cards=True) if rows else "<p id=empty>No messages.</p>"
        if page.searched:
            body += (
                f"<p class=note id=searched>Searched {page.searched:,} messages for this actor; more may follow.</p>"
            )
        if page.next:
            body += f'<p><a id=next href="{href("/messages", queue=queue, state=state, actor=actor, after=page.next, database=db)}">Next page</a></p>'
        if self.actions and rows:  # the bulk actions, on the rows ticked or every message of this list
            body += row_actions.bulk_buttons(site, queue, state, actor)
        return self.layout("Messages", flash_note(query) + body)

    def message_page(self, message_id: str, query: dict[str, str]) -> str:
        message_id = admin.check_message_id(urllib.parse.unquote(message_id))
        located = self.fleet.locate(message_id)  # a relay's move and a database that does not answer included
        if located.site is None or located.info is None:
            if located.unreachable:
                away = ", ".join(located.unreachable)
                raise HTTPError(
                    "503 Service Unavailable",
                    f"no message {message_id} in the databases that answered; database {away} did not answer "
                    "(it may be there)",
                )
            anywhere = " in any database" if self.fleet.several else ""
            raise HTTPError("404 Not Found", f"no message {message_id}{anywhere} (unknown, or finished longer ago than kept)")
        site, info = located.site, located.info
        db = site.name
        here = f"/message/{message_id}"
        claimed = ""
        if info["state"] == "running" and not info["still_running"]:
            since = listing.started_at(site.reader, site.statements, [message_id])
            claimed = f" <span id=run-state>{running_badge(message_id in since, since.get(message_id))}</span>"
        fields = [
            (
                "state",
                f"<span id=state>{esc(info['state'])}</span>{claimed}"
                + (f" <span class=badge id=still-running>{esc(info['note'])}</span>" if info["still_running"] else ""),
            ),
            (
                "queue",
                f'<a href="{href("/messages", queue=info["queue_name"], state=info["state"], database=db)}">{esc(info["queue_name"])}</a>',
            ),
            ("actor", esc(info["actor_name"])),
            ("attempt", f"{info['attempt']} (deliveries so far)"),
            ("retries", esc(str(info.get("retries")))),
            ("priority", str(info["priority"])),
            ("enqueued", utc_time(info["enqueued_at"])),
            ("due", utc_time(info["available_at"])),
            ("claimed", utc_time(info["claimed_at"])),
            ("lease until", utc_time(info["lease_expires_at"])),
            ("lease holder", esc(info["lease_holder"] or "")),
            ("cancel requested" if info["still_running"] else "finished", utc_time(info["finished_at"])),
            ("ran", age_text(info["ran_seconds"])),
        ]
        if db:
            fields.insert(0, ("database", f"<span id=database>{esc(db)}</span>"))
        if info.get("unique_key") is not None:
            fields.append(("unique key", f"{esc(info['unique_key'])} (unique_until={esc(info['unique_until'])})"))
        body = (
            flash_note(query)
            + "<div class=scroll><table class=fields>"
            + "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in fields)
        )
        body += "</table></div>"
        if "decode_error" in info:
            body += f"<p class=error>Payload not decodable here: {esc(info['decode_error'])}</p>"
        else:
            body += "<h2>Arguments</h2><pre id=args>" + esc(
                pretty_json({"args": info["args"], "kwargs": info["kwargs"]})
            )
            body += "</pre><h2>Options</h2><pre>" + esc(pretty_json(info["options"])) + "</pre>"
        if info["last_error"]:
            body += f"<h2>Last error</h2><p class=err id=error>{esc(info['error'])}</p>"
            body += f"<pre class=err>{esc(info['last_error'])}</pre>"
        body += story_section(info)  # its attempts, acks and operators' actions, in order (story.py)
        if self.actions:
            buttons = ""
            shown = {"message_id": message_id, "seen": info["version"], **({"database": db} if db else {})}
            if info["state"] in ("queued", "running"):
                buttons += self._form("cancel", "Cancel", shown, here)
            if info["state"] in FINISHED_STATES and not info["still_running"]:  # not while its actor runs
                buttons += self._form("redrive", "Re-drive", shown, here)
            if info["state"] == "queued" and info["available_at"] > datetime.now(timezone.utc):  # delayed: asks first
                link = href("/bulk", action="run_now", scope="selected", ids=message_id)
                buttons += f'<a id=run-now href="{link}">Run now…</a>'

            body += f"<p class=actions>{buttons}</p>" if buttons else ""
        return self.layout(f"Message {message_id}", body)

    def _where(self) -> str:
        """The header's words for what is shown: the schema, or each database's name and schema."""
        if not self.fleet.several:
            return f"schema {self.settings.schema}"
        return "databases " + ", ".join(f"{s.name} ({s.settings.schema})" for s in self.fleet)

    def layout(self, title: str, body: str, *, nav: bool = True) -> str:
        """A whole page: *body* goes in ``<div id=content>``, the part ``live.js`` replaces.  Without *nav*
        (the login page) it names nothing of this server."""
        root = ROOT.get()
        head = (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            '<meta name=viewport content="width=device-width, initial-scale=1">'
            f"<title>{esc(title)} · dramatiq-pg-fenced</title>"
            f'<link rel=stylesheet href="{root}/static/{static_name("style.css")}">'
            f'<script src="{root}/static/{static_name("theme.js")}"></script>'
        )
        if not nav:
            return f"{head}</head><body><header><b>dramatiq-pg-fenced</b></header><main><h1>{esc(title)}</h1>{body}</main></body></html>"
        mode = "actions on" if self.actions else "read-only"
        links = " ".join(f'<a href="{root}{path}">{name}</a>' for path, name in PAGES)
        logout = ""
        if self.sessions is not None:
            logout = (
                f'<form method=post action="{root}/logout"><input type=hidden name=token value="{esc(self.token)}">'
                "<button id=logout>Log out</button></form>"
            )
        live = ""
        if self.live:
            live = "<button type=button id=live-toggle hidden>Pause live</button> <span id=live-status></span>"
        return f"""{head}<script src="{root}/static/{static_name("live.js")}" defer></script></head>
<body data-live="{self.live:g}"><header><b>dramatiq-pg-fenced</b> <span class=schema>{esc(self._where())}</span>
<nav>{links}</nav>{live}<span class=mode>{mode}</span><button type=button id=theme-toggle hidden>Dark</button>{logout}</header>
<main><h1>{esc(title)}</h1><div id=content>{body}</div></main></body></html>"""
