"""At start-up, a configuration that can never work is an error, not an outage.

A wrong password, a role or database that does not exist, a schema missing, older or newer than
this package: the server answers, and will answer the same until someone changes the
configuration.  A worker that waited for it would say "ready for action" and never work.  So a
worker checks once as it starts, before it consumes (:class:`~.middleware.FencedDelivery`): a
``dramatiq`` worker process logs one line and exits with Dramatiq's code for a broker that failed
at start-up (3); ``Worker.start()`` in a process of your own raises :class:`StartupError`.

A server that cannot be reached is not such a fault: refused, timed out, unknown host name,
starting up, shutting down, out of connection slots.  At start-up it may be restarting during a
deploy, so the worker starts and waits for it, as it waits out an outage after a good start
(reconnect.py).

libpq gives a failed connection no SQLSTATE: the server's refusal is the ``FATAL:`` line of its
text, and the refusals that name the configuration are known by their words (the server's, in
English; in another ``lc_messages`` the worker waits, as before).  Errors of a live connection
(the schema check) are decided by SQLSTATE.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from dramatiq.errors import ConnectionClosed
from dramatiq.middleware import MiddlewareError

from ..errors import SchemaError
from . import migrations
from .database import Database, connection_kwargs
from .reconnect import PacedConnection


class StartupError(MiddlewareError, ConnectionClosed):
    """The broker's database can never work as configured (role, password, database, schema).

    A ``MiddlewareError``, so Dramatiq lets it out of ``Worker.start()`` (it only logs other errors
    of a middleware's hooks); a ``ConnectionClosed``, so code that handles a broker that cannot
    connect handles it too.
    """


#: Words of a connection refusal that names the configuration: waiting does not change it.
_FOR_GOOD = (
    "authentication failed",  # password, scram, md5, peer, ident, ldap, cert... (28P01, 28000)
    "does not exist",  # role "app" / database "app" does not exist (28000, 3D000)
    "no pg_hba.conf entry",  # 28000
    "pg_hba.conf rejects connection",  # 28000
    "is not permitted to log in",  # a role without LOGIN (28000)
    "permission denied for database",  # no CONNECT privilege (42501)
    "no password supplied",  # libpq: the server asks for one and the URL has none
    "no such database",  # PgBouncer's words
    "no such user",
)
#: SQLSTATE classes and codes of a live connection's error that name the configuration.
_FOR_GOOD_SQLSTATES = ("28", "3D", "42501")


def refused_for_good(error: BaseException) -> bool:
    """Did the server refuse us for a reason that waiting will not change (see the module's docstring)?"""
    if not isinstance(error, psycopg.Error):
        return False
    if error.sqlstate is not None:
        return error.sqlstate.startswith(_FOR_GOOD_SQLSTATES)
    if not isinstance(error, psycopg.OperationalError):
        return False
    # 'connection to server at "h", port 5432 failed: FATAL:  password authentication failed for user "app"';
    # with several hosts in the URL, psycopg lists each attempt ("- host: 'h1', port: ...: <that>"), or
    # libpq gives a line per host: the refusal is for good only if every host refused for good (one
    # down, or a standby, may be a failover under way).
    lines = str(error).splitlines() or [""]
    attempts = (
        [line for line in lines if line.startswith("- host: ")]
        or [line for line in lines if line.startswith("connection to server ") and " failed: " in line]
        or lines[:1]
    )
    causes = [line.rsplit(" failed: ", 1)[-1].lower() for line in attempts]
    return all(any(words in cause for words in _FOR_GOOD) for cause in causes)


def check(database: Database, *, ready: Callable[[PacedConnection, dict[str, Any]], None] | None = None) -> str | None:
    """Raise :class:`StartupError` if *database* can never work as configured.  Otherwise return
    ``None`` if it is ready, or why it cannot be reached now (that is waited for).  One connection of
    its own, not the pool's (whose attempts would announce an outage and try again); when the schema
    is ready it goes to *ready* with the settings it was made with (the broker's pool takes it as its
    first: :meth:`.Database.found_ready`), else it is closed."""
    kwargs = connection_kwargs(database.connect_timeout, prepare=database.prepare)
    try:
        conn = PacedConnection.connect_once(database.conninfo, **kwargs)
        try:
            migrations.check(conn, database.schema, url_hint=database.safe_url())
        except BaseException:
            conn.close()
            raise
    except SchemaError as e:
        raise StartupError(f"Cannot start: {e}") from None
    except psycopg.Error as e:
        if refused_for_good(e):
            raise StartupError(
                f"Cannot start: {database.describe(e)}. Waiting would not change it: check the URL's role,"
                " password and database name"
            ) from None
        return database.describe(e)
    if ready is None:
        conn.close()
    else:
        ready(conn, kwargs)
    return None


__all__ = ["StartupError", "check", "refused_for_good"]
