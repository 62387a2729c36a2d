"""Numbered migrations: a file numbered in a parallel branch below the applied ones is still applied."""

from __future__ import annotations

import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_fenced.db import migrations
from dramatiq_pg_fenced.errors import SchemaError


def test_a_missing_version_below_the_latest_is_applied(
    dramatiq_pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrations, "_sql_dir", lambda: tmp_path)
    (tmp_path / "001_one.sql").write_text("CREATE TABLE {schema}.one (x int);")
    (tmp_path / "005_five.sql").write_text("CREATE TABLE {schema}.five (x int);")
    schema = f"mig_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        try:
            assert migrations.migrate(conn, schema) == [1, 5]
            # Given a branch that adds 003 after 005 was applied here
            (tmp_path / "003_three.sql").write_text("CREATE TABLE {schema}.three (x int);")
            with pytest.raises(SchemaError, match=r"lacks migration\(s\) 3 \(at version 5, need 5\)"):
                migrations.check(conn, schema)
            assert migrations.migrate(conn, schema) == [3]
            migrations.check(conn, schema)
            assert migrations.migrate(conn, schema) == []
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
