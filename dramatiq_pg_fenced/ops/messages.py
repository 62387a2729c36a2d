"""An operator's actions on one message, or on a queue's dead letters: cancel, inspect, re-drive; how an error is summed up."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import psycopg
from dramatiq.message import Message

from ..core.fencing import State
from ..db.database import Database
from ..db.statements import FINISHED_STATES, Statements, check_message_id, check_queue

BATCH = 500


def check_version(seen: Any) -> str:
    """*seen* as a row version (``"<seq>.<xmin>"``, what :func:`inspect` returns); ``ValueError`` otherwise."""
    text = str(seen)
    seq, dot, xmin = text.partition(".")
    if not (dot and seq.isdigit() and xmin.isdigit()):
        raise ValueError(f"not a message version: {seen!r} (as inspect shows it: <seq>.<xmin>)")
    return text


class CancelOutcome(str, Enum):
    """What :meth:`PostgresBroker.cancel` did."""

    QUEUED = "cancelled_queued"  #: it was waiting (maybe for a retry backoff); it will never run
    RUNNING = "cancelled_running"  #: it was running; that attempt's outcome is fenced out
    ALREADY_CANCELLED = "already_cancelled"
    DEAD = "already_dead"  #: it had been dead-lettered; nothing changed
    NOT_FOUND = "not_found"  #: unknown id, already finished (acked rows leave the table), or not the one seen
    #: its row is locked by a fenced transaction in progress (its actor's block, maybe in a stopped
    #: process): nothing changed; the block commits or rolls back, then cancel again if it is still there
    IN_FENCED_TRANSACTION = "in_fenced_transaction"
    #: (several databases) a relay was moving it to its queue's database and did not finish within
    #: ``finding.MOVE_WAIT`` seconds (its target slow to answer): nothing changed; cancel again
    MOVING = "moving"


#: How long a cancel waits for its message's row lock before it answers ``IN_FENCED_TRANSACTION``.
CANCEL_LOCK_TIMEOUT = 2.0


def cancel(
    database: Database,
    statements: Statements,
    message_id: str,
    *,
    channel: str,
    seen: str | None = None,
    lock_timeout: float = CANCEL_LOCK_TIMEOUT,
) -> CancelOutcome:
    """Cancel a message whatever its attempt (administrative: not fenced on a delivery).

    *seen*: the version an operator was shown (:func:`inspect`'s ``version``,
    which the dashboard's form carries): only that incarnation of the id is
    cancelled, at whatever attempt it is now; the id sent again after it
    finished is another message (``NOT_FOUND``).
    A running one is announced on *channel* (``!cancel <id>``, and
    ``!interrupt <id> <delivery>``), so a worker that holds it in its prefetch
    never starts it, and one that runs it with ``interrupt_on_cancel`` stops it;
    also from a canceller without LISTEN (the CLI), for workers that listen.
    A message inside a fenced transaction (its row locked until the block ends,
    for as long as a stopped process holds it) is not waited for past
    *lock_timeout* seconds: ``IN_FENCED_TRANSACTION``, nothing changed.
    """
    message_id = check_message_id(message_id)
    seq = None if seen is None else int(check_version(seen).partition(".")[0])
    params = {"id": message_id, "channel": channel, "seq": seq}

    def work(conn: psycopg.Connection) -> Any:
        try:
            with conn.transaction():
                conn.execute(statements.cancel_lock_timeout, [f"{max(1, round(lock_timeout * 1000))}ms"])
                return conn.execute(statements.cancel, params).fetchone()
        except psycopg.errors.LockNotAvailable:
            return CancelOutcome.IN_FENCED_TRANSACTION

    row = database.run(work)
    if row is CancelOutcome.IN_FENCED_TRANSACTION:
        return row
    if row is not None:
        return CancelOutcome.QUEUED if row[0] == State.QUEUED.value else CancelOutcome.RUNNING
    now = database.run(lambda conn: conn.execute(statements.state_of, [message_id]).fetchone())
    if now is None or (seq is not None and now[2] != seq) or now[0] == State.COMMITTED.value:
        return CancelOutcome.NOT_FOUND  # (committed: its fenced transaction finished it)
    return CancelOutcome.ALREADY_CANCELLED if now[0] == State.CANCELLED.value else CancelOutcome.DEAD


def state_of(database: Database, statements: Statements, message_id: str) -> tuple[str, int] | None:
    """(state, attempt) of the message's row, ``None`` when there is none."""
    row = database.run(lambda conn: conn.execute(statements.state_of, [message_id]).fetchone())
    return None if row is None else (row[0], row[1])


_INSPECT_COLUMNS = (
    "message_id", "queue_name", "actor_name", "priority", "state", "attempt", "enqueued_at",
    "available_at", "lease_expires_at", "lease_holder", "finished_at", "last_error", "lost_deliveries", "claimed_at",
    "unique_key", "unique_until", "version", "still_running",
)  # fmt: skip


def inspect(database: Database, statements: Statements, message_id: str) -> dict[str, Any] | None:
    """What operators need to understand a message; ``None`` if unknown (or acked longer ago than ``keep_finished``).

    A message still in the message table is shown as it is there; an acked one
    from the history table (state ``done``).  ``history`` lists every kept
    finish of this id, newest first; ``ran_seconds`` is claim to finish.
    ``attempts`` lists its deliveries that ended without an ack, in order
    (kept with the history: none when ``keep_finished`` is 0), each with its
    ``outcome`` (:data:`OUTCOMES`), ``consumer_id``, ``claimed_at``,
    ``ended_at``, ``ran_seconds``, ``error`` (summed up) and ``error_text``;
    ``audit``, the bulk actions that named it by id (cancel, re-drive, purge,
    run now): ``id``, ``at``, ``who``, ``action``, ``touched``, ``ended_at``.
    :func:`story` puts them in one order.
    ``version`` names the row as read (``None`` for history): given to
    :func:`redrive` or :func:`cancel` as *seen*, they act on that row only.
    """
    message_id = check_message_id(message_id)

    def read(conn: psycopg.Connection) -> tuple[Any, list[Any], list[Any], list[Any]]:
        return (
            conn.execute(statements.inspect, [message_id]).fetchone(),
            conn.execute(statements.inspect_history, [message_id]).fetchall(),
            conn.execute(statements.inspect_attempts, [message_id]).fetchall(),
            conn.execute(statements.inspect_audit, [message_id]).fetchall(),
        )

    row, finished, attempts, audited = database.run(read)
    if row is None and not finished:
        return None
    info = _described(row if row is not None else finished[0])
    info["history"] = [{k: v for k, v in _described(r, decode=False).items() if k in _HISTORY_KEYS} for r in finished]
    info["attempts"] = [_attempt(r) for r in attempts]
    info["audit"] = [dict(zip(_AUDIT_KEYS, r, strict=True)) for r in audited]
    return info


_HISTORY_KEYS = ("finished_at", "attempt", "lease_holder", "claimed_at", "ran_seconds", "error", "last_error")
_ATTEMPT_COLUMNS = ("attempt", "seq", "consumer_id", "claimed_at", "ended_at", "outcome", "error_text", "queue_name")
_AUDIT_KEYS = ("id", "at", "who", "action", "touched", "ended_at")


def _attempt(row: Any) -> dict[str, Any]:
    """An attempt log row (migration 023) as :func:`inspect` lists it: its error summed up, then whole."""
    attempt = dict(zip(_ATTEMPT_COLUMNS, row, strict=True))
    started, ended = attempt["claimed_at"], attempt["ended_at"]
    attempt["ran_seconds"] = (ended - started).total_seconds() if started and ended else None
    attempt["error"] = error_summary(attempt["error_text"]) or None
    return attempt


#: What each outcome of the attempt log means, for people.
OUTCOMES = {
    "retried": "failed; retried",
    "dead": "failed; dead-lettered",
    "lease lost": "its worker stopped renewing the lease; maintenance took the message back",
    "claim lost": "claimed, but the claim's reply was lost; its consumer put it back",
    "requeued": "released unstarted as its worker stopped",
    "cancelled": "ended after its message was cancelled; its outcome dropped",
    "fenced out": "a late write of an attempt that no longer held the message, refused by the fence",
}


def story(info: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's whole story from :func:`inspect`: its attempts that ended without an ack (the attempt
    log), its acks (the history) and the audit rows of the actions that named it, in the order they
    happened (an attempt and an ack by their end, an action by its start).  Each event has ``kind``
    (``attempt``, ``done`` or ``audit``) and ``at``, and the row's own keys."""
    events: list[dict[str, Any]] = [{"kind": "attempt", "at": a["ended_at"], **a} for a in info.get("attempts", ())]
    for h in info.get("history", ()):
        events.append({"kind": "done", "at": h["finished_at"], "outcome": "done", "ended_at": h["finished_at"],
                       "consumer_id": h["lease_holder"], **h})  # fmt: skip
    events += [{"kind": "audit", **a} for a in info.get("audit", ())]
    order = {"attempt": 0, "done": 1, "audit": 2}
    return sorted(events, key=lambda e: (e["at"], order[e["kind"]]))  # (stable: the log's own order kept)


def _described(row: Any, *, decode: bool = True) -> dict[str, Any]:
    info = with_error(dict(zip(_INSPECT_COLUMNS, row[:-1], strict=True)))
    info["message_id"] = str(info["message_id"])
    started, finished = info.get("claimed_at"), info.get("finished_at")
    info["ran_seconds"] = (finished - started).total_seconds() if started and finished else None
    if info["still_running"]:  # cancelled, its actor still runs: it has not finished
        info["ran_seconds"] = None
        info["note"] = still_running_note(info["lease_holder"], started)
    if not decode:
        return info
    try:
        decoded = Message.decode(bytes(row[-1]))
        info["retries"] = decoded.options.get("retries", 0)
        info["args"], info["kwargs"] = decoded.args, decoded.kwargs
        info["options"] = {k: v for k, v in decoded.options.items() if k != "traceback"}
    except Exception as e:  # an undecodable row is still worth inspecting
        info["retries"] = None
        info["decode_error"] = str(e)
    return info


def still_running_note(holder: str | None, since: datetime | None) -> str:
    """What operators are told of a cancelled message whose actor still runs."""
    when = f" since {since.astimezone(timezone.utc):%Y-%m-%d %H:%M:%S} UTC" if since is not None else ""
    return f"cancel requested, still running on {holder or 'an unknown worker'}{when}"


# -- errors ------------------------------------------------------------------------
_TRACEBACK = "Traceback (most recent call last):"
#: Between the lines of an exception shown on one line.
NEWLINE = " \u23ce "


def error_summary(text: str | None, limit: int = 300) -> str:
    """The exception a stored error names, on one line, type and message first: ``ValueError: boom``.

    ``last_error`` holds Dramatiq's traceback (else the exception's repr, or a
    note of ours such as "retry refused: ..." before the traceback).  The
    exception is the run of unindented lines at the end of the last
    traceback (its frames are indented): a message of several lines and its
    notes included, joined with " ⏎ ".  A note of ours before the first
    traceback follows it.  A text without a traceback is shown whole.  Longer
    than *limit* characters: cut, ending with "…".
    """
    if not text:
        return ""
    lines = text.strip("\n").splitlines()
    if _TRACEBACK not in lines:
        shown = [line.strip() for line in lines if line.strip()]
    else:
        exception: list[str] = []
        for line in reversed(lines):
            if line[:1].isspace() or line == _TRACEBACK or _cut_note(line):
                break
            exception.append(line)
        note = lines[: lines.index(_TRACEBACK)]
        shown = [line for line in (*reversed(exception), *note) if line.strip()] or [lines[-1].strip()]
    summary = NEWLINE.join(shown)
    return summary if len(summary) <= limit else summary[: limit - 1] + "\u2026"


def _cut_note(line: str) -> bool:
    """The note left where a long text was cut (:func:`.delivery.storable_text`, a listed error)."""
    return line.startswith("[... ") and line.endswith(" ...]")


def with_error(row: dict[str, Any]) -> dict[str, Any]:
    """*row* with ``error`` (:func:`error_summary` of its ``last_error``) just before ``last_error``."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if key == "last_error":
            out["error"] = error_summary(value) or None
        out[key] = value
    return out


# -- re-drive ----------------------------------------------------------------------
@dataclasses.dataclass
class Redriven:
    """What a re-drive did."""

    redriven: list[str] = dataclasses.field(default_factory=list)  #: back in their queues
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)  #: id -> why not


def reset_payload(payload: bytes) -> bytes:
    """The message as a fresh one: Dramatiq's retry count and traceback gone, so it gets every retry again."""
    message = Message.decode(payload)
    options = {k: v for k, v in message.options.items() if k not in ("retries", "traceback", "attempt")}
    return dataclasses.replace(message, options=options).encode()


def redrive(
    database: Database,
    statements: Statements,
    message_ids: Iterable[str],
    channel: str | None,
    *,
    seen: Mapping[str, str] | None = None,
) -> Redriven:
    """Put dead or cancelled messages back in their queues, due now, their retry count reset.

    Fenced on the row version read (see :func:`.sql.version`): a message
    claimed, re-driven, cancelled again or purged in between is left alone,
    and so is its id sent again meanwhile, whatever its state and attempt.
    *seen*: per id, the version an operator was shown (:func:`inspect`'s
    ``version``; the dashboard's form carries it): an id whose row is no
    longer that one is left alone too.  Its attempt number goes on counting
    (the fence of its next delivery is still new).  *channel*: ring the
    doorbell of the queues that got messages (``None``: no LISTEN/NOTIFY).
    """
    ids = [check_message_id(m) for m in message_ids]
    shown = {check_message_id(m): check_version(v) for m, v in (seen or {}).items()}
    done = Redriven()

    def work(conn: psycopg.Connection) -> list[tuple[str, str]]:
        done.skipped.clear()  # a second try (broken connection) starts afresh
        rows = conn.execute(statements.redrive_read, [ids]).fetchall()
        found: list[tuple[str, str, bytes]] = []
        for message_id, version, payload in rows:
            message_id = str(message_id)
            if shown.get(message_id, version) != version:
                done.skipped[message_id] = "changed since it was shown (re-driven, cancelled again, or sent again)"
                continue
            try:
                found.append((message_id, version, reset_payload(bytes(payload))))
            except Exception as e:  # undecodable with this process's encoder: left as it is
                done.skipped[message_id] = f"cannot decode its payload: {e}"
        if not found:
            return []
        columns = [list(c) for c in zip(*found, strict=True)]
        back = [(str(r[0]), r[1]) for r in conn.execute(statements.redrive, columns).fetchall()]
        if back and channel is not None:
            conn.execute(statements.notify, [channel, sorted({q for _, q in back})])
        return back

    back = database.run(work, transaction=True)
    done.redriven = [m for m, _ in back]
    left = [m for m in ids if m not in done.redriven and m not in done.skipped]
    if left:  # why not: a cancelled one whose actor still runs is re-driven when it ends
        running = {str(r[0]): r for r in _fetch(database, statements.still_running, [left])}
        for message_id in left:
            row = running.get(message_id)
            done.skipped[message_id] = (
                "not dead or cancelled (or changed meanwhile)"
                if row is None
                else f"{still_running_note(row[1], row[2])}: re-drive it when it ends"
            )
    return done


def redrive_queue(
    database: Database,
    statements: Statements,
    queue_name: str,
    states: Iterable[str],
    channel: str | None,
    *,
    actor: str | None = None,
) -> Redriven:
    """Re-drive every dead (and/or cancelled) message of a queue (of *actor* only, if given), oldest
    first, a batch at a time."""
    check_queue(queue_name)
    total = Redriven()
    for state in _finished_states(states):
        select = getattr(statements, f"redrive_ids_{state}")
        while True:
            params = {"queue": queue_name, "skip": list(total.skipped), "actor": actor or None, "limit": BATCH}
            rows = _fetch(database, select, params)
            if not rows:
                break
            step = redrive(database, statements, [str(r[0]) for r in rows], channel)
            total.redriven += step.redriven
            total.skipped.update(step.skipped)
    return total


def _fetch(database: Database, statement: bytes, params: Any) -> list[Any]:
    return database.run(lambda conn: conn.execute(statement, params).fetchall())


def _finished_states(states: Iterable[str]) -> list[str]:
    states = list(states)
    for state in states:
        if state not in FINISHED_STATES:
            raise ValueError(f"only dead or cancelled messages can be re-driven, not {state!r}")
    return states
