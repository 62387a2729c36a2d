"""What operators do to messages and queues: cancel, inspect, re-drive, list,
purge, pause and resume, count, compact.

Functions over a :class:`~.database.Database` and the bound statements; the
broker's methods of the same names call them, as does the CLI.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from enum import Enum
from typing import Any

import psycopg
from dramatiq.errors import BrokerError
from dramatiq.message import Message

from . import processes
from .database import Database
from .doorbell import look_back
from .errors import describe_failure, lost_connection
from .fencing import State
from .sql import FINISHED_STATES, Statements, check_queue

#: Rows per statement when re-driving or purging a whole queue.
BATCH = 500


def check_message_id(message_id: Any) -> str:
    """*message_id* as a canonical UUID string; ``ValueError`` in one line otherwise."""
    try:
        return str(uuid.UUID(str(message_id)))
    except ValueError:
        raise ValueError(f"not a message id: {message_id!r} (a UUID, as Dramatiq makes them)") from None


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
    ``version`` names the row as read (``None`` for history): given to
    :func:`redrive` or :func:`cancel` as *seen*, they act on that row only.
    """
    message_id = check_message_id(message_id)

    def read(conn: psycopg.Connection) -> tuple[Any, list[Any]]:
        return (
            conn.execute(statements.inspect, [message_id]).fetchone(),
            conn.execute(statements.inspect_history, [message_id]).fetchall(),
        )

    row, finished = database.run(read)
    if row is None and not finished:
        return None
    info = _described(row if row is not None else finished[0])
    info["history"] = [{k: v for k, v in _described(r, decode=False).items() if k in _HISTORY_KEYS} for r in finished]
    return info


_HISTORY_KEYS = ("finished_at", "attempt", "lease_holder", "claimed_at", "ran_seconds", "error", "last_error")


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


# -- queues ------------------------------------------------------------------------
PURGEABLE = ("queued", "dead", "cancelled", "done")
#: Known queues named in an error at most.
NAMED_QUEUES = 30


class UnknownQueue(ValueError):
    """An operator's action named a queue nothing knows of (a typo would otherwise act on a phantom queue)."""


def known_queues(database: Database, statements: Statements) -> list[str]:
    """The queues the database knows of, sorted: those with messages in any state, with history, with
    outcomes in the last two hours, paused, or enqueued into by a schedule."""
    return [r[0] for r in database.run(lambda conn: conn.execute(statements.known_queues).fetchall())]


def check_known(
    database: Database, statements: Statements, queue_name: str, *, declared: Iterable[str] = (), hint: str = ""
) -> str:
    """*queue_name*, if the database knows it (:func:`known_queues`) or it is among *declared* (the
    queues of a broker's actors); :class:`UnknownQueue` naming the known ones otherwise (*hint*: how
    to act on it anyway)."""
    check_queue(queue_name)
    declared = set(declared)
    if queue_name in declared:
        return queue_name
    known = sorted(declared.union(known_queues(database, statements)))
    if queue_name in known:
        return queue_name
    raise unknown_queue(queue_name, known, hint)


def unknown_queue(queue_name: str, known: list[str], hint: str = "") -> UnknownQueue:
    """The error for *queue_name*, not among *known*."""
    names = ", ".join(known[:NAMED_QUEUES])
    if len(known) > NAMED_QUEUES:
        names += f" and {len(known) - NAMED_QUEUES} more"
    return UnknownQueue(
        f"no queue {queue_name!r}: no message, history, pause or schedule names it "
        f"(known: {names or 'none'}){'; ' + hint if hint else ''}"
    )


def purge_queue(
    database: Database,
    statements: Statements,
    queue_name: str,
    states: Iterable[str],
    *,
    actor: str | None = None,
    ids: list[str] | None = None,
) -> dict[str, int]:
    """Delete a queue's messages in the given states (of *actor* only, if given), in bounded batches;
    never a running one.

    ``done`` is the queue's history.  Returns rows deleted per state; the ids
    deleted are appended to *ids* when given.
    """
    check_queue(queue_name)
    states = list(states)
    for state in states:
        if state not in PURGEABLE:
            raise ValueError(f"cannot purge state {state!r}: one of {', '.join(PURGEABLE)}")
    deleted: dict[str, int] = {}
    params = {"queue": queue_name, "actor": actor or None, "limit": BATCH}
    for state in states:
        statement = getattr(statements, f"purge_queue_{state}")
        deleted[state] = 0
        while True:
            rows = _fetch(database, statement, params)
            deleted[state] += len(rows)
            if ids is not None:
                ids.extend(str(r[0]) for r in rows)
            if len(rows) < BATCH:
                break
    return deleted


def purge_counts(
    database: Database,
    statements: Statements,
    queue_name: str,
    states: Iterable[str],
    *,
    actor: str | None = None,
    cap: int | None = None,
) -> dict[str, int]:
    """How many rows :func:`purge_queue` would delete now, per state; each count stops at *cap*."""
    check_queue(queue_name)
    counts: dict[str, int] = {}
    params = {"queue": queue_name, "actor": actor or None, "cap": cap}
    for state in states:
        if state not in PURGEABLE:
            raise ValueError(f"cannot purge state {state!r}: one of {', '.join(PURGEABLE)}")
        (counts[state],) = _fetch(database, getattr(statements, f"count_queue_{state}"), params)[0]
    return counts


def pause(database: Database, statements: Statements, queue_name: str) -> bool:
    """Claims skip the queue from now on (in every process); ``False`` if it was paused already."""
    check_queue(queue_name)
    return database.run(lambda conn: conn.execute(statements.pause, [queue_name]).fetchone()) is not None


def resume(database: Database, statements: Statements, queue_name: str, channel: str | None) -> bool:
    """Claims take the queue again, woken at once; ``False`` if it was not paused."""
    check_queue(queue_name)

    def work(conn: psycopg.Connection) -> bool:
        row = conn.execute(statements.resume, [queue_name]).fetchone()
        if row is not None and channel is not None:
            conn.execute(statements.notify, [channel, look_back([queue_name])])
        return row is not None

    return database.run(work, transaction=True)


def paused(database: Database, statements: Statements) -> dict[str, datetime]:
    """Paused queues and since when."""
    return dict(database.run(lambda conn: conn.execute(statements.paused).fetchall()))


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
        shown = {"beats": processes.STALE_AFTER_BEATS, "ids": [item["message_id"] for item in page]}
        started = {str(r[0]) for r in database.run(lambda conn: conn.execute(statements.process_started, shown))}
        for item in page:
            item["started"] = item["message_id"] in started
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


# -- counting ----------------------------------------------------------------------
#: The columns of the ``overview`` statement, in order.
OVERVIEW_COLUMNS = (
    "queue", "due", "delayed", "running", "prefetched", "expired_leases", "dead", "cancelled", "done_last_minute",
    "done_last_hour", "dead_last_hour", "stale_writes", "oldest_due_seconds", "paused_since",
)  # fmt: skip


def overview(database: Database, statements: Statements, *, cap: int | None = None) -> list[dict[str, Any]]:
    """Per queue: queued (``due`` now + ``delayed``: due later), ``running``
    (claimed, and its actor started) and ``prefetched`` (claimed, waiting in
    a worker's prefetch), expired leases, dead, cancelled, outcomes of the
    last minute and hour, stale writes (ever), age of the oldest due message,
    paused since.  Counts stop at *cap* per priority (``None``: exact).

    ``running + prefetched`` is the rows claimed now; how many of them run
    comes from the worker processes' heartbeats (:mod:`.processes`: each
    process's count of started deliveries, up to one heartbeat old, from
    processes that are not stale); the rest are counted prefetched (a dead
    process's rows too, until the rescue takes them back)."""

    def read(conn: psycopg.Connection) -> tuple[list[Any], list[Any]]:
        conn.execute(statements.no_jit)
        rows = conn.execute(statements.overview, {"cap": cap, "beats": processes.STALE_AFTER_BEATS}).fetchall()
        return rows, conn.execute(statements.outcome_totals).fetchall()

    rows, sums = database.run(read, transaction=True)
    ever = _totals(sums)
    queues = []
    for row in rows:
        figures = dict(zip(OVERVIEW_COLUMNS, row, strict=True))
        name = figures.pop("queue")
        totals = ever.get(name, dict.fromkeys(TOTALS, 0))
        queues.append({"queue": name, "queued": figures["due"] + figures["delayed"], **figures, **totals})
    return queues


#: The counters of :func:`outcome_totals`, per queue.
TOTALS = ("finished_total", "dead_total", "retried_total")


def outcome_totals(database: Database, statements: Statements) -> dict[str, dict[str, int]]:
    """Per queue, ever: messages finished (acked), dead-lettered and retried.

    Monotonic: the per-minute tallies are purged after two hours, and the
    purge adds what it deletes to ``outcome_total`` in the same statement
    (see ``purge_throughput`` in ``sql.py``); these sum both.  Also in each
    :func:`overview` row (``finished_total``, ``dead_total``, ``retried_total``).
    """
    return _totals(database.run(lambda conn: conn.execute(statements.outcome_totals).fetchall()))


def _totals(rows: Iterable[Any]) -> dict[str, dict[str, int]]:
    return {r[0]: dict(zip(TOTALS, (int(r[1]), int(r[2]), int(r[3])), strict=True)) for r in rows}


def counters(database: Database, statements: Statements) -> dict[str, int]:
    """Database-wide counters: stale writes, redeliveries (per-queue counts are in :func:`overview`)."""
    rows = database.run(lambda conn: conn.execute(statements.counters).fetchall())
    return {name: value for name, value in rows if ":" not in name}


def queue_counts(database: Database, statements: Statements) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(database-wide counters, per queue: rows by state).  Of the ``running`` rows, those whose actor
    has not started yet (as of the workers' last heartbeats, see :func:`overview`) are ``prefetched``."""
    totals: dict[str, int] = dict(database.run(lambda conn: conn.execute(statements.counters).fetchall()))
    queues: dict[str, dict[str, int]] = {}
    for queue_name, state, count in database.run(lambda conn: conn.execute(statements.queue_stats).fetchall()):
        queues.setdefault(queue_name, {})[state] = count
    busy: dict[str, int] = dict(
        database.run(lambda conn: conn.execute(statements.process_busy, {"beats": processes.STALE_AFTER_BEATS}).fetchall())
    )
    for queue_name, states in queues.items():
        if "running" in states:
            running = min(states["running"], int(busy.get(queue_name, 0)))
            states["running"], states["prefetched"] = running, states["running"] - running
    return totals, queues


def compact(database: Database, statements: Statements, *, lock_timeout: float) -> dict[str, int]:
    """Give back the space a drained backlog left behind; returns the table's size before and after.

    Workers reuse emptied pages anyway; this returns them to the file
    system after a one-off spike.  It runs ``VACUUM (FULL)``, which locks
    the message table (enqueues and claims wait) for as long as copying
    its live rows takes: milliseconds when it is nearly empty, so run it
    then.  It never queues for the lock (every worker would wait behind
    it): it takes the lock only when the table is free, trying again for
    at most *lock_timeout* seconds, then fails.  No session setting is
    involved, so nothing outlives it on a pooled connection (PgBouncer).
    Needs the table's owner (or ``MAINTAIN`` on PostgreSQL 17+); any
    other role gets a :class:`BrokerError` saying so.
    """
    table = f'"{database.schema}".message'

    def size(conn: psycopg.Connection) -> int:
        row = conn.execute(statements.message_size, [table]).fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    with database.connection() as conn:  # autocommit: VACUUM refuses to run in a transaction
        before = size(conn)
        try:
            _vacuum_full(conn, statements, table, lock_timeout)
        except psycopg.Error as e:
            if lost_connection(e):
                raise  # ConnectionClosed, as for every other call
            raise BrokerError(f"cannot compact {table}: {describe_failure(e)}") from None
        after = size(conn)
    return {"bytes_before": before, "bytes_after": after}


def _vacuum_full(conn: psycopg.Connection, statements: Statements, table: str, lock_timeout: float) -> None:
    """``VACUUM (FULL, SKIP_LOCKED)`` *table* until it is rewritten, for at most *lock_timeout* seconds.

    Raises :class:`BrokerError` when this role may not vacuum it (the server
    would only warn and do nothing) or when it stayed in use throughout.
    """
    row = conn.execute(statements.may_vacuum, [table]).fetchone()
    if not (row and row[0]):
        raise BrokerError(
            f"cannot compact {table}: VACUUM (FULL) needs the table's owner (or, on PostgreSQL 17+, "
            f"GRANT MAINTAIN ON {table} TO {conn.info.user}); role {conn.info.user!r} has neither"
        )
    deadline = time.monotonic() + lock_timeout
    pause = 0.005
    while True:
        before = conn.execute(statements.file_node, [table]).fetchone()
        conn.execute(statements.compact)
        if conn.execute(statements.file_node, [table]).fetchone() != before:
            return  # rewritten
        if time.monotonic() + pause > deadline:
            raise BrokerError(
                f"cannot compact {table}: other sessions kept it in use past the lock timeout ({lock_timeout:g} s); "
                "run it when the queue is quieter, or with a longer lock_timeout"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


class OperatorMethods:
    """What operators do, as methods of :class:`~.broker.PostgresBroker` (a mixin: it needs the
    broker's ``database``, ``reader``, ``statements``, ``channel``, ``listen`` and declared ``queues``).
    Reads go to the ``reader`` (a replica's, with the broker's ``read_url``), actions to the ``database``."""

    database: Database
    reader: Database
    statements: Statements
    channel: str
    listen: bool
    queues: set[str]

    def cancel(self, message_id: str, *, seen: str | None = None) -> CancelOutcome:
        """Cancel a message so it never runs (again).

        Queued messages are cancelled whatever their attempt (a retry waiting
        for its backoff included).  A running message is marked cancelled: its
        attempt's ack, nack and retry become no-ops.  Nothing here is fenced on
        an attempt: cancellation is an administrative action on the message.
        *seen* (:meth:`inspect`'s ``version``): only the message shown, not
        its id sent again after it finished.  A message inside a fenced
        transaction is not waited for: ``IN_FENCED_TRANSACTION``, nothing changed.
        """
        return cancel(self.database, self.statements, message_id, channel=self.channel, seen=seen)

    def is_cancelled(self, message_id: str) -> bool:
        """For actors: was my message cancelled while I run?"""
        now = state_of(self.database, self.statements, message_id)
        return now is not None and now[0] == State.CANCELLED.value

    def inspect(self, message_id: str) -> dict[str, Any] | None:
        """What operators need to understand a message; ``None`` if unknown."""
        return inspect(self.reader, self.statements, message_id)

    def redrive(self, message_id: str, *, seen: str | None = None) -> bool:
        """Put a dead or cancelled message back in its queue, due now, with its retry count reset.

        Returns whether it went back (``False``: unknown, not dead or
        cancelled, or changed meanwhile).  Fenced on the row version read,
        or, with *seen* (:meth:`inspect`'s ``version``), on that one.
        """
        shown = None if seen is None else {message_id: seen}
        return bool(redrive(self.database, self.statements, [message_id], self._ring, seen=shown).redriven)

    def redrive_queue(
        self, queue_name: str, states: tuple[str, ...] = ("dead",), *, actor: str | None = None
    ) -> Redriven:
        """Re-drive every dead (or, with ``states``, cancelled) message of a queue (of *actor* only, if given)."""
        self._known(queue_name)
        return redrive_queue(self.database, self.statements, queue_name, states, self._ring, actor=actor)

    def purge_queue(
        self,
        queue_name: str,
        states: tuple[str, ...] = ("queued", "dead", "cancelled", "done"),
        *,
        actor: str | None = None,
    ) -> dict[str, int]:
        """Delete a queue's messages in *states* (``done``: its history; of *actor* only, if given), in
        bounded batches; never running ones."""
        self._known(queue_name)
        return purge_queue(self.database, self.statements, queue_name, states, actor=actor)

    def pause(self, queue_name: str, *, create: bool = False) -> bool:
        """Consumers of every process stop claiming from the queue (it survives restarts); running ones finish.

        A queue neither the database nor this broker's actors know of is refused
        (:class:`.admin.UnknownQueue`) unless *create*: paused ahead of its first message.
        """
        if not create:
            self._known(queue_name, hint="pause(queue, create=True) pauses a queue before its first message")
        return pause(self.database, self.statements, queue_name)

    def resume(self, queue_name: str) -> bool:
        """Undo :meth:`pause`; consumers are woken at once."""
        self._known(queue_name)
        return resume(self.database, self.statements, queue_name, self._ring)

    def list_messages(
        self, queue_name: str, state: str, *, actor: str | None = None, after: str | None = None, limit: int = 50
    ) -> Page:
        """A keyset page of a queue's messages in one state (see :func:`.admin.list_messages`)."""
        check_known(self.reader, self.statements, queue_name, declared=self.queues)
        return list_messages(self.reader, self.statements, queue_name, state, actor=actor, after=after, limit=limit)

    def _known(self, queue_name: str, hint: str = "") -> None:
        """Refuse a queue nothing knows of (:func:`.admin.check_known`); this broker's declared queues are known."""
        check_known(self.database, self.statements, queue_name, declared=self.queues, hint=hint)

    def queue_overview(self, *, cap: int | None = None) -> list[dict[str, Any]]:
        """Per queue: the operator's figures (see :func:`.admin.overview`)."""
        return overview(self.reader, self.statements, cap=cap)

    @property
    def _ring(self) -> str | None:
        return self.channel if self.listen else None

    def compact(self, *, lock_timeout: float = 5.0) -> dict[str, int]:
        """Give back the space a drained backlog left behind (``VACUUM (FULL)``, never queued for its
        lock for more than *lock_timeout* seconds); returns the table's size before and after.
        Needs the table's owner.  See :func:`.admin.compact`."""
        return compact(self.database, self.statements, lock_timeout=lock_timeout)
