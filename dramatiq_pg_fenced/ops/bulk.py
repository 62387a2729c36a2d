"""The console's bulk actions: re-drive, cancel, purge and run now, over selected ids or a filtered set,
each counted first (a preview), then done, and recorded in ``{schema}.audit``.

A selection is ids and/or the search's filters (:func:`.search.filters`:
queue, actor, state, argument values).  Each action touches the selected
messages in the states it applies to (:data:`ACTIONS`), at most
:data:`MAX_BULK` of them per call (in key order; call again for the rest):

- ``redrive``: dead and cancelled messages back to their queues, due now, their
  retry count reset (:func:`.admin.redrive`: fenced on the row version it
  reads; a cancelled message whose actor still runs is left alone);
- ``cancel``: queued and running messages, each through :func:`.admin.cancel`
  (a running one's outcome is fenced out, its worker told; interruptible
  actors stop);
- ``purge``: queued, dead and cancelled messages and kept history (``done``)
  deleted; never a running one, nor a cancelled one whose actor still runs;
- ``run_now``: delayed messages (queued, due later: a retry's backoff
  included) due now; the consumers are woken.

:func:`bulk` counts first (as :func:`bulk_preview` does), writes the audit row
(who, what, the selection, the count), acts, and completes the row with how
many it touched and skipped.  The count and the action are not one
transaction: what changed in between is acted on as it is then (each step
re-checks the state it acts on).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from ..db.database import Database
from ..db.doorbell import look_back
from ..db.statements import Statements
from . import admin, search
from .admin import CancelOutcome, Page, check_message_id

#: What each action touches: the states of the messages it applies to (``done``: the history).
ACTIONS: dict[str, tuple[str, ...]] = {
    "redrive": ("dead", "cancelled"),
    "cancel": ("queued", "running"),
    "purge": ("queued", "dead", "cancelled", "done"),
    "run_now": ("queued",),
}
#: Messages one call touches at most.
MAX_BULK = 10_000
#: Ids of a selection written into the audit row at most (their count always).
AUDITED_IDS = 100


@dataclasses.dataclass
class Preview:
    """What an action would touch now."""

    action: str
    count: int  #: messages it would touch now (at most :data:`MAX_BULK`)
    more: bool  #: more than :data:`MAX_BULK` match: one call touches the first ones


@dataclasses.dataclass
class BulkResult:
    """What a bulk action did."""

    action: str
    previewed: int  #: its count just before acting
    touched: int  #: messages it changed
    skipped: dict[str, str]  #: id -> why not (changed meanwhile, still running, ...)
    audit_id: int  #: its row in the audit log


@dataclasses.dataclass
class _Selection:
    action: str
    states: list[str]
    params: dict[str, Any]
    record: dict[str, Any]  #: what the audit row keeps


def _selection(
    action: str,
    *,
    ids: Iterable[str] | None,
    queue: str | None,
    actor: str | None,
    state: str | None,
    args: list[Any] | None,
    kwargs: dict[str, Any] | None,
    value: str | None = None,
) -> _Selection:
    if action not in ACTIONS:
        raise ValueError(f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    given = None if ids is None else sorted({check_message_id(i) for i in ids})
    params = search.filters(queue=queue, actor=actor, state=state, args=args, kwargs=kwargs, value=value)
    if given is None and not any(params[k] is not None for k in search.FILTERS):
        raise ValueError(
            "select ids or give a filter (queue, actor, state, args, kwargs, value): nothing selects every message"
        )
    states = [s for s in ACTIONS[action] if state is None or s == state]
    params.pop("state")
    params.update(ids=given, delayed=action == "run_now", cap=MAX_BULK + 1)
    record: dict[str, Any] = {k: v for k, v in {"queue": queue, "actor": actor, "state": state, "args": args,
                                                 "kwargs": kwargs, "value": value}.items() if v is not None}  # fmt: skip
    if given is not None:
        record["ids_count"] = len(given)
        record["ids"] = given[:AUDITED_IDS]
    return _Selection(action, states, params, record)


def _targets(database: Database, statements: Statements, sel: _Selection) -> tuple[list[str], list[str], bool]:
    """(message-table ids, history ids, whether more than :data:`MAX_BULK` match), at most MAX_BULK in all."""
    live_states = [s for s in sel.states if s != "done"]

    def read(conn: Any) -> tuple[list[str], list[str]]:
        live = kept = []
        if live_states:
            live = [str(r[0]) for r in conn.execute(statements.bulk_live, {**sel.params, "states": live_states})]
        if "done" in sel.states:
            kept = [str(r[0]) for r in conn.execute(statements.bulk_kept, sel.params)]
        return live, kept

    live, kept = database.run(read, transaction=True)
    more = len(live) + len(kept) > MAX_BULK
    live = live[:MAX_BULK]
    kept = kept[: MAX_BULK - len(live)]
    return live, kept, more


def bulk_preview(
    database: Database,
    statements: Statements,
    action: str,
    *,
    ids: Iterable[str] | None = None,
    queue: str | None = None,
    actor: str | None = None,
    state: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    value: str | None = None,
) -> Preview:
    """How many messages *action* would touch now (for the confirmation); nothing is changed or recorded."""
    sel = _selection(action, ids=ids, queue=queue, actor=actor, state=state, args=args, kwargs=kwargs, value=value)
    live, kept, more = _targets(database, statements, sel)
    return Preview(action, len(live) + len(kept), more)


def bulk(
    database: Database,
    statements: Statements,
    action: str,
    *,
    who: str,
    channel: str,
    listen: bool = True,
    ids: Iterable[str] | None = None,
    queue: str | None = None,
    actor: str | None = None,
    state: str | None = None,
    args: list[Any] | None = None,
    kwargs: dict[str, Any] | None = None,
    value: str | None = None,
) -> BulkResult:
    """Count, record, then do *action* on the selection (see the module's docstring); *who*: the operator
    (recorded); *channel*: the broker's NOTIFY channel, where cancels are announced (always, as
    :func:`.admin.cancel` does) and, with *listen*, the consumers of re-driven and run-now
    messages are rung."""
    if not who or not isinstance(who, str):
        raise ValueError("who must name the operator (it is recorded in the audit log)")
    sel = _selection(action, ids=ids, queue=queue, actor=actor, state=state, args=args, kwargs=kwargs, value=value)
    live, kept, _ = _targets(database, statements, sel)
    previewed = len(live) + len(kept)
    begin = [who, action, json.dumps(sel.record), previewed]
    audit_id = int(database.run(lambda conn: conn.execute(statements.audit_begin, begin).fetchall())[0][0])
    touched, skipped = _act(database, statements, action, live, kept, channel, listen)
    database.run(lambda conn: conn.execute(statements.audit_end, [touched, len(skipped), audit_id]))
    return BulkResult(action, previewed, touched, skipped, audit_id)


def _act(
    database: Database,
    statements: Statements,
    action: str,
    live: list[str],
    kept: list[str],
    channel: str,
    listen: bool,
) -> tuple[int, dict[str, str]]:
    """Do *action* on those ids: (how many it changed, id -> why not)."""
    skipped: dict[str, str] = {}
    ring = channel if listen else None
    if action == "redrive":
        done = admin.redrive(database, statements, live, ring)
        return len(done.redriven), done.skipped
    if action == "cancel":
        touched = 0
        for message_id in live:
            outcome = admin.cancel(database, statements, message_id, channel=channel)
            if outcome in (CancelOutcome.QUEUED, CancelOutcome.RUNNING):
                touched += 1
            else:
                skipped[message_id] = outcome.value
        return touched, skipped
    if action == "purge":

        def purge(conn: Any) -> tuple[set[str], set[str]]:
            gone = {str(r[0]) for r in conn.execute(statements.bulk_purge_live, [live])} if live else set()
            out = {str(r[0]) for r in conn.execute(statements.bulk_purge_kept, [kept])} if kept else set()
            return gone, out

        gone, out = database.run(purge, transaction=True)
        skipped = {m: "running, or changed meanwhile" for m in live if m not in gone}
        skipped.update({m: "no longer in the history" for m in kept if m not in out})
        return len(gone) + len(out), skipped

    def run_now(conn: Any) -> list[tuple[str, str]]:
        rows = [(str(r[0]), r[1]) for r in conn.execute(statements.bulk_run_now, [live])]
        if rows and ring is not None:
            conn.execute(statements.notify, [ring, look_back(sorted({q for _, q in rows}))])
        return rows

    moved = {m for m, _ in database.run(run_now, transaction=True)} if live else set()
    skipped = {m: "no longer delayed (claimed, due or changed meanwhile)" for m in live if m not in moved}
    return len(moved), skipped


def record(database: Database, statements: Statements, *, who: str, action: str, message_id: str, touched: bool) -> int:
    """Record an action on one message done from its page (cancel, re-drive) in the audit log, as a bulk
    action naming it would be: the message's story shows it.  Returns its row's id."""
    selection = json.dumps({"ids_count": 1, "ids": [check_message_id(message_id)]})
    params = {"who": who, "action": action, "selection": selection, "touched": int(touched)}
    # (schedule_audit: one row, done as it is written, whatever the action)
    return int(database.run(lambda conn: conn.execute(statements.schedule_audit, params).fetchall())[0][0])


_AUDIT_COLUMNS = ("id", "at", "who", "action", "selection", "previewed", "touched", "skipped", "ended_at")


def audit_log(database: Database, statements: Statements, *, after: str | None = None, limit: int = 50) -> Page:
    """The bulk actions done, newest first, a keyset page (*after*: the previous page's ``next``).

    Rows: ``id``, ``at``, ``who``, ``action``, ``selection`` (the filter given,
    and ``ids_count`` with the first :data:`AUDITED_IDS` ``ids``), ``previewed``,
    ``touched``, ``skipped`` (``None`` with ``ended_at``: it never finished).
    """
    if not 1 <= limit <= 1000:
        raise ValueError("limit must be between 1 and 1000")
    try:
        before = int(after) if after else 2**63 - 1
    except ValueError:
        raise ValueError(f"bad cursor {after!r}") from None
    rows = database.run(lambda conn: conn.execute(statements.audit_page, [before, limit + 1]).fetchall())
    items: list[dict[str, Any]] = [dict(zip(_AUDIT_COLUMNS, r, strict=True)) for r in rows[:limit]]
    return Page(items, str(items[-1]["id"]) if len(rows) > limit else None)
