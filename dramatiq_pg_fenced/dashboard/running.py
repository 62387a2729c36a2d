"""Running is running (issue 42): a claimed message whose actor runs, with its run time so far, told
from one waiting in a worker's prefetch, as the processes' heartbeats say (:func:`..listing.started_at`,
the figures the queues and processes pages count)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from .render import age_text, esc


def running_words(started: bool, started_at: datetime | None) -> str:
    """The state of a claimed message in words: "running, 12 s so far" or "prefetched"."""
    if not started:
        return "prefetched"
    if started_at is None:
        return "running"
    return f"running, {age_text((datetime.now(timezone.utc) - started_at).total_seconds())} so far"


def running_badge(started: bool, started_at: Any) -> str:
    """A claimed message's state (see :func:`running_words`), with the note that says what it means."""
    words = running_words(started, started_at)
    if not started:
        note = "claimed, waiting in a worker's prefetch: its actor has not started"
    elif started_at is None:
        note = "its actor runs (a worker too old to say since when)"
    else:
        note = f"its actor started {started_at.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
    kind = "running" if started else "prefetched"
    return f'<span class="run-state {kind}" title="{esc(note)}">{esc(words)}</span><br><small class=note>{esc(note)}</small>'
