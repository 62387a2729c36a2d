"""A Flask application: an order and its confirmation commit together (SQLAlchemy session, outbox),
and the dashboard at /ops/queues/ for logged-in operators only.

    pip install -e '.[frameworks]'       # from a checkout: Flask, SQLAlchemy
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test OPS_PASSWORD=... flask --app examples/flask_app run
    dramatiq examples.flask_app          # a worker, in another shell

``tests/test_framework_examples.py`` runs it.
"""

from __future__ import annotations

import hmac
import os
import secrets
from typing import Any

import dramatiq
import psycopg
from flask import Flask, abort, jsonify, redirect, request, session, url_for
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session
from werkzeug.wrappers import Response

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app
from dramatiq_pg_fenced.integrations.sqlalchemy import outbox

DASHBOARD = "/ops/queues"


def create_app(
    url: str, *, schema: str = "flask_demo", ops_password: str, secret_key: str, allowed_hosts: tuple[str, ...] = ()
) -> Flask:
    """The application, its broker (``app.extensions["dramatiq"]``) and its actor, on *url*'s database."""
    broker = PostgresBroker(url, schema=schema)
    broker.migrate()
    dramatiq.set_broker(broker)
    # The application's tables and the broker's in one database: psycopg 3 driver for the outbox.
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(url))
    with engine.begin() as conn:
        conn.execute(text(f'CREATE TABLE IF NOT EXISTS "{schema}".orders (id serial PRIMARY KEY, total int, '
                          "status text DEFAULT 'new')"))  # fmt: skip

    @dramatiq.actor(broker=broker, queue_name="orders")
    def confirm_order(order_id: int) -> None:
        """Runs only for orders whose transaction committed, and always finds their row."""
        with engine.begin() as conn:
            conn.execute(text(f"UPDATE \"{schema}\".orders SET status = 'confirmed' WHERE id = :id"), {"id": order_id})

    app = Flask(__name__)
    app.secret_key = secret_key
    app.config.update(SESSION_COOKIE_HTTPONLY=True, SESSION_COOKIE_SAMESITE="Lax")
    app.extensions["dramatiq"] = broker
    # No auth= of its own: the routes below put it behind the application's login.
    dashboard = dashboard_app(broker, actions=True, secret=secret_key, allowed_hosts=allowed_hosts)

    @app.post("/orders")
    def place_order() -> Any:
        total = int(request.get_json()["total"])
        try:
            with Session(engine) as db, db.begin(), outbox(db, broker):
                order_id = db.execute(text(f'INSERT INTO "{schema}".orders (total) VALUES (:t) RETURNING id'),
                                      {"t": total}).scalar_one()  # fmt: skip
                message = confirm_order.send(order_id)  # a row of this transaction
                if total < 0:
                    raise ValueError("a negative total is refused")  # neither the order nor its message
        except ValueError as e:
            return jsonify(error=str(e)), 400
        return jsonify(order=order_id, message_id=message.message_id)

    @app.get("/orders/<int:order_id>")
    def order_status(order_id: int) -> Any:
        with engine.connect() as conn:
            status = conn.execute(text(f'SELECT status FROM "{schema}".orders WHERE id = :id'),
                                  {"id": order_id}).scalar()  # fmt: skip
        return jsonify(status=status) if status else abort(404)

    @app.post("/login")
    def login() -> Any:
        if request.form.get("user") == "ops" and hmac.compare_digest(request.form.get("password", ""), ops_password):
            session.clear()
            session["user"] = "ops"
            return redirect(request.args.get("next") or "/")
        return "wrong user or password", 403

    @app.get("/login")
    def login_form() -> Any:
        return "<form method=post><input name=user><input name=password type=password><button>Log in</button></form>"

    @app.route(DASHBOARD + "/", defaults={"rest": ""}, methods=["GET", "HEAD", "POST"])
    @app.route(DASHBOARD + "/<path:rest>", methods=["GET", "HEAD", "POST"])
    def ops_dashboard(rest: str) -> Any:
        """The dashboard's WSGI app, called with the request's environ, under DASHBOARD."""
        if session.get("user") != "ops":
            return redirect(url_for("login_form", next=request.full_path))
        environ = dict(request.environ, SCRIPT_NAME=request.script_root + DASHBOARD, PATH_INFO="/" + rest)
        return Response.from_app(dashboard, environ)

    return app


if os.environ.get("DATABASE_URL"):  # `flask --app examples/flask_app run`, `dramatiq examples.flask_app`
    app = create_app(
        os.environ["DATABASE_URL"],
        ops_password=os.environ["OPS_PASSWORD"],
        secret_key=os.environ.get("SECRET_KEY") or secrets.token_urlsafe(32),
    )
    broker = app.extensions["dramatiq"]
