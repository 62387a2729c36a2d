"""The README's first command keeps working: the quickstart, with real worker processes."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_quickstart_runs_through_worker_processes(dramatiq_pg_url):
    schema = f"qs_{uuid.uuid4().hex[:10]}"
    env = dict(os.environ, DATABASE_URL=dramatiq_pg_url, DRAMATIQ_PG_SCHEMA=schema)
    try:
        done = subprocess.run(
            [sys.executable, "examples/quickstart.py"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240
        )
    finally:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "add(5, 50) -> 55" in out
    assert "flaky(7) -> {'n': 7, 'retries': 1, 'attempt': 2}" in out
    assert "pipeline add(1, 2) | double -> 6" in out
    assert "group of add -> [0, 2, 4]" in out
    assert "messages left in the queue table: none" in out
    assert out.rstrip().endswith("done")
