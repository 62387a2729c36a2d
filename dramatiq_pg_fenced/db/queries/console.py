"""The operator's console: listings, counts, re-drive, purge, pause (``ops/admin.py``, migration 005)."""

from __future__ import annotations

from .pieces import _BY_IDS, _LIVE_PROCESS, _retake, _still_running, version

# -- the operator's console (migration 005) --------------------------------------
# Every query below reads through an index and stops early: the queue list is
# a loose index scan (one probe per queue), a queue's due and delayed rows are
# counted per priority in use (an index range each: (queue, priority,
# available_at), in index order so the planner never trades it for a
# sequential scan), counts stop at %(cap)s rows per priority (NULL: exact),
# lists are keyset pages (no OFFSET).  Statements that must use a
# partial index name its state as a literal (a parameter would not prove the
# index's predicate in a generic plan), hence one statement per state.
FINISHED_STATES = ("dead", "cancelled")


def _loose_scan(name: str, table: str, where: str) -> str:
    """A recursive CTE *name*(name): the distinct queue names of *table*'s rows matching *where*, one
    index probe per queue (a loose index scan; a trailing NULL row ends it)."""
    return f"""{name}(name) AS (
                (SELECT queue_name FROM {table} WHERE {where} ORDER BY queue_name LIMIT 1)
                UNION ALL
                SELECT (SELECT m.queue_name FROM {table} AS m
                         WHERE {where} AND m.queue_name > {name}.name ORDER BY m.queue_name LIMIT 1)
                  FROM {name} WHERE {name}.name IS NOT NULL
            )"""


def _capped_count(where: str) -> str:
    # ORDER BY the finished index's column: an index scan that stops at the cap,
    # never a sequential scan that hopes to meet matching rows early.
    return (
        "(SELECT count(*) FROM (SELECT FROM {schema}.message AS c"
        f" WHERE c.queue_name = q.name AND {where} ORDER BY c.finished_at LIMIT %(cap)s) AS n)"
    )


def _fair_keys(queues: str) -> str:
    """Per queue of *queues* (a CTE ``fair(name)``), its fairness keys with due messages: the top
    %(top)s by due count (then the longest wait), each with its count, its oldest due time and its
    weight in ``fairness_weight`` (NULL: none set), and on every row the queue's number of such keys
    and their due messages (the window runs before the LIMIT: the figures of every key).

    Served by ``message_fair_key_idx`` (migration 021: queue_name, fairness_key, priority,
    available_at, seq, partial on queued keyed rows) alone: the queue list is a loose scan of its
    first column, a queue's keys a scan of its range (index-only once vacuum has marked the pages
    visible, a bitmap scan of the same range otherwise), ``available_at <= now()`` checked on the
    entries, grouped by key.  Rows without a key are not in the index, so a queue without keys costs
    nothing: the loose scan never meets it, and named (``fair_keys_of``) it is one probe of an empty
    range.  The cost is one index entry per keyed queued row of the queues with keys (measured with
    100,000 rows over 10,000 keys: "Seeing the keys" in docs/fairness.md); the output is bounded by
    the LIMIT per queue.
    Run it after ``fair_keys_plan``, in its transaction (see there)."""
    return f"""
        WITH RECURSIVE {queues}
        SELECT fair.name, top.key, top.due, extract(epoch FROM now() - top.oldest)::float8,
               (SELECT w.weight FROM {{schema}}.fairness_weight AS w
                 WHERE w.queue_name = fair.name AND w.key = top.key),
               top.keys, top.keyed_due
          FROM fair
         CROSS JOIN LATERAL (
               SELECT per.key, per.due, per.oldest,
                      count(*) OVER () AS keys, (sum(per.due) OVER ())::bigint AS keyed_due
                 FROM (SELECT m.fairness_key AS key, count(*) AS due, min(m.available_at) AS oldest
                         FROM {{schema}}.message AS m
                        WHERE m.queue_name = fair.name AND m.state = 'queued' AND m.fairness_key IS NOT NULL
                          AND m.available_at <= now()
                        GROUP BY m.fairness_key) AS per
                ORDER BY per.due DESC, per.oldest, per.key
                LIMIT %(top)s
         ) AS top
         WHERE fair.name IS NOT NULL
         ORDER BY fair.name, top.due DESC, top.oldest, top.key
    """


TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        # Every queue with keyed rows queued (a loose scan of message_fair_key_idx), and one queue.
        "fair_keys": _fair_keys(
            _loose_scan("fair", "{schema}.message", "state = 'queued' AND fairness_key IS NOT NULL")
        ),
        # One queue: its name if it has a keyed row queued (one probe; ORDER BY the index's second
        # column: no other index gives that order), else no row and nothing more is read.
        "fair_keys_of": _fair_keys(
            """fair(name) AS (SELECT m.queue_name FROM {schema}.message AS m
                               WHERE m.queue_name = %(queue)s AND m.state = 'queued' AND m.fairness_key IS NOT NULL
                               ORDER BY m.fairness_key LIMIT 1)"""
        ),
        # For the fair_keys statements' transaction only (SET LOCAL).  When a fair queue's rows were
        # acked and sent again since the last vacuum (a busy queue), its index range holds the dead
        # entries too and the planner prefers a sequential scan of the table, which reads every queue's
        # rows, those without keys included, however many (tests/test_fair_keys.py: 10,000 keyed rows
        # deleted and re-sent beside 10,000 plain ones).  Off, the index's range is read (a bitmap scan
        # while the visibility map lags), whatever the other queues hold.  The estimated cost is high
        # too (the planner cannot know the queues are few): no JIT, as for the overview.
        "fair_keys_plan": "SELECT set_config('jit', 'off', true), set_config('enable_seqscan', 'off', true)",
    }
)
TEMPLATES.update(
    {
        # Per queue: what the stats, the metrics and the dashboard's first page show.
        # busy: actors running now per queue, from the heartbeats of live processes
        # (processes.py): of the claimed rows, that many run, the rest wait in a prefetch.
        # Outcomes of the last minute and hour ("recent"): whole minutes, plus
        # the older minute's share of the window (a sliding-window estimate).
        # Under a pinned horizon the claim index keeps an entry for every row claimed since, at the
        # head of each queue's range, and each scan from a head walks them all (docs/performance.md):
        # the loose scan of queue names brings each queue's first priority along, and the due count
        # reads the oldest due on its way, so they are walked twice, not four times.
        "overview": f"""
            WITH RECURSIVE
            queued(name, first) AS (
                (SELECT queue_name, priority FROM {{schema}}.message WHERE state = 'queued'
                  ORDER BY queue_name, priority LIMIT 1)
                UNION ALL
                SELECT n.queue_name, n.priority
                  FROM queued CROSS JOIN LATERAL (
                       SELECT m.queue_name, m.priority FROM {{schema}}.message AS m
                        WHERE m.state = 'queued' AND m.queue_name > queued.name
                        ORDER BY m.queue_name, m.priority LIMIT 1) AS n
            ),
            finished(name) AS (
                (SELECT queue_name FROM {{schema}}.message WHERE state IN ('dead', 'cancelled')
                  ORDER BY queue_name LIMIT 1)
                UNION ALL
                SELECT (SELECT m.queue_name FROM {{schema}}.message AS m
                         WHERE m.state IN ('dead', 'cancelled') AND m.queue_name > finished.name
                         ORDER BY m.queue_name LIMIT 1)
                  FROM finished WHERE finished.name IS NOT NULL
            ),
            running AS (
                SELECT queue_name, count(*) AS n, count(*) FILTER (WHERE lease_expires_at < now()) AS expired
                  FROM {{schema}}.message WHERE state = 'running' AND lease_expires_at IS NOT NULL
                 GROUP BY queue_name
            ),
            busy AS (
                SELECT b.key AS queue_name, sum((b.value ->> 0)::bigint)::bigint AS n
                  FROM {{schema}}.process AS p CROSS JOIN LATERAL jsonb_each(p.per_queue) AS b
                 WHERE {_LIVE_PROCESS}
                 GROUP BY b.key
            ),
            recent AS (
                SELECT queue_name,
                       sum(CASE WHEN minute = date_trunc('minute', now()) THEN done
                                WHEN minute = date_trunc('minute', now()) - interval '1 minute'
                                THEN done * (1 - extract(epoch FROM now() - date_trunc('minute', now())) / 60)
                                ELSE 0 END)::bigint AS done_1m,
                       sum(CASE WHEN minute > date_trunc('minute', now()) - interval '60 minutes' THEN done
                                WHEN minute = date_trunc('minute', now()) - interval '60 minutes'
                                THEN done * (1 - extract(epoch FROM now() - date_trunc('minute', now())) / 60)
                                ELSE 0 END)::bigint AS done_1h,
                       sum(CASE WHEN minute > date_trunc('minute', now()) - interval '60 minutes' THEN dead
                                ELSE 0 END)::bigint AS dead_1h
                  FROM {{schema}}.throughput
                 WHERE minute >= date_trunc('minute', now()) - interval '60 minutes'
                 GROUP BY queue_name
            ),
            q(name) AS (
                SELECT name FROM queued
                UNION SELECT name FROM finished WHERE name IS NOT NULL
                UNION SELECT queue_name FROM running
                UNION SELECT queue_name FROM recent
                UNION SELECT queue_name FROM {{schema}}.paused_queue
            )
            SELECT q.name,
                   coalesce(depth.due, 0) AS due,
                   coalesce(depth.delayed, 0) AS delayed,
                   least(coalesce(r.n, 0), coalesce(b.n, 0)) AS running,
                   coalesce(r.n, 0) - least(coalesce(r.n, 0), coalesce(b.n, 0)) AS prefetched,
                   coalesce(r.expired, 0) AS expired_leases,
                   {_capped_count("c.state = 'dead'")} AS dead,
                   {_capped_count("c.state = 'cancelled'")} AS cancelled,
                   coalesce(t.done_1m, 0) AS done_last_minute,
                   coalesce(t.done_1h, 0) AS done_last_hour,
                   coalesce(t.dead_1h, 0) AS dead_last_hour,
                   coalesce(sc.value, 0) AS stale_writes,
                   extract(epoch FROM now() - depth.oldest)::float8 AS oldest_due_seconds,
                   p.paused_at
              FROM q
              LEFT JOIN queued AS qd ON qd.name = q.name
              LEFT JOIN running AS r ON r.queue_name = q.name
              LEFT JOIN busy AS b ON b.queue_name = q.name
              LEFT JOIN recent AS t ON t.queue_name = q.name
              LEFT JOIN {{schema}}.paused_queue AS p ON p.queue_name = q.name
              LEFT JOIN {{schema}}.counter AS sc ON sc.name = 'stale_writes:' || q.name
              LEFT JOIN LATERAL (
                  WITH RECURSIVE pr(p) AS (
                      SELECT qd.first
                      UNION ALL
                      SELECT (SELECT m.priority FROM {{schema}}.message AS m
                               WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority > pr.p
                               ORDER BY m.priority LIMIT 1)
                        FROM pr WHERE pr.p IS NOT NULL
                  )
                  SELECT sum(due.n)::bigint AS due, sum(later.n)::bigint AS delayed, min(due.oldest) AS oldest
                    FROM pr
                   CROSS JOIN LATERAL (
                         SELECT count(*) AS n, min(d.at) AS oldest FROM (
                             SELECT m.available_at AS at FROM {{schema}}.message AS m
                              WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority = pr.p
                                AND m.available_at <= now() ORDER BY m.available_at LIMIT %(cap)s) AS d) AS due
                   CROSS JOIN LATERAL (
                         SELECT count(*) AS n FROM (
                             SELECT FROM {{schema}}.message AS m
                              WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority = pr.p
                                AND m.available_at > now() ORDER BY m.available_at LIMIT %(cap)s) AS d) AS later
                   WHERE pr.p IS NOT NULL
              ) AS depth ON true
             ORDER BY q.name
        """,
        # Every queue the database knows of, for refusing an operator's action on
        # a queue nothing names (a typo would otherwise pause a phantom queue):
        # one with messages in any state (loose index scans of the claim, finished
        # and lease indexes), with history (its index), with outcomes in the
        # throughput tallies (two hours), paused, or enqueued into by a schedule.
        "known_queues": f"""
            WITH RECURSIVE
            {_loose_scan("queued", "{schema}.message", "state = 'queued'")},
            {_loose_scan("finished", "{schema}.message", "state IN ('dead', 'cancelled')")},
            {_loose_scan("kept", "{schema}.history", "true")}
            SELECT name FROM queued WHERE name IS NOT NULL
            UNION SELECT name FROM finished WHERE name IS NOT NULL
            UNION SELECT name FROM kept WHERE name IS NOT NULL
            UNION SELECT queue_name FROM {{schema}}.message WHERE lease_expires_at IS NOT NULL AND state = 'running'
            UNION SELECT queue_name FROM {{schema}}.throughput
            UNION SELECT queue_name FROM {{schema}}.paused_queue
            UNION SELECT queue_name FROM {{schema}}.schedule
            ORDER BY 1
        """,
        # The overview's plan looks costly to the planner (it cannot know the
        # counts stop early), which then spends 0.7 s compiling it with JIT for
        # a query that runs in 20 ms: off, for the overview's transaction only.
        "no_jit": "SELECT set_config('jit', 'off', true)",
        "pause": """
            INSERT INTO {schema}.paused_queue (queue_name) VALUES (%s)
            ON CONFLICT (queue_name) DO NOTHING RETURNING queue_name
        """,
        "resume": "DELETE FROM {schema}.paused_queue WHERE queue_name = %s RETURNING queue_name",
        "paused": "SELECT queue_name, paused_at FROM {schema}.paused_queue ORDER BY queue_name",
        "paused_among": "SELECT queue_name FROM {schema}.paused_queue WHERE queue_name = ANY(%s::text[])",
        # Re-drive: the rows as they are (the caller rewrites their payloads),
        # then back to the queue, fenced on the row version it read (see
        # version()), so a message re-driven, claimed, cancelled again or
        # purged meanwhile is left alone, and so is its id sent again since,
        # whatever its state and attempt: its payload never becomes the old one's.  The row loses the
        # token of its last delivery (its next claim draws a new one): a late write of that delivery,
        # cancelled while it ran, is then a stale one, not the end of the cancelled delivery.
        "redrive_read": f"""
            SELECT message_id, {version("m")}, payload FROM {{schema}}.message AS m
             WHERE message_id = ANY(%s::uuid[]) AND state IN ('dead', 'cancelled')
        """,
        "redrive": f"""
            WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::text[], %s::bytea[]) AS o(id, version, payload))
            UPDATE {{schema}}.message AS m
               SET state = 'queued', payload = o.payload, available_at = now(), finished_at = NULL,
                   lease_expires_at = NULL, consumer_id = NULL, delivery = NULL,
                   {_retake("m", finished_too=True)}
              FROM o
             WHERE {_BY_IDS} AND m.message_id = o.id AND {version("m")} = o.version
               AND m.state IN ('dead', 'cancelled') AND NOT coalesce({_still_running("m")}, false)
            RETURNING m.message_id, m.queue_name
        """,
        "inspect_history": """
            SELECT message_id, queue_name, actor_name, priority, 'done' AS state, attempt, enqueued_at,
                   NULL::timestamptz AS available_at, NULL::timestamptz AS lease_expires_at, consumer_id,
                   finished_at, last_error, NULL::int AS lost_deliveries, claimed_at,
                   NULL::text AS unique_key, NULL::text AS unique_until, NULL::text AS version,
                   false AS still_running, payload
              FROM {schema}.history WHERE message_id = %s
             ORDER BY finished_at DESC
        """,
        # A message's story (migration 023): its attempts that ended without an ack, in the order
        # they were written, and the audit rows of the bulk actions that named it by id (a filter's
        # action names no ids: it cannot be told here).
        "inspect_attempts": """
            SELECT attempt, seq, consumer_id, claimed_at, ended_at, outcome, error, queue_name
              FROM {schema}.attempt_log WHERE message_id = %s
             ORDER BY id
        """,
        "inspect_audit": """
            SELECT id, at, who, action, touched, ended_at FROM {schema}.audit
             WHERE selection -> 'ids' ? %s ORDER BY id
        """,
        # Maintenance: bounded deletes of the oldest history, a batch at a time.
        "purge_history": """
            DELETE FROM {schema}.history WHERE ctid = ANY(ARRAY(
                SELECT ctid FROM {schema}.history
                 WHERE finished_at < now() - %s * interval '1 second'
                 ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED))
        """,
        # The attempt log, by the same age and in the same bounded batches.
        "purge_attempts": """
            DELETE FROM {schema}.attempt_log WHERE ctid = ANY(ARRAY(
                SELECT ctid FROM {schema}.attempt_log
                 WHERE ended_at < now() - %s * interval '1 second'
                 ORDER BY ended_at LIMIT %s FOR UPDATE SKIP LOCKED))
        """,
        # Tallies older than two hours go, their counts added to outcome_total in the same
        # statement: the totals (throughput + outcome_total) never go down.  Two purges at once
        # never count a row twice (the second waits for the first's delete, then skips the row).
        "purge_throughput": """
            WITH gone AS (
                DELETE FROM {schema}.throughput WHERE minute < now() - interval '2 hours'
                RETURNING queue_name, done, dead, retried
            )
            INSERT INTO {schema}.outcome_total AS t (queue_name, done, dead, retried)
            SELECT queue_name, sum(done), sum(dead), sum(retried) FROM gone GROUP BY queue_name
            ON CONFLICT (queue_name) DO UPDATE
               SET done = t.done + EXCLUDED.done, dead = t.dead + EXCLUDED.dead, retried = t.retried + EXCLUDED.retried
        """,
        # Per queue, ever: finished (acked), dead-lettered, retried (issue 26's counters).
        "outcome_totals": """
            SELECT queue_name, sum(done)::bigint, sum(dead)::bigint, sum(retried)::bigint FROM (
                SELECT queue_name, done, dead, retried FROM {schema}.outcome_total
                UNION ALL
                SELECT queue_name, done, dead, retried FROM {schema}.throughput
            ) AS t GROUP BY queue_name ORDER BY queue_name
        """,
        "count_queue_done": """
            SELECT count(*) FROM (SELECT FROM {schema}.history
                                   WHERE queue_name = %(queue)s AND (%(actor)s::text IS NULL OR actor_name = %(actor)s)
                                   LIMIT %(cap)s) AS n
        """,
        "purge_queue_done": """
            DELETE FROM {schema}.history WHERE ctid = ANY(ARRAY(
                SELECT ctid FROM {schema}.history
                 WHERE queue_name = %(queue)s AND (%(actor)s::text IS NULL OR actor_name = %(actor)s)
                 LIMIT %(limit)s FOR UPDATE SKIP LOCKED))
            RETURNING message_id
        """,
    }
)
