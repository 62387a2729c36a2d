"""The Flask and FastAPI examples, run through their frameworks' test clients: a request enqueues in
the application's transaction (a worker then runs it), and the dashboard mounted under /ops/queues
answers operators only."""

from __future__ import annotations

import importlib.util
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import psycopg
import pytest
from helpers import running_worker
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PASSWORD = "correct horse"


def example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (DATABASE_URL unset: it builds no app of its own)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def schema(dramatiq_pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    name = f"ex_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def links(page: str) -> list[str]:
    return re.findall(r'(?:href|action)="([^"]*)"', page)


def test_the_flask_example(dramatiq_pg_url: str, schema: str) -> None:
    pytest.importorskip("flask")
    app = example("flask_app").create_app(dramatiq_pg_url, schema=schema, ops_password=PASSWORD, secret_key="k")
    broker: PostgresBroker = app.extensions["dramatiq"]
    client = app.test_client()
    try:
        # A request enqueues in its transaction; a worker runs it
        placed = client.post("/orders", json={"total": 30})
        assert placed.status_code == 200, placed.text
        assert broker.inspect(placed.json["message_id"])["state"] == "queued"
        refused = client.post("/orders", json={"total": -1})
        assert refused.status_code == 400
        with running_worker(broker):
            broker.join("orders", timeout=30_000)
        assert client.get(f"/orders/{placed.json['order']}").json == {"status": "confirmed"}
        assert client.get(f"/orders/{placed.json['order'] + 1}").status_code == 404  # the refused order

        # The dashboard: refused without a login, served with one, its links under /ops/queues/
        for path in ("/ops/queues/", "/ops/queues/messages?queue=orders"):
            anonymous = client.get(path)
            assert anonymous.status_code == 302 and anonymous.location.startswith("/login?next=")
        assert client.post("/ops/queues/action", data={"action": "pause", "queue": "orders"}).status_code == 302
        assert client.post("/login", data={"user": "ops", "password": "guess"}).status_code == 403
        assert client.post("/login", data={"user": "ops", "password": PASSWORD}).status_code == 302
        page = client.get("/ops/queues/")
        assert page.status_code == 200 and "orders" in page.text
        assert "/ops/queues/messages" in links(page.text)
        assert all(link.startswith("/ops/queues/") for link in links(page.text))
        assert client.get("/ops/queues/messages?queue=orders&state=done").status_code == 200
        assert "/ops/queues/confirm?action=pause&amp;queue=orders" in page.text  # its buttons ask first
        question = client.get("/ops/queues/confirm?action=pause&queue=orders")
        token = re.search(r'name="token" value="([^"]*)"', question.text)
        assert token is not None  # the question's form acts
        acted = client.post("/ops/queues/action", data={"token": token[1], "action": "pause", "queue": "orders"})
        assert acted.status_code == 303 and acted.location.startswith("/ops/queues/?note=paused")
    finally:
        broker.close()


def test_the_fastapi_example(dramatiq_pg_url: str, schema: str) -> None:
    pytest.importorskip("fastapi")
    pytest.importorskip("a2wsgi")
    from fastapi.testclient import TestClient

    app = example("fastapi_app").create_app(dramatiq_pg_url, schema=schema, ops_password=PASSWORD, secret="k")
    broker: PostgresBroker = app.state.broker
    with TestClient(app, base_url="http://localhost") as client:
        # A request enqueues in its transaction; a worker runs it
        placed = client.post("/orders", json={"total": 30})
        assert placed.status_code == 200, placed.text
        assert broker.inspect(placed.json()["message_id"])["state"] == "queued"
        assert client.post("/orders", json={"total": -1}).status_code == 400
        with running_worker(broker):
            broker.join("orders", timeout=30_000)
        assert client.get(f"/orders/{placed.json()['order']}").json() == {"status": "confirmed"}
        assert client.get(f"/orders/{placed.json()['order'] + 1}").status_code == 404  # the refused order

        # The dashboard: refused without credentials or with wrong ones, served with them, under its mount
        for auth in (None, ("ops", "guess"), ("someone", PASSWORD)):
            assert client.get("/ops/queues/", auth=auth).status_code == 401
            assert client.get("/ops/stats", auth=auth).status_code == 401
        assert client.post("/ops/queues/action", data={"action": "pause", "queue": "orders"}).status_code == 401
        ops = ("ops", PASSWORD)
        page = client.get("/ops/queues/", auth=ops)
        assert page.status_code == 200 and "orders" in page.text
        assert "/ops/queues/messages" in links(page.text)
        assert all(link.startswith("/ops/queues/") for link in links(page.text))
        assert client.get("/ops/queues/messages?queue=orders&state=done", auth=ops).status_code == 200
        assert client.get("/ops/stats", auth=ops).status_code == 200
        assert "/ops/queues/confirm?action=pause&amp;queue=orders" in page.text  # its buttons ask first
        question = client.get("/ops/queues/confirm?action=pause&queue=orders", auth=ops)
        token = re.search(r'name="token" value="([^"]*)"', question.text)
        assert token is not None  # the question's form acts
        acted = client.post("/ops/queues/action", data={"token": token[1], "action": "pause", "queue": "orders"},
                            auth=ops, follow_redirects=False)  # fmt: skip
        assert acted.status_code == 303 and acted.headers["location"].startswith("/ops/queues/?note=paused")
