"""The listings of messages by state, a page at a time (keyset cursors)."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

from ..core import processes
from ..db.database import Database
from ..db.statements import Statements, check_queue
from .messages import with_error

# -- listing -----------------------------------------------------------------------
LISTABLE = ("queued", "running", "dead", "cancelled", "done")
_LIST_COLUMNS = (
    "message_id", "actor_name", "state", "attempt", "priority", "enqueued_at", "at", "finished_at",
    "lease_holder", "last_error", "running_since",
)  # fmt: skip
#: Where each state's first page starts (the cursor of "nothing shown yet").
_FIRST = {
    "queued": ("-2147483648", "-infinity", "-1"),
    "running": ("9223372036854775807",),
    "dead": ("infinity", "9223372036854775807"),
    "cancelled": ("infinity", "9223372036854775807"),
    "done": ("infinity", "9223372036854775807"),
}


#: Rows a filtered page reads at most before it stops (its "next" goes on from there).
FILTER_WINDOW = 5000


@dataclasses.dataclass
class Page:
    """One page of a message list, and the cursor of the next (``None``: no more).

    ``searched``: the filter was tried on that many rows without filling the
    page; more may match after them (``next`` goes on from the last).
    """

    rows: list[dict[str, Any]]
    next: str | None
    searched: int | None = None


def list_messages(
    database: Database,
    statements: Statements,
    queue_name: str,
    state: str,
    *,
    actor: str | None = None,
    after: str | None = None,
    limit: int = 50,
) -> Page:
    """A page of a queue's messages in one state: queued ones in claim order
    (next first), running ones newest first (each with ``started``: its actor
    runs, as of the worker processes' last heartbeats; else it waits in a
    prefetch), finished ones (dead, cancelled, done) most recently finished
    first.  Keyset pagination: *after* is the previous page's ``next``.  With
    *actor*, at most :data:`FILTER_WINDOW` rows are read per page."""
    check_queue(queue_name)
    if state not in LISTABLE:
        raise ValueError(f"cannot list state {state!r}: one of {', '.join(LISTABLE)}")
    if not 1 <= limit <= 1000:
        raise ValueError("limit must be between 1 and 1000")
    cursor = _FIRST[state] if not after else tuple(after.split("|"))
    if len(cursor) != len(_FIRST[state]):
        raise ValueError(f"bad cursor {after!r}")
    scan = max(FILTER_WINDOW, limit + 1) if actor else limit + 1
    params: dict[str, Any] = {"queue": queue_name, "actor": actor or None, "limit": limit + 1, "scan": scan}
    try:
        if state == "queued":
            params.update(priority=int(cursor[0]), at=cursor[1], seq=int(cursor[2]))
        elif state == "running":
            params.update(seq=int(cursor[0]))
        else:
            params.update(at=cursor[0], seq=int(cursor[1]))
    except ValueError:
        raise ValueError(f"bad cursor {after!r}") from None
    statement = getattr(statements, f"list_{state}")
    rows = database.run(lambda conn: conn.execute(statement, params).fetchall())
    edge = rows.pop() if rows and rows[-1][-2] else None
    following: tuple | None = None
    searched = None
    if len(rows) > limit:
        rows = rows[:limit]
        following = rows[-1]
    elif edge is not None and edge[-1] >= scan and actor:
        following, searched = edge, int(edge[-1])
    page = []
    for row in rows:
        item = with_error(dict(zip(_LIST_COLUMNS, row[:-3], strict=True)))
        item["message_id"] = str(item["message_id"])
        item["still_running"] = item["running_since"] is not None  # cancelled, its actor still runs
        page.append(item)
    if state == "running" and page:  # started (its actor runs) or prefetched, by the processes' heartbeats
        started = started_at(database, statements, [item["message_id"] for item in page])
        for item in page:
            item["started"] = item["message_id"] in started
            item["started_at"] = started.get(item["message_id"])
    return Page(page, page_cursor(state, following) if following else None, searched)


def page_cursor(state: str, row: tuple) -> str:
    """The sort key of *row* (columns as the list statements return them)."""
    seq = row[11]
    if state == "queued":
        return f"{row[4]}|{_stamp(row[6])}|{seq}"
    if state == "running":
        return str(seq)
    return f"{_stamp(row[7])}|{seq}"


def _stamp(value: datetime) -> str:
    """A cursor's timestamp: UTC, microseconds, no '+' (safe in a URL as it is)."""
    return value.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def started_at(database: Database, statements: Statements, ids: list[str]) -> dict[str, Any]:
    """Of the messages *ids*, those whose actor runs, as of the heartbeats of the live processes: message id
    -> when its actor started (``None`` from a process too old to say); a claimed message not here waits
    in a worker's prefetch."""
    if not ids:
        return {}
    shown = {"beats": processes.STALE_AFTER_BEATS, "ids": ids}
    return {str(r[0]): r[1] for r in database.run(lambda conn: conn.execute(statements.process_started, shown))}
