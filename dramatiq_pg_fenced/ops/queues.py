"""An operator's view of the queues: which exist, purge, pause and resume, the overview's counts, compaction."""

from __future__ import annotations

import time
from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg
from dramatiq.errors import BrokerError

from ..core import processes
from ..db.database import Database
from ..db.doorbell import look_back
from ..db.statements import OVERVIEW_COLUMNS, Statements, check_queue
from ..errors import describe_failure, lost_connection
from .messages import BATCH, _fetch

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


# -- counting ----------------------------------------------------------------------
#: How many fairness keys per queue :func:`overview` (the ``stats`` command), :func:`fair_keys`, the
#: metrics and the dashboard name: the top by due messages; the rest are summed up.
FAIR_TOP = 10


def overview(
    database: Database, statements: Statements, *, cap: int | None = None, fair_top: int = FAIR_TOP
) -> list[dict[str, Any]]:
    """Per queue: queued (``due`` now + ``delayed``: due later), ``running``
    (claimed, and its actor started) and ``prefetched`` (claimed, waiting in
    a worker's prefetch), expired leases, dead, cancelled, outcomes of the
    last minute and hour, stale writes (ever), age of the oldest due message,
    paused since.  Counts stop at *cap* per priority (``None``: exact).
    With *fair_top* > 0, ``fair_keys``: the queue's fairness keys with due
    messages, the top *fair_top* named (:func:`fair_keys`; ``None``: none);
    0 reads none and leaves the key out (a page that does not show them).

    ``running + prefetched`` is the rows claimed now; how many of them run
    comes from the worker processes' heartbeats (:mod:`.processes`: each
    process's count of started deliveries, up to one heartbeat old, from
    processes that are not stale); the rest are counted prefetched (a dead
    process's rows too, until the rescue takes them back)."""
    top = _check_top(fair_top, zero=True)

    def read(conn: psycopg.Connection) -> tuple[list[Any], list[Any], list[Any]]:
        conn.execute(statements.no_jit)
        rows = conn.execute(statements.overview, {"cap": cap, "beats": processes.STALE_AFTER_BEATS}).fetchall()
        sums = conn.execute(statements.outcome_totals).fetchall()
        return rows, sums, _read_fair_keys(conn, statements, statements.fair_keys, {"top": top}) if top else []

    rows, sums, keyed = database.run(read, transaction=True)
    ever = _totals(sums)
    fair = _fair_figures(keyed)
    queues = []
    for row in rows:
        figures = dict(zip(OVERVIEW_COLUMNS, row, strict=True))
        name = figures.pop("queue")
        totals = ever.get(name, dict.fromkeys(TOTALS, 0))
        queue = {"queue": name, "queued": figures["due"] + figures["delayed"], **figures, **totals}
        if top:
            queue["fair_keys"] = fair.get(name)
        queues.append(queue)
    return queues


def fair_keys(
    database: Database, statements: Statements, *, queue: str | None = None, top: int = FAIR_TOP
) -> dict[str, dict[str, Any]]:
    """Per queue with keyed messages due (of *queue* only, if given), its fairness keys: ``keys`` (how
    many have messages due), ``due`` (their due messages), ``top`` (the *top* keys with the most due,
    then the longest waiting: ``key``, ``due``, ``oldest_wait_seconds`` since the oldest became due,
    ``weight`` from the ``fairness_weight`` table, ``None`` when not set there), ``other_keys`` and
    ``other_due`` (the rest).  A queue without keyed messages due is absent.  One statement, bounded
    by *top* per queue; queues without keys cost nothing (see ``_fair_keys`` in ``db/queries/console.py``)."""
    params = {"top": _check_top(top), "queue": None if queue is None else check_queue(queue)}
    statement = statements.fair_keys if queue is None else statements.fair_keys_of

    return _fair_figures(
        database.run(lambda conn: _read_fair_keys(conn, statements, statement, params), transaction=True)
    )


def _read_fair_keys(conn: psycopg.Connection, statements: Statements, statement: bytes, params: dict[str, Any]) -> Any:
    """*statement* (``fair_keys`` or ``fair_keys_of``) in the caller's transaction, after the planner
    settings it needs for the rest of that transaction (``fair_keys_plan``): run it last."""
    conn.execute(statements.fair_keys_plan)
    return conn.execute(statement, params).fetchall()


def _check_top(top: int, *, zero: bool = False) -> int:
    if not isinstance(top, int) or isinstance(top, bool) or top < (0 if zero else 1):
        raise ValueError(f"the top keys per queue must be an int >= {0 if zero else 1}, not {top!r}")
    return top


def _fair_figures(rows: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """The rows of ``fair_keys`` by queue, each queue's rest summed up (see :func:`fair_keys`)."""
    queues: dict[str, dict[str, Any]] = {}
    for name, key, due, wait, weight, keys, keyed_due in rows:
        figures = queues.setdefault(name, {"keys": int(keys), "due": int(keyed_due), "top": []})
        figures["top"].append({"key": key, "due": int(due), "oldest_wait_seconds": float(wait),
                               "weight": None if weight is None else float(weight)})  # fmt: skip
    for figures in queues.values():
        figures["other_keys"] = figures["keys"] - len(figures["top"])
        figures["other_due"] = figures["due"] - sum(k["due"] for k in figures["top"])
    return queues


#: The counters of :func:`outcome_totals`, per queue.
TOTALS = ("finished_total", "dead_total", "retried_total")


def outcome_totals(database: Database, statements: Statements) -> dict[str, dict[str, int]]:
    """Per queue, ever: messages finished (acked), dead-lettered and retried.

    Monotonic: the per-minute tallies are purged after two hours, and the
    purge adds what it deletes to ``outcome_total`` in the same statement
    (see ``purge_throughput`` in ``db/queries/``); these sum both.  Also in each
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
