"""The database's health on the dashboard: who holds the oldest transaction and what it costs, the queue
tables' dead rows, sizes and autovacuum, the history's retention, each with the action it calls for; for a
role that sees only its own sessions too; in a real headless Chromium with real workers."""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import Factory, running_worker, wait_for
from psycopg import sql
from psycopg.conninfo import make_conninfo
from test_dashboard import call, chrome  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import emulate, screenshot, serving

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.ops import health
from dramatiq_pg_fenced.ops.fleet import Fleet


class Own:
    """A database of the test's own (no other test's sessions in it: only its sessions pin its horizon)."""

    def __init__(self, url: str, broker: PostgresBroker) -> None:
        self.url, self.broker = url, broker


@pytest.fixture
def own(dramatiq_pg_url: str) -> Iterator[Own]:
    dbname = f"health_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    url = make_conninfo(dramatiq_pg_url, dbname=dbname)
    broker = PostgresBroker(url, schema="jobs")
    try:
        broker.migrate()
        yield Own(url, broker)
    finally:
        broker.close()
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))


@contextlib.contextmanager
def stuck(url: str, application: str, how: str = "xid") -> Iterator[int]:
    """A session of *application* idle in a transaction: holding a transaction id (``xid``), a snapshot
    (``snapshot``: repeatable read), or neither (``none``: read committed, after a read); yields its pid."""
    with psycopg.connect(url, application_name=application) as conn:
        if how == "snapshot":
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT txid_current()" if how == "xid" else "SELECT 1")
        yield conn.info.backend_pid
        conn.rollback()


def work_some(broker: PostgresBroker, n: int = 300) -> None:
    """*n* messages sent and acked by a real worker: as many dead rows in the message table."""

    @dramatiq.actor(broker=broker, queue_name="work")
    def job(i: int) -> None:
        pass

    broker.enqueue_many([job.message(i) for i in range(n)])
    with running_worker(broker, threads=4):
        broker.join("work", timeout=60_000)


def test_a_transaction_left_open_is_named_with_what_it_holds_back_and_the_action(
    own: Own, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given an application idle in a transaction holding a transaction id, one holding a snapshot and one
    holding neither, and 300 messages acked by a real worker meanwhile, I expect the findings to name the
    first two's pid, role and application, say they hold back the cleanup of the queue tables' dead rows and
    call for pg_terminate_backend; the third said to hold no snapshot; the tables with their dead rows, sizes
    and autovacuum; the history's rows and retention."""
    broker, url = own.broker, own.url
    monkeypatch.setattr(health, "TRANSACTION_WARN", 0.0)  # (an hour's transaction, without the hour)
    with stuck(url, "billing-app") as pid, stuck(url, "report-app", "snapshot") as reader, \
            stuck(url, "harmless-app", "none") as harmless:  # fmt: skip
        work_some(broker)

        def read() -> health.Health:
            return health.health(broker.database, broker.statements, keep_finished=broker.settings.keep_finished)

        def message_dead_rows() -> int:
            return next((int(t["n_dead_tup"]) for t in read().tables if t["relname"] == "message"), 0)

        # The statistics are reported by each backend when it goes idle: wait for what is asserted below.
        wait_for(lambda: message_dead_rows() >= 300, 30, "the statistics of the acks' dead rows")
        found = read()
        assert found.sees_all and found.hidden == 0 and found.level == "warn"
        pids = [t["pid"] for t in found.transactions]
        assert {pid, reader, harmless} <= set(pids)
        texts = {f.text: f for f in found.findings}
        (billing,) = [f for t, f in texts.items() if f"pid {pid} " in t]
        assert "application billing-app" in billing.text and "idle in transaction" in billing.text
        assert re.search(r"holds back the cleanup of [\d,]+ dead rows in the queue tables", billing.text)
        assert (
            f"pg_terminate_backend({pid})" in billing.action and "idle_in_transaction_session_timeout" in billing.action
        )
        (report,) = [f for t, f in texts.items() if f"pid {reader} " in t]
        assert "holds back the cleanup" in report.text
        (calm,) = [f for t, f in texts.items() if f"pid {harmless} " in t]
        assert "holds no snapshot (it does not hold back cleanup)" in calm.text
        tables = {t["relname"]: t for t in found.tables}
        assert {"message", "history", "queue_minute"} <= tables.keys()
        assert tables["message"]["n_dead_tup"] >= 300 and tables["history"]["size"] > 0
        assert tables["history"]["n_live_tup"] >= 0 and found.keep_finished == 3600
        assert found.history_oldest is not None and found.history_oldest < 3600

        status, _, page = call(dashboard_app(broker), "/database")
        assert status == "200 OK" and f"pid {pid} (role postgres, application billing-app)" in page
        assert f"SELECT pg_terminate_backend({pid})" in page and "Role postgres sees every session" in page
        assert "Finished messages are kept 60 min (keep_finished=3600)" in page
        _, _, first = call(dashboard_app(broker), "/")
        assert 'class="health warn"' in first and 'href="/database"' in first and "(and " in first
    # And once they end: nothing calls for action (the dead rows are vacuum's to remove now)
    monkeypatch.setattr(health, "DEAD_ROWS_WARN", 10**9)
    wait_for(lambda: not health.health(broker.database, broker.statements, keep_finished=3600).findings, 30, "the end")
    _, _, first = call(dashboard_app(broker), "/")
    assert 'class="health ok"' in first and "no long transaction, no table bloated" in first


def test_findings_for_slots_prepared_transactions_bloat_a_late_purge_and_a_role_that_sees_little() -> None:
    """Given what a test cluster cannot easily make (an inactive slot with an xmin, a prepared transaction, a
    bloated table, a history purge behind), I expect each judged with its action, the most urgent first."""
    h = health.Health(
        transactions=[], hidden=2, role="jobs_app", sees_all=False, history_oldest=3600 + 3600.0, keep_finished=3600,
        slots=[{"slot_name": "standby1", "slot_type": "physical", "active": False, "xmin_age": 48_000,
                "catalog_xmin_age": None}],
        prepared=[{"gid": "tx-7", "owner": "app", "age": 700.0, "xid_age": 1000}],
        tables=[{"relname": "message", "n_live_tup": 1000, "n_dead_tup": 48_000, "size": 10**8, "last_autovacuum": None,
                 "last_vacuum": None, "last_autoanalyze": None, "autovacuum_count": 0, "autoanalyze_count": 0,
                 "n_mod_since_analyze": 0}],
        findings=[],
    )  # fmt: skip
    found = health.judge(h)
    assert [f.level for f in found] == ["alert", "alert", "warn", "warn", "warn"]
    said = " | ".join(f.text + " => " + f.action for f in found)
    assert "pg_drop_replication_slot('standby1')" in said and "holds back cleanup by 48,000 transactions" in said
    assert "ROLLBACK PREPARED 'tx-7'" in said and "holds back the cleanup of 48,000 dead rows" in said
    assert "table message has 48,000 dead rows for 1,000 live ones; autovacuum has not run on it" in said
    assert "oldest row finished 2.0 h ago, though it keeps 60 min" in said
    assert "2 sessions of other roles" in said and "GRANT pg_read_all_stats TO jobs_app" in said


@contextlib.contextmanager
def app_role(broker: PostgresBroker, url: str) -> Iterator[str]:
    """A role as docs/permissions.md's application role: it owns nothing, may use the schema's tables."""
    role = f"t_app_{broker.schema}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        try:
            schema = sql.Identifier(broker.schema)
            admin.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(schema, sql.Identifier(role)))
            admin.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {} TO {}").format(
                schema, sql.Identifier(role)))  # fmt: skip
            yield role
        finally:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_an_application_role_sees_its_own_sessions_and_is_told_the_grant_that_shows_more(
    own: Own, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given the dashboard connected as an application role that owns nothing, and another role's session idle
    in a transaction, I expect the page to work, not to list that session, to count it hidden and to name the
    grant; and, once granted pg_read_all_stats, to list it."""
    broker, url = own.broker, own.url
    monkeypatch.setattr(health, "TRANSACTION_WARN", 0.0)
    with app_role(broker, url) as role, stuck(url, "other-app") as pid:
        viewer = PostgresBroker(make_conninfo(url, user=role), schema=broker.schema)
        try:
            status, _, page = call(dashboard_app(viewer), "/database")
            assert status == "200 OK" and f"pid {pid} " not in page
            assert re.search(r"[1-9]\d* sessions? of other roles hidden", page)
            assert f"GRANT pg_read_all_stats TO {role}" in page and "<td>message</td>" in page
            with psycopg.connect(url, autocommit=True) as admin:
                admin.execute(sql.SQL("GRANT pg_read_all_stats TO {}").format(sql.Identifier(role)))
            status, _, page = call(dashboard_app(viewer), "/database")
            assert f"pid {pid} (role postgres, application other-app)" in page, page
            assert f"Role {role} sees every session" in page
        finally:
            viewer.close()


def test_several_databases_each_have_their_section_and_summary(dramatiq_pg_broker_factory: Factory) -> None:
    """Given a fleet of two, I expect a section per database on the Database page and a line per database on
    the first page."""
    fleet = Fleet.of_brokers({"eu": dramatiq_pg_broker_factory(), "us": dramatiq_pg_broker_factory(keep_finished=0)})
    _, _, page = call(dashboard_app(fleet), "/database")
    assert "<h2>Database eu</h2>" in page and "<h2>Database us</h2>" in page
    assert "The history is off (keep_finished=0)" in page
    _, _, first = call(dashboard_app(fleet), "/")
    assert first.count("Database health</a>") == 2 and "Database eu:" in first and "Database us:" in first


def test_the_database_page_in_a_browser(own: Own, chrome: Any) -> None:  # noqa: F811
    """Given an application idle in a transaction for longer than the warning threshold (made short), I expect
    the first page to warn, linking to the Database page, which names the session and the action; light and
    dark, desktop and phone."""
    from selenium.webdriver.common.by import By

    broker, d = own.broker, chrome
    work_some(broker, 200)
    original = health.TRANSACTION_WARN
    health.TRANSACTION_WARN = 0.0
    try:
        with stuck(own.url, "billing-app") as pid, serving(dashboard_app(broker, actions=True)) as url:
            d.get(url + "/")
            wait_for(lambda: "pid" in d.find_element(By.ID, "health").text, 15, "the warning")
            line = d.find_element(By.CSS_SELECTOR, "#health p")
            assert line.get_attribute("data-level") == "warn" and f"pid {pid}" in line.text
            screenshot(d, "dashboard-health-summary.png")
            line.find_element(By.LINK_TEXT, "Database health").click()
            wait_for(lambda: d.find_elements(By.ID, "findings"), 15, "the Database page")
            findings = d.find_element(By.ID, "findings").text
            assert f"pg_terminate_backend({pid})" in findings and "billing-app" in findings
            rows = d.find_elements(By.CSS_SELECTOR, "table.tables tbody tr")
            assert any(r.text.startswith("message ") for r in rows)
            d.set_window_size(1400, 1250)
            for dark in (False, True):
                emulate(d, dark=dark)
                d.get(url + "/database")
                screenshot(d, f"dashboard-database{'-dark' if dark else ''}.png")
            for dark in (False, True):
                emulate(d, dark=dark, width=390)
                d.get(url + "/database")
                assert d.execute_script("return document.documentElement.scrollWidth") <= 390
                screenshot(d, f"dashboard-database-phone{'-dark' if dark else ''}.png")
            emulate(d, dark=False)
            d.set_window_size(1400, 900)
    finally:
        health.TRANSACTION_WARN = original
