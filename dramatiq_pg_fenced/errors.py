"""Errors of our own; everything else is one of Dramatiq's."""

from __future__ import annotations

import psycopg
from dramatiq.errors import BrokerError, ConnectionClosed
from dramatiq.middleware import MiddlewareError
from psycopg_pool import PoolTimeout


class SchemaError(BrokerError):
    """The database has no schema, or an older one: run the migrate command."""


#: What a statement raises when the schema was dropped, or taken back to an older version, under a
#: running process (the database layer then checks the schema again: database.py).
MISSING_OBJECT = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedFunction,
    psycopg.errors.UndefinedColumn,
)


class PayloadTooLarge(BrokerError, ValueError):
    """An encoded message is larger than the broker's ``max_payload_bytes``."""


class UniqueOptionError(MiddlewareError, ValueError):
    """An actor declared with a ``unique_key`` or ``unique_until`` the broker cannot use.

    A ``MiddlewareError``, so Dramatiq lets it out of the declaration (it
    only logs other errors of a middleware's hooks).
    """


class FairnessOptionError(MiddlewareError, ValueError):
    """An actor declared with a ``fairness_key`` or ``fairness_weight`` the broker cannot use (fairness.py)."""


class NestedSendError(BrokerError, RuntimeError):
    """Two blocks that decide where a send goes are nested in a way that would break one of them:
    ``with_ack()`` inside ``broker.transaction(conn)`` would send with the ack whether or not the
    caller's transaction commits."""


class DeliveryLost(BrokerError):
    """Raised as a fenced transaction begins (``broker.fenced_transaction()``) when the delivery running
    it no longer holds its message: its lease lapsed and the message went back to the queue or to
    another worker, or it was cancelled.  Nothing of the block runs, and nothing of it is written;
    the delivery's outcome is fenced out and counted as a stale write, as for any stale delivery."""


class FencedTransactionError(BrokerError, RuntimeError):
    """A fenced transaction used where it cannot keep its promise: outside an actor delivered by this
    broker, on a connection already in a transaction (the block must begin and commit it), or a
    second time in one delivery (the first one's commit acked the message)."""


class DeadLetterError(BrokerError):
    """Raised by ``join(fail_fast=True)`` for a message dead-lettered elsewhere.

    When the message failed in this process, ``join`` raises the actor's own
    exception instead, as Dramatiq's StubBroker does.
    """

    def __init__(self, message_id: str, error: str | None) -> None:
        super().__init__(f"message {message_id} was dead-lettered: {error}")
        self.message_id = message_id
        self.error = error


class ResultNotStored(Exception):
    """Stored in place of an actor's result (or exception) that the database refused.

    ``get_result`` then raises Dramatiq's ``ResultFailure`` naming it, with
    the reason, instead of waiting for a result that will never come.
    """


#: Server errors that mean the connection itself is gone (shutdown, crash, restart, idle timeout).
_CONNECTION_SQLSTATES = {"57P01", "57P02", "57P03", "57P05"}
#: Server errors that mean the server takes no writes: read_only_sql_transaction, which a standby (in
#: recovery: "cannot execute ... during recovery") and a primary turned read-only
#: (``default_transaction_read_only``, how Aurora and some proxies demote one) both answer.
_UNWRITABLE_SQLSTATES = {"25006"}


class ServerUnwritable(psycopg.OperationalError):
    """The server answered as a read-only one: a standby, or a demoted primary whose sockets stay open.

    For the package it is a lost connection: the connection is dropped (with every other one made
    to that server before), a new one is dialled (libpq's ``target_session_attrs=read-write`` finds
    the new primary) and the work is done again there, fenced as always.  Never a refusal of what
    was written: nothing is dead-lettered, nacked or counted stale because of it.
    """

    sqlstate = "25006"


def unwritable(error: BaseException) -> bool:
    """Did the server refuse *error*'s statement because it takes no writes (read-only, in recovery)?"""
    return isinstance(error, ServerUnwritable) or (
        isinstance(error, psycopg.Error) and error.sqlstate in _UNWRITABLE_SQLSTATES
    )


def as_lost(error: psycopg.Error) -> psycopg.Error:
    """*error* as the package's parts handle it: an unwritable server's answer becomes a
    :class:`ServerUnwritable` (an ``OperationalError``, which they take for a lost connection)."""
    if unwritable(error) and not isinstance(error, ServerUnwritable):
        lost = ServerUnwritable(str(error).splitlines()[0] if str(error) else "the server is read-only")
        lost.__cause__ = error
        return lost
    return error


def lost_connection(error: BaseException) -> bool:
    """Did *error* cost us the connection (unlike, say, a lock or statement timeout on a live one)?

    A server that takes no writes (:func:`unwritable`) counts: its connection is of no use to us.
    """
    if isinstance(error, (psycopg.InterfaceError, PoolTimeout)) or unwritable(error):
        return True
    if not isinstance(error, psycopg.OperationalError):
        return False
    sqlstate = error.sqlstate
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _CONNECTION_SQLSTATES


def describe_failure(error: BaseException, where: str = "") -> str:
    """One line for an operational failure: "cannot reach" only when the connection is what failed."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    at = f" at {where}" if where else ""
    if unwritable(error):
        return f"PostgreSQL{at} takes no writes (a standby, or a demoted primary): {text}"
    if lost_connection(error):
        # libpq gives a failed connection no SQLSTATE; the server's own refusal is its "FATAL:" line
        # (a wrong password, an unknown role or database, too many connections).
        refused = text.partition("FATAL:")[2].strip()
        if refused:
            return f"PostgreSQL{at} refused the connection: {refused}"
        return f"cannot reach PostgreSQL{at}: {text.rsplit(' failed: ', 1)[-1]}"
    if isinstance(error, SchemaError):  # says which schema, and what to run
        return text
    sqlstate = getattr(error, "sqlstate", None)
    return f"PostgreSQL{at} failed the statement (SQLSTATE {sqlstate}): {text}"


def key_taken_meanwhile(error: BaseException) -> bool:
    """A row going back to the queue met a send that took its unique key while the statement ran.

    The statement takes the key back only if no other row holds it (db/queries/,
    ``_retake``), but a holder that commits after the statement's snapshot is
    seen only by the index.  Written again, the statement sees the holder and
    moves the row without its key.
    """
    return (
        isinstance(error, psycopg.errors.UniqueViolation)
        and getattr(error.diag, "constraint_name", None) == "message_unique_idx"
    )


def worth_retrying(error: BaseException) -> bool:
    """Could the same write succeed later, unchanged?

    Yes when the connection was lost, the server was busy or going away
    (lock or statement timeout, deadlock, serialization failure, too many
    connections, disk full), the schema is not migrated yet, or a unique key
    was taken meanwhile (:func:`key_taken_meanwhile`).  No when the
    database refused what was written (bad data, a constraint, a trigger that
    raised, a value over a limit) or the driver could not even send it (text
    that is not valid Unicode): writing it again would be refused again.
    """
    if lost_connection(error):
        return True
    if key_taken_meanwhile(error):
        return True
    if isinstance(error, psycopg.errors.ProgramLimitExceeded):
        return False
    return isinstance(error, (psycopg.OperationalError, SchemaError, ConnectionClosed))


def refusal(error: BaseException) -> str:
    """Why a write was refused, in one ASCII line that any database can store (at most 300 characters)."""
    text = str(error).splitlines()[0] if str(error) else ""
    sqlstate = getattr(error, "sqlstate", None)
    line = type(error).__name__ + (f" (SQLSTATE {sqlstate})" if sqlstate else "") + (f": {text}" if text else "")
    line = line.replace("\x00", "\\0").encode("ascii", "backslashreplace").decode("ascii")
    return line if len(line) <= 300 else line[:297] + "..."
