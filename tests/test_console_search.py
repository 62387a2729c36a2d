"""Search: by id, queue, actor, state and argument value, over the message table and the history, in
keyset pages that neither skip nor repeat a row."""

from __future__ import annotations

import pickle
import uuid

import dramatiq
import pytest
from helpers import query
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.ops import search


def message(queue: str, actor: str, *args: object, **kwargs: object) -> dramatiq.Message:
    return dramatiq.Message(queue_name=queue, actor_name=actor, args=args, kwargs=kwargs, options={})


def every_page(broker: PostgresBroker, **filters: object) -> tuple[list[dict], int]:
    rows, pages, after = [], 0, None
    while True:
        page = broker.search(after=after, **filters)  # type: ignore[arg-type]
        rows += page.rows
        pages += 1
        if page.next is None:
            return rows, pages
        after = page.next


@pytest.fixture
def messages(dramatiq_pg_broker: PostgresBroker) -> dict[str, list[dramatiq.Message]]:
    """30 queued sends on "s" (n=0..29, user 7 for even n), 5 dead, 5 acked (history), one of another queue."""
    broker = dramatiq_pg_broker
    broker.declare_queue("s")
    broker.declare_queue("t")
    queued = [message("s", "send", n, user=7 if n % 2 == 0 else 8) for n in range(30)]
    dead = [message("s", "charge", 100 + n) for n in range(5)]
    done = [message("s", "send", 200 + n, user=7) for n in range(5)]
    other = [message("t", "send", 0, user=7)]
    broker.enqueue_many(queued + dead + done + other)
    ids = [m.message_id for m in dead]
    query(broker, "UPDATE {schema}.message SET state = 'dead', finished_at = now(), last_error = 'ValueError: no'"
          " WHERE message_id = ANY(%s::uuid[])", [ids])  # fmt: skip
    ids = [m.message_id for m in done]
    query(broker, "WITH d AS (DELETE FROM {schema}.message WHERE message_id = ANY(%s::uuid[]) RETURNING *)"
          " INSERT INTO {schema}.history (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at,"
          " claimed_at, finished_at, consumer_id, last_error, payload)"
          " SELECT message_id, seq, queue_name, actor_name, priority, 1, enqueued_at, now(), now(), 'w', NULL,"
          " payload FROM d", [ids])  # fmt: skip
    return {"queued": queued, "dead": dead, "done": done, "other": other}


def test_search_by_each_filter_over_the_message_table_and_the_history(
    dramatiq_pg_broker: PostgresBroker, messages: dict[str, list[dramatiq.Message]]
) -> None:
    broker = dramatiq_pg_broker
    ids = lambda ms: sorted(m.message_id for m in ms)  # noqa: E731
    found = lambda **f: sorted(r["message_id"] for r in every_page(broker, **f)[0])  # noqa: E731
    everything = messages["queued"] + messages["dead"] + messages["done"] + messages["other"]
    assert found() == ids(everything)
    assert found(queue="t") == ids(messages["other"])
    assert found(actor="charge") == ids(messages["dead"])
    assert found(state="dead") == ids(messages["dead"])
    assert found(state="done") == ids(messages["done"])
    assert found(state="queued", queue="s") == ids(messages["queued"])
    # by argument value: JSON containment on args and kwargs
    assert found(args=[3]) == ids([messages["queued"][3]])
    assert found(args=[0]) == ids([messages["queued"][0], messages["other"][0]])
    evens = [m for m in messages["queued"] if m.args[0] % 2 == 0]
    assert found(kwargs={"user": 7}, queue="s") == ids(evens + messages["done"])
    assert found(kwargs={"user": 7}, state="done") == ids(messages["done"])
    assert found(args=[201], kwargs={"user": 7}) == ids([messages["done"][1]])
    assert found(args=["nothing like it"]) == []
    # by id, in either table, with what an operator needs to see
    (row,) = broker.search(message_id=messages["done"][2].message_id).rows
    assert (row["state"], row["queue_name"], row["args"], row["kwargs"]) == ("done", "s", [202], {"user": 7})
    (row,) = broker.search(message_id=messages["dead"][0].message_id).rows
    assert (row["state"], row["error"], row["attempt"]) == ("dead", "ValueError: no", 0)
    assert broker.search(message_id=messages["dead"][0].message_id, state="queued").rows == []
    assert broker.search(message_id=str(uuid.uuid4())).rows == []


def test_pages_neither_skip_nor_repeat_and_a_sparse_filter_reads_a_bounded_window(
    dramatiq_pg_broker: PostgresBroker, messages: dict[str, list[dramatiq.Message]], monkeypatch: pytest.MonkeyPatch
) -> None:
    broker = dramatiq_pg_broker
    everything = messages["queued"] + messages["dead"] + messages["done"] + messages["other"]
    rows, pages = every_page(broker, limit=7)
    assert [r["message_id"] for r in rows] == sorted(m.message_id for m in everything)  # key order, each once
    assert pages == 6
    # Given windows of 4 rows per table, the 5 dead among 41 come back over pages that say how far they read
    monkeypatch.setattr(search, "SEARCH_WINDOW", 4)
    seen, after, partial = [], None, 0
    while True:
        page = broker.search(state="dead", limit=3, after=after)
        seen += [r["message_id"] for r in page.rows]
        partial += page.searched is not None
        if page.next is None:
            break
        after = page.next
    assert sorted(seen) == sorted(m.message_id for m in messages["dead"]) and len(seen) == 5
    assert partial > 0
    # and over both tables at once, windows of 4 still give every row once, in key order
    rows, _ = every_page(broker, limit=3)
    assert [r["message_id"] for r in rows] == sorted(m.message_id for m in everything)
    rows, _ = every_page(broker, kwargs={"user": 7}, limit=2)
    evens = [m for m in messages["queued"] if m.args[0] % 2 == 0]
    assert [r["message_id"] for r in rows] == sorted(m.message_id for m in evens + messages["done"] + messages["other"])


def test_a_payload_that_is_not_json_is_found_by_id_but_never_by_argument(
    dramatiq_pg_broker: PostgresBroker, messages: dict[str, list[dramatiq.Message]]
) -> None:
    broker = dramatiq_pg_broker
    odd = str(uuid.uuid4())
    query(broker, "INSERT INTO {schema}.message (message_id, queue_name, actor_name, payload)"
          " VALUES (%s, 's', 'send', %s)", [odd, pickle.dumps({"args": [0]})])  # fmt: skip
    assert odd not in {r["message_id"] for r in every_page(broker, args=[0])[0]}
    (row,) = broker.search(message_id=odd).rows
    assert row["args"] is None and row["decode_error"]


def test_bad_filters_and_cursors_are_refused(dramatiq_pg_broker: PostgresBroker) -> None:
    for bad in ({"state": "sleeping"}, {"queue": "a b"}, {"args": {"x": 1}}, {"kwargs": [1]}, {"limit": 0},
                {"after": "nope"}, {"message_id": "42"},
                # PostgreSQL's jsonb and text hold no NUL: the server refused the whole search with its own error
                {"args": ["a\x00b"]}, {"kwargs": {"k\x00": 1}}, {"args": [{"deep": ["\x00"]}]},
                {"actor": "job\x00"}):  # fmt: skip
        with pytest.raises(ValueError):
            dramatiq_pg_broker.search(**bad)  # type: ignore[arg-type]


def test_a_message_with_a_nul_in_its_arguments_is_found_and_does_not_break_a_search(
    dramatiq_pg_broker: PostgresBroker,
) -> None:
    """A message whose arguments hold a NUL character (JSON's \\u0000, which jsonb refuses) is found by id
    and by actor, and a search by argument over it finds the others (the literal text \\u0000 is no NUL)."""
    broker = dramatiq_pg_broker

    @dramatiq.actor(broker=broker, queue_name="nul")
    def nul(text: str) -> None:
        pass

    odd, plain, literal = nul.send("a\x00b"), nul.send("plain"), nul.send("\\u0000")
    assert [r["message_id"] for r in broker.search(message_id=odd.message_id).rows] == [odd.message_id]
    assert {r["message_id"] for r in broker.search(actor="nul").rows} == {odd.message_id, plain.message_id,
                                                                             literal.message_id}  # fmt: skip
    assert [r["message_id"] for r in broker.search(args=["plain"]).rows] == [plain.message_id]
    assert [r["message_id"] for r in broker.search(args=["\\u0000"]).rows] == [literal.message_id]


def test_a_plain_value_finds_the_messages_one_of_whose_arguments_holds_it_as_people_type_it(
    dramatiq_pg_broker: PostgresBroker, messages: dict[str, list[dramatiq.Message]]
) -> None:
    """Given messages whose arguments hold strings, numbers and ids at any depth, I expect a plain value to
    find those with an argument (positional, or a keyword's value, never its name) equal to it: as a string,
    or as a number when it reads as one (42 matches 42, 42.0 and "42"; 42.0 the numbers; "42" quoted only
    the string)."""
    broker = dramatiq_pg_broker
    nested = message("s", "greet", "alice", {"to": ["bob", 42.0]}, order="7f3c-ab")
    text = message("s", "greet", "42", note="café", flag=True)
    keyed = message("s", "greet", alice=1)  # "alice" is a keyword's name here, not a value
    odd = message("s", "greet", 4.2e1, "1e400")
    broker.enqueue_many([nested, text, keyed, odd])
    found = lambda **f: sorted(r["message_id"] for r in every_page(broker, **f)[0])  # noqa: E731
    ids = lambda *ms: sorted(m.message_id for m in ms)  # noqa: E731
    assert found(value="alice") == ids(nested)
    assert found(value="bob") == ids(nested)
    assert found(value="7f3c-ab") == ids(nested)
    assert found(value="42") == ids(nested, text, odd)
    assert found(value="42.0") == ids(nested, odd)  # numbers only: the text is not "42"
    assert found(value='"42"') == ids(text)
    assert found(value="café") == ids(text)
    assert found(value="true") == ids(text)
    assert found(value="4.2e1") == ids(nested, odd)
    assert found(value="1e400") == ids(odd)
    assert found(value="ali") == []
    # the other filters still narrow it, the history included
    assert found(value="7", state="done") == ids(*messages["done"])
    evens = [m for m in messages["queued"] if m.args[0] % 2 == 0]
    assert found(value="7", queue="s", state="queued") == ids(messages["queued"][7], *evens)
    assert found(value="203") == ids(messages["done"][3])
    # a bulk action selects by it too
    assert broker.bulk_preview("cancel", value="alice").count == 1
    with pytest.raises(ValueError, match="NUL"):
        broker.search(value="a\x00b")


def test_a_search_by_argument_planned_in_parallel_does_not_fail(
    dramatiq_pg_broker: PostgresBroker, messages: dict[str, list[dramatiq.Message]]
) -> None:
    """Given a server that plans the argument filter as a parallel scan (as it does on a large table), I
    expect the search's statement to answer, not "cannot start subtransactions during a parallel
    operation" (message_arguments' EXCEPTION block)."""
    broker = dramatiq_pg_broker
    statement = sql.SQL("SELECT count(*) FROM {schema}.message WHERE {schema}.message_arguments(payload) @> %s::jsonb")
    with broker.database.connection() as conn, conn.transaction():
        # force_parallel_mode was renamed debug_parallel_query in PostgreSQL 16 (the embedded server is newer)
        force = "debug_parallel_query" if conn.info.server_version >= 160000 else "force_parallel_mode"
        for setting, value in ((force, "on"), ("parallel_setup_cost", "0"),
                               ("min_parallel_table_scan_size", "0")):  # fmt: skip
            conn.execute("SELECT set_config(%s, %s, true)", [setting, value])
        (n,) = conn.execute(statement.format(schema=sql.Identifier(broker.schema)), ['{"kwargs": {"user": 7}}']).fetchone()
    assert n == 16
