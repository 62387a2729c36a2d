"""Operators see every database at once (issue 27, item 4): the ``dramatiq-pg-fenced`` commands with
``--url NAME=URL`` repeated or ``--broker app:broker``, and the dashboard over a ``RoutedBroker``.

As in ``test_routing.py``, the two databases are two schemas of the test database (each a database
to the broker: its own tables, pool and doorbell).  Every test reads the tables themselves to check
that an action landed in the right one, and nowhere else.
"""

from __future__ import annotations

import io
import sys
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest
from helpers import Factory, query
from test_dashboard import chrome  # noqa: F401 (the fixture)

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.cli.command import main
from dramatiq_pg_fenced.dashboard import Dashboard, dashboard_app
from dramatiq_pg_fenced.routing.router import RoutedBroker


def send(
    broker: PostgresBroker, queue: str, actor: str = "job", *args: Any, message_id: str | None = None
) -> dramatiq.Message:
    """A message written straight into *broker*'s database (whatever the routes say)."""
    broker.declare_queue(queue)
    ids = {"message_id": message_id} if message_id else {}
    return broker.enqueue(dramatiq.Message(queue_name=queue, actor_name=actor, args=args, kwargs={}, options={}, **ids))


def states(broker: PostgresBroker) -> list[tuple[str, str]]:
    return sorted((str(q), str(s)) for q, s in query(broker, "SELECT queue_name, state FROM {schema}.message"))


def paused(broker: PostgresBroker) -> list[str]:
    return sorted(str(r[0]) for r in query(broker, "SELECT queue_name FROM {schema}.paused_queue"))


def audits(broker: PostgresBroker) -> list[tuple[str, int]]:
    return [(str(a), int(t)) for a, t in query(broker, "SELECT action, touched FROM {schema}.audit ORDER BY id")]


@pytest.fixture
def first_second(dramatiq_pg_broker_factory: Factory) -> tuple[PostgresBroker, PostgresBroker]:
    return dramatiq_pg_broker_factory(), dramatiq_pg_broker_factory()


def urls(url: str, first: PostgresBroker, second: PostgresBroker) -> list[str]:
    """The command line naming both databases."""
    return ["--url", f"first={url}", "--url", f"second={url}",
            "--schema", f"first={first.schema}", "--schema", f"second={second.schema}"]  # fmt: skip


def run(capsys: Any, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_reads_name_every_database_and_actions_land_where_the_queue_or_message_lives(
    dramatiq_pg_url: str, first_second: tuple[PostgresBroker, PostgresBroker], capsys: Any
) -> None:
    # Given queue "a" in database first, "b" in second, and "both" known in each
    first, second = first_second
    send(first, "a")
    held = send(second, "b")
    send(first, "both")
    send(second, "both")
    both = urls(dramatiq_pg_url, first, second)

    # When an operator asks for the figures, I expect one table naming both databases
    code, out, _ = run(capsys, *both, "stats")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["database", "queue"]
    assert {tuple(line.split()[:2]) for line in lines[1:5]} == {
        ("first", "a"),
        ("first", "both"),
        ("second", "b"),
        ("second", "both"),
    }
    code, out, _ = run(capsys, *both, "stats", "--json")
    assert code == 0 and '"second"' in out and '"first"' in out

    # and a message is found in the database that holds it, and cancelled there only
    code, out, _ = run(capsys, *both, "inspect", held.message_id)
    assert code == 0 and '"database": "second"' in out
    code, out, _ = run(capsys, *both, "cancel", held.message_id)
    assert (code, out.strip()) == (0, "cancelled_queued (database second)")
    assert ("b", "cancelled") in states(second) and all(q != "b" for q, _ in states(first))
    code, out, _ = run(capsys, *both, "list", "--queue", "b", "--state", "cancelled")
    assert code == 0 and "second" in out and held.message_id in out
    code, out, _ = run(capsys, *both, "redrive", held.message_id)
    assert (code, out.strip()) == (0, f"redriven {held.message_id} (database second)")
    assert ("b", "queued") in states(second)

    # A queue's action goes to the one database that knows it, and says which
    code, out, _ = run(capsys, *both, "pause", "b")
    assert (code, out.strip()) == (0, "b: paused (database second)")
    assert paused(second) == ["b"] and paused(first) == []
    # A queue known in both is refused until a database is named; a queue nothing knows, refused too
    code, _, err = run(capsys, *both, "pause", "both")
    assert code == 2 and "known in databases first, second" in err and "--database" in err
    code, out, _ = run(capsys, *both, "pause", "both", "--database", "first")
    assert (code, out.strip()) == (0, "both: paused (database first)")
    assert paused(first) == ["both"] and paused(second) == ["b"]
    code, _, err = run(capsys, *both, "purge", "--queue", "nope", "--yes")
    assert code == 2 and "no queue 'nope'" in err and "a (first)" in err and "b (second)" in err
    code, out, _ = run(capsys, *both, "purge", "--queue", "a", "--yes")
    assert code == 0 and out.startswith("database first: queued 1")
    assert states(first) == [("both", "queued")]

    # --database shows one database; processes, schedules and metrics name both
    code, out, _ = run(capsys, *both, "stats", "--database", "second")
    assert code == 0 and {line.split()[0] for line in out.splitlines()[1:3]} == {"second"}
    assert run(capsys, *both, "stats", "--database", "third")[0] == 2
    assert run(capsys, *both, "processes")[:2] == (0, "no worker process\n")
    assert run(capsys, *both, "schedules")[:2] == (0, "no schedules\n")
    code, out, _ = run(capsys, *both, "metrics", "--once")
    assert code == 0
    assert 'dramatiq_pg_up{database="first"} 1.0' in out and 'dramatiq_pg_up{database="second"} 1.0' in out
    assert 'queue="b",state="queued"' in out

    # Exit codes as with one database: a message no database has is 1; a plain URL beside names is 2
    code, out, _ = run(capsys, *both, "cancel", str(uuid.uuid4()))
    assert (code, out.strip()) == (1, "not_found")
    assert main(["--url", f"first={dramatiq_pg_url}", "--url", dramatiq_pg_url, "stats"]) == 2


@pytest.fixture
def app_module(
    dramatiq_pg_url: str, first_second: tuple[PostgresBroker, PostgresBroker], tmp_path: Path, monkeypatch: Any
) -> Iterator[str]:
    """An application module whose ``broker`` is a RoutedBroker: "a" in first, "b" in second, no default."""
    first, second = first_second
    name = f"app_{uuid.uuid4().hex[:8]}"
    # Each shard with its own schema, which the module reads from the environment.
    (tmp_path / f"{name}.py").write_text(
        "import os\n"
        "from dramatiq_pg_fenced import PostgresBroker\n"
        "from dramatiq_pg_fenced.routing.router import RoutedBroker\n"
        "url = os.environ['APP_URL']\n"
        "broker = RoutedBroker(brokers={\n"
        "    'first': PostgresBroker(url, schema=os.environ['APP_FIRST'], listen=False, middleware=[]),\n"
        "    'second': PostgresBroker(url, schema=os.environ['APP_SECOND'], listen=False, middleware=[]),\n"
        "}, routes={'a': 'first', 'b': 'second'})\n"
    )
    monkeypatch.setenv("APP_URL", dramatiq_pg_url)
    monkeypatch.setenv("APP_FIRST", first.schema)
    monkeypatch.setenv("APP_SECOND", second.schema)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the command puts the directory there: undone after
    try:
        yield name
    finally:
        sys.modules.pop(name, None)


def test_the_apps_routed_broker_routes_the_commands_and_moves_a_queue(
    app_module: str, first_second: tuple[PostgresBroker, PostgresBroker], capsys: Any
) -> None:
    # Given the application's RoutedBroker ("a" in first, "b" in second, no default), and two messages
    # of "a" left in second (sent there under an older route)
    first, second = first_second
    send(first, "a")
    send(second, "a")
    send(second, "a")
    app = ["--broker", f"{app_module}:broker"]

    # When I ask for the figures, both databases are shown
    code, out, _ = run(capsys, *app, "stats")
    assert code == 0 and {line.split()[0] for line in out.splitlines()[1:3]} == {"first", "second"}

    # A queue's action goes to its route, and a queue of no route is refused (exit 2, as bad usage)
    code, out, _ = run(capsys, *app, "pause", "a")
    assert (code, out.strip()) == (0, "a: paused (database first)")
    assert paused(first) == ["a"] and paused(second) == []
    code, _, err = run(capsys, *app, "pause", "unrouted", "--create")
    assert code == 2 and "unrouted" in err
    run(capsys, *app, "resume", "a")

    # And move-queue finishes moving "a" to first: nothing of it is left queued in second
    code, out, err = run(capsys, *app, "move-queue", "a", "--timeout", "30")
    assert code == 0, err
    assert out.strip() == "a: 2 moved to database first; none left in second (paused there)"
    assert states(first) == [("a", "queued")] * 3 and states(second) == []
    assert paused(second) == ["a"]

    # move-queue without routes is bad usage
    assert main(["--url", "first=postgresql://x/y", "--url", "second=postgresql://x/z", "move-queue", "a"]) == 2


# -- the dashboard, as a WSGI app in this process -------------------------------------------------------------------
def call(app: Dashboard, path: str, form: dict[str, str] | None = None) -> tuple[str, str, str]:
    """One request: (status, Location, body); a POST when *form* is given."""
    path, _, qs = path.partition("?")
    body = urllib.parse.urlencode(form or {}).encode()
    environ: dict[str, Any] = {
        "REQUEST_METHOD": "POST" if form is not None else "GET", "PATH_INFO": path, "QUERY_STRING": qs,
        "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body)), "HTTP_HOST": "127.0.0.1:8080",
        "SERVER_NAME": "127.0.0.1",
    }  # fmt: skip
    seen: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]]) -> None:
        seen["status"], seen["headers"] = status, dict(headers)

    data = b"".join(app(environ, start_response)).decode()
    return seen["status"], urllib.parse.unquote_plus(seen["headers"].get("Location", "")), data


@pytest.fixture
def router(first_second: tuple[PostgresBroker, PostgresBroker]) -> Iterator[RoutedBroker]:
    first, second = first_second
    routed = RoutedBroker(brokers={"first": first, "second": second}, routes={"b": "second"}, default="first")
    yield routed


def test_the_dashboard_shows_every_database_and_acts_in_the_right_one(
    router: RoutedBroker, first_second: tuple[PostgresBroker, PostgresBroker]
) -> None:
    # Given messages of queue "a" in first and "b" in second, and a dashboard over the router
    first, second = first_second
    here = send(first, "a", "job", 1)
    there = send(second, "b", "job", 2)
    app = dashboard_app(router, actions=True)
    token = app.token

    # The queues page lists both databases' queues, each row naming its database
    status, _, page = call(app, "/")
    assert status == "200 OK"
    assert "<th>database</th>" in page and "databases first" in page
    assert ">first</span>" in page and ">second</span>" in page

    # A message's page finds it in whichever database holds it, and says which
    status, _, page = call(app, f"/message/{there.message_id}")
    assert status == "200 OK" and "<span id=database>second</span>" in page
    status, _, page = call(app, "/messages?queue=b&state=queued")
    assert status == "200 OK" and there.message_id in page and "in database second" in page

    # The search reads both, one page in key order, each row naming its database
    status, _, page = call(app, "/search?actor=job")
    assert status == "200 OK" and here.message_id in page and there.message_id in page
    for page_name in ("/processes", "/schedules", "/charts", "/audit"):
        assert call(app, page_name)[0] == "200 OK", page_name
    assert "2 databases summed" in call(app, "/charts")[2]

    # Pausing "b" (its route: second) pauses it there only, and the note says where
    status, location, _ = call(app, "/action", {"token": token, "action": "pause", "queue": "b", "next": "/"})
    assert status == "303 See Other" and "paused (database second)" in location
    assert paused(second) == ["b"] and paused(first) == []

    # Cancelling a message acts in the database holding it (no database named in the form)
    status, location, _ = call(app, "/action", {"token": token, "action": "cancel", "message_id": here.message_id})
    assert "cancel: cancelled_queued (database first)" in location
    assert states(first) == [("a", "cancelled")] and states(second) == [("b", "queued")]

    # A bulk action by filter touches only the database its filter matches: the audit row is written there
    status, _, page = call(app, "/bulk?action=cancel&scope=filter&queue=b")
    assert status == "200 OK" and "1 in database second" in page
    form = {
        "token": token,
        "action": "bulk",
        "bulk_action": "cancel",
        "scope": "filter",
        "queue": "b",
        "confirm": "yes",
    }
    status, location, _ = call(app, "/action", form)
    assert status == "303 See Other" and "1 touched of 1 counted" in location and "in database second" in location
    assert audits(second) == [("cancel", 1)] and audits(first) == [("cancel", 1)]  # (first: the page's cancel above)
    # and a bulk re-drive of ids held by both databases writes one audit row in each
    ids = f"{here.message_id},{there.message_id}"
    form = {
        "token": token,
        "action": "bulk",
        "bulk_action": "redrive",
        "scope": "selected",
        "ids": ids,
        "confirm": "yes",
    }
    status, location, _ = call(app, "/action", form)
    assert status == "303 See Other", location
    assert audits(first) == [("cancel", 1), ("redrive", 1)] and audits(second) == [("cancel", 1), ("redrive", 1)]
    assert states(first) == [("a", "queued")] and states(second) == [("b", "queued")]
    status, _, page = call(app, "/audit")
    assert "<h2>Database first</h2>" in page and "<h2>Database second</h2>" in page

    # The metrics carry a database label
    status, _, text = call(app, "/metrics")
    assert 'database="first"' in text and 'database="second"' in text


def test_a_database_that_does_not_answer_leaves_the_others_shown(
    dramatiq_pg_url: str, router: RoutedBroker, first_second: tuple[PostgresBroker, PostgresBroker], capsys: Any
) -> None:
    # Given a message in each database, then the second one's tables gone from under the broker
    first, second = first_second
    kept = send(first, "a", "job", 7)
    send(second, "b", "job", 7)
    app = dashboard_app(router)
    gone = f"{second.schema}_gone"
    query(second, "ALTER SCHEMA {schema} RENAME TO " + gone)
    try:
        # The queues, processes and schedules pages still show the first database, and name the missing one
        status, _, page = call(app, "/")
        assert status == "200 OK" and ">a</a>" in page and ">b</a>" not in page
        assert "<p class=error id=away>Database second did not answer" in page
        for path in ("/processes", "/schedules", "/charts", "/charts?queue=a", "/audit", "/search?args=[7]",
                     f"/search?id={kept.message_id}"):  # fmt: skip
            status, _, page = call(app, path)
            assert status == "200 OK" and "Database second did not answer" in page, path
            if path.startswith("/search"):  # the first database's match, the second's missing
                assert page.count('data-label="database"><span class=database>') == 1 and kept.message_id in page, path
        # A chart of the second database alone has nothing to show: 503, the database named
        status, _, page = call(app, "/charts?database=second")
        assert status.startswith("503") and "second" in page
        # and stats prints the first database's queues, names the second on stderr and exits 3
        code, out, err = run(capsys, *urls(dramatiq_pg_url, first, second), "stats")
        lines = out.splitlines()
        assert code == 3 and lines[1].split()[:2] == ["first", "a"] and "second" not in out
        assert "error: database second did not answer" in err
    finally:  # (on a connection of its own: the broker's own now refuses, its schema being gone)
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(f'ALTER SCHEMA "{gone}" RENAME TO "{second.schema}"')


def test_the_queues_page_of_two_databases_in_a_browser(
    router: RoutedBroker,
    first_second: tuple[PostgresBroker, PostgresBroker],
    chrome: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By
    from test_dashboard_console import screenshot, serving

    # Given queues in both databases, one paused
    first, second = first_second
    for i in range(3):
        send(first, "emails", "send_email", i)
    send(first, "default", "cleanup")
    for i in range(2):
        send(second, "reports", "build_report", i)
    second.pause("reports")
    with serving(dashboard_app(router, actions=True, live=0)) as url:
        chrome.get(url + "/")
        # I expect each row to name its database, in the first column
        rows = [
            [c.text for c in tr.find_elements(By.TAG_NAME, "td")[:3]]
            for tr in chrome.find_elements(By.CSS_SELECTOR, "table.queues tbody tr")
        ]
        assert rows == [["first", "default", "1"], ["first", "emails", "3"], ["second", "reports paused", "2"]]
        screenshot(chrome, "dashboard-databases.png")


def test_a_search_over_two_databases_pages_in_key_order_and_skips_nothing_either_read(
    first_second: tuple[PostgresBroker, PostgresBroker], monkeypatch: Any
) -> None:
    from dramatiq_pg_fenced.ops import search

    # Given, in key order: three messages of another actor then one "job" in first, three "job" in second,
    # and a window of three rows per read
    first, second = first_second
    key = "00000000-0000-4000-8000-{:012d}".format
    for i in (1, 2, 3):
        send(first, "a", "other", message_id=key(i))
    send(first, "a", "job", message_id=key(4))
    for i in (5, 6, 7):
        send(second, "b", "job", message_id=key(i))
    monkeypatch.setattr(search, "SEARCH_WINDOW", 3)
    sources = [("first", first.reader, first.statements), ("second", second.reader, second.statements)]

    # When I page through the "job" messages two at a time
    seen: list[tuple[str, str]] = []
    after = None
    for _ in range(10):
        page = search.search_many(sources, actor="job", after=after, limit=2)
        seen += [(r["database"], r["message_id"]) for r in page.rows]
        after = page.next
        if after is None:
            break

    # I expect each once, in key order, each naming its database: first's window ended before its match,
    # so the first page stops there rather than jump past it to second's rows
    assert seen == [("first", key(4)), ("second", key(5)), ("second", key(6)), ("second", key(7))]
