"""Errors of our own; everything else is one of Dramatiq's."""

from __future__ import annotations

import psycopg
from dramatiq.errors import BrokerError
from psycopg_pool import PoolTimeout


class SchemaError(BrokerError):
    """The database has no schema, or an older one: run the migrate command."""


class PayloadTooLarge(BrokerError, ValueError):
    """An encoded message is larger than the broker's ``max_payload_bytes``."""


class DeadLetterError(BrokerError):
    """Raised by ``join(fail_fast=True)`` for a message dead-lettered elsewhere.

    When the message failed in this process, ``join`` raises the actor's own
    exception instead, as Dramatiq's StubBroker does.
    """

    def __init__(self, message_id: str, error: str | None) -> None:
        super().__init__(f"message {message_id} was dead-lettered: {error}")
        self.message_id = message_id
        self.error = error


#: Server errors that mean the connection itself is gone (shutdown, crash, restart).
_CONNECTION_SQLSTATES = {"57P01", "57P02", "57P03"}


def lost_connection(error: BaseException) -> bool:
    """Did *error* cost us the connection (unlike, say, a lock or statement timeout on a live one)?"""
    if isinstance(error, (psycopg.InterfaceError, PoolTimeout)):
        return True
    if not isinstance(error, psycopg.OperationalError):
        return False
    sqlstate = error.sqlstate
    return sqlstate is None or sqlstate.startswith("08") or sqlstate in _CONNECTION_SQLSTATES


def describe_failure(error: BaseException, where: str = "") -> str:
    """One line for an operational failure: "cannot reach" only when the connection is what failed."""
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    at = f" at {where}" if where else ""
    if lost_connection(error):
        return f"cannot reach PostgreSQL{at}: {text}"
    sqlstate = getattr(error, "sqlstate", None)
    return f"PostgreSQL{at} failed the statement (SQLSTATE {sqlstate}): {text}"
