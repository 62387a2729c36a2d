"""A FastAPI application: an order and its confirmation commit together (psycopg pool, outbox),
and the dashboard mounted at /ops/queues for operators only (HTTP basic authentication).

    pip install -e '.[frameworks]'       # from a checkout: FastAPI, a2wsgi, uvicorn
    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test OPS_PASSWORD=... uvicorn examples.fastapi_app:app
    dramatiq examples.fastapi_app        # a worker, in another shell

``tests/test_framework_examples.py`` runs it.
"""

import base64
import binascii
import os
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import dramatiq
from a2wsgi import WSGIMiddleware
from fastapi import Depends, FastAPI, HTTPException
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from psycopg import sql
from psycopg_pool import ConnectionPool
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.dashboard import dashboard_app


class OrderIn(BaseModel):
    total: int


def create_app(
    url: str, *, schema: str = "fastapi_demo", ops_password: str, secret: str, allowed_hosts: tuple[str, ...] = ()
) -> FastAPI:
    """The application, its broker (``app.state.broker``) and its actor, on *url*'s database."""
    broker = PostgresBroker(url, schema=schema)
    broker.migrate()
    dramatiq.set_broker(broker)
    pool = ConnectionPool(url, min_size=1, max_size=4, open=True)  # the application's own connections
    orders = sql.Identifier(schema, "orders")
    with pool.connection() as conn:
        conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id serial PRIMARY KEY, total int, "
                             "status text DEFAULT 'new')").format(orders))  # fmt: skip

    @dramatiq.actor(broker=broker, queue_name="orders")
    def confirm_order(order_id: int) -> None:
        """Runs only for orders whose transaction committed, and always finds their row."""
        with pool.connection() as conn:
            conn.execute(sql.SQL("UPDATE {} SET status = 'confirmed' WHERE id = %s").format(orders), [order_id])

    def is_operator(username: str, password: str) -> bool:
        return secrets.compare_digest(username.encode(), b"ops") & secrets.compare_digest(
            password.encode(), ops_password.encode()
        )

    basic = HTTPBasic()

    def operator(credentials: Annotated[HTTPBasicCredentials, Depends(basic)]) -> str:
        """The dependency of the operators' routes."""
        if not is_operator(credentials.username, credentials.password):
            raise HTTPException(401, "operators only", headers={"WWW-Authenticate": "Basic"})
        return credentials.username

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        pool.close()
        broker.close()

    app = FastAPI(lifespan=lifespan)
    app.state.broker = broker

    # A plain `def`: FastAPI runs it in a thread, where broker.transaction() takes a (synchronous)
    # psycopg connection. Sends inside it are rows of this transaction.
    @app.post("/orders")
    def place_order(order: OrderIn) -> dict[str, Any]:
        try:
            with pool.connection() as conn, conn.transaction(), broker.transaction(conn):
                row = conn.execute(sql.SQL("INSERT INTO {} (total) VALUES (%s) RETURNING id").format(orders),
                                   [order.total]).fetchone()  # fmt: skip
                assert row is not None
                message = confirm_order.send(row[0])
                if order.total < 0:
                    raise ValueError("a negative total is refused")  # neither the order nor its message
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return {"order": row[0], "message_id": message.message_id}

    @app.get("/orders/{order_id}")
    def order_status(order_id: int) -> dict[str, str]:
        with pool.connection() as conn:
            row = conn.execute(sql.SQL("SELECT status FROM {} WHERE id = %s").format(orders), [order_id]).fetchone()
        if row is None:
            raise HTTPException(404)
        return {"status": row[0]}

    @app.get("/ops/stats")
    def stats(user: Annotated[str, Depends(operator)]) -> dict[str, Any]:
        return broker.stats()["totals"]

    # The dashboard (a WSGI app) under /ops/queues, behind the same credentials: a mounted app
    # does not run FastAPI's dependencies, so a small ASGI wrapper checks them first.
    dashboard = dashboard_app(broker, actions=True, secret=secret, allowed_hosts=allowed_hosts)
    app.mount("/ops/queues", OperatorsOnly(WSGIMiddleware(dashboard), is_operator))  # type: ignore[arg-type]
    return app


class OperatorsOnly:
    """An ASGI app that answers 401 unless the request carries an operator's basic credentials."""

    def __init__(self, app: ASGIApp, check: Any) -> None:
        self.app, self.check = app, check

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(Headers(scope=scope).get("authorization", "")):
            response = PlainTextResponse("operators only", 401, {"WWW-Authenticate": 'Basic realm="ops"'})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _allowed(self, authorization: str) -> bool:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            username, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        return bool(self.check(username, password))


if os.environ.get("DATABASE_URL"):  # `uvicorn examples.fastapi_app:app`, `dramatiq examples.fastapi_app`
    app = create_app(
        os.environ["DATABASE_URL"],
        ops_password=os.environ["OPS_PASSWORD"],
        secret=os.environ.get("SECRET_KEY") or secrets.token_urlsafe(32),
    )
    broker = app.state.broker
