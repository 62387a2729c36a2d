"""The pattern for testing one's own code (docs/testing.md, "Testing your own code with it"), on an app module
that builds its broker from DATABASE_URL at import (examples/shop.py) and its tests
(examples/test_shop.py), run by pytest in a process of their own as a project's suite would be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dramatiq
import pytest
from helpers import messages_in, sessions_of

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.testing import bind_actors

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def pytest_run(cwd: Path, app_url: str, test_url: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DATABASE_URL=app_url, DRAMATIQ_PG_TEST_URL=test_url, PYTHONPATH=str(EXAMPLES))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
def test_the_example_apps_tests_pass_without_touching_its_database(own_data, dramatiq_pg_url):
    """Given DATABASE_URL pointing at a database holding data, when examples/test_shop.py runs, then its
    tests pass (a charge is made by the test's worker; a failing charge raises from join), and not one
    session was opened on that database: its rows are as they were."""
    rows = messages_in(own_data.url)
    sessions = sessions_of(own_data.admin_url, own_data.dbname)

    done = pytest_run(REPO, own_data.url, dramatiq_pg_url, str(EXAMPLES / "test_shop.py"))

    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert sessions_of(own_data.admin_url, own_data.dbname) == sessions, "the tests connected to DATABASE_URL"
    assert messages_in(own_data.url) == rows


FALSE_PASS = """\
import shop


def test_a_failing_charge_joined_fail_fast(dramatiq_pg_broker, dramatiq_pg_worker):
    shop.charge.send("o-4", 0)
    dramatiq_pg_broker.join(shop.charge.queue_name, fail_fast=True)
"""


@pytest.mark.slow
def test_a_failing_actor_joined_fail_fast_fails_the_test(own_data, dramatiq_pg_url, tmp_path):
    """A test that sends to an actor that raises and joins with fail_fast=True fails, with the actor's
    error, and its message never reaches DATABASE_URL's database."""
    (tmp_path / "test_false_pass.py").write_text(FALSE_PASS)
    rows = messages_in(own_data.url)
    sessions = sessions_of(own_data.admin_url, own_data.dbname)

    done = pytest_run(tmp_path, own_data.url, dramatiq_pg_url)

    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "ValueError: order o-4: nothing to charge (0 cents)" in done.stdout
    assert sessions_of(own_data.admin_url, own_data.dbname) == sessions, "the test connected to DATABASE_URL"
    assert messages_in(own_data.url) == rows


def test_bind_actors_moves_every_actor_of_the_apps_broker_and_back() -> None:
    """Given actors declared at import on an app's broker (no I/O: its database is never reached), when
    bound to a test broker, then sends go to the test broker and its worker knows them; afterwards each
    actor is the app's again, as it was."""
    app = PostgresBroker("postgresql://app@127.0.0.1:1/app")
    test = PostgresBroker("postgresql://test@127.0.0.1:1/test")

    @dramatiq.actor(broker=app, queue_name="billing", interrupt_on_cancel=True)
    def bill(n: int) -> None: ...

    fn, options = bill.fn, dict(bill.options)
    with bind_actors(test, source=app) as bound:
        assert bound == [bill]
        assert bill.broker is test
        assert test.actors == {"bill": bill} and "billing" in test.queues
    assert bill.broker is app and app.actors == {"bill": bill}
    assert bill.fn is fn and bill.options == options
    assert "bill" not in test.actors
