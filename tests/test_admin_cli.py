"""The ``dramatiq-pg-fenced`` command: migrate, cancel, inspect, stats, list, redrive, purge, pause,
metrics, dashboard, compact; and how it behaves at its edges."""

import json
import os
import re
import signal
import subprocess
import sys
import traceback
import urllib.request
import uuid

import dramatiq
import psycopg
import pytest
from dramatiq.errors import BrokerError
from helpers import query, running_worker, wait_for
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.cli.command import main


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
    assert result.returncode == 3  # a database failure
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

    # A version inspect showed: redrive and cancel act on that row only
    seen = info["version"]
    stale = cli(dramatiq_pg_url, "--schema", schema, "redrive", message.message_id, "--seen", seen)
    assert stale.returncode == 1 and "changed since it was shown" in stale.stderr  # cancelled since
    seen = json.loads(cli(dramatiq_pg_url, "--schema", schema, "inspect", message.message_id).stdout)["version"]
    redriven = cli(dramatiq_pg_url, "--schema", schema, "redrive", message.message_id, "--seen", seen)
    assert redriven.returncode == 0, redriven.stderr
    gone = cli(dramatiq_pg_url, "--schema", schema, "cancel", message.message_id, "--seen", "999999.1")
    assert gone.returncode == 1 and gone.stdout.strip() == "not_found"
    assert dramatiq_pg_broker.inspect(message.message_id)["state"] == "queued"


def test_compact_gives_back_what_a_drained_backlog_left(own_data):
    """After 20,000 messages come and go, the table and its indexes hold several MB; compact (run
    while a message waits, so it must keep it) brings them back near an empty table's size.  In a
    database of its own: a snapshot held by a test running beside this one (another pytest-xdist
    worker) holds back the cleanup of its own database only, and would keep the dead rows here."""
    dramatiq_pg_url = own_data.url
    broker = PostgresBroker(dramatiq_pg_url, listen=False)
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

    def compacted() -> bool:
        """A snapshot taken while the deletes ran (an autovacuum ANALYZE of this database, say: a CI
        run kept 7 of 10 MB) keeps the rows deleted after it: compact keeps what it may not remove,
        and gives it back when run again once that snapshot is gone."""
        nonlocal report
        if report["bytes_after"] < empty + 200_000:
            return True
        again = cli(dramatiq_pg_url, "--schema", schema, "compact")
        assert again.returncode == 0, again.stderr
        report = json.loads(again.stdout)
        return report["bytes_after"] < empty + 200_000

    wait_for(compacted, 60, f"compact to bring the table near its empty size ({empty:,} bytes)")
    assert broker.inspect(kept.message_id)["state"] == "queued"
    broker.close()


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


def test_options_go_before_or_after_the_command(dramatiq_pg_url, dramatiq_pg_broker):
    schema = dramatiq_pg_broker.schema
    dramatiq_pg_broker.declare_queue("q")
    dramatiq_pg_broker.enqueue(dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
    before = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", dramatiq_pg_url, "--schema", schema, "stats", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    after = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "stats", "--json", "--schema", schema, "--url", dramatiq_pg_url],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert before.returncode == after.returncode == 0, (before.stderr, after.stderr)
    one, two = json.loads(before.stdout), json.loads(after.stdout)
    assert [q["due"] for q in one["queues"]] == [q["due"] for q in two["queues"]] == [1]


def test_a_bad_message_id_is_one_line_and_exit_2(dramatiq_pg_url, dramatiq_pg_broker):
    for command in ("inspect", "cancel", "redrive"):
        result = cli(dramatiq_pg_url, "--schema", dramatiq_pg_broker.schema, command, "12345")
        assert result.returncode == 2, result
        assert result.stderr.strip().splitlines() == [
            "error: not a message id: '12345' (a UUID, as Dramatiq makes them)"
        ]


def test_stats_is_a_table_for_people_and_json_for_scripts(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    broker.declare_queue("mail")
    broker.enqueue_many([dramatiq.Message(queue_name="mail", actor_name="a", args=(), kwargs={}, options={})] * 1)
    broker.pause("mail")
    table = cli(dramatiq_pg_url, "--schema", broker.schema, "stats")
    assert table.returncode == 0, table.stderr
    head, row, footer = table.stdout.strip().splitlines()
    assert head.split()[:5] == ["queue", "paused", "queued", "delayed", "running"]
    assert row.split()[:3] == ["mail", "yes", "1"]
    assert footer.startswith("stale writes: 0   redeliveries: 0")
    data = json.loads(cli(dramatiq_pg_url, "--schema", broker.schema, "stats", "--json").stdout)
    assert data["queues"][0]["queue"] == "mail" and data["queues"][0]["due"] == 1
    assert data["queues"][0]["paused_since"] is not None


def test_list_and_redrive_dead_letters_pause_resume_and_purge(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    schema = broker.schema

    @dramatiq.actor(queue_name="jobs", max_retries=0)
    def fails(n):
        raise ValueError(f"bad {n}")

    dead = [fails.send(i) for i in range(3)]
    with running_worker(broker):
        wait_for(lambda: all((broker.inspect(m.message_id) or {}).get("state") == "dead" for m in dead), 30, "dead")

    listed = cli(dramatiq_pg_url, "--schema", schema, "list", "--queue", "jobs")  # dead letters by default
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.strip().splitlines()
    assert len(lines) == 4 and "ValueError: bad" in lines[1]
    assert {line.split()[0] for line in lines[1:]} == {m.message_id for m in dead}
    paged = json.loads(
        cli(dramatiq_pg_url, "--schema", schema, "list", "--queue", "jobs", "--limit", "2", "--json").stdout
    )
    assert len(paged["messages"]) == 2 and paged["next"]

    one = cli(dramatiq_pg_url, "--schema", schema, "redrive", dead[0].message_id)
    assert one.returncode == 0 and one.stdout.strip() == f"redriven {dead[0].message_id}"
    again = cli(dramatiq_pg_url, "--schema", schema, "redrive", dead[0].message_id)
    assert again.returncode == 1 and "not dead or cancelled" in again.stderr
    rest = cli(dramatiq_pg_url, "--schema", schema, "redrive", "--queue", "jobs")
    assert rest.returncode == 0 and rest.stdout == "2 re-driven, 0 skipped\n"
    assert {broker.inspect(m.message_id)["retries"] for m in dead} == {0}
    assert {broker.inspect(m.message_id)["state"] for m in dead} == {"queued"}

    assert cli(dramatiq_pg_url, "--schema", schema, "pause", "jobs").returncode == 0
    assert cli(dramatiq_pg_url, "--schema", schema, "pause", "jobs").returncode == 1  # already
    assert query(broker, "SELECT queue_name FROM {schema}.paused_queue") == [("jobs",)]
    assert cli(dramatiq_pg_url, "--schema", schema, "resume", "jobs").returncode == 0

    refused = cli(dramatiq_pg_url, "--schema", schema, "purge", "--queue", "jobs")
    assert refused.returncode == 2 and "--yes" in refused.stderr
    purged = cli(dramatiq_pg_url, "--schema", schema, "purge", "--queue", "jobs", "--state", "queued", "--yes")
    assert purged.returncode == 0 and purged.stdout.strip() == "queued 3"


def test_a_closed_pipe_is_quiet(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    broker.declare_queue("many")
    broker.enqueue_many(
        [dramatiq.Message(queue_name="many", actor_name="a", args=(), kwargs={}, options={}) for _ in range(2000)]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", dramatiq_pg_url, "--schema", broker.schema,
         "list", "--queue", "many", "--state", "queued", "--limit", "1000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout.readline().split()[0] == b"message_id"
    proc.stdout.close()  # as `| head -1` does
    assert proc.wait(60) == 0
    assert proc.stderr.read() == b""


def test_without_a_url_it_names_the_database_it_uses(dramatiq_pg_url, dramatiq_pg_broker):
    info = conninfo_to_dict(dramatiq_pg_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG") and k != "DATABASE_URL"}
    for key, var in (("host", "PGHOST"), ("port", "PGPORT"), ("user", "PGUSER"), ("dbname", "PGDATABASE"),
                     ("password", "PGPASSWORD")):  # fmt: skip
        if info.get(key):
            env[var] = str(info[key])
    result = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--schema", dramatiq_pg_broker.schema, "stats"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "using libpq's defaults: postgresql://" in result.stderr
    assert str(info.get("dbname")) in result.stderr and str(info.get("password") or "\0") not in result.stderr


def test_metrics_once_and_the_dashboard_command(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    broker.declare_queue("m")
    broker.enqueue(dramatiq.Message(queue_name="m", actor_name="a", args=(), kwargs={}, options={}))
    shown = cli(dramatiq_pg_url, "--schema", broker.schema, "metrics", "--once")
    assert shown.returncode == 0, shown.stderr
    assert 'dramatiq_pg_messages{queue="m",state="queued"} 1.0' in shown.stdout
    assert "# TYPE dramatiq_pg_stale_writes_total counter" in shown.stdout

    proc = subprocess.Popen(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "dashboard", "--url", dramatiq_pg_url,
         "--schema", broker.schema, "--port", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        line = proc.stderr.readline()
        assert "(read-only) on http://127.0.0.1:" in line, line
        url = line.rsplit(" ", 1)[-1].strip()
        with urllib.request.urlopen(url, timeout=10) as page:
            body = page.read().decode()
        assert page.status == 200 and ">m</a>" in body and dramatiq_pg_url not in body
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def _traceback_of(raise_it):
    try:
        raise_it()
    except Exception:
        return traceback.format_exc()
    raise AssertionError("it did not raise")


def _deep(n, error):
    """Raise *error* from a chain of *n* earlier exceptions (each with its own traceback)."""
    cause = None
    for i in range(n):
        try:
            raise LookupError(f"link {i}") from cause
        except LookupError as e:
            cause = e
    raise error from cause


def test_lists_show_the_exception_first_cut_with_a_marker_and_text_stays_text(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    schema = broker.schema
    broker.declare_queue("errs")
    # Given dead letters whose tracebacks end with a message of two lines, a note, and a chain of 16 exceptions
    multi, noted, deep = (
        dramatiq.Message(queue_name="errs", actor_name="a", args=("café ☕",), kwargs={}, options={}) for _ in range(3)
    )
    broker.enqueue_many([multi, noted, deep])

    def with_note():
        e = KeyError("missing")
        e.add_note("see the runbook")
        raise e

    errors = {
        multi.message_id: _traceback_of(lambda: _deep(0, ValueError("boom\nsecond line"))),
        noted.message_id: _traceback_of(with_note),
        deep.message_id: _traceback_of(lambda: _deep(15, RuntimeError("naïve ☕ deep"))),
    }
    assert len(errors[deep.message_id]) > 3000
    for message_id, text in errors.items():
        query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now(), last_error = %s"
              " WHERE message_id = %s", [text, message_id])  # fmt: skip

    # When I list them, I expect the exception's type and message, not the traceback's last line
    table = cli(dramatiq_pg_url, "--schema", schema, "list", "--queue", "errs")
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[1:]}
    assert "ValueError: boom" in rows[multi.message_id]
    assert "KeyError: 'missing'" in rows[noted.message_id]
    assert "RuntimeError: naïve ☕ deep" in rows[deep.message_id]

    # In JSON: the exception first, then the text, cut in the middle with a marker, never from the front
    data = json.loads(cli(dramatiq_pg_url, "--schema", schema, "list", "--queue", "errs", "--json").stdout)
    by_id = {m["message_id"]: m for m in data["messages"]}
    assert by_id[multi.message_id]["error"] == "ValueError: boom ⏎ second line"
    assert by_id[noted.message_id]["error"] == "KeyError: 'missing' ⏎ see the runbook"
    assert by_id[multi.message_id]["last_error"] == errors[multi.message_id]  # short: whole
    long = by_id[deep.message_id]["last_error"]
    assert long.startswith("Traceback (most recent call last):") and long.endswith("RuntimeError: naïve ☕ deep\n")
    assert re.search(r"\[\.\.\. \d+ characters cut; inspect shows all \.\.\.\]", long)
    assert list(by_id[deep.message_id]).index("error") < list(by_id[deep.message_id]).index("last_error")

    # inspect keeps text as text (no \\u escapes), and names the exception first
    shown = cli(dramatiq_pg_url, "--schema", schema, "inspect", deep.message_id)
    assert shown.returncode == 0, shown.stderr
    assert "café ☕" in shown.stdout and "\\u" not in shown.stdout
    info = json.loads(shown.stdout)
    assert info["error"] == "RuntimeError: naïve ☕ deep" and info["last_error"] == errors[deep.message_id]


def test_one_vocabulary_of_states_in_stats_metrics_lists_and_inspect(dramatiq_pg_url, dramatiq_pg_broker):
    """States are queued, running, dead, cancelled, done everywhere; 'delayed' is the part of 'queued' due later,
    and the figures split a running row's state into 'running' (its actor started) and 'prefetched'."""
    broker = dramatiq_pg_broker
    schema = broker.schema
    broker.declare_queue("v")
    now, later = (dramatiq.Message(queue_name="v", actor_name="a", args=(), kwargs={}, options={}) for _ in range(2))
    broker.enqueue(now)
    broker.enqueue(later, delay=600_000)
    states = {"queued", "running", "dead", "cancelled", "done"}

    (q,) = json.loads(cli(dramatiq_pg_url, "--schema", schema, "stats", "--json").stdout)["queues"]
    assert (q["queued"], q["due"], q["delayed"]) == (2, 1, 1)
    head = cli(dramatiq_pg_url, "--schema", schema, "stats").stdout.splitlines()[0].split()
    assert head[:5] == ["queue", "paused", "queued", "delayed", "running"]

    metrics = cli(dramatiq_pg_url, "--schema", schema, "metrics", "--once").stdout
    labels = set(re.findall(r'dramatiq_pg_messages\{queue="v",state="(\w+)"\}', metrics))
    # (running rows are split: "running" whose actor started, "prefetched" waiting in a worker's prefetch)
    assert labels == {"queued", "running", "prefetched", "dead", "cancelled"}
    assert 'dramatiq_pg_messages{queue="v",state="queued"} 2.0' in metrics
    assert 'dramatiq_pg_delayed_messages{queue="v"} 1.0' in metrics

    listed = json.loads(cli(dramatiq_pg_url, "--schema", schema, "list", "--queue", "v", "--state", "queued",
                            "--json").stdout)["messages"]  # fmt: skip
    assert {m["state"] for m in listed} == {"queued"} and len(listed) == 2
    assert json.loads(cli(dramatiq_pg_url, "--schema", schema, "inspect", later.message_id).stdout)["state"] in states


def test_operator_actions_on_an_unknown_queue_are_refused_with_the_known_ones(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    schema = broker.schema
    broker.declare_queue("mail")
    broker.enqueue(dramatiq.Message(queue_name="mail", actor_name="a", args=(), kwargs={}, options={}))
    query(broker, "INSERT INTO {schema}.paused_queue (queue_name) VALUES ('held')")
    # When I act on a queue the database knows nothing of, I expect exit 2, naming the known queues
    for command in (
        ["pause", "nosuchqueue"],
        ["resume", "nosuchqueue"],
        ["purge", "--queue", "nosuchqueue", "--yes"],
        ["redrive", "--queue", "nosuchqueue"],
        ["list", "--queue", "nosuchqueue"],
    ):
        refused = cli(dramatiq_pg_url, "--schema", schema, *command)
        assert refused.returncode == 2, (command, refused)
        assert refused.stdout == ""
        assert "no queue 'nosuchqueue'" in refused.stderr and "known: held, mail" in refused.stderr, refused.stderr
    pause = cli(dramatiq_pg_url, "--schema", schema, "pause", "nosuchqueue")
    assert "--create" in pause.stderr
    # ... and no phantom queue in stats or metrics
    stats = json.loads(cli(dramatiq_pg_url, "--schema", schema, "stats", "--json").stdout)
    assert [q["queue"] for q in stats["queues"]] == ["held", "mail"]
    assert "nosuchqueue" not in cli(dramatiq_pg_url, "--schema", schema, "metrics", "--once").stdout

    # pause --create pauses a queue ahead of its first message; then it is known
    created = cli(dramatiq_pg_url, "--schema", schema, "pause", "--create", "later")
    assert created.returncode == 0 and created.stdout.strip() == "later: paused", created
    assert cli(dramatiq_pg_url, "--schema", schema, "resume", "later").returncode == 0
    assert cli(dramatiq_pg_url, "--schema", schema, "resume", "mail").returncode == 1  # known, not paused


def test_bulk_commands_print_a_count_ids_with_verbose_and_take_an_actor(dramatiq_pg_url, dramatiq_pg_broker):
    broker = dramatiq_pg_broker
    schema = broker.schema
    broker.declare_queue("bulk")
    mine = [dramatiq.Message(queue_name="bulk", actor_name="mine", args=(), kwargs={}, options={}) for _ in range(30)]
    theirs = [
        dramatiq.Message(queue_name="bulk", actor_name="theirs", args=(), kwargs={}, options={}) for _ in range(5)
    ]
    broker.enqueue_many(mine + theirs)
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now()")

    # When I re-drive one actor's dead letters, I expect a count, not 5 ids, and only that actor's back
    theirs_back = cli(dramatiq_pg_url, "--schema", schema, "redrive", "--queue", "bulk", "--actor", "theirs")
    assert theirs_back.returncode == 0, theirs_back.stderr
    assert theirs_back.stdout == "5 re-driven, 0 skipped\n"
    assert {broker.inspect(m.message_id)["state"] for m in theirs} == {"queued"}
    assert {broker.inspect(m.message_id)["state"] for m in mine} == {"dead"}
    # With --verbose, the ids too
    mine_back = cli(dramatiq_pg_url, "--schema", schema, "redrive", "--queue", "bulk", "--verbose")
    lines = mine_back.stdout.splitlines()
    assert {line.split()[-1] for line in lines[:-1]} == {m.message_id for m in mine} and lines[0].startswith(
        "redriven "
    )
    assert lines[-1] == "30 re-driven, 0 skipped"

    # Purge takes an actor too, and names what it deleted only with --verbose
    purged = cli(dramatiq_pg_url, "--schema", schema, "purge", "--queue", "bulk", "--actor", "theirs", "--yes")
    assert purged.returncode == 0 and purged.stdout == "queued 5, dead 0, cancelled 0, done 0\n", purged
    assert all(broker.inspect(m.message_id) is None for m in theirs)
    assert {broker.inspect(m.message_id)["state"] for m in mine} == {"queued"}
    verbose = cli(dramatiq_pg_url, "--schema", schema, "purge", "--queue", "bulk", "--state", "queued", "--actor",
                  "mine", "--verbose", "--yes")  # fmt: skip
    lines = verbose.stdout.splitlines()
    assert {line.split()[-1] for line in lines[:-1]} == {m.message_id for m in mine} and lines[0].startswith("deleted ")
    assert lines[-1] == "queued 30"
