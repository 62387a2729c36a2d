"""The tutorial (docs/tutorial.md) runs as written: its ``jobs.py``, migrated with the CLI, run by a real
``dramatiq jobs`` worker, and its ``>>>`` lines, outputs and exceptions included, in one shell."""

from __future__ import annotations

import doctest
import io
import os
import re
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tutorial.md"


def blocks(page: str, language: str) -> list[str]:
    """The page's fenced code blocks of one language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", page, flags=re.S | re.M)


def test_the_tutorial_has_a_module_and_a_session() -> None:
    """Given the page, I expect jobs.py in parts marked ``# jobs.py`` and shell lines to run against it."""
    page = PAGE.read_text()
    assert sum(b.startswith("# jobs.py\n") for b in blocks(page, "python")) >= 4
    assert len(blocks(page, "pycon")) >= 4


@pytest.mark.slow
def test_the_tutorial_runs_as_written(dramatiq_pg_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a database of its own, when jobs.py is migrated and run by `dramatiq jobs` as the page says,
    then every ``>>>`` line of the page gives the output the page shows, and the worker said hello."""
    page = PAGE.read_text()
    (tmp_path / "jobs.py").write_text("\n\n".join(b for b in blocks(page, "python") if b.startswith("# jobs.py\n")))
    session = "\n".join(blocks(page, "pycon"))
    database = f"tutorial_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    url = make_conninfo(dramatiq_pg_url, dbname=database)
    env = dict(os.environ, DATABASE_URL=url, PYTHONUNBUFFERED="1")
    log = (tmp_path / "worker.log").open("w+")
    worker = None
    try:
        migrated = subprocess.run(
            [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, "migrate"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert migrated.returncode == 0, migrated.stderr
        worker = subprocess.Popen(
            [sys.executable, "-m", "dramatiq", "jobs", "--processes", "1", "--threads", "4"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        monkeypatch.setenv("DATABASE_URL", url)
        monkeypatch.syspath_prepend(str(tmp_path))
        test = doctest.DocTestParser().get_doctest(session, {}, "docs/tutorial.md", str(PAGE), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        report = io.StringIO()
        result = runner.run(test, out=report.write)
        assert result.failed == 0, report.getvalue()
    finally:
        jobs = sys.modules.pop("jobs", None)
        if jobs is not None:
            jobs.backend.close()
            jobs.broker.close()
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
    log.seek(0)
    assert "hello, Ada" in log.read()
