"""Worker processes (``core/processes.py``, migration 011) and the charts' samples (``core/samples.py``, migration 013)."""

from __future__ import annotations

from .pieces import _LIVE_PROCESS

# -- worker processes (processes.py, migration 011) -------------------------------
# One row per worker process: written at boot and every heartbeat by its
# maintenance loop (one upsert, in place), deleted at a clean shutdown; a row
# left by a process that died is purged an hour after its last heartbeat.
TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "process_beat": """
            INSERT INTO {schema}.process AS p
                (process_id, host, pid, queues, threads, busy, prefetched, per_queue, running, running_since, version,
                 beat_seconds)
            VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(threads)s, %(busy)s, %(prefetched)s,
                    %(per_queue)s::jsonb, %(running)s::uuid[], %(running_since)s::timestamptz[], %(version)s,
                    %(beat_seconds)s)
            ON CONFLICT (process_id) DO UPDATE
               SET queues = EXCLUDED.queues, threads = EXCLUDED.threads, busy = EXCLUDED.busy,
                   prefetched = EXCLUDED.prefetched, per_queue = EXCLUDED.per_queue, running = EXCLUDED.running,
                   running_since = EXCLUDED.running_since,
                   beat_seconds = EXCLUDED.beat_seconds, heartbeat_at = now()
        """,
        "process_delete": "DELETE FROM {schema}.process WHERE process_id = %s",
        "process_list": """
            SELECT process_id, host, pid, queues, threads, busy, prefetched, per_queue, version,
                   started_at, heartbeat_at, extract(epoch FROM now() - heartbeat_at), beat_seconds
              FROM {schema}.process ORDER BY heartbeat_at DESC, process_id
        """,
        # Actors running now per queue, from the heartbeats of live processes.
        "process_busy": f"""
            SELECT b.key, sum((b.value ->> 0)::bigint)::bigint
              FROM {{schema}}.process AS p CROSS JOIN LATERAL jsonb_each(p.per_queue) AS b
             WHERE {_LIVE_PROCESS}
             GROUP BY b.key
        """,
        # Of these messages, those whose actor runs (as of the heartbeats of live processes), each with
        # when its actor started (NULL: a process of a version that does not say, migration 020).
        "process_started": f"""
            SELECT DISTINCT ON (r.id) r.id, r.since
              FROM {{schema}}.process AS p CROSS JOIN LATERAL unnest(p.running, p.running_since) AS r(id, since)
             WHERE {_LIVE_PROCESS} AND r.id = ANY(%(ids)s::uuid[])
             ORDER BY r.id, r.since DESC
        """,
        "process_purge": "DELETE FROM {schema}.process WHERE heartbeat_at < now() - %s * interval '1 second'",
    }
)

# -- the charts' samples (charts.py, migration 013) ------------------------------
# One process at a time (a transaction-scoped advisory lock on the table's oid),
# once per minute (the '' row of this minute is the mark): the queues' depth and
# oldest due age, read by the overview statement in the same transaction, then
# the outcome tallies of the minutes that are over and not copied yet.
TEMPLATES.update(
    {
        "sample_claim": """
            SELECT pg_try_advisory_xact_lock(1684107597, '{schema}.queue_minute'::regclass::oid::int)
                   AND NOT EXISTS (SELECT FROM {schema}.queue_minute
                                    WHERE queue_name = '' AND minute = date_trunc('minute', now()))
        """,
        # The depth's budget (samples.SAMPLE_BUDGET_MS), inside a savepoint, and the session's own
        # statement timeout back for the rest of the transaction.
        "sample_budget": "SELECT set_config('statement_timeout', %(ms)s, true)",
        "sample_budget_end": "SET LOCAL statement_timeout TO DEFAULT",
        "sample_depth": """
            INSERT INTO {schema}.queue_minute AS s (queue_name, minute, due, oldest_due_seconds)
            SELECT q, date_trunc('minute', now()), d, o
              FROM unnest(%(queues)s::text[], %(due)s::bigint[], %(oldest)s::float8[]) AS x(q, d, o)
            ON CONFLICT (queue_name, minute) DO UPDATE
               SET due = EXCLUDED.due, oldest_due_seconds = EXCLUDED.oldest_due_seconds
        """,
        "sample_outcomes": """
            INSERT INTO {schema}.queue_minute AS s (queue_name, minute, done, dead, retried)
            SELECT coalesce(queue_name, ''), minute, sum(done), sum(dead), sum(retried)
              FROM {schema}.throughput
             WHERE minute < date_trunc('minute', now())
             GROUP BY GROUPING SETS ((queue_name, minute), (minute))
            ON CONFLICT (queue_name, minute) DO UPDATE
               SET done = EXCLUDED.done, dead = EXCLUDED.dead, retried = EXCLUDED.retried
             WHERE s.done IS NULL
        """,
        "sample_purge": "DELETE FROM {schema}.queue_minute WHERE minute < now() - %s * interval '1 second'",
        # Per minute of the span, oldest first: outcomes from the tallies (two hours, exact, the
        # current minute too), else from the samples; depth and age from the samples.
        "series": """
            WITH m(minute) AS (
                SELECT generate_series(date_trunc('minute', now()) - (%(points)s - 1) * interval '1 minute',
                                       date_trunc('minute', now()), interval '1 minute')
            ),
            t AS (
                SELECT minute, sum(done)::bigint AS done, sum(dead)::bigint AS dead, sum(retried)::bigint AS retried
                  FROM {schema}.throughput
                 WHERE minute > date_trunc('minute', now()) - %(points)s * interval '1 minute'
                   AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
                 GROUP BY minute
            )
            SELECT m.minute, coalesce(t.done, s.done, 0), coalesce(t.dead, s.dead, 0),
                   coalesce(t.retried, s.retried, 0), s.due, s.oldest_due_seconds
              FROM m
              LEFT JOIN t ON t.minute = m.minute
              LEFT JOIN {schema}.queue_minute AS s
                ON s.queue_name = coalesce(%(queue)s, '') AND s.minute = m.minute
             ORDER BY m.minute
        """,
    }
)

#: A listed message's error is at most this many characters: its head and its
#: tail (where a traceback names the exception) around a note of how much was
#: cut (``inspect`` shows it whole).
