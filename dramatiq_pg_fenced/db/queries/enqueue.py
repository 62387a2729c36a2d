"""The enqueue (one row, many, with a unique key) and its ring of the doorbell (``sending/enqueue.py``)."""

from __future__ import annotations

from .pieces import _DURABLE, _HELD, _RELAXED

# -- enqueue, built from explicit pieces ---------------------------------------
# One statement (one round trip, atomic even in autocommit): the rows and one
# NOTIFY per queue that got a message due now, one more ("queue<TAB>ms") per
# queue that got a delayed one, for the earliest (see doorbell.py); the last
# parameter says whether to ring at all.  It returns how many rows it
# inserted: an id that exists already is not inserted again (the sender is
# told, see PostgresBroker.enqueue).  Values travel in binary (%b): no
# escaping of payloads on either side, which bulk enqueue feels most.
_ENQUEUE_ROWS = {
    # many messages: arrays, one element per message
    "many": "unnest(%b::uuid[], %b::text[], %b::text[], %b::int[], %b::bigint[], %b::bytea[])",
    # one message (every plain send()): scalars, about a sixth less server time than unnest
    "one": "(SELECT %b::uuid, %b::text, %b::text, %b::int, %b::bigint, %b::bytea)",
}


# The doorbell of every enqueue: rings for the rows of ``ins``.
_RING = """
        rung AS (
            SELECT pg_notify(%s, CASE WHEN q.later
                                      THEN q.queue_name || chr(9)
                                           || ceil(extract(epoch FROM q.at - now()) * 1000)::bigint
                                      ELSE q.queue_name END)
              FROM (SELECT queue_name, available_at > now() AS later, min(available_at) AS at
                      FROM ins WHERE %s GROUP BY 1, 2) AS q
        )"""


def _enqueue(rows: str, *, relaxed: bool) -> str:
    return f"""
        WITH ins AS (
            INSERT INTO {{schema}}.message
                (message_id, queue_name, actor_name, priority, available_at, payload)
            SELECT m.id, m.queue, m.actor, m.priority,
                   now() + m.delay_ms * interval '1 millisecond', m.payload
              FROM {_ENQUEUE_ROWS[rows]} AS m(id, queue, actor, priority, delay_ms, payload)
                   {_RELAXED if relaxed else _DURABLE}
            ON CONFLICT (message_id) DO NOTHING
            RETURNING queue_name, available_at
        ), {_RING}
        SELECT (SELECT count(*) FROM ins) AS inserted, (SELECT count(*) FROM rung) AS rung
    """


# Sends of which at least one carries a unique key (migration 006); sends
# without one never take this path.  ON CONFLICT DO NOTHING without a target
# covers both the id and message_unique_idx: a held key makes the insert do
# nothing.  Rows go in in send order (ORDER BY n), so of two sends with one
# key in a batch the first wins.  One row back per send, in order: whether it
# was inserted, and the holder of its key (itself when inserted; a send of
# this batch; else the row that held it, read from this statement's
# snapshot).  A holder that committed after that snapshot (the insert waited
# for it) reads as NULL: see unique_holders.
def _enqueue_unique(*, relaxed: bool, fair: bool = False) -> str:
    return f"""
        WITH m AS MATERIALIZED (
            SELECT * FROM unnest(%b::uuid[], %b::text[], %b::text[], %b::int[], %b::bigint[], %b::bytea[],
                                 %b::text[], %b::text[]{_FAIR_PARAMS if fair else ""})
                   WITH ORDINALITY AS m(id, queue, actor, priority, delay_ms, payload, key, until{
                       ", fkey, fweight" if fair else ""}, n)
        ), {_FAIR_TAGS if fair else ""}ins AS (
            INSERT INTO {{schema}}.message
                (message_id, queue_name, actor_name, priority, available_at, payload, unique_key, unique_until{
                    ", fairness_key, fair_tag" if fair else ""})
            SELECT m.id, m.queue, m.actor, m.priority,
                   now() + m.delay_ms * interval '1 millisecond', m.payload, m.key, m.until{
                       ", m.fkey, m.ftag" if fair else ""}
              FROM {"tagged AS m" if fair else "m"}{_RELAXED if relaxed else _DURABLE}
             ORDER BY m.n
            ON CONFLICT DO NOTHING
            RETURNING message_id, actor_name, unique_key, queue_name, available_at
        ), {_RING}
        SELECT i.message_id IS NOT NULL AS inserted,
               coalesce(i.message_id, b.message_id, h.message_id) AS holder,
               (SELECT count(*) FROM rung) AS rung
          FROM m
          LEFT JOIN ins AS i ON i.message_id = m.id
          LEFT JOIN ins AS b ON b.actor_name = m.actor AND b.unique_key = m.key
          LEFT JOIN LATERAL (
                SELECT u.message_id FROM {{schema}}.message AS u
                 WHERE i.message_id IS NULL AND b.message_id IS NULL
                   AND u.actor_name = m.actor AND u.unique_key = m.key AND {_HELD}
               ) AS h ON true
         ORDER BY m.n
    """


# Sends to a fair queue (migration 021, sending/fairness.py): the unique enqueue plus each keyed
# row's place in the queue's weighted round robin (start-time fair queuing).  Per queue, the
# virtual time is the lowest tag of a due queued row (what the fair claim serves next), else, with
# nothing due, the highest finish tag ever given (everything before it is served).  Per key of the
# batch, one upsert of its fairness_tag row (in key order: two batches lock them in the same order)
# moves its last (finish) tag to base + n / weight, base = max(last tag, virtual time), atomically
# (ON CONFLICT DO UPDATE reads the latest version, and holds the row until commit: concurrent sends
# of one key queue up there); its rows take the start tags base, base + 1/weight, ... in send order.  A key idle for a while comes
# back at the virtual time (no credit saved up); a flooding key's rows lie far ahead of it.
_FAIR_PARAMS = ", %b::text[], %b::float8[]"
_FAIR_TAGS = """k AS MATERIALIZED (
            SELECT m.queue, m.fkey, count(*) AS cnt,
                   coalesce(min(m.fweight), (SELECT w.weight FROM {schema}.fairness_weight AS w
                                              WHERE w.queue_name = m.queue AND w.key = m.fkey), 1) AS w
              FROM m WHERE m.fkey IS NOT NULL GROUP BY m.queue, m.fkey
        ), clock AS MATERIALIZED (
            SELECT q.queue, coalesce(
                (SELECT x.fair_tag FROM {schema}.message AS x
                  WHERE x.queue_name = q.queue AND x.state = 'queued' AND x.fair_tag IS NOT NULL
                    AND x.available_at <= now()
                  ORDER BY x.fair_tag LIMIT 1),
                (SELECT t.last_tag FROM {schema}.fairness_tag AS t
                  WHERE t.queue_name = q.queue ORDER BY t.last_tag DESC LIMIT 1),
                0) AS v
              FROM (SELECT DISTINCT queue FROM k) AS q
        ), tag AS (
            INSERT INTO {schema}.fairness_tag AS t (queue_name, key, last_tag, step)
            SELECT k.queue, k.fkey, c.v + k.cnt / k.w, k.cnt / k.w FROM k JOIN clock AS c USING (queue)
             ORDER BY 1, 2
            ON CONFLICT (queue_name, key)
               DO UPDATE SET last_tag = greatest(t.last_tag + excluded.step, excluded.last_tag), step = excluded.step
            RETURNING t.queue_name, t.key, t.last_tag - t.step AS base
        ), tagged AS (
            SELECT m.*, tag.base + (row_number() OVER (PARTITION BY m.queue, m.fkey ORDER BY m.n) - 1) / k.w AS ftag
              FROM m LEFT JOIN k ON k.queue = m.queue AND k.fkey = m.fkey
                     LEFT JOIN tag ON tag.queue_name = m.queue AND tag.key = m.fkey
        ), """


TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "enqueue": _enqueue("many", relaxed=False),
        "enqueue_relaxed": _enqueue("many", relaxed=True),
        "enqueue_one": _enqueue("one", relaxed=False),
        "enqueue_one_relaxed": _enqueue("one", relaxed=True),
        "enqueue_unique": _enqueue_unique(relaxed=False),
        "enqueue_unique_relaxed": _enqueue_unique(relaxed=True),
        "enqueue_fair": _enqueue_unique(relaxed=False, fair=True),
        "enqueue_fair_relaxed": _enqueue_unique(relaxed=True, fair=True),
        # Sends with a key that were not inserted and whose holder enqueue_unique
        # could not see, read again with a fresh snapshot: the holder now, if
        # any, and whether a row with the send's own id exists (a send under an
        # existing id).  Neither: the key was freed meanwhile; send again.
        "unique_holders": f"""
            SELECT (SELECT u.message_id FROM {{schema}}.message AS u
                     WHERE u.actor_name = k.actor AND u.unique_key = k.key AND {_HELD}),
                   EXISTS (SELECT FROM {{schema}}.message AS s WHERE s.message_id = k.id)
              FROM unnest(%s::uuid[], %s::text[], %s::text[]) WITH ORDINALITY AS k(id, actor, key, n)
             ORDER BY k.n
        """,
    }
)
