"""The charts' wait and run times (``ops/timings.py``): percentiles per minute from the history (migration 005).

A finished message's row in ``history`` has its send (``enqueued_at``), its last claim
(``claimed_at``) and its ack (``finished_at``): wait = claim - send, run = finish - claim.
Read over a bounded window (the chart's span) by ``finished_at``, through
``history_queue_idx`` (one queue) or ``history_finished_idx`` (all queues); the
percentiles are computed in the database (``percentile_cont``) per minute and over the
whole span (``GROUPING SETS``): one statement, one row per minute with a finished
message, plus the span's row (``minute`` NULL).
"""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    "timings": """
        WITH h AS (
            SELECT date_trunc('minute', finished_at) AS minute,
                   extract(epoch FROM claimed_at - enqueued_at)::float8 AS wait,
                   extract(epoch FROM finished_at - claimed_at)::float8 AS run
              FROM {schema}.history
             WHERE finished_at >= date_trunc('minute', now()) - (%(points)s - 1) * interval '1 minute'
               AND (%(queue)s::text IS NULL OR queue_name = %(queue)s)
               AND claimed_at IS NOT NULL
        )
        SELECT minute, count(*),
               percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY wait),
               percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY run)
          FROM h
         GROUP BY GROUPING SETS ((minute), ())
    """,
    # The queues page's sparklines: messages finished per queue and minute over the last hour,
    # from the tallies (two hours, a row per queue, minute and writing process).
    "sparklines": """
        SELECT queue_name, minute, sum(done)::bigint
          FROM {schema}.throughput
         WHERE minute > date_trunc('minute', now()) - 60 * interval '1 minute'
         GROUP BY queue_name, minute
    """,
}
