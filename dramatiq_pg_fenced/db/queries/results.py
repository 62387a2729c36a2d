"""Results and rate limits (``features/results.py``, ``features/rate_limits.py``, migration 002)."""

from __future__ import annotations

# -- results and rate limits (migration 002) ----------------------------------
# Used by results.py, rate_limits.py and the outcome writer.  A result write
# NOTIFYs "{schema}_results" with its key, a rate-limiter event
# "{schema}_rate_limits" with its key; a key too long for a NOTIFY payload
# (8000 bytes) sends "*" and wakes every waiter, who then re-read.
# A stored result is replaced by a later attempt's, never by an earlier one's; and always by a write
# that names its delivery token, since every such write was checked against the message row in its
# statement (or rides its ack or nack, applied in the same transaction): it is the newest outcome,
# even of an id sent again after its ack, whose attempts start at 1 again.
_RESULT_UPSERT = """
        ON CONFLICT (key) DO UPDATE
           SET message_id = EXCLUDED.message_id, attempt = EXCLUDED.attempt, delivery = EXCLUDED.delivery,
               data = EXCLUDED.data,
               stored_at = now(), expires_at = EXCLUDED.expires_at
         WHERE r.attempt IS NULL OR EXCLUDED.attempt IS NULL OR r.attempt <= EXCLUDED.attempt
            OR EXCLUDED.delivery IS NOT NULL OR r.expires_at <= now()
        RETURNING key
"""
# The rows a result write inserts (both result_store statements).
_RESULT_ROWS = """
        INSERT INTO {schema}.result AS r (key, message_id, attempt, delivery, data, expires_at)
        SELECT w.key, w.message_id, w.attempt, w.delivery, w.data,
               now() + w.ttl_ms * interval '1 millisecond'
          FROM unnest(%(keys)s::text[], %(ids)s::text[], %(attempts)s::int[], %(deliveries)s::uuid[],
                      %(data)s::bytea[], %(ttls)s::bigint[])
               AS w(key, message_id, attempt, delivery, data, ttl_ms)
"""
_WAKE = "pg_notify(%(channel)s, CASE WHEN octet_length(key) < 8000 THEN key ELSE '*' END)"
TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        # A result, or when there is none, why none will come: the message was dead-lettered or
        # cancelled with nothing stored (the rescuer's dead letter at max_deliveries, an actor
        # without store_results).  The message row is read only on a miss.
        "result_get": """
            SELECT r.data, r.expires_at > now(), m.state, m.last_error
              FROM (SELECT) AS one
              LEFT JOIN {schema}.result AS r ON r.key = %(key)s
              LEFT JOIN {schema}.message AS m
                     ON r.key IS NULL AND m.message_id = %(id)s::uuid AND m.state IN ('dead', 'cancelled')
        """,
        "result_drop_expired": "DELETE FROM {schema}.result WHERE key = %s AND expires_at <= now()",
        # Results whose delivery was already checked (their ack applied in this
        # transaction) or that belong to no delivery (attempt NULL).
        "result_store": f"""
            WITH written AS (
                {_RESULT_ROWS}
                {_RESULT_UPSERT}
            )
            SELECT key, {_WAKE} FROM written
        """,
        # Fenced: written only while the message row is at that attempt (and
        # delivery token, when the writer knows it: a copy of a message knows
        # only its attempt) in one of
        # %(states)s; FOR SHARE makes a concurrent claim or rescue wait for us.
        "result_store_fenced": f"""
            WITH written AS (
                {_RESULT_ROWS}
                 WHERE EXISTS (
                       SELECT 1 FROM {{schema}}.message AS m
                        WHERE m.message_id = w.message_id::uuid AND m.attempt = w.attempt
                          AND (m.delivery = w.delivery OR (w.delivery IS NULL AND m.state = 'running'))
                          AND m.state = ANY(%(states)s::text[])
                          FOR SHARE)
                {_RESULT_UPSERT}
            )
            SELECT key, {_WAKE} FROM written
        """,
        "result_purge": """
            DELETE FROM {schema}.result
             WHERE key IN (SELECT key FROM {schema}.result WHERE expires_at <= now()
                            ORDER BY expires_at LIMIT %s FOR UPDATE SKIP LOCKED)
               AND expires_at <= now()
        """,
        # Rate limits: an expired row counts as absent (value 0).
        "rate_limit_add": """
            INSERT INTO {schema}.rate_limit AS r (key, value, expires_at)
            VALUES (%(key)s, %(value)s, now() + %(ttl)s * interval '1 millisecond')
            ON CONFLICT (key) DO UPDATE SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at
             WHERE r.expires_at <= now()
            RETURNING value
        """,
        # incr/decr when delta alone is within [low, high] (so inserting it is right).
        "rate_limit_upsert": """
            INSERT INTO {schema}.rate_limit AS r (key, value, expires_at)
            VALUES (%(key)s, %(delta)s, now() + %(ttl)s * interval '1 millisecond')
            ON CONFLICT (key) DO UPDATE
               SET value = (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + EXCLUDED.value,
                   expires_at = EXCLUDED.expires_at
             WHERE (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + EXCLUDED.value
                   BETWEEN %(low)s AND %(high)s
            RETURNING value
        """,
        # incr/decr when delta alone is out of bounds: only a live row can take it.
        "rate_limit_update": """
            UPDATE {schema}.rate_limit AS r
               SET value = r.value + %(delta)s, expires_at = now() + %(ttl)s * interval '1 millisecond'
             WHERE r.key = %(key)s AND r.expires_at > now() AND r.value + %(delta)s BETWEEN %(low)s AND %(high)s
            RETURNING value
        """,
        # incr_and_sum: make every key a row (an expired placeholder if new),
        # then lock them all in one order ("C" collation, as Python sorts str).
        "rate_limit_placeholders": """
            INSERT INTO {schema}.rate_limit (key, value, expires_at)
            SELECT k, 0, '-infinity' FROM unnest(%s::text[]) AS k ORDER BY k COLLATE "C"
            ON CONFLICT (key) DO NOTHING
        """,
        "rate_limit_lock": """
            SELECT key, CASE WHEN expires_at > now() THEN value ELSE 0 END
              FROM {schema}.rate_limit WHERE key = ANY(%s::text[])
             ORDER BY key COLLATE "C" FOR UPDATE
        """,
        "rate_limit_set": """
            UPDATE {schema}.rate_limit SET value = %s, expires_at = now() + %s * interval '1 millisecond'
             WHERE key = %s
        """,
        "rate_limit_notify": f"""
            WITH event AS (
                INSERT INTO {{schema}}.rate_limit AS r (key, value, expires_at)
                VALUES (%(key)s, 1, now() + %(ttl)s * interval '1 millisecond')
                ON CONFLICT (key) DO UPDATE
                   SET value = (CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END) + 1,
                       expires_at = EXCLUDED.expires_at
                RETURNING key
            )
            SELECT {_WAKE} FROM event
        """,
        "rate_limit_event": """
            SELECT 1 FROM {schema}.rate_limit WHERE key = %s AND value > 0 AND expires_at > now()
        """,
        "rate_limit_purge": """
            DELETE FROM {schema}.rate_limit
             WHERE key IN (SELECT key FROM {schema}.rate_limit WHERE expires_at <= now()
                            LIMIT %s FOR UPDATE SKIP LOCKED)
               AND expires_at <= now()
        """,
    }
)
