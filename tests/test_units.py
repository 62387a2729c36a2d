"""The pure logic, without a database: capacity, retry wake-ups, stale-write
classification, statement variants, hook selection, lost-claim bookkeeping."""

from __future__ import annotations

import dramatiq
import pytest
from dramatiq.middleware import Middleware

from dramatiq_pg_fenced.core.consumer import LostClaims
from dramatiq_pg_fenced.core.delivery import PostgresMessageProxy, attempt_of
from dramatiq_pg_fenced.core.fencing import State, Write, left_by, stale_message
from dramatiq_pg_fenced.core.leases import Leases, room
from dramatiq_pg_fenced.core.outcomes import Outcome, retry_wakes
from dramatiq_pg_fenced.db import statements as sql_module
from dramatiq_pg_fenced.db.statements import statements
from dramatiq_pg_fenced.hooks import active_hooks


def test_room_is_the_prefetch_of_unsettled_messages_and_under_twice_it_in_all() -> None:
    assert room(prefetch=4, held=0, settled=0) == 4
    assert room(prefetch=4, held=4, settled=0) == 0
    # Settled messages (outcome on its way) free their slot, up to 2x prefetch held in all.
    assert room(prefetch=4, held=4, settled=3) == 3
    assert room(prefetch=4, held=7, settled=6) == 1
    assert room(prefetch=4, held=8, settled=8) == 0


def test_leases_count_settled_messages_out_of_the_prefetch() -> None:
    leases = Leases()
    for n in range(2):
        leases.hold("q", f"m{n}", 1, f"token-{n}")
    assert leases.capacity("q", 2) == 0
    leases.settle("m0")
    assert leases.capacity("q", 2) == 1
    leases.release("m0", "token-0")
    assert leases.capacity("q", 2) == 1 and leases.snapshot() == {"m1": ("q", 1, "token-1")}
    leases.release("m1", "another delivery's token")  # changes nothing, even at the same attempt
    assert leases.held("m1") == ("q", 1, "token-1")


def test_leases_mark_lost_only_unsettled_deliveries_of_the_same_attempt() -> None:
    leases = Leases()
    leases.hold("q", "a", 1, "ta")
    leases.hold("q", "b", 1, "tb")
    leases.hold("q", "c", 2, "tc")
    leases.settle("b")
    lost = leases.mark_lost({"a": "ta", "b": "tb", "c": "an older delivery of c"}, kept=set())
    assert lost == {"a"}  # b's outcome is on its way; c is held as another delivery
    assert leases.is_lost("a") and not leases.is_lost("c")


def test_retry_wakes_ring_due_queues_and_the_earliest_backoff_per_queue() -> None:
    def retry(queue: str, delay_ms: int) -> Outcome:
        return Outcome(Write.RETRY, "id", 1, "token", queue_name=queue, delay_ms=delay_ms)

    wakes = retry_wakes([retry("a", 0), retry("b", 500), retry("b", 200), retry("a", 0), retry("", 0)])
    assert wakes == ["a", "b\t200"]


@pytest.mark.parametrize(
    ("kind", "delivery", "now", "expected"),
    [
        (Write.ACK, "t", None, True),
        (Write.ACK, "t", ("running", 3, "t"), False),
        (Write.NACK, "t", ("dead", 3, "t"), True),
        (Write.NACK, "t", ("dead", 3, "u"), False),  # same attempt, another delivery (the id was sent again)
        (Write.RETRY, "t", ("queued", 3, "t"), True),
        (Write.RETRY, "t", ("running", 4, "u"), False),
        (Write.REQUEUE, "t", ("queued", 3, "t"), False),
    ],
)
def test_a_write_whose_commit_was_lost_is_recognised_by_the_row_it_left(
    kind: Write, delivery: str, now: tuple[str, int, str] | None, expected: bool
) -> None:
    assert left_by(kind, delivery, now) is expected


def test_stale_message_names_both_attempts() -> None:
    text = stale_message(Write.ACK, "m", 1, (State.RUNNING.value, 2, "t"))
    assert "attempt 1" in text and "attempt 2" in text and "'running'" in text
    assert "gone" in stale_message(Write.NACK, "m", 1, None)


def test_relaxed_variants_and_only_they_turn_synchronous_commit_off() -> None:
    """Each relaxed statement is its durable one with the set_config piece joined to its FROM list."""
    s = statements("units")
    relaxed = b", (SELECT set_config('synchronous_commit', 'off', true)) AS relaxed"
    forced_on = sql_module._DURABLE.encode()  # a durable send's: on where a default set it off
    alone = b" FROM " + relaxed[2:]  # a claim's FROM list is that alone
    for durable in ("enqueue", "enqueue_one", "enqueue_unique", "claim", "claim_telling", "extend"):
        without = getattr(s, f"{durable}_relaxed").replace(alone, b"").replace(relaxed, b"")
        assert b" ".join(without.split()) == b" ".join(getattr(s, durable).replace(forced_on, b"").split())
        assert relaxed[2:] in getattr(s, f"{durable}_relaxed")
    for name in ("enqueue", "enqueue_one", "enqueue_unique"):
        assert forced_on in getattr(s, name) and b"'off', true" not in getattr(s, name)
    for name in ("claim", "claim_telling", "ack", "nack", "retry", "requeue", "extend", "rescue"):
        assert b"synchronous_commit" not in getattr(s, name)
    assert s.begin_relaxed == b"BEGIN; SET LOCAL synchronous_commit = off"  # the writer's transactions
    assert b"unnest" in s.enqueue and b"unnest" not in s.enqueue_one
    assert b'"units".message' in s.claim


def test_only_hooks_that_do_something_are_called_in_dramatiqs_order() -> None:
    class Quiet(Middleware):
        pass

    class Loud(Middleware):
        def before_enqueue(self, broker: object, message: object, delay: object) -> None: ...

        def after_enqueue(self, broker: object, message: object, delay: object) -> None: ...

    quiet, first, second = Quiet(), Loud(), Loud()
    chain = [quiet, first, second]
    assert [m for m, _ in active_hooks(chain, "before_enqueue")] == [first, second]
    assert [m for m, _ in active_hooks(chain, "after_enqueue")] == [second, first]


def test_lost_claims_are_taken_once_per_queue() -> None:
    lost = LostClaims()
    lost.add("q", "c1")
    lost.put_back("q", ["c2"])
    assert lost.take("other") == []
    assert lost.take("q") == ["c1", "c2"]
    assert lost.take("q") == []


def test_the_proxy_is_the_one_source_of_a_deliverys_attempt() -> None:
    message = dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    proxy = PostgresMessageProxy(message, 3, "token")
    assert proxy.options["attempt"] == 3  # a copy for actors and middleware
    proxy.options["attempt"] = 99  # an actor scribbling on it changes no fence
    assert attempt_of(proxy) == 3
    assert attempt_of(message.copy(options={"attempt": 2})) == 2
    assert attempt_of(dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})) is None


def test_a_delivery_reads_as_its_message() -> None:
    """The message's fields are the proxy's own attributes (read without MessageProxy.__getattr__, a cost
    of every delivery), the same values, and the same options dict: what a middleware writes there is
    the message's."""
    message = dramatiq.Message(queue_name="q", actor_name="a", args=(1,), kwargs={"k": 2}, options={"x": 1})
    proxy = PostgresMessageProxy(message, 1, "t")
    for field in ("queue_name", "actor_name", "message_id", "message_timestamp", "args", "kwargs", "options"):
        assert getattr(proxy, field) == getattr(message, field) and field in vars(proxy), field
    assert proxy.options is message.options
    proxy.options["retries"] = 2
    assert message.options["retries"] == 2 and proxy.asdict() == message.asdict() and proxy == message


def test_metrics_are_named_after_prometheus_conventions() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dramatiq_pg_fenced.ops.metrics import families

    queue = {
        "queue": "mail", "queued": 4, "due": 3, "delayed": 1, "running": 2, "prefetched": 1, "expired_leases": 1, "dead": 4, "cancelled": 0,
        "done_last_minute": 5, "done_last_hour": 50, "dead_last_hour": 2, "stale_writes": 5,
        "oldest_due_seconds": 12.5,
        "paused_since": None,
    }  # fmt: skip

    class Fixed:
        def collect(self):
            return families([queue], {"stale_writes": 7, "redeliveries": 2})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    assert 'dramatiq_pg_messages{queue="mail",state="queued"} 4.0' in text
    assert 'dramatiq_pg_delayed_messages{queue="mail"} 1.0' in text
    assert 'dramatiq_pg_messages{queue="mail",state="dead"} 4.0' in text
    assert 'dramatiq_pg_oldest_due_age_seconds{queue="mail"} 12.5' in text
    assert 'dramatiq_pg_queue_paused{queue="mail"} 0.0' in text
    assert "# TYPE dramatiq_pg_stale_writes_total counter" in text
    assert 'dramatiq_pg_stale_writes_total{queue="mail"} 5.0' in text
    assert 'dramatiq_pg_stale_writes_total{queue=""} 2.0' in text  # the rest of the total
    assert "dramatiq_pg_redeliveries_total 2.0" in text


def test_fairness_keys_make_bounded_metrics_and_a_stats_table_and_a_queue_without_them_nothing() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from dramatiq_pg_fenced.cli.output import fair_keys_table
    from dramatiq_pg_fenced.ops.metrics import fair_families

    top = [{"key": "acme", "due": 9, "oldest_wait_seconds": 61.25, "weight": 3.0},
           {"key": "", "due": 2, "oldest_wait_seconds": 0.5, "weight": None}]  # fmt: skip
    fair = {"keys": 40, "due": 50, "top": top, "other_keys": 38, "other_due": 39}
    queues = [{"queue": "reports", "fair_keys": fair}, {"queue": "mail", "fair_keys": None}, {"queue": "old"}]

    class Fixed:
        def collect(self):
            return fair_families(queues)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Fixed())
    text = generate_latest(registry).decode()
    samples = [line for line in text.splitlines() if not line.startswith("#")]
    assert samples == [
        'dramatiq_pg_fair_keys{queue="reports"} 40.0',
        'dramatiq_pg_fair_key_due{key="acme",queue="reports"} 9.0',
        'dramatiq_pg_fair_key_due{key="",queue="reports"} 2.0',
        'dramatiq_pg_fair_key_oldest_wait_seconds{key="acme",queue="reports"} 61.25',
        'dramatiq_pg_fair_key_oldest_wait_seconds{key="",queue="reports"} 0.5',
    ]
    lines = fair_keys_table(queues).splitlines()
    assert [line.split() for line in lines[:4]] == [
        ["queue", "fairness", "key", "due", "oldest", "wait", "weight"],
        ["reports", "acme", "9", "61.2s", "3"],
        ["reports", "(no", "key)", "2", "0.5s"],
        ["reports", "(38", "other", "keys)", "39"],
    ]
    assert fair_keys_table(queues[1:]) == ""
    assert fair_keys_table([{**queues[0], "database": "eu"}]).split()[:2] == ["database", "queue"]


def test_a_list_cursor_is_url_safe_and_a_bad_one_is_refused() -> None:
    from datetime import datetime, timedelta, timezone

    from dramatiq_pg_fenced.ops.admin import list_messages, page_cursor

    at = datetime(2026, 1, 2, 3, 4, 5, 6789, tzinfo=timezone(timedelta(hours=2)))
    row = ("id", "a", "queued", 1, -3, at, at, at, None, None, False, 42)
    assert page_cursor("queued", row) == "-3|2026-01-02T01:04:05.006789Z|42"
    assert page_cursor("dead", row) == "2026-01-02T01:04:05.006789Z|42"
    assert page_cursor("running", row) == "42"
    for bad in ("nope", "a|b|c", "1|2026-01-02T01:04:05Z"):  # refused before any query
        with pytest.raises(ValueError, match="bad cursor"):
            list_messages(None, statements("s"), "q", "queued", after=bad)  # type: ignore[arg-type]


def test_statements_are_read_only_and_complete() -> None:
    from dramatiq_pg_fenced.db.statements import Statements

    bound = statements("units")
    assert bound.ack_relaxed.startswith(b'WITH finished AS ( DELETE FROM "units".message')
    with pytest.raises(AttributeError):
        bound.ack = b"DELETE FROM elsewhere"
    with pytest.raises(AttributeError):
        del bound.ack
    with pytest.raises(AttributeError, match="no statement named 'nonsense'"):
        bound.nonsense  # noqa: B018
    # every declared name has a template, and every template a declared name
    assert set(Statements.__annotations__) == set(sql_module.templates())


def test_an_error_summary_names_the_exception_first() -> None:
    from dramatiq_pg_fenced.ops.admin import error_summary

    frames = 'Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\n'
    assert error_summary(frames + "ValueError: boom\n") == "ValueError: boom"
    assert error_summary(frames + "ValueError: boom\nsecond line\n") == "ValueError: boom ⏎ second line"
    assert error_summary("retry refused: too large\n" + frames + "KeyError: 'k'\n") == (
        "KeyError: 'k' ⏎ retry refused: too large"
    )
    # cut by storable_text between the frames: the tail still names it
    assert error_summary(frames + "[... 70000 bytes cut here ...]\n  File 'b.py'\nOSError: gone") == "OSError: gone"
    assert error_summary("ValueError('boom')") == "ValueError('boom')"  # no traceback: the text
    assert error_summary(None) == "" and error_summary("x" * 500, limit=10) == "x" * 9 + "…"


def test_cancelled_deliveries_held_here_are_running_or_never_started() -> None:
    leases = Leases()
    for mid in ("runs", "ended", "waits", "other"):
        leases.hold("q", mid, 1, f"t-{mid}")
    assert leases.start("runs", "t-runs") and leases.start("ended", "t-ended")
    leases.settle("ended")  # its outcome is on its way: the writer clears its lease
    for mid in ("runs", "ended", "waits"):
        leases.mark_cancelled(mid)
    assert leases.cancelled() == ({"runs": "t-runs"}, {"waits": "t-waits"})
    assert not leases.start("waits", "t-waits")  # cancelled before it started: never starts
    leases.release("runs", "t-runs")
    assert leases.cancelled() == ({}, {"waits": "t-waits"})


@pytest.mark.parametrize("schema", ["dramatiq", "Jobs_2026", "_x"])
def test_every_statement_is_bound_as_psycopg_would_compose_it(schema: str) -> None:
    """The templates are bound with ``str.format`` and a name quoted once (start-up cost); every one
    must come out byte for byte as ``psycopg.sql`` composes it, braces and quoting included."""
    from psycopg import sql

    bound = sql_module.statements(schema)
    ident = sql.Identifier(schema)
    for name, text in sql_module.templates().items():
        composed = sql.SQL(" ".join(text.split())).format(schema=ident).as_string(None).encode()
        assert getattr(bound, name) == composed, name
    assert b'"Jobs_2026".message' in bound.claim or schema != "Jobs_2026"


def test_a_claim_takes_all_the_room_up_to_sixteen_then_a_power_of_two_within_it() -> None:
    """Each claim limit is a statement of its own (prepared, its plan kept): a few dozen at most."""
    from dramatiq_pg_fenced.core.consumer import EXACT_LIMITS, claim_limit, with_limit

    assert [claim_limit(n) for n in (0, 1, 7, 16, 17, 31, 32, 100, 65535)] == [0, 1, 7, 16, 16, 16, 32, 64, 32768]
    assert all(claim_limit(n) <= n for n in range(1, 70_000))
    assert len({claim_limit(n) for n in range(1, 70_000)}) == EXACT_LIMITS + 12
    for claim in (statements("dramatiq").claim, statements("dramatiq").claim_telling):
        assert b"LIMIT 7 FOR UPDATE SKIP LOCKED" in with_limit(claim, 7) and b"LIMIT %(limit)s" not in with_limit(
            claim, 7
        )
    assert b"%(limit)s - 1" in with_limit(statements("dramatiq").claim_telling, 7)  # "!took": the claim came back short
