"""What the options both ``dramatiq-pg-fenced`` commands take mean, and the servers they start.

The databases named (``--url NAME=URL``, ``--schema NAME=SCHEMA``) and, for ``metrics`` and
``dashboard``, the hosts answered (``--host``, ``--allow-host``), the credentials
(``--auth-file``), the start-up check and serving until interrupted.  Shared by :mod:`.cli` (one
database) and :mod:`.fleet_cli` (several).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import DEFAULT_SCHEMA
from ..db import startup
from ..db.database import Database
from .output import OK

if TYPE_CHECKING:
    from ..broker import PostgresBroker

_NAMED_URL = re.compile(r"([A-Za-z_][A-Za-z0-9_.-]*)=(postgres(?:ql)?://.*)", re.DOTALL)


def named_url(url: str | None) -> tuple[str, str] | None:
    """``NAME=postgresql://...``: (name, URL); a plain URL or DSN (``host=... dbname=...``): ``None``."""
    match = _NAMED_URL.fullmatch(url or "")
    return (match[1], match[2]) if match else None


def schema_of(args: argparse.Namespace, name: str) -> str:
    """The schema of database *name* (``""``: the only one): its ``--schema NAME=SCHEMA``, else a plain
    ``--schema``, else ``$DRAMATIQ_PG_SCHEMA``, else the default."""
    plain = os.environ.get("DRAMATIQ_PG_SCHEMA", DEFAULT_SCHEMA)
    for value in args.schema or ():
        key, eq, schema = value.partition("=")
        if not eq:
            plain = value
        elif key == name:
            return schema
        elif not name:
            raise ValueError(f"--schema {value}: NAME=SCHEMA goes with several databases (--url NAME=URL)")
    return plain


def serve(server: Any, args: argparse.Namespace) -> int:
    """Serve until interrupted (after the note on a wildcard bind without --allow-host)."""
    _note_wildcard(args)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return OK


def check_before_serving(broker: PostgresBroker | None, meanwhile: str, *databases: Database) -> None:
    """A role, password, database or schema that can never work: fail now (``StartupError``, exit 3).
    A database that cannot be reached now: serve all the same, and say so (as once started).
    *databases*: those the server uses (default: the broker's)."""
    for database in dict.fromkeys(databases or ([broker.database] if broker is not None else [])):
        away = startup.check(database)
        if away is not None:
            print(f"note: {away}; {meanwhile} until it is back", file=sys.stderr)


def allowed_hosts(args: argparse.Namespace) -> list[str]:
    """The host names the server answers besides the loopback ones: the bound address and --allow-host."""
    return [args.host, *args.allow_host] if args.host else list(args.allow_host)


def _note_wildcard(args: argparse.Namespace) -> None:
    if args.host in ("", "0.0.0.0", "::") and not args.allow_host:
        print(
            "note: requests are answered only when addressed to localhost, 127.0.0.1 or [::1]: "
            "add --allow-host for each name or address it is reached by",
            file=sys.stderr,
        )


def dashboard_auth(path: str | None) -> str | None:
    """The dashboard's credentials, from *path* (``--auth-file``), else ``$DRAMATIQ_PG_DASHBOARD_AUTH``: one
    line (``user:password`` or a token), or several, each after an optional role word (``operator``,
    ``read-only``; see :mod:`..dashboard.roles`).

    Never from an argument: a command line is visible to every user of the host (``ps``,
    ``/proc``) and kept in shell histories.  Errors name neither the file nor its content
    (a secret typed where the path goes stays out of the output)."""
    from ..dashboard import AUTH_ENV

    if path is not None:
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read --auth-file: {getattr(e, 'strerror', None) or 'not UTF-8 text'}") from None
        where = "--auth-file"
    else:
        env = os.environ.get(AUTH_ENV)
        if env is None:
            return None
        text, where = env, f"${AUTH_ENV}"
    text = text.strip()
    if not text:
        raise ValueError(f"{where} must hold user:password or a token, one a line, each after an optional "
                         "role (operator, read-only)")
    return text
