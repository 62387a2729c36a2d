"""Cancel that stops a running actor (``interrupt_on_cancel``): on a real database, with
in-process workers and with the ``dramatiq`` CLI; the interrupter's races without one."""

from __future__ import annotations

import logging
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import dramatiq
import pytest
from dramatiq.middleware import CurrentMessage
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.results import ResultFailure, Results
from helpers import Factory, acked, query, running_worker, wait_for
from psycopg import sql

from dramatiq_pg_fenced import CancelOutcome, PostgresBroker
from dramatiq_pg_fenced.core import interrupt
from dramatiq_pg_fenced.core.interrupt import Interrupter, MessageCancelled, interruptible, shielded, with_throws
from dramatiq_pg_fenced.features.results import PostgresBackend
from dramatiq_pg_fenced.ops import admin


def state(broker: PostgresBroker, message_id: str) -> tuple[str, int] | None:
    info = broker.inspect(message_id)
    return None if info is None else (info["state"], info["attempt"])


def current() -> Any:
    message = CurrentMessage.get_current_message()
    assert message is not None
    return message


# -- in-process workers on a real database ----------------------------------------------
#: How the cancel reaches the worker: the "!interrupt" notification; without LISTEN, the
#: cancel watch; a notification lost (sent where nobody listens), the lease keeper.
#: (worker broker options, the channel the cancel notifies)
PATHS: dict[str, tuple[dict[str, Any], str | None]] = {
    "notify": ({}, None),
    "watch": ({"listen": False}, None),  # poll_interval=0.1 below
    "keeper": ({"lease_seconds": 0.9}, "nobody_listens"),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", ["cpu", "sleep", "db", "long sleep"])
def test_cancel_stops_a_running_actor_and_nothing_it_would_cause_is_written(
    dramatiq_pg_broker_factory: Factory, kind: str, path: str
) -> None:
    """Given an actor with interrupt_on_cancel, storing results, first step of a pipeline,
    running a pure-Python loop (cpu), sleeping in 50 ms steps (sleep), running 10 ms
    statements on the broker's pool (db) or in interrupt.sleep(600); when its message is
    cancelled, I expect MessageCancelled in its thread, no retry, no result, no successor, the
    row cancelled, its nack dropped as a cancelled write; and the same thread runs the next
    message normally."""
    worker_options, channel = PATHS[path]
    broker = dramatiq_pg_broker_factory(rescue_interval=0.2, poll_interval=0.1, **worker_options)
    backend = PostgresBackend(broker=broker)
    broker.add_middleware(CurrentMessage())
    broker.add_middleware(Results(backend=backend))
    dramatiq.set_broker(broker)
    started, stopped = threading.Event(), threading.Event()
    seen: dict[str, Any] = {}
    after: list[int] = []

    @dramatiq.actor(queue_name="ia", interrupt_on_cancel=True, store_results=True, max_retries=3, min_backoff=1)
    def work(kind: str) -> int:
        seen.setdefault("attempts", []).append(current().options["attempt"])
        started.set()
        try:
            if kind == "cpu":
                n = 0
                while True:
                    n += 1
            while kind == "db":  # the broker's database calls are shielded: stopped between them
                with broker.database.connection() as conn:
                    conn.execute("SELECT pg_sleep(0.01)")
            if kind == "long sleep":
                interrupt.sleep(600)  # a cancel ends it at once
            while True:
                time.sleep(0.05)
        except MessageCancelled as e:
            seen["exception"] = e
            stopped.set()
            if kind == "cpu":
                return 42  # swallowed: the delivery ends as cancelled all the same
            raise

    @dramatiq.actor(queue_name="ia", store_results=True)
    def successor(x: int) -> int:
        after.append(x)
        return x

    @dramatiq.actor(queue_name="ia", interrupt_on_cancel=True, store_results=True)
    def next_one() -> str:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:  # pure Python: a stray interrupt would land here
            pass
        return "done"

    assert MessageCancelled in work.options["throws"]
    with running_worker(broker, threads=1):
        pipe = dramatiq.pipeline([work.message(kind), successor.message()]).run()
        mid = pipe.messages[0].message_id
        assert started.wait(30)
        before = broker.stats()["process"]
        how = admin.cancel(broker.database, broker.statements, mid, channel=channel or broker.channel)
        assert how is CancelOutcome.RUNNING
        assert stopped.wait(30), "the actor was not interrupted"
        wait_for(
            lambda: broker.stats()["process"]["cancelled_writes"] > before["cancelled_writes"],
            30,
            "the cancelled delivery's outcome to be dropped",
        )
        later = next_one.send()
        assert later.get_result(backend=backend, block=True, timeout=30_000) == "done"
        broker.join("ia", timeout=30_000)
        stats = broker.stats()["process"]
    assert isinstance(seen["exception"], MessageCancelled)
    assert seen["attempts"] == [1]  # not retried
    assert state(broker, mid) == ("cancelled", 1)
    assert after == []  # the pipeline's next step was not sent
    with pytest.raises(ResultFailure) as failure:  # no result, not even the stored exception: the reader
        backend.get_result(pipe.messages[0])  # is told that the message was cancelled
    assert failure.value.orig_exc_type == "MessageCancelled" and "cancelled" in failure.value.orig_exc_msg
    assert query(broker, "SELECT count(*) FROM {schema}.result WHERE message_id = %s", [mid]) == [(0,)]
    assert stats["cancelled_writes"] == before["cancelled_writes"] + 1  # the nack (the exception rode it)
    assert stats["stale_writes"] == before["stale_writes"]
    assert broker.interrupter.interrupts == stats["interrupts"] == 1
    assert query(broker, "SELECT count(*) FROM {schema}.message WHERE state = 'dead'") == [(0,)]
    pool = broker.database._here().pool.get_stats()
    assert pool.get("requests_waiting", 0) == 0 and pool["pool_available"] >= 1


def test_without_the_option_a_cancelled_actor_runs_on(dramatiq_pg_broker: PostgresBroker) -> None:
    """Given an actor that did not opt in; when its running message is cancelled, I expect it to
    run to its end (it may poll is_cancelled), its outcome dropped."""
    broker = dramatiq_pg_broker
    broker.add_middleware(CurrentMessage())
    started, finished = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="io")
    def plain() -> None:
        started.set()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            pass
        finished.set()

    assert "throws" not in plain.options
    with running_worker(broker, threads=1):
        message = plain.send()
        assert started.wait(30)
        assert broker.cancel(message.message_id) is CancelOutcome.RUNNING
        assert finished.wait(30)
        broker.join("io", timeout=30_000)
    assert state(broker, message.message_id) == ("cancelled", 1)
    assert broker.interrupter.interrupts == 0


def test_broker_option_interrupts_every_actor_unless_it_opts_out(dramatiq_pg_broker_factory: Factory) -> None:
    broker = dramatiq_pg_broker_factory(interrupt_on_cancel=True)
    dramatiq.set_broker(broker)

    @dramatiq.actor
    def by_default() -> None:
        pass

    @dramatiq.actor(interrupt_on_cancel=False, throws=ValueError)
    def opted_out() -> None:
        pass

    assert getattr(by_default.fn, "interrupts_on_cancel", False)
    assert by_default.options["throws"] == (MessageCancelled,)
    assert not getattr(opted_out.fn, "interrupts_on_cancel", False)
    assert opted_out.options["throws"] is ValueError
    assert by_default() is None  # called directly, outside a delivery: just the function


def test_a_late_cancel_never_reaches_the_next_message_on_the_thread(dramatiq_pg_broker: PostgresBroker) -> None:
    """Given an interruptible actor that returned, and one running on the same thread; when a
    cancel of the first delivery arrives late (a notification delayed past its ack), I expect
    nothing to happen to the second."""
    broker = dramatiq_pg_broker
    broker.add_middleware(CurrentMessage())
    tokens: dict[str, str] = {}
    started = threading.Event()

    @dramatiq.actor(queue_name="il", interrupt_on_cancel=True)
    def quick() -> None:
        tokens[current().message_id] = current().delivery

    @dramatiq.actor(queue_name="il", interrupt_on_cancel=True)
    def busy() -> None:
        started.set()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            pass

    with running_worker(broker, threads=1):
        first = quick.send()
        wait_for(lambda: acked(broker, first.message_id), 30, "the first message's ack")
        assert broker.interrupter.cancelled(first.message_id, tokens[first.message_id]) is False
        second = busy.send()
        assert started.wait(30)
        assert broker.interrupter.cancelled(first.message_id, tokens[first.message_id]) is False
        wait_for(lambda: acked(broker, second.message_id), 30, "the second message's ack")
    assert broker.interrupter.interrupts == 0


def test_cancels_at_random_moments_around_short_actors_reach_only_running_bodies(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """Given short interruptible actors (0-30 ms of pure Python) on two threads; when each is
    cancelled a random 0-30 ms after its send (before it starts, while it runs, as it returns,
    after its ack), I expect only bodies cancelled while running interrupted, none acked before
    its cancel, none cancelled while queued to run, and every message settled."""
    broker = dramatiq_pg_broker
    finished: list[int] = []
    interrupted: list[int] = []
    rng = random.Random(12)

    @dramatiq.actor(queue_name="ie", interrupt_on_cancel=True, max_retries=0)
    def edge(n: int, ms: float) -> None:
        try:
            deadline = time.monotonic() + ms / 1000
            while time.monotonic() < deadline:
                pass
        except MessageCancelled:
            interrupted.append(n)
            raise
        finished.append(n)

    outcomes: dict[int, CancelOutcome] = {}
    with running_worker(broker, threads=2):
        for n in range(100):
            message = edge.send(n, rng.uniform(0, 30))
            time.sleep(rng.uniform(0, 0.03))
            outcomes[n] = broker.cancel(message.message_id)
        broker.join("ie", timeout=60_000)
    by_outcome = {o: {n for n, got in outcomes.items() if got is o} for o in CancelOutcome}
    assert set(interrupted) <= by_outcome[CancelOutcome.RUNNING]
    assert not set(interrupted) & set(finished)
    assert not by_outcome[CancelOutcome.NOT_FOUND] & set(interrupted)  # acked before the cancel
    assert by_outcome[CancelOutcome.NOT_FOUND] <= set(finished)
    assert not by_outcome[CancelOutcome.QUEUED] & (set(finished) | set(interrupted))
    assert broker.interrupter.interrupts >= len(interrupted)


# -- real worker processes --------------------------------------------------------------
@pytest.mark.slow
def test_cancel_stops_actors_in_dramatiq_cli_workers(
    dramatiq_pg_broker_factory: Factory, dramatiq_cli: Callable[..., subprocess.Popen], dramatiq_pg_url: str
) -> None:
    """Given the dramatiq CLI running a CPU-bound and a sleeping actor (interrupt_on_cancel); when
    both are cancelled (one by broker.cancel(), one by the dramatiq-pg-fenced command, which has no
    LISTEN of its own), I expect both stopped by the notification, their rows
    cancelled, and the worker still working."""
    broker = dramatiq_pg_broker_factory()
    schema = sql.Identifier(broker.schema)
    with broker.database.connection() as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.ledger (message_id uuid, event text, at float8)").format(schema))
    cli = dramatiq_cli(broker, "tests.apps.cancel_app", "--processes", "1", "--threads", "2")

    def events() -> set[tuple[str, str]]:
        rows = query(broker, "SELECT message_id::text, event FROM {schema}.ledger")
        return {(r[0], r[1]) for r in rows}

    broker.declare_queue("default")
    messages = [
        dramatiq.Message(queue_name="default", actor_name=name, args=(), kwargs={}, options={})
        for name in ("spin", "nap")
    ]
    broker.enqueue_many(messages)
    ids = [m.message_id for m in messages]
    wait_for(lambda: {(i, "started") for i in ids} <= events(), 60, "both actors to start")
    assert broker.cancel(ids[0]) is CancelOutcome.RUNNING
    command = subprocess.run(
        [sys.executable, "-m", "dramatiq_pg_fenced.cli", "--url", dramatiq_pg_url, "--schema", broker.schema]
        + ["cancel", ids[1]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert command.returncode == 0, command.stderr
    # The app's lease keeper reads the rows every 40 s: a stop within 30 s came by notification.
    wait_for(lambda: {(i, "stopped") for i in ids} <= events(), 30, "both actors to be stopped")
    assert [state(broker, i) for i in ids] == [("cancelled", 1)] * 2
    again = dramatiq.Message(queue_name="default", actor_name="spin", args=(0.1,), kwargs={}, options={})
    broker.enqueue(again)
    wait_for(lambda: acked(broker, again.message_id), 30, "the next message on the same worker")
    assert cli.poll() is None
    cli.send_signal(signal.SIGTERM)
    assert cli.wait(60) == 0, cli.log_path.read_text()  # type: ignore[attr-defined]
    log = cli.log_path.read_text()  # type: ignore[attr-defined]
    assert log.count("expected exception MessageCancelled") == 2, log
    assert "CRITICAL" not in log and "unhandled exception" not in log, log


# -- the interrupter alone: races, without a database ------------------------------------
def in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = target()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            out["raised"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def spin(seconds: float) -> int:
    """Pure Python for *seconds*: an exception sent to this thread lands here."""
    n, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        n += 1
    return n


def test_interrupter_stops_the_registered_delivery_only(caplog: pytest.LogCaptureFixture) -> None:
    interrupter = Interrupter(__import__("logging").getLogger("test"))
    entered = threading.Event()

    def body() -> int:
        assert interrupter.enter("m1", 1, "t1")
        entered.set()
        try:
            return spin(30)
        finally:
            interrupter.leave("t1")

    thread, out = in_thread(body)
    assert entered.wait(5)
    assert interrupter.running() == {"t1": "m1"}
    assert interrupter.cancelled("m1", "other-token") is False  # another delivery of the message
    assert interrupter.cancelled("other", "t1") is False
    assert interrupter.cancelled("m1", "t1") is True
    assert interrupter.cancelled("m1", "t1") is False  # one interrupt per delivery
    thread.join(5)
    assert isinstance(out.get("raised"), MessageCancelled)
    assert interrupter.running() == {} and interrupter.interrupts == 1


def test_a_delivery_cancelled_before_its_body_starts_raises_at_enter() -> None:
    interrupter = Interrupter(__import__("logging").getLogger("test"))
    assert interrupter.cancelled("m1", "t1") is False  # not running here yet: remembered
    with pytest.raises(MessageCancelled):
        interrupter.enter("m1", 1, "t1")
    assert interrupter.enter("m1", 2, "t2")  # a later delivery of the same message runs
    assert interrupter.enter("m1", 2, "t2") is False  # nested: the outer call registered it
    assert interrupter.leave("t2") is False


def test_an_interrupt_that_lands_while_leaving_is_caught_and_reported() -> None:
    """The cancel wins the lock as the body returns: the exception lands inside leave(), which
    reports the delivery interrupted; nothing is left pending for what the thread runs next."""
    interrupter = Interrupter(__import__("logging").getLogger("test"))
    entered, leaving = threading.Event(), threading.Event()

    def body() -> tuple[bool, int]:
        assert interrupter.enter("m1", 1, "t1")
        entered.set()
        leaving.wait(5)
        interrupted = interrupter.leave("t1")  # blocks on the lock the cancel holds
        return interrupted, spin(0.2)  # the next work on this thread

    thread, out = in_thread(body)
    assert entered.wait(5)
    with interrupter._lock:  # the cancel's critical section, as cancelled() runs it
        leaving.set()
        frames, ident = sys._current_frames, thread.ident or 0
        wait_for(lambda: frames()[ident].f_code.co_name == "leave", 5, "leave() to wait")
        entry = interrupter._running["t1"]
        entry.interrupted = True
        raise_thread_exception(entry.thread_id, MessageCancelled)
    thread.join(5)
    assert "raised" not in out, out
    assert out["value"][0] is True


def test_the_wrapped_body_ends_cancelled_even_if_it_swallows_the_exception() -> None:
    interrupter = Interrupter(__import__("logging").getLogger("test"))

    def swallow() -> str:
        try:
            spin(30)
        except MessageCancelled:
            return "swallowed"
        return "finished"

    run = interruptible(swallow, lambda: interrupter)
    from dramatiq_pg_fenced.core import delivery

    def body() -> Any:
        delivery.start(Proxy())  # type: ignore[arg-type]
        return run()

    thread, out = in_thread(body)
    wait_for(lambda: interrupter.running(), 5, "the body to enter")
    assert interrupter.cancelled("m1", "t1")
    thread.join(5)
    assert isinstance(out.get("raised"), MessageCancelled), out
    assert "m1" in str(out["raised"])


def test_a_cancel_inside_a_shielded_block_stops_the_body_as_the_block_ends() -> None:
    interrupter = Interrupter(__import__("logging").getLogger("test"))
    entered, inside = threading.Event(), threading.Event()
    steps: list[str] = []

    def body() -> None:
        assert interrupter.enter("m1", 1, "t1")
        try:
            with shielded():
                entered.set()
                assert inside.wait(5)
                spin(0.2)  # pure Python: an interrupt would land here if the shield let it
                steps.append("block done")
            steps.append("after the block")  # never: it raises as the block ends
        finally:
            interrupter.leave("t1")

    thread, out = in_thread(body)
    assert entered.wait(5)
    assert interrupter.cancelled("m1", "t1") is True  # deferred
    assert interrupter.running() == {}  # the watch does not ask for it again
    inside.set()
    thread.join(5)
    assert steps == ["block done"]
    assert isinstance(out.get("raised"), MessageCancelled)
    with shielded():  # outside an interruptible body: nothing
        pass


class Proxy:
    message_id, attempt, delivery = "m1", 1, "t1"


def cancel_from_another_thread(interrupter: Interrupter, delivery: str) -> None:
    """As the doorbell's listener, the cancel watch or the lease keeper do: a cancel reported on
    another thread, returned from before this one goes on (so its exception is pending here)."""
    canceller = threading.Thread(target=interrupter.cancelled, args=("m1", delivery))
    canceller.start()
    canceller.join()


def run_wrapped(interrupter: Interrupter, body: Callable[[], Any]) -> dict[str, Any]:
    """*body* as the actor of delivery t1 on a thread of its own; then, on that thread, what it
    runs next: an interrupt.sleep(0.2) and pure Python, where a stray exception would land."""
    from dramatiq_pg_fenced.core import delivery

    run = interruptible(body, lambda: interrupter)

    def thread_body() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        delivery.start(Proxy())  # type: ignore[arg-type]
        try:
            seen["returned"] = run()
        except BaseException as e:  # noqa: BLE001 (the test reads it)
            seen["raised"] = e
        finally:
            delivery.start(None)
        began = time.monotonic()
        interrupt.sleep(0.2)  # not an interruptible body any more: a plain sleep
        seen["slept"] = time.monotonic() - began
        spin(0.1)
        return seen

    thread, out = in_thread(thread_body)
    thread.join(10)
    assert "raised" not in out, out  # nothing landed in what the thread ran next
    return out["value"]


@pytest.mark.parametrize("window", ["returned", "entered", "time limit"])
def test_a_cancel_landing_between_the_body_and_its_registration_leaves_nothing_behind(window: str) -> None:
    """Given a cancel reported on another thread exactly between the body's return and its
    unregistering (or between its registering and the body's start); I expect the delivery to
    end with MessageCancelled raised by the wrapper, no entry left in the registry, and nothing
    left on the thread: what it runs next sleeps and runs undisturbed.  The same for another
    interrupt that lands there (Dramatiq's time limit): it is raised once the entry is gone."""
    forced: list[str] = []

    class CancelledInTheWindow(Interrupter):
        def enter(self, message_id: str, attempt: int, delivery: str) -> bool:
            entered = super().enter(message_id, attempt, delivery)
            if window == "entered" and not forced:
                forced.append(delivery)
                cancel_from_another_thread(self, delivery)  # lands before the body starts
            return entered

        def leave(self, delivery: str) -> bool:
            if window == "returned" and not forced:
                forced.append(delivery)
                cancel_from_another_thread(self, delivery)  # lands before leave() takes the lock
            if window == "time limit" and not forced:
                forced.append(delivery)
                raise_thread_exception(threading.get_ident(), TimeLimitExceeded)  # lands as leave() starts
            return super().leave(delivery)

    interrupter = CancelledInTheWindow(__import__("logging").getLogger("test"))
    ran: list[str] = []
    seen = run_wrapped(interrupter, lambda: ran.append("body") or "done")
    assert forced == ["t1"] and interrupter.interrupts == (0 if window == "time limit" else 1)
    expected = TimeLimitExceeded if window == "time limit" else MessageCancelled
    assert isinstance(seen.get("raised"), expected), seen
    assert ran == ([] if window == "entered" else ["body"])
    assert interrupter._running == {}  # no entry outlives its delivery
    assert interrupter.cancelled("m1", "t1") is False  # a late cancel interrupts nothing any more
    assert seen["slept"] >= 0.15  # the thread's entry is gone too: its cancelled wake no longer ends sleeps


def test_with_throws_adds_message_cancelled_once() -> None:
    assert with_throws(None) == (MessageCancelled,)
    assert with_throws(ValueError) == (ValueError, MessageCancelled)
    assert with_throws((KeyError, MessageCancelled)) == (KeyError, MessageCancelled)


@pytest.mark.parametrize("preempted", [False, True], ids=["waiting", "preempted_before_the_wait"])
def test_an_async_actor_is_stopped_too(
    dramatiq_pg_broker: PostgresBroker, monkeypatch: pytest.MonkeyPatch, preempted: bool
) -> None:
    """Given an async actor (Dramatiq's AsyncIO middleware) with interrupt_on_cancel; when its
    message is cancelled, I expect its coroutine cancelled and the delivery to end as cancelled.

    *preempted*: the cancel comes while the worker thread has scheduled the coroutine and not yet
    begun to wait for it (Dramatiq's ``run_coroutine`` between ``run_coroutine_threadsafe`` and its
    ``try``: a thread preempted there on a busy machine, as in a CI run); an exception raised into
    the worker thread there would leave the coroutine running on the loop for ever."""
    import asyncio

    from dramatiq.middleware.asyncio import AsyncIO

    broker = dramatiq_pg_broker
    broker.add_middleware(AsyncIO())
    started = threading.Event()
    seen: list[str] = []
    schedule = asyncio.run_coroutine_threadsafe

    def scheduled_then_preempted(coro: Any, loop: Any) -> Any:
        future = schedule(coro, loop)
        wait_for(lambda: broker.interrupter.interrupts, 30, "the cancel to reach the interrupter")
        return future

    @dramatiq.actor(queue_name="iy", interrupt_on_cancel=True)
    async def waits() -> None:
        started.set()
        try:
            while True:
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            seen.append("coroutine cancelled")
            raise

    if preempted:
        monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", scheduled_then_preempted)
    with running_worker(broker, threads=1):
        message = waits.send()
        assert started.wait(30)
        assert broker.cancel(message.message_id) is CancelOutcome.RUNNING
        wait_for(lambda: seen, 30, "the coroutine to be cancelled")
        broker.join("iy", timeout=30_000)
    assert state(broker, message.message_id) == ("cancelled", 1)
    assert broker.interrupter.interrupts == 1


def test_only_dramatiqs_own_wrapper_of_a_coroutine_is_taken_for_an_async_actor() -> None:
    """A function of the user's that wraps a coroutine function (``functools.wraps``) keeps its own way
    of running it: only Dramatiq's ``async_to_sync`` wrapper is replaced by the cancellable runner."""
    import asyncio
    import functools

    from dramatiq.asyncio import async_to_sync

    async def body() -> int:
        return 1

    @functools.wraps(body)
    def users_own() -> int:
        return asyncio.run(body())

    assert interrupt._async_actor_body(async_to_sync(body)) is body
    assert interrupt._async_actor_body(users_own) is None
    assert interrupt._async_actor_body(lambda: None) is None
    assert interruptible(users_own, lambda: Interrupter(logging.getLogger("t"))).__wrapped__ is users_own


def test_an_async_actor_that_swallows_the_cancel_still_ends_cancelled(
    dramatiq_pg_broker: PostgresBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Given an async actor that catches the CancelledError of its cancel and returns normally; I expect
    its delivery to end as cancelled all the same (no ack, no result), as a thread's that swallowed the
    interrupt does."""
    import asyncio

    from dramatiq.middleware.asyncio import AsyncIO

    broker = dramatiq_pg_broker
    broker.add_middleware(AsyncIO())
    started = threading.Event()
    seen: list[str] = []

    @dramatiq.actor(queue_name="iz", interrupt_on_cancel=True)
    async def swallows() -> None:
        started.set()
        try:
            while True:
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            seen.append("swallowed")  # and returns

    with caplog.at_level(logging.INFO, logger="dramatiq.worker"), running_worker(broker, threads=1):
        message = swallows.send()
        assert started.wait(30)
        assert broker.cancel(message.message_id) is CancelOutcome.RUNNING
        wait_for(lambda: seen, 30, "the coroutine to see its cancel")
        broker.join("iz", timeout=30_000)
        wait_for(lambda: "expected exception MessageCancelled" in caplog.text, 30, "the worker to log the cancel")
    assert state(broker, message.message_id) == ("cancelled", 1)
