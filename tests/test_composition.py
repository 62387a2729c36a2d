"""Everything Dramatiq composes, on PostgreSQL alone: pipelines, groups, callbacks, results."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from dramatiq.middleware import GroupCallbacks
from dramatiq.results import ResultFailure, ResultMissing, Results
from helpers import running_worker, wait_for
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core.outcomes import OutcomeWriter
from dramatiq_pg_fenced.features import rate_limits
from dramatiq_pg_fenced.results import PostgresBackend, setup

App = Callable[..., tuple[PostgresBroker, PostgresBackend]]


@pytest.fixture
def make_app(dramatiq_pg_url: str) -> Iterator[App]:
    """``make_app(**setup_options)``: broker and backend from ``setup()``, migrated, set globally."""
    made: list[tuple[PostgresBroker, PostgresBackend]] = []

    def make(**options: Any) -> tuple[PostgresBroker, PostgresBackend]:
        broker, backend = setup(dramatiq_pg_url, schema=f"t_{uuid.uuid4().hex[:12]}", **options)
        broker.migrate()
        dramatiq.set_broker(broker)
        made.append((broker, backend))
        return broker, backend

    yield make
    for broker, backend in made:
        broker.close()
        backend.close()
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        for broker, _ in made:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(broker.schema)))


@pytest.fixture
def app(make_app: App) -> tuple[PostgresBroker, PostgresBackend]:
    return make_app()


TIMEOUT = 30_000  # ms, for blocking reads: generous, this machine is shared


def math_actors() -> tuple[dramatiq.Actor, dramatiq.Actor]:
    """``square`` and ``add``, storing results, on the broker set now."""

    @dramatiq.actor(store_results=True)
    def square(x: int) -> int:
        return x * x

    @dramatiq.actor(store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    return square, add


def result_collector(backend: PostgresBackend, calls: list[Any]) -> dramatiq.Actor:
    """An actor given messages' ``asdict()``: it appends their results, read without blocking
    (every one must already be there), ``"missing"`` for any that is not."""
    lock = threading.Lock()

    @dramatiq.actor
    def collect(children: list[dict[str, Any]]) -> None:
        found = []
        for child in children:
            try:
                found.append(Message(**child).get_result(backend=backend))
            except ResultMissing:
                found.append("missing")
        with lock:
            calls.append(found)

    return collect


def test_setup_wires_results_and_group_callbacks(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app
    assert broker.get_results_backend() is backend
    assert backend.broker is broker and backend.schema == broker.schema
    callbacks = [m for m in broker.middleware if isinstance(m, GroupCallbacks)]
    assert len(callbacks) == 1
    assert isinstance(callbacks[0].rate_limiter_backend, rate_limits.PostgresBackend)


def test_store_results_for_every_actor(make_app: App) -> None:
    broker, backend = make_app(store_results=True, result_ttl=60_000)

    @dramatiq.actor
    def echo(x: Any) -> Any:
        return x

    with running_worker(broker):
        assert echo.send("plain actor").get_result(block=True, timeout=TIMEOUT) == "plain actor"


def test_pipelines(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app

    @dramatiq.actor(store_results=True)
    def add(x: int, y: int = 0) -> int:
        return x + y

    @dramatiq.actor(store_results=True)
    def constant(value: str) -> str:
        return value

    with running_worker(broker):
        pipe = dramatiq.pipeline([add.message(1, 2), add.message(3), add.message(4)]).run()
        assert pipe.get_result(block=True, timeout=TIMEOUT) == 10
        assert list(pipe.get_results(block=True, timeout=TIMEOUT)) == [3, 6, 10]
        # The same with the | operator.
        assert (add.message(1) | add.message(1)).run().get_result(block=True, timeout=TIMEOUT) == 2
        # pipe_ignore: the next step does not receive the previous result.
        ignoring = dramatiq.pipeline(
            [add.message(1, 2), constant.message_with_options(args=("fresh",), pipe_ignore=True)]
        ).run()
        assert ignoring.get_result(block=True, timeout=TIMEOUT) == "fresh"


def test_pipeline_stops_at_a_failure(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app
    ran: list[int] = []

    @dramatiq.actor(store_results=True, max_retries=0)
    def explode(x: int) -> int:
        raise ValueError(f"no {x}")

    @dramatiq.actor(store_results=True)
    def after(x: int) -> int:  # pragma: no cover - must not run
        ran.append(x)
        return x

    with running_worker(broker):
        pipe = dramatiq.pipeline([explode.message(1), after.message()]).run()
        with pytest.raises(ResultFailure, match="no 1"):
            pipe.messages[0].get_result(block=True, timeout=TIMEOUT)
        broker.join("default", timeout=TIMEOUT, fail_fast=False)
    with pytest.raises(ResultMissing):
        pipe.get_result()
    assert ran == []


def test_groups_with_get_results(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app
    square, add = math_actors()

    with running_worker(broker):
        g = dramatiq.group(
            [square.message(i) for i in range(8)] + [dramatiq.pipeline([add.message(1, 1), square.message()])]
        ).run()
        assert list(g.get_results(block=True, timeout=TIMEOUT)) == [i * i for i in range(8)] + [4]
        g.wait(timeout=TIMEOUT)
        assert g.completed
        assert g.completed_count == 9
        nested = dramatiq.group([dramatiq.group([square.message(2), square.message(3)]), square.message(4)]).run()
        assert list(nested.get_results(block=True, timeout=TIMEOUT)) == [[4, 9], 16]


def test_group_completion_callback_runs_once_and_sees_every_result(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app
    calls: list[Any] = []
    square, add = math_actors()
    collect = result_collector(backend, calls)

    with running_worker(broker):
        members = [square.message(i) for i in range(10)]
        g = dramatiq.group(members)
        g.add_completion_callback(collect.message([m.asdict() for m in members]))
        g.run()
        # A group of pipelines: the callback follows the last step of each.
        pipes = [dramatiq.pipeline([add.message(i, 1), square.message()]) for i in range(3)]
        pg = dramatiq.group(pipes)
        pg.add_completion_callback(collect.message([p.messages[-1].asdict() for p in pipes]))
        pg.run()
        wait_for(lambda: len(calls) >= 2, what="both completion callbacks")
        broker.join("default", timeout=TIMEOUT)  # anything else they might have caused has run too
    assert sorted(calls) == sorted([[i * i for i in range(10)], [(i + 1) ** 2 for i in range(3)]])


def test_group_completion_callback_waits_for_results_behind_slow_acks(
    app: tuple[PostgresBroker, PostgresBackend], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acks (which carry results) commit late; the callback must still see every member's result.

    Regression: the last member released the barrier while earlier members'
    results still waited in the outcome writer, and the callback read
    "missing".  Each member now writes its result before counting down.
    """
    broker, backend = app
    write = OutcomeWriter.write

    def slow_write(self: OutcomeWriter, batch: list[Any]) -> None:
        time.sleep(0.3)  # a slow commit, so that every ack is still in flight when the callback runs
        write(self, batch)

    monkeypatch.setattr(OutcomeWriter, "write", slow_write)
    calls: list[Any] = []
    square, _ = math_actors()
    collect = result_collector(backend, calls)

    with running_worker(broker):
        for _ in range(3):
            members = [square.message(i) for i in range(6)]
            g = dramatiq.group(members)
            g.add_completion_callback(collect.message([m.asdict() for m in members]))
            g.run()
        wait_for(lambda: len(calls) >= 3, what="three completion callbacks")
        broker.join("default", timeout=TIMEOUT)
    assert calls == [[i * i for i in range(6)]] * 3


def test_group_callbacks_after_results_is_warned_about(
    dramatiq_pg_broker_factory: Callable[..., PostgresBroker], caplog: pytest.LogCaptureFixture
) -> None:
    broker = dramatiq_pg_broker_factory()
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(Results(backend=backend))
    broker.add_middleware(GroupCallbacks(rate_limits.PostgresBackend(broker=broker)))
    with caplog.at_level(logging.WARNING), running_worker(broker):
        pass
    assert "GroupCallbacks is added after Results" in caplog.text


def test_group_completion_callback_needs_the_middleware(make_app: App) -> None:
    broker, backend = make_app(group_callbacks=False)

    @dramatiq.actor
    def noop() -> None:  # pragma: no cover - never sent
        pass

    g = dramatiq.group([noop.message()])
    g.add_completion_callback(noop.message())
    with pytest.raises(RuntimeError, match="GroupCallbacks"):
        g.run()


def test_on_success_and_on_failure_callbacks(app: tuple[PostgresBroker, PostgresBackend]) -> None:
    broker, backend = app
    successes: list[Any] = []
    failures: list[Any] = []

    @dramatiq.actor(store_results=True)
    def double(x: int) -> int:
        return 2 * x

    @dramatiq.actor(store_results=True, max_retries=0)
    def refuse(x: int) -> int:
        raise KeyError(x)

    @dramatiq.actor
    def on_ok(message_data: dict[str, Any], result: int) -> None:
        successes.append((message_data["args"][0], result, Message(**message_data).get_result(backend=backend)))

    @dramatiq.actor
    def on_error(message_data: dict[str, Any], exception_data: dict[str, str]) -> None:
        failures.append((message_data["args"][0], exception_data["type"], exception_data["message"]))

    with running_worker(broker):
        for i in range(3):
            double.send_with_options(args=(i,), on_success=on_ok, on_failure=on_error)
        bad = refuse.send_with_options(args=(7,), on_success=on_ok, on_failure=on_error)
        wait_for(lambda: len(successes) == 3 and len(failures) == 1, what="the callbacks")
        with pytest.raises(ResultFailure, match="KeyError"):
            bad.get_result(block=True, timeout=TIMEOUT)
        broker.join("default", timeout=TIMEOUT, fail_fast=False)
    assert sorted(successes) == [(i, 2 * i, 2 * i) for i in range(3)]
    assert failures == [(7, "KeyError", "7")]


def test_backends_wired_by_hand(dramatiq_pg_broker_factory: Callable[..., PostgresBroker]) -> None:
    """The long form from the module docstring, on the test plugin's broker."""
    broker = dramatiq_pg_broker_factory()
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(GroupCallbacks(rate_limits.PostgresBackend(broker=broker)))
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)
    done = threading.Event()

    @dramatiq.actor(store_results=True)
    def inc(x: int) -> int:
        return x + 1

    @dramatiq.actor
    def finished() -> None:
        done.set()

    with running_worker(broker):
        g = dramatiq.group([inc.message(i) for i in range(4)])
        g.add_completion_callback(finished.message())
        g.run()
        assert list(g.get_results(block=True, timeout=TIMEOUT)) == [1, 2, 3, 4]
        assert done.wait(30)
