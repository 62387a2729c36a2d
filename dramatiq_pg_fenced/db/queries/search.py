"""Search (``ops/search.py``, migration 014), the listed pages, and bulk actions (``ops/bulk.py``, migration 015)."""

from __future__ import annotations

from .console import FINISHED_STATES
from .pieces import STILL_RUNNING

LISTED_ERROR_CHARS = 2000


def _listed_error() -> str:
    head, tail = LISTED_ERROR_CHARS // 4, LISTED_ERROR_CHARS - LISTED_ERROR_CHARS // 4
    return (
        f"CASE WHEN char_length(last_error) <= {LISTED_ERROR_CHARS} THEN last_error"
        f" ELSE left(last_error, {head}) || chr(10) || '[... ' || (char_length(last_error) - {LISTED_ERROR_CHARS})"
        f" || ' characters cut; inspect shows all ...]' || chr(10) || right(last_error, {tail}) END"
    )


# A plain value (search.py's value_vars: {"s": the text, "v": the text as a JSON scalar, else the text}):
# some scalar of the args or of the kwargs' values, at any depth, equals it (jsonpath ==: 42 matches 42.0).
# %(needles)s (NULL: none): byte strings one of which the payload holds if it holds the value as
# Dramatiq's JSON encoder writes it; tested first (CASE: in that order), a cheap read of the bytes
# that spares most rows the parse.
_HOLDS_VALUE = (
    "(%(value)s::jsonb IS NULL OR CASE"
    " WHEN %(needles)s::bytea[] IS NOT NULL"
    "  AND NOT EXISTS (SELECT FROM unnest(%(needles)s::bytea[]) AS n WHERE position(n IN payload) > 0) THEN false"
    " ELSE jsonb_path_exists({schema}.message_arguments(payload),"
    " 'strict $.** ? (@ == $s || @ == $v)', %(value)s::jsonb) END)"
)

# -- search (search.py, migration 014) ------------------------------------------
# Keyset pages in (message_id, table, seq) order: the message table's primary key
# and history's message_id index, so a search adds no index to the hot table.  Each
# table's next %(scan)s rows after the cursor are read in key order and filtered;
# the last row read (edge) says how far that table was searched.
_SEARCH_FILTER = f"""
    (%(queue)s::text IS NULL OR queue_name = %(queue)s)
    AND (%(actor)s::text IS NULL OR actor_name = %(actor)s)
    AND (%(state)s::text IS NULL OR state = %(state)s)
    AND (%(arguments)s::jsonb IS NULL OR {{schema}}.message_arguments(payload) @> %(arguments)s::jsonb)
    AND {_HOLDS_VALUE}
"""
_SEARCH_COLUMNS = """message_id, {src} AS src, seq, queue_name, actor_name, {state} AS state, attempt, enqueued_at,
    {available_at} AS available_at, finished_at, {listed_error}, payload"""


def _search(table: str) -> str:
    src, state, available_at = (
        ("0", "state", "available_at") if table == "message" else ("1", "'done'::text", "NULL::timestamptz")
    )
    columns = _SEARCH_COLUMNS.format(
        src=src, state=state, available_at=available_at, listed_error=_listed_error() + " AS last_error"
    )
    return f"""
        WITH w AS (
            SELECT {columns} FROM {{schema}}.{table}
             WHERE message_id >= %(id)s::uuid AND (message_id, {src}, seq) > (%(id)s::uuid, %(src)s, %(seq)s)
             ORDER BY message_id, seq LIMIT %(scan)s
        )
        (SELECT *, false AS edge, 0::bigint AS scanned FROM w
          WHERE {_SEARCH_FILTER} ORDER BY message_id, seq LIMIT %(limit)s)
        UNION ALL
        (SELECT *, true, (SELECT count(*) FROM w) FROM w ORDER BY message_id DESC, seq DESC LIMIT 1)
    """


def _search_id(table: str) -> str:
    src, state, available_at = (
        ("0", "state", "available_at") if table == "message" else ("1", "'done'::text", "NULL::timestamptz")
    )
    columns = _SEARCH_COLUMNS.format(
        src=src, state=state, available_at=available_at, listed_error=_listed_error() + " AS last_error"
    )
    return (
        f"SELECT * FROM (SELECT {columns} FROM {{schema}}.{table} WHERE message_id = %(message_id)s::uuid) AS r"
        f" WHERE {_SEARCH_FILTER}"
    )


TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "search_live": _search("message"),
        "search_kept": _search("history"),
        "search_id": f"({_search_id('message')}) UNION ALL ({_search_id('history')}) ORDER BY src, seq",
    }
)

# Pages of a queue's messages (no payload).  A page reads a window of at most
# %(scan)s rows in index order from the cursor (the sort key of the last row
# shown or searched), keeps those of %(actor)s (NULL: all) up to %(limit)s,
# and returns the window's last row as its edge (edge = true, with how many
# rows the window held): a filter that matches little never scans the queue
# to its end, and the next page goes on from the edge.
_LIST_COLUMNS = f"""message_id, actor_name, {{state}} AS state, attempt, priority, enqueued_at, {{at}} AS at,
                   finished_at AS fin, consumer_id, {_listed_error()} AS last_error,
                   {{still_running}} AS running_since, seq"""


def _page(table: str, at: str, where: str, order: str, reverse: str) -> str:
    state = "'done'::text" if table == "history" else "state"
    # A cancelled row whose actor still runs: since when (its claim); NULL otherwise.
    still_running = (
        "NULL::timestamptz"
        if table == "history"
        else f"CASE WHEN {STILL_RUNNING} THEN coalesce(claimed_at, finished_at) END"
    )
    return f"""
        WITH w AS (
            SELECT {_LIST_COLUMNS.format(at=at, state=state, still_running=still_running)} FROM {{schema}}.{table}
             WHERE queue_name = %(queue)s AND {where}
             ORDER BY {order} LIMIT %(scan)s
        )
        (SELECT *, false AS edge, 0::bigint AS scanned FROM w
          WHERE %(actor)s::text IS NULL OR actor_name = %(actor)s ORDER BY {order} LIMIT %(limit)s)
        UNION ALL
        (SELECT *, true, (SELECT count(*) FROM w) FROM w ORDER BY {reverse} LIMIT 1)
    """


TEMPLATES.update(
    {
        # Queued: claim order, next to run first (the claim index).
        "list_queued": _page(
            "message",
            "available_at",
            "state = 'queued' AND (priority, available_at, seq) > (%(priority)s, %(at)s::timestamptz, %(seq)s)",
            "priority, at, seq",
            "priority DESC, at DESC, seq DESC",
        ),
        # Running: newest first (few rows: the lease index).
        "list_running": _page(
            "message",
            "lease_expires_at",
            "state = 'running' AND lease_expires_at IS NOT NULL AND seq < %(seq)s",
            "seq DESC",
            "seq",
        ),
        # Finished: most recently finished first.
        "list_done": _page(
            "history",
            "claimed_at",
            "(finished_at, seq) < (%(at)s::timestamptz, %(seq)s)",
            "fin DESC, seq DESC",
            "fin, seq",
        ),
        **{
            f"list_{state}": _page(
                "message",
                "available_at",
                f"state = '{state}' AND (finished_at, seq) < (%(at)s::timestamptz, %(seq)s)",
                "fin DESC, seq DESC",
                "fin, seq",
            )
            for state in FINISHED_STATES
        },
    }
)

# An operator's bulk action may name one actor (%(actor)s; NULL: every actor).
_OF_ACTOR = "(%(actor)s::text IS NULL OR actor_name = %(actor)s)"

for _state in FINISHED_STATES:
    # Ids to re-drive, oldest dead first, skipping those that could not be.
    TEMPLATES[f"redrive_ids_{_state}"] = f"""
        SELECT message_id FROM {{schema}}.message
         WHERE queue_name = %(queue)s AND state = '{_state}' AND message_id <> ALL(%(skip)s::uuid[])
           AND {_OF_ACTOR}
         ORDER BY finished_at LIMIT %(limit)s
    """

for _state in ("queued", *FINISHED_STATES):
    # Never a running row, nor a cancelled one whose actor still runs.
    _purgeable = f"state = '{_state}' AND {_OF_ACTOR}" + (
        f" AND NOT coalesce({STILL_RUNNING}, false)" if _state == "cancelled" else ""
    )
    # What a purge would delete now (the dashboard asks with it), counting stops at %(cap)s.
    TEMPLATES[f"count_queue_{_state}"] = f"""
        SELECT count(*) FROM (SELECT FROM {{schema}}.message
                               WHERE queue_name = %(queue)s AND {_purgeable} LIMIT %(cap)s) AS n
    """
    # Bounded: a batch at a time, skipping rows someone holds.
    TEMPLATES[f"purge_queue_{_state}"] = f"""
        DELETE FROM {{schema}}.message WHERE message_id IN (
            SELECT message_id FROM {{schema}}.message
             WHERE queue_name = %(queue)s AND {_purgeable}
             LIMIT %(limit)s FOR UPDATE SKIP LOCKED)
        RETURNING message_id
    """


# -- bulk actions (bulk.py, migration 015) ----------------------------------------
# The rows a bulk action touches: those of %(states)s that match the selection
# (ids and/or the search's filters), in key order, %(cap)s at most.  The action
# itself then goes through the operators' own statements (cancel, redrive) or
# these, each re-checking the state it acts on.
_BULK_SELECTION = f"""
    (%(ids)s::uuid[] IS NULL OR message_id = ANY(%(ids)s::uuid[]))
    AND (%(queue)s::text IS NULL OR queue_name = %(queue)s) AND {_OF_ACTOR}
    AND (%(arguments)s::jsonb IS NULL OR {{schema}}.message_arguments(payload) @> %(arguments)s::jsonb)
    AND {_HOLDS_VALUE}
"""
TEMPLATES.update(
    {
        "bulk_live": f"""
            SELECT message_id FROM {{schema}}.message
             WHERE state = ANY(%(states)s::text[]) AND {_BULK_SELECTION}
               AND (NOT %(delayed)s OR available_at > now())
               AND NOT (state = 'cancelled' AND coalesce({STILL_RUNNING}, false))
             ORDER BY message_id LIMIT %(cap)s
        """,
        "bulk_kept": f"""
            SELECT DISTINCT message_id FROM {{schema}}.history WHERE {_BULK_SELECTION}
             ORDER BY message_id LIMIT %(cap)s
        """,
        # Purge: never a running row, nor a cancelled one whose actor still runs.
        "bulk_purge_live": f"""
            DELETE FROM {{schema}}.message
             WHERE message_id = ANY(%s::uuid[]) AND state IN ('queued', 'dead', 'cancelled')
               AND NOT (state = 'cancelled' AND coalesce({STILL_RUNNING}, false))
            RETURNING message_id
        """,
        "bulk_purge_kept": "DELETE FROM {schema}.history WHERE message_id = ANY(%s::uuid[]) RETURNING message_id",
        # Run now: a delayed message (a retry's backoff included) becomes due now.
        "bulk_run_now": """
            UPDATE {schema}.message SET available_at = now()
             WHERE message_id = ANY(%s::uuid[]) AND state = 'queued' AND available_at > now()
            RETURNING message_id, queue_name
        """,
        "audit_begin": """
            INSERT INTO {schema}.audit (who, action, selection, previewed) VALUES (%s, %s, %s::jsonb, %s)
            RETURNING id
        """,
        "audit_end": "UPDATE {schema}.audit SET touched = %s, skipped = %s, ended_at = now() WHERE id = %s",
        "audit_page": """
            SELECT id, at, who, action, selection, previewed, touched, skipped, ended_at FROM {schema}.audit
             WHERE id < %s ORDER BY id DESC LIMIT %s
        """,
    }
)
