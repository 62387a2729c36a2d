"""Operators acting on schedules: pause, resume and "run now" (migration 022), each recorded in the audit log.

- **pause**: the schedule's row is marked paused (``paused_at``).  No process enqueues its
  ticks from then on: ``schedule_tick`` moves ``last_tick`` only while the row it locks is not
  paused, so a pause committed before a tick's statement stops it on every process, whatever
  that process read before.
- **resume**: the mark is cleared and ``resumed_at`` set: the ticks that fell while it was
  paused are not owed (the scheduler counts from the latest of its last tick, its definition's
  change and its resume); the next tick after the resume is enqueued as usual.
- **run now**: one extra message of the schedule (its actor, arguments and options, the
  ``tick`` option saying when it was asked), enqueued exactly once per click.  The database
  keeps the click (``schedule_run``, keyed on the click's id: a form sent twice asks once) and
  its audit row; the arguments live in the code, so a scheduler that declares the schedule's
  definition in force takes the click on its next pass (within ``MAX_SLEEP``, 5 s) and writes
  the message, the click's ``message_id`` and the audit row's end in one statement, under the
  click's row lock (two schedulers: one message).  A paused schedule still runs when asked to.
  With no scheduler running it, the click waits (shown as pending).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from typing import Any

import psycopg
from dramatiq.message import Message

from ..config import Settings
from ..db.database import Database
from ..db.statements import Statements

#: The audit log's names for these actions.
AUDIT_ACTIONS = {"pause": "schedule_pause", "resume": "schedule_resume", "run_now": "schedule_run_now"}


class UnknownSchedule(ValueError):
    """No schedule of that name is stored (never declared, or forgotten)."""


@dataclasses.dataclass
class RunRequest:
    """A "run now" click, recorded."""

    click: str  #: its id (the same id again asks nothing more)
    new: bool  #: this call recorded it (``False``: that click was recorded before)
    audit_id: int | None  #: its row in the audit log (``None`` when not new)


def _check_who(who: str) -> None:
    if not who or not isinstance(who, str):
        raise ValueError("who must name the operator (it is recorded in the audit log)")


def _toggle(database: Database, statements: Statements, what: str, name: str, who: str) -> bool:
    _check_who(who)

    def run(conn: Any) -> bool:
        found, changed = conn.execute(getattr(statements, f"schedule_{what}"), {"name": name, "who": who}).fetchone()
        if not found:
            raise UnknownSchedule(f"no schedule {name!r}")
        conn.execute(
            statements.schedule_audit,
            {"who": who, "action": AUDIT_ACTIONS[what], "selection": json.dumps({"schedule": name}),
             "touched": int(changed)},
        )  # fmt: skip
        return bool(changed)

    return bool(database.run(run, transaction=True))


def pause(database: Database, statements: Statements, name: str, *, who: str) -> bool:
    """Pause schedule *name* on every process; returns whether it was running (``False``: paused already).
    Recorded in the audit log.  :class:`UnknownSchedule` when there is no such schedule."""
    return _toggle(database, statements, "pause", name, who)


def resume(database: Database, statements: Statements, name: str, *, who: str) -> bool:
    """Resume schedule *name*; returns whether it was paused.  The ticks that fell while it was paused are
    not enqueued.  Recorded in the audit log."""
    return _toggle(database, statements, "resume", name, who)


def run_now(database: Database, statements: Statements, name: str, *, who: str, click: str | None = None) -> RunRequest:
    """Ask for one extra message of schedule *name* now (see the module's docstring); *click*: the id of this
    request (a form's, made when its page was drawn): asking again with the same id adds nothing."""
    _check_who(who)
    click = str(uuid.UUID(click)) if click else str(uuid.uuid4())

    def run(conn: Any) -> RunRequest:
        if conn.execute(statements.schedule_run_seen, [click]).fetchone():
            return RunRequest(click, False, None)
        audit = conn.execute(
            statements.schedule_audit,
            {"who": who, "action": AUDIT_ACTIONS["run_now"], "selection": json.dumps({"schedule": name}),
             "touched": None},
        ).fetchone()[0]  # fmt: skip
        row = conn.execute(
            statements.schedule_run_request, {"click": click, "name": name, "who": who, "audit": audit}
        ).fetchone()
        if row is None:
            if not conn.execute(statements.schedule_exists, [name]).fetchone():
                raise UnknownSchedule(f"no schedule {name!r}")
            raise RuntimeError("a concurrent request took this click")  # rolls the audit row back
        return RunRequest(click, True, int(audit))

    return database.run(run, transaction=True)  # type: ignore[no-any-return]


def take_runs(
    conn: psycopg.Connection,
    statements: Statements,
    settings: Settings,
    mine: Iterable[Any],
    row: Callable[[Message, int | None], Any],
    logger: logging.Logger,
) -> int:
    """A scheduler's pass: enqueue the pending "run now" clicks of its schedules (*mine*), each exactly once
    across processes; returns how many this call enqueued."""
    by_name = {s.name: s for s in mine}
    if not by_name:
        return 0
    pending = conn.execute(statements.schedule_runs_pending, [list(by_name)]).fetchall()
    taken = 0
    for click, name in pending:
        scheduled = by_name[name]
        asked = datetime.now(timezone.utc)
        message = scheduled.message(asked)
        message = message.copy(options={**message.options, "run_now": True})
        message_id, queue_name, actor_name, priority, _, payload, *_ = row(message, None)
        inserted, _, _ = conn.execute(  # type: ignore[misc]
            statements.schedule_run_take,
            {"click": click, "id": message_id, "fingerprint": scheduled.fingerprint, "queue": queue_name,
             "actor": actor_name, "priority": priority, "payload": payload, "channel": settings.channel,
             "listen": settings.listen},
        ).fetchone()  # fmt: skip
        if inserted:
            taken += 1
            logger.info("Schedule %r: run now (asked by an operator), enqueued as message %s.", name, message_id)
    return taken


def pending_click() -> str:
    """A new click id, for a form's "run now" button."""
    return str(uuid.uuid4())
