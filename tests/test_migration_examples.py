"""The migration guides (docs/migrating.md), tried end to end: their scripts in examples/ run the
procedure each guide gives, on the real old broker (Redis, RabbitMQ) or the old package's table
(dramatiq-pg, dramatiq-postgres), or a django_dramatiq project's two settings, and check that every
message ran once."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

REPO = Path(__file__).resolve().parent.parent


def reachable(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def run(script: str, kind: str, url: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, f"examples/{script}", kind],
        cwd=REPO,
        env=dict(os.environ, DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "module", "port"), [("redis", "redis", 6379), ("rabbitmq", "pika", 5672)])
def test_the_drain_and_switch_from_dramatiqs_own_broker(dramatiq_pg_url: str, kind: str, module: str, port: int) -> None:
    """Given messages sent on Dramatiq's RedisBroker (or RabbitmqBroker), one of them delayed, when the
    application switches its sends to PostgreSQL while the old workers drain the old broker, then stops
    them and moves what is left, I expect every message to run exactly once, the delayed one on
    PostgreSQL and not before it was due."""
    pytest.importorskip(module, reason=f"{module} is not installed (pip install -e '.[migrate]')")
    if not reachable(port):
        pytest.skip(f"no {kind} on 127.0.0.1:{port} (CI's machine runs one)")
    done = run("migrate_from_dramatiq.py", kind, dramatiq_pg_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4. moved 1 message(s) to PostgreSQL" in done.stdout, done.stdout
    assert f"every message ran once: 5 on {kind}, 6 on PostgreSQL" in done.stdout, done.stdout
    assert done.stdout.rstrip().endswith("done")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dramatiq-pg", "dramatiq-postgres"])
def test_moving_the_queued_messages_of_another_postgres_broker(dramatiq_pg_url: str, kind: str) -> None:
    """Given the old package's table holding queued, consumed (its worker died), delayed and rejected
    messages, when they are moved in one transaction, I expect the four unfinished ones moved and each
    run once, and the rejected one left behind."""
    done = run("migrate_from_dramatiq_pg.py", kind, dramatiq_pg_url)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "moved 4 message(s) in one transaction; left in the old table: ['rejected']" in done.stdout
    assert "ran: [0, 1, 2, 3]" in done.stdout


# ~25 s: the script runs the real thing in processes: manage.py migrate, the old rundramatiq on Redis
# until it drains and stops, the new worker on PostgreSQL until the delayed message is due.
@pytest.mark.slow
def test_the_drain_and_switch_of_a_django_dramatiq_project_from_redis(dramatiq_pg_url: str) -> None:
    """Given a Django project configured the django_dramatiq way on Redis (``DRAMATIQ_BROKER`` a
    RedisBroker, results in Redis) that sent messages, one of them delayed, when its settings switch to
    the guide's (``DjangoPostgresBroker``, ``PostgresResultBackend`` in ``DRAMATIQ_RESULT_BACKEND``),
    ``manage.py migrate`` runs, the old ``rundramatiq`` drains Redis and stops, and ``move()`` takes
    what is left to the new broker, I expect every message to run exactly once, the delayed one on
    PostgreSQL and not before it was due, and results read back through the new results backend."""
    pytest.importorskip("django", reason="django is not installed")
    pytest.importorskip("django_dramatiq", reason="django_dramatiq is not installed")
    pytest.importorskip("redis", reason="redis is not installed (pip install -e '.[migrate]')")
    if not reachable(6379):
        pytest.skip("no redis on 127.0.0.1:6379 (CI's machine runs one)")
    name = f"migrate_dj_{uuid.uuid4().hex[:8]}"
    try:
        done = subprocess.run(
            [sys.executable, "examples/migrate_from_django_dramatiq.py"],
            cwd=REPO,
            # The Django processes import this checkout's package (the script puts it on their path).
            env=dict(os.environ, DATABASE_URL=dramatiq_pg_url, DJANGO_DATABASE=name, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "4. moved 1 message(s) to PostgreSQL" in done.stdout, done.stdout
        assert "every message ran once: 5 on Redis, 6 on PostgreSQL" in done.stdout, done.stdout
        assert "results through the new backend: [10, 198]" in done.stdout, done.stdout
        assert done.stdout.rstrip().endswith("done")
    finally:  # the script drops its database; if it was killed, here it is dropped
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", [name])
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
            assert conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None
