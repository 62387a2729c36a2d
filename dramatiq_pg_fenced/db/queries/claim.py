"""The claim and the lease extension, durable or relaxed (``core/consumer.py``, ``core/leases.py``)."""

from __future__ import annotations

from .pieces import _RELAXED


# -- claim and lease extension, durable or relaxed -------------------------------
# Both variants are the same statement; the relaxed one only adds _RELAXED to
# its FROM list (a claim's FROM list is that alone).  A claim lost in a crash leaves the row queued at its old
# attempt; its next claim draws a new delivery token, so the token stays
# unique per delivery even though the attempt number repeats.
def _claim(*, relaxed: bool, telling: bool = False, fair: bool = False) -> str:
    # A paused queue (a row in paused_queue) is skipped: the NOT EXISTS does
    # not depend on the row, so it runs once per claim (one primary-key probe).
    # (priority, available_at, seq) >= (%(from_priority)s, %(from_at)s, %(from_seq)s) is where the
    # index scan starts: a consumer that knows nothing is claimable before that
    # point skips the entries its earlier claims left dead at the head of the
    # index, which no vacuum may remove while another session's snapshot is
    # older (see floor.Floor).  floor.HEAD starts at the head.  now() comes back with the rows: the database's clock sets the floor.
    # A claim from the head walks those dead entries, and no index can spare it that: a row put back
    # at its place, committed late, or of a priority no actor here has may lie anywhere among them, and
    # a B-tree scan visits every entry before the first live one (under the pin none is marked dead in
    # the index).  Its cost grows with the pin (tests/test_pinned_horizon.py, STILL_GROWING); how often
    # a consumer claims from the head is what is bounded (consumer.LOOK_BACK_MAX_FACTOR).
    # One UPDATE of the rows its subquery locked: no CTE to fill and join back (the simpler statement;
    # paced claims with the consumer's own parameters were no slower, at best ~50 µs faster:
    # docs/performance.md).
    update = f"""
        UPDATE {{schema}}.message AS m
           SET state = 'running', attempt = m.attempt + 1, delivery = gen_random_uuid(),
               lease_expires_at = now() + %(lease)s * interval '1 second',
               consumer_id = %(consumer)s, claimed_at = now(){(" FROM " + _RELAXED[2:]) if relaxed else ""}
         WHERE m.message_id = ANY(ARRAY({_FAIR_PICK if fair else _PICK}))
        RETURNING m.message_id::text, m.attempt, m.delivery::text, m.payload, m.priority, m.available_at, m.seq, now(){
            ", m.fairness_key" if fair else ""}
    """
    if not telling:
        return update
    # While a process of an older version listens (it waits for "!took" before answering a ring,
    # turns.Answered), a claim that took rows and came back short of its limit (the queue is drained
    # for now) says so with %(took)s ("!took <queue> <process>") in its own commit, no transaction more.
    return f"""
        WITH claimed AS ({update}), told AS (
            SELECT pg_notify(%(channel)s, %(took)s::text)
             WHERE (SELECT count(*) FROM claimed) BETWEEN 1 AND %(limit)s - 1
        )
        SELECT * FROM claimed WHERE (SELECT count(*) FROM told) >= 0
    """


_PICK = """
            SELECT message_id FROM {schema}.message
             WHERE queue_name = %(queue)s AND state = 'queued' AND available_at <= now()
               AND (priority, available_at, seq)
                   >= (%(from_priority)s::int, %(from_at)s::timestamptz, %(from_seq)s::bigint)
               AND NOT EXISTS (SELECT FROM {schema}.paused_queue AS p WHERE p.queue_name = %(queue)s)
             ORDER BY priority, available_at, seq
             LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED"""

# The fair claim (a fair queue's: sending/fairness.py, migration 021): the queue's due keyed rows
# with the lowest tags are the claim's slots (read, not locked: the weighted round robin across
# keys); each key's slots are then filled with its own due rows in the usual order (priority, then
# available_at), locked with SKIP LOCKED, so a high-priority row of a key takes the slot of its
# key's earlier-tagged one.  Two consumers claiming at once see the same slots; the second one
# skips the rows the first locked and fills its slots with the key's next rows.  Each key's scan
# starts at its floor (floor.KeyFloors: %(floor_keys)s, %(floor_at)s, %(floor_seq)s, at the queue's
# %(from_priority)s), a key without one at its head.  The slots' scan starts at the head of the
# tag index: no floor there yet.
_FAIR_PICK = """
            SELECT r.message_id
              FROM (SELECT s.fairness_key, count(*) AS n
                      FROM (SELECT fairness_key FROM {schema}.message
                             WHERE queue_name = %(queue)s AND state = 'queued' AND fair_tag IS NOT NULL
                               AND available_at <= now()
                               AND NOT EXISTS (SELECT FROM {schema}.paused_queue AS p WHERE p.queue_name = %(queue)s)
                             ORDER BY fair_tag, seq
                             LIMIT %(limit)s) AS s
                     GROUP BY s.fairness_key) AS slot
                   LEFT JOIN unnest(%(floor_keys)s::text[], %(floor_at)s::timestamptz[], %(floor_seq)s::bigint[])
                        AS f(key, at, seq) ON f.key = slot.fairness_key,
                   LATERAL (SELECT x.message_id FROM {schema}.message AS x
                             WHERE x.queue_name = %(queue)s AND x.fairness_key = slot.fairness_key
                               AND x.state = 'queued' AND x.available_at <= now()
                               AND (x.priority, x.available_at, x.seq)
                                   >= (CASE WHEN f.key IS NULL THEN (-2147483648)::int ELSE %(from_priority)s::int END,
                                       coalesce(f.at, '-infinity'::timestamptz),
                                       coalesce(f.seq, (-9223372036854775808)::bigint))
                             ORDER BY x.priority, x.available_at, x.seq
                             LIMIT slot.n
                             FOR UPDATE SKIP LOCKED) AS r"""


def _extend(*, relaxed: bool) -> str:
    # SKIP LOCKED: a row some other session has locked (an operator's
    # SELECT ... FOR UPDATE, a cancel in progress, an open fenced block) never
    # holds up the others; delivery_states tells it apart from a lost row
    # without locking.  A 'committed' row (its fenced transaction committed) is
    # extended as a running one: its actor may run on after its block, and its
    # outcome, still to come, finishes it with what it caused (see below).
    # The update reads the rows it locked by their ids alone (one probe of the primary key each), not
    # by a join to the lock's rows: under a pinned horizon the table grows, and the planner, expecting
    # one locked row, put the probe of every id inside a loop over them (10 rows: 244 buffers for 20).
    relaxed_from = "\n          FROM " + _RELAXED.removeprefix(", ") if relaxed else ""
    return f"""
        WITH mine AS (
            SELECT m.message_id FROM {{schema}}.message AS m
              JOIN unnest(%(ids)s::uuid[], %(deliveries)s::uuid[]) AS o(id, delivery)
                ON m.message_id = o.id AND m.delivery = o.delivery
             WHERE m.message_id = ANY(%(ids)s::uuid[]) AND m.state IN ('running', 'committed')
               FOR UPDATE OF m SKIP LOCKED
        )
        UPDATE {{schema}}.message AS m
           SET lease_expires_at = now() + %(lease)s * interval '1 second'{relaxed_from}
         WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM mine))
        RETURNING m.message_id
    """


TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "claim": _claim(relaxed=False),
        "claim_relaxed": _claim(relaxed=True),
        "claim_telling": _claim(relaxed=False, telling=True),
        "claim_telling_relaxed": _claim(relaxed=True, telling=True),
        "claim_fair": _claim(relaxed=False, fair=True),
        "claim_fair_relaxed": _claim(relaxed=True, fair=True),
        "claim_fair_telling": _claim(relaxed=False, telling=True, fair=True),
        "claim_fair_telling_relaxed": _claim(relaxed=True, telling=True, fair=True),
        # Is a claimable row waiting behind a consumer's look-back window (floor.Window)?  Read without
        # locking, by the claim index from its head: under a pinned horizon it steps over every dead
        # entry there, as a claim from the head does, but on a connection and a thread of its own, once
        # per floor.FULL_LOOK_BACK_EVERY, so the consumer's claims never wait for it (core/consumer.py).
        "behind_window": """
            SELECT 1 FROM {schema}.message
             WHERE queue_name = %(queue)s AND state = 'queued' AND available_at <= now()
               AND (priority, available_at, seq) < (%(to_priority)s::int, %(to_at)s::timestamptz, %(to_seq)s::bigint)
             ORDER BY priority, available_at, seq
             LIMIT 1
        """,
        "extend": _extend(relaxed=False),
        "extend_relaxed": _extend(relaxed=True),
        # How the outcome writer's and the shutdown release's transactions
        # begin unless durable_outcomes=True: one simple query (no
        # parameters), so one round trip, as a plain BEGIN; SET LOCAL ends
        # with the transaction (nothing left on a pooled connection).
        "begin_relaxed": "BEGIN; SET LOCAL synchronous_commit = off",
    }
)
