"""Under a pinned MVCC horizon, no hot statement's cost grows with dead rows (issue 41).

Another session holds a ``REPEATABLE READ`` snapshot open, idle in its transaction, so no row
version deleted or updated after it may be vacuumed, nor its index entries marked dead: every
message sent, claimed, extended and acked since then leaves its old versions in the table and
their entries in every index.  Each statement of the hot paths is run with ``EXPLAIN (ANALYZE,
BUFFERS, FORMAT JSON)`` (in a transaction rolled back) over a few live rows, once before any dead
row, once after ``N`` such message lives and once after ``5 N``: from ``N`` to ``5 N`` the shared
buffers its scans touched (hit + read) must not grow past a small slack (a write's own cost, new
versions into heap and indexes, is a matter of tree depth and free space: see :func:`_reads`).  A
statement whose plan walks the dead entries (a range that takes in every old lease, a join that
scans a whole index for a list of ids) reads about five times as many buffers the second time.
Buffers are counted, not timed.

Before each measure the table is analyzed with no live row in it, as autovacuum finds a queue that
keeps up: the planner then believes the table empty, and a plan that is safe only with the
statistics of a few live rows shows here (the rescue's did not, until a soak found it).

The message lives are written in bulk with SQL, as the broker's own statements would leave them:
inserted queued (an entry in the claim index), claimed (running, a token, a lease: an entry in the
lease index), extended (another), then acked (deleted); the leases lie in the past, as every lease
of a message acked more than a lease ago does.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import psycopg.conninfo
import pytest
from psycopg import sql

from dramatiq_pg_fenced import PostgresBroker
from dramatiq_pg_fenced.core import processes
from dramatiq_pg_fenced.core.floor import HEAD, LOOK_BACK_WINDOW
from dramatiq_pg_fenced.core.maintenance import RESCUE_MARGIN

#: Message lives (each: insert, claim, extend, ack) before the first and the second measure.
FIRST = 4_000
SECOND = 5 * FIRST
#: A statement may touch at most this many more buffers at FIRST or SECOND than with no dead row,
#: plus SLACK_RATIO of that: a statement walking the dead entries touches thousands more.  (A probe of
#: the primary key may go one level deeper as its dead entries pile up: one buffer per id at most.)
SLACK = 100
SLACK_RATIO = 0.25

LIVE_QUEUED = 10
LIVE_RUNNING = 10
#: Deliveries in the id lists whose rows are gone (acked meanwhile, say): a worker's prefetch
#: holds tens of them; with so many ids the planner hashed the whole table rather than probe.
GONE = 50
#: Outcome batches are smaller: their lists carry this many of the gone ones.
GONE_IN_BATCH = 10

#: Statements whose buffers still grow under a pin, and why; measured and reported, not held flat
#: (docs/performance.md, "Under a pinned horizon").  The rescue and finish_committed are measured as
#: their periodic pass runs them (a window from the previous pass); their full pass, every
#: maintenance.FULL_RESCUE_EVERY, still walks the dead entries.
STILL_GROWING = {
    "claim": "from the head (floor.HEAD): a row put back or committed late may lie anywhere behind the"
    " floor, among the dead entries, and a B-tree scan visits each entry before the first live one; bounded"
    " in frequency instead: in a listening process only after a \"!back\" or a row found behind the window"
    " (behind_window); claim_window, held flat, is its other look backs",
    "claim_relaxed": "the same",
    "behind_window": "the probe behind the look-back window walks from the head as the claim does; on a thread"
    " and a connection of its own, once per floor.FULL_LOOK_BACK_EVERY: the claims do not wait for it",
    "relay_look": "the queued rows of the outbox's queues in seq order, by the claim index: its dead entries too",
    "relay_waiting": "a count over the same entries: a count of a range visits every entry in it",
    "relay_take": "the ids relay_look found, taken: with the statistics of an empty table the planner walks the"
    " claim index of those queues (state 'queued', queue_name) for them rather than probe the primary key;"
    " once per batch relay_look found, on the relay's thread, as relay_look itself",
    "overview": "each queue's queued rows counted from the head of its range in the claim index (the loose scan of"
    " queue names, then the due count, which reads the oldest due on its way: two walks of the dead entries);"
    " the charts' sample runs it within a budget (samples.SAMPLE_BUDGET_MS), the rest at a person's or a"
    " scraper's pace",
}


def _lives(conn: psycopg.Connection, schema: str, n: int) -> None:
    """*n* message lives on queue ``q``, after the pin: every version they leave is dead but kept."""
    s = sql.Identifier(schema)
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.message (message_id, queue_name, actor_name, payload, available_at)"
            " SELECT gen_random_uuid(), 'q', 'a', '\\x00'::bytea, now() - interval '1 hour' + g * interval '1 ms'"
            "   FROM generate_series(1, %s) AS g"
        ).format(s),
        [n],
    )
    # The claim, the extension, the ack (only the churned rows: consumer 'gone').
    conn.execute(
        sql.SQL(
            "UPDATE {}.message SET state = 'running', attempt = attempt + 1, delivery = gen_random_uuid(),"
            " lease_expires_at = now() - interval '50 minutes' + seq * interval '1 ms', consumer_id = 'gone',"
            " claimed_at = now() WHERE state = 'queued' AND actor_name = 'a'"
        ).format(s)
    )
    conn.execute(
        sql.SQL(
            "UPDATE {}.message SET lease_expires_at = lease_expires_at + interval '30 seconds'"
            " WHERE consumer_id = 'gone'"
        ).format(s)
    )
    conn.execute(sql.SQL("DELETE FROM {}.message WHERE consumer_id = 'gone'").format(s))


class Live:
    """The live rows every statement works on: a few queued, a few running under a fresh lease."""

    def __init__(self, conn: psycopg.Connection, schema: str) -> None:
        s = sql.Identifier(schema)
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.message (message_id, queue_name, actor_name, payload)"
                " SELECT gen_random_uuid(), 'q', 'live', '\\x00'::bytea FROM generate_series(1, %s)"
            ).format(s),
            [LIVE_QUEUED + LIVE_RUNNING],
        )
        conn.execute(
            sql.SQL(
                "UPDATE {}.message SET state = 'running', attempt = 1, delivery = gen_random_uuid(),"
                " lease_expires_at = now() + interval '1 hour', consumer_id = 'live', claimed_at = now()"
                " WHERE message_id IN (SELECT message_id FROM {}.message WHERE actor_name = 'live' ORDER BY seq LIMIT %s)"
            ).format(s, s),
            [LIVE_RUNNING],
        )
        rows = conn.execute(
            sql.SQL("SELECT message_id, delivery FROM {}.message WHERE state = 'running' ORDER BY seq").format(s)
        ).fetchall()
        self.ids = [r[0] for r in rows]
        self.deliveries = [r[1] for r in rows]
        #: The queued ones and their versions (the relay's look reads them so).
        self.queued = conn.execute(
            sql.SQL("SELECT message_id, xmin::text FROM {}.message WHERE state = 'queued' ORDER BY seq").format(s)
        ).fetchall()


def _statements(broker: PostgresBroker, live: Live) -> dict[str, tuple[bytes, Any]]:
    """Each hot statement with the parameters its caller gives it, over *live*'s rows."""
    st = broker.statements
    now = datetime.now(timezone.utc)
    # A prefetch's worth: the live deliveries and as many again whose rows are gone.
    gone = [uuid.uuid4() for _ in range(GONE)]
    prefetch, prefetch_tokens = live.ids + gone, live.deliveries + [uuid.uuid4() for _ in gone]
    ids, tokens = prefetch[: len(live.ids) + GONE_IN_BATCH], prefetch_tokens[: len(live.ids) + GONE_IN_BATCH]
    n = len(ids)
    head = {"from_priority": HEAD[0], "from_at": HEAD[1], "from_seq": HEAD[2], "channel": "", "took": None}
    claim = {"queue": "q", "limit": 5, "lease": 30, "consumer": "c", **head}
    named = {"ids": ids, "deliveries": tokens, "writer": "w"}
    statements = {
        # the claim (from the head: a consumer that knows no floor), and the next due row
        "claim": (st.claim, claim),
        "claim_relaxed": (st.claim_relaxed, claim),
        # a look back nothing announced, in a process that listens: from the window before the floor
        # (the floor at the live rows; the dead lives lie an hour before it)
        "claim_window": (st.claim, {**claim, "from_priority": 0, "from_at": now - LOOK_BACK_WINDOW, "from_seq": HEAD[2]}),
        # the probe behind that window (beside the claims, once per floor.FULL_LOOK_BACK_EVERY)
        "behind_window": (
            st.behind_window,
            {"queue": "q", "to_priority": 0, "to_at": now - LOOK_BACK_WINDOW, "to_seq": HEAD[2]},
        ),
        "next_due": (st.next_due, {"queue": "q"}),
        # the start gate
        "still_held_many": (st.still_held_many, [prefetch, prefetch_tokens]),
        # lease keeping
        "extend": (st.extend, {"ids": ids, "deliveries": tokens, "lease": 30}),
        "extend_relaxed": (st.extend_relaxed, {"ids": ids, "deliveries": tokens, "lease": 30}),
        "delivery_states": (st.delivery_states, [ids, tokens]),
        "extend_cancelled": (st.extend_cancelled, {"ids": ids, "deliveries": tokens, "lease": 30}),
        "cancel_ended": (st.cancel_ended, [ids, tokens]),
        # outcomes
        "ack": (st.ack, named),
        "ack_keep": (st.ack_keep, named),
        "ack_relaxed": (st.ack_relaxed, named),
        "committed_done": (st.committed_done, named),
        "nack": (st.nack, {**named, "errors": ["e"] * n}),
        "retry": (
            st.retry,
            {**named, "payloads": [b"\x00"] * n, "delays": [0] * n, "errors": ["e"] * n},
        ),
        "requeue": (st.requeue, [ids, tokens]),
        "current": (st.current, [ids]),
        "release_unseen": (
            st.release_unseen,
            {"consumers": ["nobody"], "queue": "q", "held": ids, "max": None},
        ),
        # maintenance
        # the periodic passes: their windows start where their previous pass ended, less the margin
        "rescue": (st.rescue, {"max": None, "since": now - RESCUE_MARGIN}),
        "finish_committed": (
            st.finish_committed,
            {"grace": 300, "writer": "maintenance", "since": now - timedelta(seconds=300) - RESCUE_MARGIN},
        ),
        # the relay of a routed broker
        "relay_look": (st.relay_look, {"queues": ["q"], "limit": 100}),
        "relay_waiting": (st.relay_waiting, [["q"]]),
        "relay_take": (
            st.relay_take,
            {"ids": [r[0] for r in live.queued], "versions": [r[1] for r in live.queued], "queues": ["q"]},
        ),
        # an operator's cancel of a queued message
        "cancel": (st.cancel, {"id": live.queued[0][0], "seq": None, "channel": ""}),
        # the console's first page, stats(), the metrics (capped) and the charts' sample (samples.SAMPLE_CAP)
        "overview": (st.overview, {"cap": 10_001, "beats": processes.STALE_AFTER_BEATS}),
    }
    # The variants run while history is kept (keep_finished > 0, the default): the same with the
    # attempt log's insert, whose CTEs read the rows again (a plan of their own).
    for name in ("nack", "retry", "requeue", "release_unseen", "rescue"):
        text, params = statements[name]
        statements[f"{name}_logged"] = (getattr(st, f"{name}_logged"), params)
    for name in ("committed_done", "finish_committed"):
        text, params = statements[name]
        statements[f"{name}_keep"] = (getattr(st, f"{name}_keep"), params)
    return statements


#: Plan nodes that read a table or an index: their buffers (children included: a bitmap heap scan's
#: index scan) are the reads of the statement.  A CTE or subquery scan reads its subplan's rows, counted
#: at that subplan's own scans.
_NOT_READS = {"CTE Scan", "Subquery Scan", "Function Scan", "Values Scan", "WorkTable Scan", "Result"}


def _reads(node: dict[str, Any]) -> int:
    """The shared buffers (hit + read) of the scans in *node*'s plan tree.

    Not the writes: an UPDATE's new row versions go into every index (a descent of each B-tree, one
    level deeper as the dead entries pile up) and into heap pages the rolled-back runs before it filled
    (the relation grows): a write's cost by tree depth and free space, a few hundred buffers that moved
    from one run to the next (a loaded CI pass: extend 160, 326, 422), not a walk of the dead entries."""
    kind = node.get("Node Type", "")
    if kind.endswith("Scan") and kind not in _NOT_READS:
        return int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))
    return sum(_reads(child) for child in node.get("Plans", []))


def _buffers(conn: psycopg.Connection, statement: bytes, params: Any, plans: list[str] | None = None) -> int:
    """Shared buffers (hit + read) the statement's scans touched, run twice (hint bits set by the first),
    rolled back, with its planning's (the planner reads an index's ends for the range of a column).
    The plan of the run counted goes on *plans*, in short (see :func:`_outline`)."""
    explain = b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement
    touched = 0
    for _ in range(2):
        with conn.transaction(force_rollback=True):
            plan = conn.execute(explain, params).fetchone()[0]
        if isinstance(plan, str):
            plan = json.loads(plan)
        planning = plan[0].get("Planning", {})
        touched = _reads(plan[0]["Plan"]) + sum(planning.get(k, 0) for k in ("Shared Hit Blocks", "Shared Read Blocks"))
    if plans is not None:
        planned = sum(planning.get(k, 0) for k in ("Shared Hit Blocks", "Shared Read Blocks"))
        plans.append(f"Planning buffers={planned}\n{_outline(plan[0]['Plan'])}")
    return touched


def _outline(node: dict[str, Any], depth: int = 0) -> str:
    """A plan in short, for a failure's message: each node, its relation or index, rows and buffers."""
    where = node.get("Index Name") or node.get("Relation Name") or node.get("CTE Name") or ""
    buffers = int(node.get("Shared Hit Blocks", 0)) + int(node.get("Shared Read Blocks", 0))
    line = f"{'  ' * depth}{node.get('Node Type')} {where} rows={node.get('Actual Rows')} buffers={buffers}"
    return "\n".join([line, *(_outline(child, depth + 1) for child in node.get("Plans", []))])


@pytest.fixture
def pinned() -> Iterator[Callable[[str], None]]:
    """``pin(url)``: another session takes a snapshot and stays idle in its transaction until the test ends."""
    conns: list[psycopg.Connection] = []

    def pin(url: str) -> None:
        conn = psycopg.connect(url)
        conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        conn.execute("SELECT 1").fetchone()
        conns.append(conn)

    yield pin
    for conn in conns:
        conn.close()


#: The plans of the last :func:`measure`, per statement, one per measure (for a failure's message).
PLANS: dict[str, list[str]] = {}


def measure(broker: PostgresBroker, url: str, pin: Callable[[], None]) -> dict[str, list[int]]:
    """Buffers per statement under the pin: with no dead row yet, at FIRST and at SECOND message lives."""
    schema = broker.schema
    table_schema = sql.Identifier(schema)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER TABLE {}.message SET (autovacuum_enabled = off)").format(table_schema))
        # Lives vacuumed away before the pin: the indexes as deep as the dead entries will make them
        # (a probe one level deeper is not a walk of the dead), none of their entries left.
        _lives(conn, schema, SECOND)
        conn.execute(sql.SQL("VACUUM {}.message").format(table_schema))
        pin()
        PLANS.clear()
        measured: dict[str, list[int]] = {}
        for lives in (0, FIRST, SECOND - FIRST):
            # The live rows of the round before go (dead lives too, kept by the pin), then this round's lives.
            conn.execute(sql.SQL("DELETE FROM {}.message WHERE actor_name = 'live'").format(table_schema))
            _lives(conn, schema, lives)
            # The measured writes of the round before, rolled back, left aborted versions of the live rows
            # (a HOT chain, index entries: a probe of a live row follows them all): a vacuum takes them
            # away, even under the pin, and leaves the dead lives (deleted after the pin) where they are.
            # Each round starts from as many of its own as the one before (a CI pass saw the extend 74,
            # 74, 289: rows of its own and not of the dead lives).
            conn.execute(sql.SQL("VACUUM {}.message").format(table_schema))
            # The statistics autovacuum's analyze leaves under a pin at a moment the queue is empty (a
            # queue that keeps up): no live row (reltuples 0) in as many pages as the dead versions fill.
            # The planner then prices a probe of an index by its pages per live row, and a walk of a
            # whole index at nearly nothing: the rescue's update, joined to its expired rows, walked every
            # dead entry of the primary key at each pass in a soak (issue 41) with these, and probed with
            # the statistics of a few live rows.
            conn.execute(sql.SQL("ANALYZE {}.message").format(table_schema))
            live = Live(conn, schema)
            for name, (text, params) in _statements(broker, live).items():
                measured.setdefault(name, []).append(_buffers(conn, text, params, PLANS.setdefault(name, [])))
    return measured


def _grew(n: list[int]) -> bool:
    """Did the buffers *n* (at 0, FIRST and SECOND dead lives) grow with the dead lives?  From FIRST to
    SECOND (five times as many): a walk of the dead entries reads about five times as many.  The first
    measure is shown, not compared: on a table of a page or two the planner reads that page where it
    probes the primary key once the dead versions fill hundreds (7 buffers, then 125 for 60 ids, at
    FIRST as at SECOND: no walk)."""
    return n[2] > n[1] + SLACK + SLACK_RATIO * n[1]


@pytest.fixture
def own_database(dramatiq_pg_url: str) -> Iterator[str]:
    """A database of its own: the snapshots of other sessions (tests running beside this one) hold back
    the horizon of the database they are connected to only, so its vacuum before the pin is complete."""
    name = f"pin_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield psycopg.conninfo.make_conninfo(dramatiq_pg_url, dbname=name)
    finally:
        with psycopg.connect(dramatiq_pg_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def test_no_hot_statement_reads_more_buffers_as_dead_rows_pile_up_under_a_pinned_horizon(
    own_database: str, pinned: Callable[[str], None]
) -> None:
    """Given another session's snapshot pinned and FIRST, then SECOND (5x) message lives sent, claimed,
    extended and acked after it, I expect every hot statement to touch about as many shared buffers
    each time as before any of them: none walks the dead entries."""
    broker = PostgresBroker(own_database, schema="pinned")
    try:
        broker.migrate()
        broker.declare_queue("q")
        measured = measure(broker, own_database, lambda: pinned(own_database))
    finally:
        broker.close()
    report = "\n".join(f"{name:20} {a:7} {b:7} {c:7}" for name, (a, b, c) in measured.items())
    grown = {name: n for name, n in measured.items() if _grew(n) and name not in STILL_GROWING}
    plans = "\n".join(f"-- {name}, at 0 and {SECOND} dead lives:\n{PLANS[name][0]}\n{PLANS[name][-1]}" for name in grown)
    assert not grown, f"buffers grew with dead rows (at 0, {FIRST} and {SECOND} dead lives): {grown}\n{report}\n{plans}"


if __name__ == "__main__":  # the table for docs/performance.md, in a database of its own (as the test)
    import os

    url = os.environ.get("DRAMATIQ_PG_TEST_URL", "postgresql://postgres@127.0.0.1:5432/test")
    own = f"pin_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(own)))
    own_url = psycopg.conninfo.make_conninfo(url, dbname=own)
    held: list[psycopg.Connection] = []

    def _pin() -> None:
        c = psycopg.connect(own_url)
        c.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        c.execute("SELECT 1").fetchone()
        held.append(c)

    b = PostgresBroker(own_url, schema="pinned")
    try:
        b.migrate()
        b.declare_queue("q")
        for name, (a, b2, c2) in measure(b, own_url, _pin).items():
            print(f"| `{name}` | {a} | {b2} | {c2} |")
    finally:
        for c in held:
            c.close()
        b.close()
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(own)))
