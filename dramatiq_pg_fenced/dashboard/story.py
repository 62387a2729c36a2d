"""A message's whole story on its page: every attempt that ended without an ack (the attempt log,
migration 023), its acks (the history) and the operators' actions that named it (the audit log), in
the order they happened, times as UTC dates.  A table on a desktop, one card per event on a phone
(``table.story`` in ``static/style.css``)."""

from __future__ import annotations

from typing import Any

from ..ops import admin
from .render import age_text, esc, utc_time

#: The badge of each outcome (its class in the style): failures red, a lost lease or claim and a
#: fenced-out write yellow, an ack green, an operator's action grey.
_BADGES = {
    "retried": "warn",
    "dead": "alert",
    "lease lost": "alert",
    "claim lost": "warn",
    "requeued": "",
    "cancelled": "warn",
    "fenced out": "warn",
    "done": "ok",
}
_HEADS = ("attempt", "claimed", "ended", "ran", "process", "outcome", "error")
#: How an audit row's action reads.
_ACTIONS = {"redrive": "re-drive", "run_now": "run now"}


def story_section(info: dict[str, Any]) -> str:
    """The "Story" section of a message's page (empty when nothing is recorded of it)."""
    events = admin.story(info)
    if not events:
        return ""
    rows = "".join(_row(event) for event in events)
    head = "".join(f"<th>{h}</th>" for h in _HEADS)
    note = (
        "<p class=note>Each attempt that ended without an ack, its acks and the operators' actions on it "
        "(those that named it), oldest first; times in UTC. Kept as long as the history.</p>"
    )
    return (
        f"<h2 id=story-title>Story</h2>{note}<div class=scroll><table class=story id=story>"
        f"<thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>"
    )


def _row(event: dict[str, Any]) -> str:
    if event["kind"] == "audit":
        action = _ACTIONS.get(event["action"], event["action"])
        done = "" if event["touched"] is None else f", {event['touched']} touched"
        cells = [
            "",
            "",
            utc_time(event["at"]),
            "",
            f"<span class=who>{esc(event['who'])}</span>",
            f"<span class=badge>{esc(action)}</span>"
            f" <small class=note>operator, audit #{esc(event['id'])}{done}</small>",
            "",
        ]
        return _tr(cells, "audit")
    outcome = event["outcome"]
    meaning = admin.OUTCOMES.get(outcome, "acked" if outcome == "done" else "")
    badge = f"<span class='badge {_BADGES.get(outcome, '')}' title=\"{esc(meaning)}\">{esc(outcome)}</span>"
    cells = [
        esc(event["attempt"]),
        utc_time(event["claimed_at"]),
        utc_time(event["ended_at"]),
        age_text(event["ran_seconds"]),
        f"<span class=mid>{esc(event['consumer_id'] or '')}</span>",
        badge + (f" <small class=note>{esc(meaning)}</small>" if outcome not in ("done", "retried", "dead") else ""),
        "" if outcome == "done" else _error(event["error"], event["error_text"]),  # (an ack's is an earlier one's)
    ]
    return _tr(cells, outcome.replace(" ", "-"))


def _error(summary: str | None, text: str | None) -> str:
    """The error summed up, its whole text (a traceback) folded away under it."""
    if not text:
        return ""
    shown = f"<span class=err>{esc(summary or '')}</span>"
    if text.strip() == (summary or "").strip():
        return shown
    return f"{shown}<details><summary>traceback</summary><pre class=err>{esc(text)}</pre></details>"


def _tr(cells: list[str], kind: str) -> str:
    tds = "".join(
        f'<td data-label="{head}">{cell}</td>' if cell else "<td class=empty></td>"
        for head, cell in zip(_HEADS, cells, strict=True)
    )
    return f"<tr class={esc(kind)}>{tds}</tr>"
