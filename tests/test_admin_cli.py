"""The ``dramatiq-pg-fenced`` command: migrate, cancel, inspect, stats, compact."""

import json
import subprocess
import sys
import uuid

import dramatiq
import psycopg
import pytest
from dramatiq.errors import BrokerError
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


def test_compact_gives_back_what_a_drained_backlog_left(dramatiq_pg_url, dramatiq_pg_broker):
    """After 20,000 messages come and go, the table and its indexes hold several MB; compact (run
    while a message waits, so it must keep it) brings them back near an empty table's size."""
    broker = dramatiq_pg_broker
    schema = broker.schema
    broker.declare_queue("default")

    def size():
        return broker.database.run(
            lambda conn: conn.execute("SELECT pg_total_relation_size(%s::regclass)", [f'"{schema}".message']).fetchone()
        )[0]

    empty = size()
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        for _ in range(4):
            broker.enqueue_many(
                [
                    dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
                    for _ in range(5000)
                ]
            )
            conn.execute(sql.SQL("DELETE FROM {}.message").format(sql.Identifier(schema)))  # as 5,000 acks would
    kept = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(kept)
    drained = size()
    assert drained > empty + 2_000_000, (empty, drained)

    done = cli(dramatiq_pg_url, "--schema", schema, "compact")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["bytes_before"] == drained
    assert report["bytes_after"] < empty + 200_000, (empty, report)
    assert broker.inspect(kept.message_id)["state"] == "queued"


def test_compact_gives_up_on_a_busy_table_rather_than_block_it(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    broker.declare_queue("default")
    with psycopg.connect(dramatiq_pg_url) as holder:  # a long transaction that has touched the table
        holder.execute(sql.SQL("SELECT count(*) FROM {}.message").format(sql.Identifier(broker.schema)))
        with pytest.raises(BrokerError, match="lock timeout"):
            broker.compact(lock_timeout=0.2)
    message = dramatiq.Message(queue_name="default", actor_name="x", args=(), kwargs={}, options={})
    broker.enqueue(message)  # the pool's connections are back to no lock timeout, and nothing else changed
    assert broker.inspect(message.message_id)["state"] == "queued"
