"""The pieces several statements share: name checks, the unique-key predicate, the lost-delivery update, row versions, relaxed and durable commits."""

from __future__ import annotations

import re
import uuid
from typing import Any

SCHEMA_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,47}")
QUEUE_RE = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,199}")


#: PostgreSQL's bigint range (rate-limit values).
BIGINT_MIN, BIGINT_MAX = -(2**63), 2**63 - 1


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


def check_message_id(message_id: Any) -> str:
    """*message_id* as a canonical UUID string; ``ValueError`` in one line otherwise."""
    try:
        return str(uuid.UUID(str(message_id)))
    except ValueError:
        raise ValueError(f"not a message id: {message_id!r} (a UUID, as Dramatiq makes them)") from None


#: The columns of the ``overview`` statement, in order.
OVERVIEW_COLUMNS = (
    "queue", "due", "delayed", "running", "prefetched", "expired_leases", "dead", "cancelled", "done_last_minute",
    "done_last_hour", "dead_last_hour", "stale_writes", "oldest_due_seconds", "paused_since",
)  # fmt: skip


# Does a row hold its unique key (migration 006)?  The predicate of
# message_unique_idx, spelled the same so the planner proves the index usable.
def _held(alias: str) -> str:
    return (
        f"{alias}.unique_key IS NOT NULL AND ({alias}.state = 'queued'"
        f" OR ({alias}.state = 'running' AND {alias}.unique_until = 'finished'))"
    )


_HELD = _held("u")


def _retake(alias: str, *, finished_too: bool) -> str:
    """SET clause: a row going back to the queue keeps its key only if no other row carries it.

    For rows that did not hold their key: a 'started' row leaving running
    (retry, requeue, release_unseen, rescue), or, with *finished_too* (redrive),
    any dead or cancelled row.  The key is kept only if no other row with it
    is queued or running (redrive: exists at all); else it is set to NULL and
    the row goes back without it, so the move never violates the index.
    Asking about every other row, not only holders, keeps two rows that one
    statement moves from taking one key: each sees the other, and neither
    takes it.  Rows without a key skip the probe (CASE evaluates lazily; the
    probe reads message_key_idx).  A send holding the key that commits while
    this statement runs can still make it fail with a unique violation on
    message_unique_idx: callers write again, and the next snapshot sees the
    holder (:func:`.errors.worth_retrying`).
    """
    keep = f"{alias}.unique_key IS NULL" + ("" if finished_too else f" OR {alias}.unique_until = 'finished'")
    live = "" if finished_too else "AND u.state IN ('queued', 'running')"
    return f"""unique_key = CASE WHEN {keep} THEN {alias}.unique_key
                     WHEN EXISTS (SELECT FROM {{schema}}.message AS u
                                   WHERE u.actor_name = {alias}.actor_name AND u.unique_key = {alias}.unique_key
                                     AND u.unique_key IS NOT NULL AND u.message_id <> {alias}.message_id {live})
                     THEN NULL ELSE {alias}.unique_key END"""


# A delivery ended without an outcome (rescue, release_unseen): count it, and
# at %(max)s such deliveries (NULL: no limit) dead-letter the message with the
# reason, keeping the error of its last retry, instead of queueing it again.
_LOST_DEAD = "lost_deliveries + 1 >= %(max)s::int"
_LOST = f"""
    lost_deliveries = lost_deliveries + 1,
    state = CASE WHEN {_LOST_DEAD} THEN 'dead' ELSE 'queued' END,
    finished_at = CASE WHEN {_LOST_DEAD} THEN now() END,
    last_error = CASE WHEN {_LOST_DEAD}
        THEN 'dead-lettered after ' || (lost_deliveries + 1)
             || CASE WHEN lost_deliveries = 0 THEN ' delivery' ELSE ' deliveries' END
             || ' without an outcome (the worker crashed or lost its lease each time; max_deliveries='
             || %(max)s::int || ')' || coalesce(E'\\nthe error before that: ' || last_error, '')
        ELSE last_error END,
    lease_expires_at = NULL, consumer_id = NULL,
    delivery = NULL,
    {_retake("m", finished_too=False)}
"""


def version(alias: str) -> str:
    """The row version an operator saw, as text: ``"<seq>.<xmin>"``.

    ``seq`` names the incarnation (an identity column: a message id inserted
    again after its row was acked or purged gets a new one, though its state
    and attempt may come to match the old one's); ``xmin``, the transaction
    that wrote this version of the row (every change of a row writes a new
    version; locking it does not).  Together they tell the row read from any
    later one, which the state and attempt alone do not: a message cancelled,
    re-driven and cancelled again at one attempt reads the same.
    """
    return f"({alias}.seq::text || '.' || {alias}.xmin::text)"


#: Every statement that joins message rows to a list of ids (an unnest, or the
#: rows of a CTE: the rescue's expired, the cancel watch's mine, the relay's
#: taken) also says ``message_id = ANY(those ids)``: an index condition on the primary key
#: whatever the join order.  A hot queue's table is near empty whenever
#: (auto)analyze looks, and with such statistics the planner otherwise
#: liked a full scan of an index as the outer side of the join (all of the
#: primary key, or of the lease index), which is cheap until another
#: session's old snapshot keeps every dead entry in it (50-85 ms per ack
#: and per claim after two minutes at 300 messages/s; the rescue's periodic
#: pass 716 ms after eleven minutes at 200/s).  _BY_IDS: for a CTE o.
_BY_IDS = "m.message_id = ANY(ARRAY(SELECT o.id FROM o))"

#: The logged variants' pre-image (attempt log, migration 023): the consumer of each row of ``o`` still
#: running under its token, read before the statement's update clears it.
_HOLDER_BEFORE = f"""
        was AS MATERIALIZED (
            SELECT m.message_id, m.delivery, m.consumer_id FROM {{schema}}.message AS m
              JOIN o ON m.message_id = o.id AND m.delivery = o.delivery
             WHERE {_BY_IDS} AND m.state = 'running'
        ),"""


def _still_running(alias: str = "") -> str:
    """A cancelled row whose actor still runs (its delivery's lease is kept while it runs, cleared when
    it ends); NULL for a row without a lease."""
    a = f"{alias}." if alias else ""
    return f"{a}state = 'cancelled' AND {a}lease_expires_at > now()"


STILL_RUNNING = _still_running()

#: A worker process (alias ``p``) whose counts are believed: its last heartbeat is less than
#: %(beats)s of its own intervals old (processes.py).
_LIVE_PROCESS = "p.heartbeat_at > now() - %(beats)s * p.beat_seconds * interval '1 second'"

#: A commit that does not wait for the WAL flush, for one autocommit
#: statement: set_config(..., true) is SET LOCAL and lasts until the commit of
#: the statement's own implicit transaction, so it costs no extra round trip
#: and leaves nothing on the connection (PgBouncer).  Joined to a FROM list;
#: evaluated whenever the statement writes a row (with no row written there
#: is no commit record to wait for).  Used by relaxed enqueues
#: (``synchronous_commit=False``) and, unless ``durable_outcomes=True``, by
#: claims and lease extensions.
_RELAXED = ", (SELECT set_config('synchronous_commit', 'off', true)) AS relaxed"
#: A durable send's commit waits for the WAL flush even where a default says
#: ``synchronous_commit = off`` (the role's, the database's, the server's or the connection's: a
#: common tuning): ``send()`` returning means the row is on disk.  A caller's own ``SET`` or ``SET
#: LOCAL`` (source ``session``) is kept, as is any setting that flushes locally (``local``, ``on``,
#: ``remote_apply``...).  Set for the statement's own transaction, or the caller's for a send
#: inside one.  ``pg_settings`` is read only when the setting is ``off`` (a lazy InitPlan).
_DURABLE = (
    ", (SELECT CASE WHEN current_setting('synchronous_commit') <> 'off' THEN NULL"
    " WHEN (SELECT source FROM pg_settings WHERE name = 'synchronous_commit') = 'session' THEN NULL"
    " ELSE set_config('synchronous_commit', 'on', true) END) AS durable"
)
#: The attempt log (migration 023): a row per delivery that ended without an ack, inserted by a CTE of
#: the statement that ends it (the ``_logged`` variants, run while ``keep_finished`` > 0), so that it
#: commits with that outcome and is fenced as it is.  Followed by a SELECT of these columns.
_ATTEMPT_LOG = """
    INSERT INTO {schema}.attempt_log
        (message_id, seq, attempt, delivery, queue_name, consumer_id, claimed_at, ended_at, outcome, error)"""
#: A row's state as operators say it: one its fenced transaction committed is done (its outcome
#: writer finishes it within milliseconds; see exactly_once.py).
_STATE = "CASE state WHEN 'committed' THEN 'done' ELSE state END"
