"""Django's Tasks framework on the broker, in the real Django project (``tests/django_project``), run by
Django's own test runner in a process of its own, with a real ``dramatiq`` worker process
(``shop.task_scenarios``)."""

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
try:
    import django.tasks  # noqa: F401
except ImportError:
    pytest.importorskip("django_tasks")

PROJECT = Path(__file__).resolve().parent / "django_project"
ROOT = PROJECT.parent.parent


def test_djangos_tasks_run_on_the_broker_under_djangos_test_runner(dramatiq_pg_url: str) -> None:
    # The project, its worker and this package from this checkout (not another installed copy).
    env = dict(os.environ, DATABASE_URL=dramatiq_pg_url, DJANGO_TEST_DATABASE=f"test_djt_{uuid.uuid4().hex[:8]}",
               PYTHONPATH=os.pathsep.join([str(PROJECT), str(ROOT)]),
               EXPECT_PACKAGE_UNDER=str(ROOT / "dramatiq_pg_fenced"))  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "django", "test", "shop.task_scenarios", "--settings=settings", "--noinput", "-v", "2"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-8000:]
    ran = re.search(r"^Ran (\d+) tests?", output, flags=re.M)
    assert ran is not None and int(ran[1]) >= 11, output[-3000:]
    assert re.search(r"^OK\b", output, flags=re.M), output[-3000:]
    assert "Destroying test database" in output
