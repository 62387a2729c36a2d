"""Fair shares, seen by operators: per queue with fairness keys, how many keys have messages due and,
for the top keys by due messages, their count, their oldest wait and their weight; in ``stats`` (the
command, text and JSON, and the broker's methods), in the Prometheus metrics (the top keys only: a
bounded ``key`` label) and on the queue's dashboard page; nothing of it for a queue without keys.

The messages are sent by a fair actor, then made due at known times (``available_at`` set in the
past), so each key's due count and oldest wait are known."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from typing import Any

import dramatiq
import pytest
from helpers import query, wait_for
from test_dashboard import call, chrome  # noqa: F401 (chrome: the fixture)
from test_dashboard_console import emulate, fresh, screenshot, serving

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.ops import admin, metrics

Q, PLAIN = "reports", "plain"
#: key -> (due messages, seconds its messages have been due).  Twelve keys of one message each after
#: the three big ones: 15 keys with messages due, more than the 10 named.
KEYS: dict[str, tuple[int, int]] = {"acme": (12, 300), "globex": (7, 120), "": (4, 200)}
KEYS.update({f"t{i:02}": (1, 100 - i) for i in range(12)})
#: The ten named, in order: most due first, then the longest waiting (t00 waited longest of the singles).
TOP = ["acme", "globex", "", *(f"t{i:02}" for i in range(7))]
assert len(TOP) == admin.FAIR_TOP


def cli(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def keyed(dramatiq_pg_broker: PostgresBroker) -> PostgresBroker:
    """A fair queue with the messages of :data:`KEYS` due (and a key with only delayed ones, not counted),
    ``acme`` weighing 3 in the ``fairness_weight`` table; a plain queue with messages and no key."""
    broker = dramatiq_pg_broker

    @dramatiq.actor(broker=broker, queue_name=Q, fairness_key=lambda tenant, n=0: tenant)
    def report(tenant: str | None, n: int = 0) -> None:
        pass

    @dramatiq.actor(broker=broker, queue_name=PLAIN)
    def plain(n: int) -> None:
        pass

    query(broker, "INSERT INTO {schema}.fairness_weight VALUES (%s, 'acme', 3)", [Q])
    with broker.batch():
        for key, (due, _) in KEYS.items():
            for n in range(due):
                report.send(key or None, n)  # None: the keyless messages of a fair queue, the key ""
        for n in range(5):
            plain.send(n)
    report.send_with_options(args=("later", 0), delay=3_600_000)
    report.send_with_options(args=("later", 1), delay=3_600_000)
    for key, (_, waited) in KEYS.items():
        query(
            broker,
            "UPDATE {schema}.message SET available_at = now() - %s * interval '1 second' WHERE fairness_key = %s",
            [waited, key],
        )
    return broker


def check_figures(fair: dict[str, Any]) -> None:
    """*fair* (a queue's ``fair_keys``) names the top 10 keys with their due counts, waits and weights."""
    assert (fair["keys"], fair["due"]) == (15, 35)
    assert [k["key"] for k in fair["top"]] == TOP
    for k in fair["top"]:
        due, waited = KEYS[k["key"]]
        assert k["due"] == due, k
        assert waited <= k["oldest_wait_seconds"] < waited + 60, k  # waited since, read a moment later
        assert k["weight"] == (3.0 if k["key"] == "acme" else None), k
    assert (fair["other_keys"], fair["other_due"]) == (5, 5)


def test_stats_name_the_top_keys_with_due_count_oldest_wait_and_weight(dramatiq_pg_url: str, keyed: PostgresBroker) -> None:
    """Given 15 keys with messages due (and one with only delayed messages), I expect the overview, the
    broker's stats and the ``stats`` command (JSON and text) to name the top 10 by due messages, each
    with its due count, oldest wait and table weight, and the other 5 keys summed up; the plain queue
    none."""
    broker = keyed
    overview = {q["queue"]: q for q in broker.queue_overview()}
    check_figures(overview[Q]["fair_keys"])
    assert overview[PLAIN]["fair_keys"] is None
    assert set(broker.stats()["fair_keys"]) == {Q}
    check_figures(broker.stats()["fair_keys"][Q])
    assert broker.fair_keys(PLAIN) == {} and set(broker.fair_keys(Q)) == {Q}
    three = broker.fair_keys(Q, top=3)[Q]
    assert [k["key"] for k in three["top"]] == TOP[:3] and (three["other_keys"], three["other_due"]) == (12, 12)

    data = json.loads(cli(dramatiq_pg_url, "--schema", broker.schema, "stats", "--json").stdout)
    queues = {q["queue"]: q for q in data["queues"]}
    check_figures(queues[Q]["fair_keys"])
    assert queues[PLAIN]["fair_keys"] is None

    text = cli(dramatiq_pg_url, "--schema", broker.schema, "stats")
    assert text.returncode == 0, text.stderr
    lines = text.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["queue", "fairness", "key"])
    assert lines[head].split() == ["queue", "fairness", "key", "due", "oldest", "wait", "weight"]
    rows = lines[head + 1 : head + 12]
    assert [r.split()[0] for r in rows] == [Q] * 11  # the plain queue has no line
    assert rows[0].split()[1:3] == ["acme", "12"] and rows[0].split()[-1] == "3"
    assert re.fullmatch(r"\d+\.\ds", rows[0].split()[3]) and float(rows[0].split()[3][:-1]) >= 300
    assert rows[1].split()[1:3] == ["globex", "7"] and rows[1].split()[-1].endswith("s")  # no weight set
    assert rows[2].split()[1:5] == ["(no", "key)", "4", rows[2].split()[4]]
    assert rows[10].split()[1:] == ["(5", "other", "keys)", "5"]


def test_a_queue_without_keys_shows_no_fairness_figures(dramatiq_pg_url: str, dramatiq_pg_broker: PostgresBroker) -> None:
    """Given only a plain queue, I expect no fairness figures anywhere: none in the overview or the
    stats, no fairness lines in the ``stats`` text, no fairness samples in the metrics, no table on its page."""
    broker = dramatiq_pg_broker

    @dramatiq.actor(broker=broker, queue_name=PLAIN)
    def plain(n: int) -> None:
        pass

    for n in range(3):
        plain.send(n)
    (row,) = broker.queue_overview()
    assert row["fair_keys"] is None and broker.stats()["fair_keys"] == {}
    text = cli(dramatiq_pg_url, "--schema", broker.schema, "stats").stdout
    assert "fairness" not in text and "plain" in text
    scraped = metrics.exposition(metrics.registry(broker.database, broker.statements)).decode()
    assert not [line for line in scraped.splitlines() if line.startswith("dramatiq_pg_fair")]
    _, _, page = call(dashboard_app(broker), f"/messages?queue={PLAIN}")
    assert "Fairness keys" not in page and "fair-keys" not in page


def test_metrics_name_only_the_top_keys_of_each_queue(keyed: PostgresBroker) -> None:
    """Given 15 keys with messages due, I expect ``dramatiq_pg_fair_keys`` to count 15 and the per-key
    gauges to name the top 10 only (the top 4 with ``fair_top=4``), with their due counts and waits;
    the plain queue has no fairness sample."""
    broker = keyed
    scraped = metrics.exposition(metrics.registry(broker.database, broker.statements)).decode()
    assert f'dramatiq_pg_fair_keys{{queue="{Q}"}} 15.0' in scraped
    due = dict(re.findall(rf'dramatiq_pg_fair_key_due{{key="([^"]*)",queue="{Q}"}} (\S+)', scraped))
    assert due == {key: f"{KEYS[key][0]}.0" for key in TOP}
    waits = dict(re.findall(rf'dramatiq_pg_fair_key_oldest_wait_seconds{{key="([^"]*)",queue="{Q}"}} (\S+)', scraped))
    assert set(waits) == set(TOP)
    assert all(KEYS[key][1] <= float(w) < KEYS[key][1] + 60 for key, w in waits.items()), waits
    assert f'queue="{PLAIN}"' in scraped  # its other figures are there...
    assert not re.search(rf'dramatiq_pg_fair\w*{{[^}}]*queue="{PLAIN}"', scraped)  # ...and no fairness one

    four = metrics.exposition(metrics.registry(broker.database, broker.statements, fair_top=4)).decode()
    assert set(re.findall(r'dramatiq_pg_fair_key_due{key="([^"]*)"', four)) == set(TOP[:4])
    assert f'dramatiq_pg_fair_keys{{queue="{Q}"}} 15.0' in four


def test_the_queue_page_shows_its_fairness_keys(keyed: PostgresBroker) -> None:
    """Given the fair queue, I expect its page (the queued messages) to show a "Fairness keys" table: the
    top 10 keys with due count, oldest wait and weight, then the other 5 keys; its dead letters' list
    and the plain queue's page none."""
    app = dashboard_app(keyed)
    status, _, page = call(app, f"/messages?queue={Q}")
    assert status == "200 OK"
    assert "<h2>Fairness keys</h2>" in page and "15 keys with messages due (35 messages)" in page
    table = page[page.index("<table class=fair-keys>") :]
    table = table[: table.index("</table>")]
    rows = re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td></tr>", table)
    shown = [re.sub(r"<[^>]+>", "", key) for key, *_ in rows]
    assert shown == ["acme", "globex", "(no key)", *(f"t{i:02}" for i in range(7)), "5 other keys"]
    assert rows[0][1:] == ("12", "5 min", "3") and rows[1][1:] == ("7", "2 min", "")
    assert rows[3][1] == "1" and rows[3][2].endswith(" s") and rows[-1][1:] == ("5", "", "")
    assert "Fairness keys" not in call(app, f"/messages?queue={Q}&state=dead")[2]
    assert "Fairness keys" not in call(app, f"/messages?queue={PLAIN}")[2]


def test_the_fairness_keys_in_a_browser_light_and_at_a_phones_width_dark(
    keyed: PostgresBroker,
    chrome: Any,  # noqa: F811
) -> None:
    """Given the fair queue, I expect its page in a real browser to show the keys' table, on the desktop
    in light mode (docs/dashboard-fair-keys.png) and at a phone's width in dark mode without a
    horizontal scroll of the page (docs/dashboard-fair-keys-phone-dark.png)."""
    from selenium.webdriver.common.by import By

    d = chrome
    with serving(dashboard_app(keyed, actions=True)) as url:
        emulate(d, dark=False)
        d.get(url + f"/messages?queue={Q}")
        wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "table.fair-keys tbody tr"), 15, "the keys' table")
        # (read again if a live update replaced the table between the find and the read)
        rows = fresh(lambda: [r.text for r in d.find_elements(By.CSS_SELECTOR, "table.fair-keys tbody tr")])
        assert len(rows) == 11 and rows[0].startswith("acme 12 5 min 3") and rows[-1] == "5 other keys 5"
        screenshot(d, "dashboard-fair-keys.png")
        emulate(d, dark=True, width=390)
        d.get(url + f"/messages?queue={Q}")
        wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "table.fair-keys"), 15, "the keys' table")
        assert d.execute_script("return document.documentElement.scrollWidth") <= 390
        screenshot(d, "dashboard-fair-keys-phone-dark.png")
        emulate(d, dark=False)


def test_the_read_never_scans_the_table_and_a_queue_without_keys_costs_one_probe(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given a plain queue of 10,000 rows and a fair queue of 10,000 keyed rows (1,000 keys) that were
    deleted and sent again since the last vacuum (a busy queue between two vacuums), I expect the reads
    of every queue's keys and of the fair queue's to go through the keys' index, never a sequential
    scan (the planner's choice here, left alone: it reads the plain queue's rows too, and would read
    any number of them), and the read of the plain queue's keys to touch a few index pages, nothing else."""
    broker = dramatiq_pg_broker
    st = broker.statements
    query(broker, "ALTER TABLE {schema}.message SET (autovacuum_enabled = off)")
    keyed = (
        "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload, fairness_key, fair_tag)"
        " SELECT gen_random_uuid(), %s, 'report', '\\x00', 'k' || mod(i, 1000), i FROM generate_series(1, 10000) AS i"
    )
    query(broker, keyed, [Q])
    query(
        broker,
        "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload)"
        " SELECT gen_random_uuid(), %s, 'plain', '\\x00' FROM generate_series(1, 10000)",
        [PLAIN],
    )
    query(broker, "DELETE FROM {schema}.message WHERE queue_name = %s", [Q])  # acked...
    query(broker, keyed, [Q])  # ...and as many sent again
    query(broker, "ANALYZE {schema}.message")

    def plan(statement: bytes, params: dict[str, Any]) -> dict[str, Any]:
        with broker.database.connection() as conn, conn.transaction(force_rollback=True):
            conn.execute(st.fair_keys_plan)  # as admin.fair_keys and admin.overview run it
            found = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, params).fetchone()[0]
        return (json.loads(found) if isinstance(found, str) else found)[0]["Plan"]

    def nodes(node: dict[str, Any]) -> list[dict[str, Any]]:
        return [node, *(n for child in node.get("Plans", []) for n in nodes(child))]

    for statement, params in ((st.fair_keys, {"top": 10}), (st.fair_keys_of, {"top": 10, "queue": Q})):
        scans = [n for n in nodes(plan(statement, params)) if n.get("Relation Name") == "message"]
        assert scans and {n["Node Type"] for n in scans} <= {"Index Only Scan", "Index Scan", "Bitmap Heap Scan"}
        indexes = {n.get("Index Name") for n in nodes(plan(statement, params)) if n.get("Index Name")}
        assert indexes == {"message_fair_key_idx", "fairness_weight_pkey"}, indexes
    plain = plan(st.fair_keys_of, {"top": 10, "queue": PLAIN})
    assert plain["Shared Hit Blocks"] + plain.get("Shared Read Blocks", 0) <= 5, plain
    assert all(n.get("Actual Loops", 0) == 0 for n in nodes(plain) if n["Node Type"] == "Bitmap Heap Scan")
    assert (broker.fair_keys(PLAIN), broker.fair_keys(Q)[Q]["keys"]) == ({}, 1000)
