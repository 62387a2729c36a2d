"""Schema migrations: numbered SQL files applied once, under an advisory lock.

The files live in the top-level ``sql/`` folder of the source tree and inside
the wheel as ``dramatiq_pg_fenced/sql``.  Each file runs in the transaction
that records it, so a failed migration leaves nothing half done.
"""

from __future__ import annotations

import re
import zlib
from importlib import resources
from pathlib import Path

import psycopg
import psycopg.errors
from psycopg import sql

from ..errors import SchemaError
from .statements import check_schema

_FILE_RE = re.compile(r"(\d{3})_[a-z0-9_]+\.sql")


def _sql_dir() -> Path:
    packaged = resources.files("dramatiq_pg_fenced") / "sql"
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent.parent / "sql"  # source checkout / editable install


def available() -> list[tuple[int, str, str]]:
    """(version, file name, text) of every migration, in order."""
    found = []
    for path in sorted(_sql_dir().iterdir()):
        match = _FILE_RE.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path.name, path.read_text()))
    return found


def versions() -> list[int]:
    """The version of every migration, in order: the file names alone (a worker's start-up check reads
    no SQL text)."""
    return sorted(int(m.group(1)) for path in _sql_dir().iterdir() if (m := _FILE_RE.fullmatch(path.name)))


def latest_version() -> int:
    return versions()[-1]


def _lock_key(schema: str) -> int:
    return zlib.crc32(f"dramatiq_pg_fenced:{schema}".encode()) - 2**31


def applied_versions(conn: psycopg.Connection, schema: str) -> set[int]:
    """The versions applied to *schema* (empty when it has none)."""
    exists = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", [sql.Identifier(schema, "schema_version").as_string(conn)]
    ).fetchone()
    if not exists or not exists[0]:
        return set()
    rows = conn.execute(sql.SQL("SELECT version FROM {}").format(sql.Identifier(schema, "schema_version")))
    return {int(r[0]) for r in rows.fetchall()}


def current_version(conn: psycopg.Connection, schema: str) -> int:
    """The schema's highest applied version; 0 when it has none."""
    return max(applied_versions(conn, schema), default=0)


def migrate(conn: psycopg.Connection, schema: str) -> list[int]:
    """Apply every pending migration to *schema*; return the versions applied.

    Safe to run twice and from several processes at once: a transaction-level
    advisory lock serialises them and the second one finds nothing to do.
    With nothing to do it changes nothing, so any role that can read the
    schema may call it; otherwise it needs the schema's owner (or ``CREATE``
    on the database when the schema does not exist yet).
    A version missing below the highest applied one (files numbered in
    parallel branches) is applied too, in order.
    """
    check_schema(schema)
    ident = sql.Identifier(schema)
    applied: list[int] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", [_lock_key(schema)])
        if {version for version, _, _ in available()} <= applied_versions(conn, schema):
            return applied
        _create_schema(conn, schema)
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {}.schema_version ("
                " version integer PRIMARY KEY, name text NOT NULL,"
                " applied_at timestamptz NOT NULL DEFAULT now())"
            ).format(ident)
        )
        done = applied_versions(conn, schema)
        for version, name, text in available():
            if version in done:
                continue
            conn.execute(sql.SQL(text).format(schema=ident))  # type: ignore[arg-type]
            conn.execute(
                sql.SQL("INSERT INTO {}.schema_version (version, name) VALUES (%s, %s)").format(ident),
                [version, name],
            )
            applied.append(version)
    return applied


def _create_schema(conn: psycopg.Connection, schema: str) -> None:
    """Create *schema* if it is missing, inside the migration's transaction.

    Only if missing: ``CREATE SCHEMA IF NOT EXISTS`` needs ``CREATE`` on the
    database even when the schema exists, which its owner may well lack.
    """
    if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", [schema]).fetchone():
        return
    ident = sql.Identifier(schema)
    try:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(ident))
    except psycopg.errors.InsufficientPrivilege as e:
        role = sql.Identifier(conn.info.user).as_string(conn)
        raise SchemaError(
            f"cannot create schema {schema!r} ({str(e).splitlines()[0]}): grant the migrating role CREATE on "
            f"the database, or create the schema for it: CREATE SCHEMA {ident.as_string(conn)} AUTHORIZATION {role}"
        ) from None


def check(conn: psycopg.Connection, schema: str, url_hint: str = "URL") -> None:
    """Raise :class:`SchemaError` unless every migration of this package is applied to *schema*."""
    applied = applied_versions(conn, schema)
    known = versions()
    have, want = max(applied, default=0), known[-1]
    if have > want:
        raise SchemaError(
            f"schema {schema!r} is at version {have}, newer than this dramatiq-pg-fenced ({want}); upgrade the package"
        )
    missing = [version for version in known if version not in applied]
    if missing:
        what = (
            "has no dramatiq-pg-fenced schema"
            if not applied
            else f"lacks migration(s) {', '.join(map(str, missing))} (at version {have}, need {want})"
        )
        raise SchemaError(
            f"schema {schema!r} {what}. Run: dramatiq-pg-fenced migrate --url {url_hint} --schema {schema}"
            " (or broker.migrate())"
        )
