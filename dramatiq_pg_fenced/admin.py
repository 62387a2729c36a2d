"""What operators do to messages: cancel, inspect, count, compact.

Functions over a :class:`~.database.Database` and the bound statements; the
broker's methods of the same names call them, as does the CLI.
"""

from __future__ import annotations

import time
from enum import Enum
from typing import Any

import psycopg
from dramatiq.errors import BrokerError
from dramatiq.message import Message

from .database import Database
from .errors import describe_failure, lost_connection
from .fencing import State
from .sql import Statements


class CancelOutcome(str, Enum):
    """What :meth:`PostgresBroker.cancel` did."""

    QUEUED = "cancelled_queued"  #: it was waiting (maybe for a retry backoff); it will never run
    RUNNING = "cancelled_running"  #: it was running; that attempt's outcome is fenced out
    ALREADY_CANCELLED = "already_cancelled"
    DEAD = "already_dead"  #: it had been dead-lettered; nothing changed
    NOT_FOUND = "not_found"  #: unknown id, or already finished (acked rows leave the table)


def cancel(database: Database, statements: Statements, message_id: str, *, channel: str, listen: bool) -> CancelOutcome:
    """Cancel a message whatever its attempt (administrative: not fenced).

    A running one is announced on *channel* (``!cancel <id>``), so a worker
    that holds it in its prefetch never starts it.
    """
    params = [message_id, listen, channel]
    row = database.run(lambda conn: conn.execute(statements.cancel, params).fetchone())
    if row is not None:
        return CancelOutcome.QUEUED if row[0] == State.QUEUED.value else CancelOutcome.RUNNING
    now = state_of(database, statements, message_id)
    if now is None:
        return CancelOutcome.NOT_FOUND
    return CancelOutcome.ALREADY_CANCELLED if now[0] == State.CANCELLED.value else CancelOutcome.DEAD


def state_of(database: Database, statements: Statements, message_id: str) -> tuple[str, int] | None:
    """(state, attempt) of the message's row, ``None`` when there is none."""
    row = database.run(lambda conn: conn.execute(statements.state_of, [message_id]).fetchone())
    return None if row is None else (row[0], row[1])


_INSPECT_COLUMNS = (
    "message_id", "queue_name", "actor_name", "priority", "state", "attempt", "enqueued_at",
    "available_at", "lease_expires_at", "lease_holder", "finished_at", "last_error", "lost_deliveries",
)  # fmt: skip


def inspect(database: Database, statements: Statements, message_id: str) -> dict[str, Any] | None:
    """What operators need to understand a message; ``None`` if unknown."""
    row = database.run(lambda conn: conn.execute(statements.inspect, [message_id]).fetchone())
    if row is None:
        return None
    info = dict(zip(_INSPECT_COLUMNS, row[:-1], strict=True))
    info["message_id"] = str(info["message_id"])
    try:
        decoded = Message.decode(bytes(row[-1]))
        info["retries"] = decoded.options.get("retries", 0)
        info["args"], info["kwargs"] = decoded.args, decoded.kwargs
    except Exception as e:  # an undecodable row is still worth inspecting
        info["retries"] = None
        info["decode_error"] = str(e)
    return info


def queue_counts(database: Database, statements: Statements) -> tuple[dict[str, int], dict[str, dict[str, int]]]:
    """(database-wide counters, per queue: rows by state)."""
    totals: dict[str, int] = dict(database.run(lambda conn: conn.execute(statements.counters).fetchall()))
    queues: dict[str, dict[str, int]] = {}
    for queue_name, state, count in database.run(lambda conn: conn.execute(statements.queue_stats).fetchall()):
        queues.setdefault(queue_name, {})[state] = count
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
