"""Ack and nack, and the fenced transaction (``core/outcomes.py``, ``features/exactly_once.py``)."""

from __future__ import annotations

from .pieces import _ATTEMPT_LOG, _BY_IDS, _HOLDER_BEFORE, _RELAXED, _retake


# -- ack and nack, built from explicit pieces (migration 005) ------------------
# Both are fenced on (message_id, delivery, state = 'running') and batched with
# unnest.  In the same statement they count their outcomes per queue in this
# minute's row of the writing process (%(writer)s: no two processes share a
# row, so no writer ever waits for another's), and the ack moves the row into
# the history table when history is kept (``keep_finished`` > 0): one round
# trip, and the hot table loses the row either way.  A batch of acks and
# nothing else (no result, no follow-up, no countdown) is written by the ack
# alone, in its own transaction: the ``_relaxed`` variants then turn off
# ``synchronous_commit`` in the statement, as the claim does.
def _ack_delete(*, relaxed: bool, state: str = "running") -> str:
    return f"""
        DELETE FROM {{schema}}.message AS m
         USING unnest(%(ids)s::uuid[], %(deliveries)s::uuid[]) AS o(id, delivery){_RELAXED if relaxed else ""}
         WHERE m.message_id = ANY(%(ids)s::uuid[])
           AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = '{state}'
"""


_KEEP = """
    kept AS (
        INSERT INTO {schema}.history
            (message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at, claimed_at,
             finished_at, consumer_id, last_error, payload)
        SELECT message_id, seq, queue_name, actor_name, priority, attempt, enqueued_at, claimed_at,
               now(), consumer_id, last_error, payload
          FROM finished
    ),"""


def _tally(column: str) -> str:
    return f"""
    tally AS (
        INSERT INTO {{schema}}.throughput AS t (queue_name, minute, writer, {column})
        SELECT queue_name, date_trunc('minute', now()), %(writer)s, count(*) FROM finished GROUP BY queue_name
        ON CONFLICT (queue_name, minute, writer) DO UPDATE SET {column} = t.{column} + EXCLUDED.{column}
    )"""


def _finished(keep: bool) -> str:
    """What an ack's delete returns: with *keep*, the columns its history row takes (_KEEP)."""
    return (
        "RETURNING m.message_id, m.delivery, m.seq, m.queue_name, m.actor_name, m.priority, m.attempt,"
        " m.enqueued_at, m.claimed_at, m.consumer_id, m.last_error, m.payload"
        if keep
        else "RETURNING m.message_id, m.delivery, m.queue_name"
    )


# Ids come back as text here, in the claim and in still_held_many: the worker knows deliveries by
# those strings, and a UUID object made for each id and turned back into a string cost the worker
# 5-10 µs per row and statement on the 2-core VM (one thread holding the GIL does all of it).
def _ack(*, keep: bool, relaxed: bool = False, state: str = "running") -> str:
    return f"""
        WITH finished AS ({_ack_delete(relaxed=relaxed, state=state)} {_finished(keep)}),
        {_KEEP if keep else ""}
        {_tally("done")}
        SELECT message_id::text, delivery::text FROM finished
    """


# -- the fenced transaction (exactly_once.py, migration 016) ---------------------
# An actor's block begins by moving its delivery's row from 'running' to
# 'committed', under its token, in the actor's own transaction: the update
# locks the row until the block ends (no rescue, claim, cancel or other
# delivery can touch the message meanwhile), and commits with the actor's
# writes, or rolls back with them and leaves the row running.  So the block's
# end is a plain COMMIT.  A committed row is finished as an ack is, by the
# outcome writer, batched: committed_done, fenced on the token and on the
# state, and what the delivery caused after its block (result, follow-ups,
# countdown) is written only if it takes the row, so at most once.  The lease
# keeper of the delivery's process extends a committed row as a running one,
# fenced on its token, while its actor runs on after the block and until its
# outcome is written; the rescue takes running rows only: a committed row is
# never delivered again.  One whose lease lapsed (its process stopped
# extending it: it died, was stopped, or lost the database) is finished by
# maintenance ``COMMITTED_GRACE_LEASES`` leases later (finish_committed),
# without those effects.
_FENCE = """
    UPDATE {schema}.message SET state = 'committed'
     WHERE message_id = %s AND delivery = %s AND state = 'running'
    RETURNING attempt
"""


# %(since)s (NULL: a full pass), as the rescue's (lifecycle.py): a periodic pass starts a margin before
# where its previous pass ended, so it does not walk the lease index's entries of every lease since
# another session's snapshot (issue 41); the full pass now and then takes a row that became committed
# with a lease further back (a block that held its row longer than the grace).
def _finish_committed(*, keep: bool) -> str:
    return f"""
        WITH finished AS (
            DELETE FROM {{schema}}.message AS m
             WHERE m.state = 'committed' AND m.lease_expires_at < now() - %(grace)s * interval '1 second'
               AND m.lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
            {_finished(keep)}
        ),
        {_KEEP if keep else ""}
        {_tally("done")}
        SELECT message_id::text, queue_name FROM finished
    """


TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "fence_lock": _FENCE,
        # The same with its BEGIN, one simple query (values bound by the client: exactly_once.py).
        "fence_begin": "BEGIN; " + _FENCE,
        "committed_done": _ack(keep=False, state="committed"),
        "committed_done_relaxed": _ack(keep=False, relaxed=True, state="committed"),
        "committed_done_keep": _ack(keep=True, state="committed"),
        "committed_done_keep_relaxed": _ack(keep=True, relaxed=True, state="committed"),
        # After a connection lost at the block's COMMIT: did it commit?
        "committed_seen": "SELECT 1 FROM {schema}.message WHERE delivery = %s AND state = 'committed'",
        "finish_committed": _finish_committed(keep=False),
        "finish_committed_keep": _finish_committed(keep=True),
    }
)

# -- retry and nack, and the attempt log (migration 023) --------------------------------
# The _logged variants (run while keep_finished > 0) record the delivery they end in the attempt
# log, in a CTE of the same statement: only for the rows the fenced update took, so a stale
# delivery's late retry never logs 'retried' (its miss is recorded as 'fenced out' by the
# stale-write report, attempt_ended below).  A retry clears the row's consumer_id: the logged retry
# reads it first (was: the statement's snapshot, taken after the claim it ends committed; nothing
# else changes consumer_id while the row runs under that token).  A nack keeps it.
def _retry(*, logged: bool) -> str:
    was = _HOLDER_BEFORE
    log = f"""
            logged AS ({_ATTEMPT_LOG}
                SELECT f.message_id, f.seq, f.attempt, f.delivery, f.queue_name, w.consumer_id, f.claimed_at, now(),
                       'retried', o.error
                  FROM finished AS f JOIN o ON o.id = f.message_id AND o.delivery = f.delivery
                  LEFT JOIN was AS w ON w.message_id = f.message_id AND w.delivery = f.delivery
            ),"""
    returning = "m.message_id, m.delivery, m.queue_name" + (", m.seq, m.attempt, m.claimed_at" if logged else "")
    return f"""
            WITH o AS (SELECT * FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(payloads)s::bytea[],
                                            %(delays)s::bigint[], %(errors)s::text[])
                                     AS o(id, delivery, payload, delay_ms, error)),{was if logged else ""}
            finished AS (
                UPDATE {{schema}}.message AS m
                   SET state = 'queued', payload = o.payload, last_error = o.error,
                       available_at = now() + o.delay_ms * interval '1 millisecond',
                       lease_expires_at = NULL, consumer_id = NULL,
                       {_retake("m", finished_too=False)}
                  FROM o
                 WHERE {_BY_IDS} AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
                RETURNING {returning}
            ),{log if logged else ""}
            {_tally("retried")}
            SELECT message_id::text, delivery::text FROM finished
        """


def _nack(*, logged: bool) -> str:
    log = f"""
            logged AS ({_ATTEMPT_LOG}
                SELECT message_id, seq, attempt, delivery, queue_name, consumer_id, claimed_at, now(), 'dead', error
                  FROM finished
            ),"""
    returning = "m.message_id, m.delivery, m.queue_name" + (
        ", m.seq, m.attempt, m.consumer_id, m.claimed_at, o.error" if logged else ""
    )
    return f"""
            WITH finished AS (
                UPDATE {{schema}}.message AS m
                   SET state = 'dead', finished_at = now(), last_error = o.error, lease_expires_at = NULL
                  FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(errors)s::text[])
                       AS o(id, delivery, error)
                 WHERE m.message_id = ANY(%(ids)s::uuid[])
                   AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
                RETURNING {returning}
            ),{log if logged else ""}
            {_tally("dead")}
            SELECT message_id::text, delivery::text FROM finished
        """


TEMPLATES.update(
    {
        # Counted in the writer's throughput row (retried), as ack and nack count theirs.
        "retry": _retry(logged=False),
        "retry_logged": _retry(logged=True),
        "ack": _ack(keep=False),
        "ack_keep": _ack(keep=True),
        "ack_relaxed": _ack(keep=False, relaxed=True),
        "ack_keep_relaxed": _ack(keep=True, relaxed=True),
        "nack": _nack(logged=False),
        "nack_logged": _nack(logged=True),
        # The writes the fence refused, as the stale-write report classed them (fencing.py; only while
        # keep_finished > 0, and only when a write missed: nothing on an outcome that applied): a stale
        # delivery's ('fenced out': the process that wrote it as its consumer, its claim unknown), or
        # the end of a delivery whose message was cancelled while it ran ('cancelled': its row still
        # names it, with its consumer and claim), once: a second write of that delivery (its nack after
        # its fenced block's, a write tried again) finds the row naming it still, and is not logged again.
        "attempt_ended": f"""{_ATTEMPT_LOG}
            SELECT o.id, m.seq, o.attempt, o.delivery, coalesce(m.queue_name, nullif(o.queue, '')),
                   coalesce(m.consumer_id, %(process)s), m.claimed_at, now(), o.outcome, o.error
              FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(attempts)s::int[], %(queues)s::text[],
                          %(outcomes)s::text[], %(errors)s::text[]) AS o(id, delivery, attempt, queue, outcome, error)
              LEFT JOIN {{schema}}.message AS m
                ON m.message_id = o.id AND m.delivery = o.delivery AND o.outcome = 'cancelled'
             WHERE o.outcome <> 'cancelled'
                OR NOT EXISTS (SELECT FROM {{schema}}.attempt_log AS a
                                WHERE a.message_id = o.id AND a.delivery = o.delivery AND a.outcome = 'cancelled')
        """,
    }
)
