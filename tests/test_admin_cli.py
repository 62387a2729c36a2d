"""The ``dramatiq-pg-fenced`` command: migrate, cancel, inspect, stats."""

import json
import subprocess
import sys
import uuid

import dramatiq
import psycopg
import pytest
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.cli import main


def cli(url, *args):
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def fresh_schema(dramatiq_pg_url):
    schema = f"cli_{uuid.uuid4().hex[:10]}"
    yield schema
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_migrate_twice_then_the_broker_works(dramatiq_pg_url, fresh_schema):
    first = cli(dramatiq_pg_url, "--schema", fresh_schema, "migrate")
    assert first.returncode == 0, first.stderr
    assert "1" in first.stdout
    second = cli(dramatiq_pg_url, "--schema", fresh_schema, "migrate")
    assert second.returncode == 0, second.stderr
    assert "nothing to do" in second.stdout

    broker = PostgresBroker(dramatiq_pg_url, schema=fresh_schema)
    try:
        broker.declare_queue("default")
        broker.enqueue(dramatiq.Message(queue_name="default", actor_name="a", args=(), kwargs={}, options={}))
        assert broker.stats()["queues"] == {"default": {"queued": 1}}
    finally:
        broker.close()


def test_stats_on_an_unmigrated_schema_names_the_migrate_command(dramatiq_pg_url, fresh_schema):
    result = cli(dramatiq_pg_url, "--schema", fresh_schema, "stats")
    assert result.returncode == 1
    assert "dramatiq-pg-fenced migrate" in result.stderr
    assert fresh_schema in result.stderr


def test_bad_schema_name_is_refused(dramatiq_pg_url):
    assert main(["--url", dramatiq_pg_url, "--schema", 'x"; drop table y; --', "stats"]) == 2


def test_cancel_and_inspect(dramatiq_pg_url, dramatiq_pg_broker):
    schema = dramatiq_pg_broker.schema

    @dramatiq.actor(broker=dramatiq_pg_broker)
    def never_runs():
        pass

    message = never_runs.send()
    shown = cli(dramatiq_pg_url, "--schema", schema, "inspect", message.message_id)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["state"] == "queued" and info["attempt"] == 0 and info["actor_name"] == "never_runs"

    cancelled = cli(dramatiq_pg_url, "--schema", schema, "cancel", message.message_id)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() == "cancelled_queued"
    again = cli(dramatiq_pg_url, "--schema", schema, "cancel", message.message_id)
    assert again.returncode == 1 and again.stdout.strip() == "already_cancelled"
    assert dramatiq_pg_broker.inspect(message.message_id)["state"] == "cancelled"

    unknown = cli(dramatiq_pg_url, "--schema", schema, "inspect", str(uuid.uuid4()))
    assert unknown.returncode == 1
