"""The Django integration in a real Django project (``tests/django_project``), run by Django's own
test runner in a process of its own: its settings, its test database (made and dropped by the
runner), ``TestCase`` transactions and django_dramatiq's ``DramatiqTestCase`` with a worker."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

pytest.importorskip("django")
pytest.importorskip("django_dramatiq")

PROJECT = Path(__file__).resolve().parent / "django_project"
#: The project, then this checkout's package (not whatever copy is installed).
PATH = os.pathsep.join([str(PROJECT), str(PROJECT.parent.parent)])


# ~20 s: Django's own test runner in a subprocess, 18+ tests on a test database of their own.
@pytest.mark.slow
def test_the_django_project_passes_under_djangos_test_runner(dramatiq_pg_url: str) -> None:
    env = dict(os.environ, DATABASE_URL=dramatiq_pg_url, DJANGO_TEST_DATABASE=f"test_dj_{uuid.uuid4().hex[:8]}",
               PYTHONPATH=PATH)  # fmt: skip
    run = subprocess.run(
        [sys.executable, "-m", "django", "test", "shop.scenarios", "shop.atomic_scenarios", "--settings=settings", "--noinput", "-v", "2"],
        cwd=PROJECT, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    ran = re.search(r"^Ran (\d+) tests?", output, flags=re.M)
    assert ran is not None and int(ran[1]) >= 36, output[-3000:]
    assert re.search(r"^OK\b", output, flags=re.M), output[-3000:]
    assert "Destroying test database" in output  # the runner dropped it: the broker let go of it


def test_manage_py_migrate_creates_the_brokers_tables_and_rundramatiq_runs_an_outbox_send(
    dramatiq_pg_url: str, tmp_path: Path
) -> None:
    # Given a fresh database for the project (not a test database: what production runs)
    name = f"dj_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = make_conninfo(dramatiq_pg_url, dbname=name)
    env = dict(os.environ, DATABASE_URL=url, DJANGO_SETTINGS_MODULE="settings", PYTHONPATH=PATH,
               PYTHONUNBUFFERED="1")  # fmt: skip
    django = [sys.executable, "-m", "django"]
    worker = None
    try:
        # When I migrate, I expect the broker's tables beside Django's
        migrate = subprocess.run([*django, "migrate", "--noinput"], cwd=PROJECT, env=env, capture_output=True,
                                 text=True, timeout=120)  # fmt: skip
        assert migrate.returncode == 0, migrate.stdout + migrate.stderr
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT to_regclass('shop_queue.message')").fetchone()[0] is not None
        # and when a django_dramatiq worker runs, an order placed in Django's transaction is confirmed
        with open(tmp_path / "rundramatiq.log", "wb") as log:
            worker = subprocess.Popen([*django, "rundramatiq", "--processes", "1", "--threads", "2"],
                                      cwd=PROJECT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)  # fmt: skip
        code = (
            "from dramatiq_pg_fenced.integrations.django import outbox\n"
            "from shop.models import Order\nfrom shop.tasks import confirm_order\n"
            "with outbox():\n    order = Order.objects.create(total=5)\n    confirm_order.send(order.pk)\n"
            "print(order.pk)\n"
        )
        shell = subprocess.run([*django, "shell", "-c", code], cwd=PROJECT, env=env, capture_output=True, text=True,
                               timeout=120)  # fmt: skip
        assert shell.returncode == 0, shell.stdout + shell.stderr
        order_id = int(shell.stdout.split()[-1])
        deadline = time.monotonic() + 60
        with psycopg.connect(url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute("SELECT status FROM shop_order WHERE id = %s", [order_id]).fetchone()
                if row == ("confirmed",):
                    break
                time.sleep(0.1)
            else:
                pytest.fail("the worker did not confirm the order:\n" + (tmp_path / "rundramatiq.log").read_text())
    finally:
        if worker is not None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name])
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
