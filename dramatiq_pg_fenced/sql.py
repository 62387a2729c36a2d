"""Every SQL statement the broker runs, in one place.

Statements are templates over ``{schema}``; :func:`statements` binds them to
a quoted schema identifier once per broker.  Values always travel as
parameters.  Fenced statements carry ``attempt = %s AND state = 'running'``:
zero rows back means the caller's attempt is stale.
"""

from __future__ import annotations

import re
from functools import cache
from types import SimpleNamespace

from psycopg import sql

#: Schema, channel and queue names we accept: plain identifiers (queue names
#: may also hold Dramatiq's ``.`` and ``-``).
SCHEMA_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
QUEUE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,199}")


def check_schema(name: str) -> str:
    if not isinstance(name, str) or not SCHEMA_RE.fullmatch(name):
        raise ValueError(
            f"invalid schema name {name!r}: use letters, digits and _ (at most 48), not starting with a digit"
        )
    return name


def check_queue(name: str) -> str:
    if not isinstance(name, str) or not QUEUE_RE.fullmatch(name):
        raise ValueError(f"invalid queue name {name!r}: use letters, digits, '.', '-' and '_' (at most 200)")
    return name


_TEMPLATES = {
    # -- enqueue ---------------------------------------------------------
    # One statement (one round trip, atomic even in autocommit): the rows and
    # one NOTIFY per queue that got a message due now; the last parameter
    # says whether to ring at all.
    "enqueue": """
        WITH ins AS (
            INSERT INTO {schema}.message
                (message_id, queue_name, actor_name, priority, available_at, payload)
            SELECT m.id, m.queue, m.actor, m.priority,
                   now() + m.delay_ms * interval '1 millisecond', m.payload
              FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::int[], %s::bigint[], %s::bytea[])
                   AS m(id, queue, actor, priority, delay_ms, payload)
            ON CONFLICT (message_id) DO NOTHING
            RETURNING queue_name, available_at
        )
        SELECT pg_notify(%s, q.queue_name)
          FROM (SELECT DISTINCT queue_name FROM ins WHERE %s AND available_at <= now()) AS q
    """,
    "notify": "SELECT pg_notify(%s, q) FROM unnest(%s::text[]) AS q",
    # -- claim -------------------------------------------------------------
    "claim": """
        WITH due AS (
            SELECT message_id FROM {schema}.message
             WHERE queue_name = %(queue)s AND state = 'queued' AND available_at <= now()
             ORDER BY priority, available_at, seq
             LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED
        )
        UPDATE {schema}.message AS m
           SET state = 'running', attempt = m.attempt + 1,
               lease_expires_at = now() + %(lease)s * interval '1 second',
               consumer_id = %(consumer)s
          FROM due
         WHERE m.message_id = due.message_id
        RETURNING m.message_id, m.attempt, m.payload, m.priority, m.available_at, m.seq
    """,
    # -- fenced outcomes (batched: unnest of ids and attempts) ------------
    "ack": """
        DELETE FROM {schema}.message AS m
         USING unnest(%s::uuid[], %s::int[]) AS o(id, attempt)
         WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
        RETURNING m.message_id
    """,
    "nack": """
        UPDATE {schema}.message AS m
           SET state = 'dead', finished_at = now(), last_error = o.error,
               lease_expires_at = NULL
          FROM unnest(%s::uuid[], %s::int[], %s::text[]) AS o(id, attempt, error)
         WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
        RETURNING m.message_id
    """,
    "retry": """
        UPDATE {schema}.message AS m
           SET state = 'queued', payload = o.payload, last_error = o.error,
               available_at = now() + o.delay_ms * interval '1 millisecond',
               lease_expires_at = NULL, consumer_id = NULL
          FROM unnest(%s::uuid[], %s::int[], %s::bytea[], %s::bigint[], %s::text[])
               AS o(id, attempt, payload, delay_ms, error)
         WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
        RETURNING m.message_id
    """,
    "requeue": """
        UPDATE {schema}.message AS m
           SET state = 'queued', available_at = now(), lease_expires_at = NULL, consumer_id = NULL
          FROM unnest(%s::uuid[], %s::int[]) AS o(id, attempt)
         WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
        RETURNING m.message_id
    """,
    "extend": """
        UPDATE {schema}.message AS m
           SET lease_expires_at = now() + %s * interval '1 second'
          FROM unnest(%s::uuid[], %s::int[]) AS o(id, attempt)
         WHERE m.message_id = o.id AND m.attempt = o.attempt AND m.state = 'running'
        RETURNING m.message_id
    """,
    # What a stale writer is told: the row as it is now.
    "current": """
        SELECT message_id, state, attempt FROM {schema}.message WHERE message_id = ANY(%s::uuid[])
    """,
    "count_stale": """
        INSERT INTO {schema}.counter (name, value) VALUES ('stale_writes', %s)
        ON CONFLICT (name) DO UPDATE SET value = counter.value + EXCLUDED.value
    """,
    "counters": "SELECT name, value FROM {schema}.counter",
    # -- maintenance -------------------------------------------------------
    # Expired leases go back to the queue; the next claim bumps the attempt.
    "rescue": """
        UPDATE {schema}.message
           SET state = 'queued', available_at = now(), lease_expires_at = NULL, consumer_id = NULL
         WHERE state = 'running' AND lease_expires_at < now()
        RETURNING message_id, queue_name, attempt
    """,
    "purge_finished": """
        DELETE FROM {schema}.message
         WHERE state IN ('dead', 'cancelled') AND finished_at < now() - %s * interval '1 second'
    """,
    # -- administration ----------------------------------------------------
    "cancel": """
        WITH old AS (
            SELECT message_id, state, attempt FROM {schema}.message
             WHERE message_id = %s FOR UPDATE
        )
        UPDATE {schema}.message AS m
           SET state = 'cancelled', finished_at = now(), lease_expires_at = NULL,
               last_error = 'cancelled'
          FROM old
         WHERE m.message_id = old.message_id AND old.state IN ('queued', 'running')
        RETURNING old.state, old.attempt
    """,
    "state_of": "SELECT state, attempt FROM {schema}.message WHERE message_id = %s",
    "inspect": """
        SELECT message_id, queue_name, actor_name, priority, state, attempt,
               enqueued_at, available_at, lease_expires_at, consumer_id,
               finished_at, last_error, payload
          FROM {schema}.message WHERE message_id = %s
    """,
    "flush": "DELETE FROM {schema}.message WHERE queue_name = ANY(%s::text[])",
    "pending": """
        SELECT count(*) FROM {schema}.message
         WHERE queue_name = %s AND state IN ('queued', 'running')
    """,
    "dead_letters": """
        SELECT message_id, last_error FROM {schema}.message
         WHERE queue_name = %s AND state = 'dead'
         ORDER BY finished_at LIMIT 1
    """,
    "queue_stats": """
        SELECT queue_name, state, count(*) FROM {schema}.message GROUP BY queue_name, state
    """,
}


#: ``enqueue`` for ``synchronous_commit=False``: set_config(..., true) is SET
#: LOCAL, and lasts until the commit of the statement's own implicit
#: transaction, so relaxed enqueues need no extra round trip either.
_TEMPLATES["enqueue_relaxed"] = _TEMPLATES["enqueue"].replace(
    "AS m(id, queue, actor, priority, delay_ms, payload)",
    "AS m(id, queue, actor, priority, delay_ms, payload),\n"
    "                   (SELECT set_config('synchronous_commit', 'off', true)) AS relaxed",
)


@cache
def statements(schema: str) -> SimpleNamespace:
    """The statements bound to *schema*, as bytes ready to execute."""
    ident = sql.Identifier(check_schema(schema))
    return SimpleNamespace(**{name: bind(text, ident) for name, text in _TEMPLATES.items()})


def bind(text: str, schema: sql.Identifier) -> bytes:
    """Put the quoted *schema* into a template; whitespace folded for the logs."""
    return sql.SQL(" ".join(text.split())).format(schema=schema).as_string(None).encode()
