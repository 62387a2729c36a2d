"""The Django integration in a real Django project (``tests/django_project``), run by Django's own
test runner in a process of its own: its settings, its test database (made and dropped by the
runner), ``TestCase`` transactions and django_dramatiq's ``DramatiqTestCase`` with a worker."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytest.importorskip("django")
pytest.importorskip("django_dramatiq")

PROJECT = Path(__file__).resolve().parent / "django_project"


def test_the_django_project_passes_under_djangos_test_runner(dramatiq_pg_url: str) -> None:
    env = dict(os.environ, DATABASE_URL=dramatiq_pg_url, DJANGO_TEST_DATABASE=f"test_dj_{uuid.uuid4().hex[:8]}",
               PYTHONPATH=str(PROJECT))  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "django", "test", "shop.scenarios", "--settings=settings", "--noinput", "-v", "2"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    ran = re.search(r"^Ran (\d+) tests?", output, flags=re.M)
    assert ran is not None and int(ran[1]) >= 13, output[-3000:]
    assert re.search(r"^OK\b", output, flags=re.M), output[-3000:]
    assert "Destroying test database" in output  # the runner dropped it: the broker let go of it
