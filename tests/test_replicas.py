"""Operators' reads from a replica (``read_url``, ``--read-url``): ``stats``, ``inspect``, ``list``, the
metrics and the dashboard's pages read from a streaming hot standby; actions, sends, claims, leases and
outcomes go to the primary.

The standby is made here (``tests/cluster.py``: ``initdb``, ``pg_basebackup -R``), and its replay is
paused while the primary takes more writes: what a read answers then says where it was read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from cluster import Pair, make_pair
from dramatiq.message import Message
from helpers import running_worker, wait_for
from psycopg import sql
from test_dashboard import call

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.cli.command import main
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.db import reconnect


@pytest.fixture
def replica() -> Iterator[Pair]:
    """A primary and its asynchronous hot standby."""
    servers = make_pair("async")
    try:
        yield servers
    finally:
        if servers.standby is not None:
            servers.standby.close()
        servers.primary.close()


def caught_up(servers: Pair) -> None:
    """Wait until the standby has replayed everything the primary wrote so far."""
    assert servers.standby is not None
    with psycopg.connect(servers.primary.url, autocommit=True) as primary:
        row = primary.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    with psycopg.connect(servers.standby.url, autocommit=True) as standby:
        wait_for(
            lambda: standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", [row[0]]).fetchone() == (True,),
            30,
            "the standby to replay the primary's writes",
        )


def replay(servers: Pair, on: bool) -> None:
    """Pause or resume the standby's replay (what it answers then stays as it was)."""
    assert servers.standby is not None
    with psycopg.connect(servers.standby.url, autocommit=True) as standby:
        standby.execute("SELECT pg_wal_replay_resume()" if on else "SELECT pg_wal_replay_pause()")
        wanted = "not paused" if on else "paused"
        wait_for(
            lambda: standby.execute("SELECT pg_get_wal_replay_pause_state()").fetchone() == (wanted,),
            30,
            f"replay {wanted}",
        )


def state_on(url: str, schema: str, message_id: str) -> str | None:
    with psycopg.connect(url, autocommit=True) as conn:
        query = sql.SQL("SELECT state FROM {}.message WHERE message_id = %s").format(sql.Identifier(schema))
        row = conn.execute(query, [message_id]).fetchone()
    return None if row is None else str(row[0])


@pytest.mark.slow
def test_operators_read_from_the_replica_and_act_on_the_primary(
    replica: Pair,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a broker with ``read_url`` on a hot standby whose replay is paused after three sends,
    when two more are sent to the primary, then ``stats()``, ``queue_overview()``, ``list_messages()``,
    ``inspect()``, the ``stats``/``list``/``inspect``/``metrics`` commands with ``--read-url`` and the
    dashboard's pages answer from the standby (three messages; the two later ones unknown), while a
    cancel from the broker and from the dashboard's form (of a message the standby does not have yet)
    applies on the primary; a worker on that broker claims and acks on the primary. The reader's
    connections are checked on every checkout here (``CHECK_IDLE = 0``), and a standby that takes no
    writes is no reason to drop them: nothing says "takes no writes"."""
    assert replica.standby is not None
    monkeypatch.setattr(reconnect, "CHECK_IDLE", 0.0)
    primary_url, standby_url, schema = replica.primary.url, replica.standby.url, "rep"
    broker = PostgresBroker(primary_url, schema=schema, read_url=standby_url, connect_timeout=2)
    ran: list[str] = []

    @dramatiq.actor(broker=broker, queue_name="q")
    def job(n: int) -> None:
        ran.append(str(n))

    try:
        broker.migrate()
        early = [job.send(n).message_id for n in range(3)]
        caught_up(replica)
        replay(replica, False)
        late = [job.send(n).message_id for n in range(3, 5)]
        with caplog.at_level(logging.INFO, logger="dramatiq_pg_fenced"):
            # The broker's reads: the standby's three.
            (queue,) = broker.queue_overview()
            assert (queue["queue"], queue["due"]) == ("q", 3)
            assert broker.stats()["queues"]["q"]["queued"] == 3
            assert {r["message_id"] for r in broker.list_messages("q", "queued").rows} == set(early)
            assert broker.inspect(late[0]) is None
            info = broker.inspect(early[0])
            assert info is not None and info["state"] == "queued"
            # The commands, with --read-url.
            urls = ["--url", primary_url, "--read-url", standby_url, "--schema", schema]
            assert main([*urls, "stats", "--json"]) == 0
            assert [q["due"] for q in json.loads(capsys.readouterr().out)["queues"]] == [3]
            assert main([*urls, "inspect", late[0]]) == 1
            assert main([*urls, "list", "--queue", "q", "--state", "queued", "--json"]) == 0
            assert len(json.loads(capsys.readouterr().out)["messages"]) == 3
            assert main([*urls, "metrics", "--once"]) == 0
            assert 'dramatiq_pg_messages{queue="q",state="queued"} 3.0' in capsys.readouterr().out
            # The dashboard: pages from the standby, actions on the primary.
            app = dashboard_app(broker, actions=True)
            status, _, page = call(app, "/messages?queue=q&state=queued")
            assert status == "200 OK" and early[0] in page and late[0] not in page
            form = {"token": app.token, "action": "cancel", "message_id": late[0]}
            status, headers, _ = call(app, "/action", "POST", form, origin="http://127.0.0.1:8080")
            assert status == "303 See Other" and "cancelled" in headers["Location"], headers
            assert broker.cancel(late[1]).value.startswith("cancelled")
            assert state_on(primary_url, schema, late[0]) == state_on(primary_url, schema, late[1]) == "cancelled"
            assert broker.inspect(late[0]) is None  # the standby has not replayed it yet
            # Work: claims, leases and outcomes on the primary, whatever the standby replays.
            with running_worker(broker, threads=2):
                wait_for(lambda: sorted(ran) == ["0", "1", "2"], 20, "the three queued jobs")
                time.sleep(0.5)
            assert broker.flush_outcomes(10)
            assert state_on(primary_url, schema, early[0]) is None  # acked: moved to the history
            assert broker.queue_overview()[0]["due"] == 3  # the standby still replays nothing
            replay(replica, True)
            caught_up(replica)
            info = broker.inspect(late[0])
            assert info is not None and info["state"] == "cancelled"
            (queue,) = broker.queue_overview()
            assert (queue["due"], queue["cancelled"], queue["running"]) == (0, 2, 0)
        assert not [r.getMessage() for r in caplog.records if "takes no writes" in r.getMessage()]
        assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        broker.close()


def test_without_read_url_operators_read_the_primary(dramatiq_pg_broker: PostgresBroker) -> None:
    broker = dramatiq_pg_broker
    assert broker.reader is broker.database
    sent = broker.enqueue(Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={}))
    info = broker.inspect(sent.message_id)
    assert info is not None and info["state"] == "queued"
