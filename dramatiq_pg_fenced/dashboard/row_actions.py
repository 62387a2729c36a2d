"""Actions where the rows are (issue 42, point 3): the messages list's arguments column, tick boxes and
bulk buttons ("on the rows ticked", "on all N matching"), and the questions the queues page's buttons ask
before they act (pause, resume: with the count of messages they hold back or let go).

Every bulk button leads to ``GET /bulk`` (:func:`.bulk_pages.bulk_page`), which counts now and asks in a
destructive style; only its form acts, through :func:`..bulk.bulk`, audited.  The queue questions post
the queues page's own actions (``pause``, ``resume``) with ``confirm=yes``.
"""

from __future__ import annotations

from typing import Any

from dramatiq.message import Message
from psycopg import sql

from ..db.database import Database
from ..ops import admin, bulk
from .console_pages import _short_json
from .render import ROOT, esc, href

#: The bulk actions a list of messages in a state offers, first the one whose count "all N matching" says.
FOR_STATE = {
    "queued": ("cancel", "run_now", "purge"),
    "running": ("cancel",),
    "dead": ("redrive", "purge"),
    "cancelled": ("redrive", "purge"),
    "done": ("purge",),
}
LABELS = {"redrive": "Re-drive", "cancel": "Cancel", "run_now": "Run now", "purge": "Purge"}
_ARGUMENTS = (
    "SELECT message_id::text, payload FROM {schema}.message WHERE message_id = ANY(%s::uuid[]) "
    "UNION ALL SELECT message_id::text, payload FROM {schema}.history WHERE message_id = ANY(%s::uuid[])"
)


def arguments(reader: Database, schema: str, ids: list[str]) -> dict[str, str]:
    """The shortened arguments of each listed message (id -> text; a payload not decodable here: "?")."""
    if not ids:
        return {}
    text = _ARGUMENTS.format(schema=sql.Identifier(schema).as_string(None))
    rows = reader.run(lambda conn: conn.execute(text, [ids, ids]).fetchall())
    found: dict[str, str] = {}
    for message_id, payload in rows:
        try:
            decoded = Message.decode(bytes(payload))
            found[message_id] = _short_json(list(decoded.args), dict(decoded.kwargs), limit=80)
        except Exception:  # noqa: BLE001  (another encoder's payload: shown as not decodable)
            found[message_id] = "?"
    return found


def tick_box(message_id: str) -> str:
    mid = esc(message_id)
    return f'<input type=checkbox name=ids value="{mid}" form=bulk aria-label="select {mid}">'


def bulk_buttons(site: Any, queue: str, state: str, actor: str) -> str:
    """The list's bulk form: an action, on the rows ticked or on all the messages the list's filter matches
    (counted now, as the first action of the state would touch them)."""
    offered = FOR_STATE.get(state, ())
    if not offered:
        return ""
    chosen: dict[str, Any] = {"queue": queue, "state": state, **({"actor": actor} if actor else {})}
    preview = bulk.bulk_preview(site.database, site.statements, offered[0], **chosen)
    count = f"{preview.count:,}{'+' if preview.more else ''}"
    kept = "".join(f'<input type=hidden name="{k}" value="{esc(v)}">' for k, v in chosen.items())
    options = "".join(f'<option value="{a}">{LABELS[a]}</option>' for a in offered)
    every = (
        f"<button name=scope value=filter id=bulk-all class=danger>On all {count} matching…</button>"
        if preview.count
        else ""
    )
    return (
        f'<form method=get action="{ROOT.get()}/bulk" id=bulk class="actions select-all">{kept}'
        f"<label>Bulk action <select name=action id=bulk-action>{options}</select></label> "
        "<button name=scope value=selected id=bulk-selected>On the rows ticked…</button> "
        f"{every}<span class=note> Each asks first, saying how many messages it touches.</span></form>"
    )


def queue_question(site: Any, action: str, queue: str, form: Any) -> str:
    """The question before the queues page's pause or resume acts, with the count of queued messages."""
    if action not in ("pause", "resume"):
        raise ValueError(f"no question for {action!r}: pause or resume")
    counts = admin.purge_counts(site.database, site.statements, queue, ("queued",), cap=100_001)
    n = counts.get("queued", 0)
    held = f"{n:,}{'+' if n > 100_000 else ''} queued message{'' if n == 1 else 's'}"
    where = f" in {site.label}" if site.name else ""
    if action == "pause":
        question = f"Pause queue {queue}{where}? Its {held} wait, unclaimed, until it is resumed."
        note = "Running messages finish; no worker claims a message of this queue while it is paused."
    else:
        question = f"Resume queue {queue}{where}? Its {held} become claimable at once."
        note = "The workers are woken; due messages are claimed in their usual order."
    fields = {"queue": queue, "confirm": "yes", **({"database": site.name} if site.name else {})}
    button = form(action, f"{action.capitalize()} {queue}", fields, "/", danger=True)
    return (
        f"<p id=question class=question>{esc(question)}</p><p class=note>{esc(note)}</p>"
        f'<p class=actions>{button} <a href="{ROOT.get()}/" id=back>Back, doing nothing</a></p>'
    )


def ask_link(action: str, label: str, queue: str, database: str) -> str:
    """A queues page button that asks first (``/confirm``)."""
    return f'<a class=button-link id="{esc(action)}-{esc(queue)}" href="{href("/confirm", action=action, queue=queue, database=database)}">{esc(label)}…</a> '
