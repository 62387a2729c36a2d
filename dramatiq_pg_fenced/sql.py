"""Every SQL statement the broker runs, in one place.

Statements are templates over ``{schema}``; :func:`statements` binds them to
a quoted schema identifier once per schema, into a typed :class:`Statements`.
Values always travel as parameters.  Fenced statements carry
``delivery = %s AND state = 'running'``: ``delivery`` is a random token each
claim draws (migration 003), so no two deliveries ever share one, even when a
message id is inserted again or a claim is lost in a crash and its attempt
number handed out twice.  Zero rows back means the caller's delivery is stale.

A message row moves between four states (:class:`~.fencing.State`).  Every
legal transition, and the one statement that makes it:

=========  =========  ===============  ==============================================
from       to         statement        who, and the fence
=========  =========  ===============  ==============================================
(none)     queued     enqueue(_one)    a producer; ``ON CONFLICT DO NOTHING`` by id
(none)     queued     enqueue_unique   the same, with a key; nothing while the key is held
(none)     queued     schedule_tick    a scheduler; once per (schedule, tick), by the
                                       database clock (see schedules.py)
queued     running    claim            a consumer; attempt + 1, a new token, a lease; not if paused
running    (deleted)  ack              the outcome writer; fenced on the token
running    history    ack_keep         the same, and the row moves to ``history``
running    committed  fence_begin      the actor's fenced transaction, as it begins; fenced
                                       on the token; the row stays locked, and the state
                                       commits with the actor's writes or not at all
committed  (deleted)  committed_done   the outcome writer; fenced on the token; as ack
committed  history    committed_done_keep  the same, and the row moves to ``history``
committed  history    finish_committed maintenance; a worker died before its writer did
                                       (``COMMITTED_GRACE_LEASES`` leases after)
running    dead       nack             the outcome writer; fenced on the token
running    queued     retry            the outcome writer; fenced; new payload, due time
running    queued     requeue          shutdown release; fenced; attempt and place kept
running    queued     release_unseen   a consumer after a lost claim response; its rows
                                       only; lost_deliveries + 1
running    dead       release_unseen   the same, at ``max_deliveries`` lost deliveries
running    queued     rescue           maintenance; lease expired (any process);
                                       lost_deliveries + 1
running    dead       rescue           the same, at ``max_deliveries`` lost deliveries
running    running    extend           the lease keeper; fenced; lease pushed out
queued     cancelled  cancel           an operator; any attempt (administrative), of the
                                       version seen if one is given (its seq)
running    cancelled  cancel           the same; fences out that attempt's outcome; the
                                       lease stays while the actor runs (see below)
cancelled  cancelled  extend_cancelled the lease keeper; fenced; while its actor runs
cancelled  cancelled  cancel_ended     the outcome writer, start gate or keeper; fenced;
                                       the cancelled delivery ended (lease cleared)
dead       queued     redrive          an operator; fenced on the row version read
                                       (:func:`version`: seq and xmin)
cancelled  queued     redrive          the same; not while its actor still runs
dead       (deleted)  purge_finished   maintenance, after ``dead_message_ttl``
cancelled  (deleted)  purge_finished   maintenance, after ``dead_message_ttl``
queued     (deleted)  purge_queue_*    an operator; never a running row
dead       (deleted)  purge_queue_*    an operator
cancelled  (deleted)  purge_queue_*    an operator
history    (deleted)  purge_history    maintenance, after ``keep_finished``
=========  =========  ===============  ==============================================

Unique keys (migration 006): a row with ``unique_key`` *holds* it while
queued, and while running if ``unique_until = 'finished'`` (the predicate of
``message_unique_idx``, :data:`_HELD`).  Every transition above keeps the
index's meaning: inserts do nothing on a held key; claim, ack, nack, cancel
and the purges only take rows out of the held set (or keep a 'finished' row
in it); the transitions *into* it from a row that did not hold its key
(``retry``, ``requeue``, ``release_unseen`` and ``rescue`` of a 'started'
row, ``redrive`` of any) take the key back only if no other row with the
key is queued or running (redrive: exists at all), else the row goes back
to the queue without its key (:func:`_retake`): the newer message keeps the
key, and both run.

``lost_deliveries`` counts the deliveries that ended without any outcome
(migration 004): only ``rescue`` and ``release_unseen`` raise it; a retry or
a release at shutdown is an outcome.

A cancelled row whose actor still runs keeps its token, its holder and a
lease in the future (``lease_expires_at``): the cancel leaves the lease,
the keeper extends it while the actor runs (``extend_cancelled``), and the
end of that delivery clears it (``cancel_ended``: its fenced-out outcome,
the start gate's refusal, or the keeper for one that never started).  A
crashed worker's lease lapses.  Operators see "cancel requested, still
running" while it is in the future (:data:`STILL_RUNNING`); a re-drive or a
purge leaves such a row alone.

``history`` is a table of its own (acked messages, state ``done`` for
readers); ``paused_queue`` and ``throughput`` (outcomes per minute) serve the
operator's console.

Only the enqueue waits for the WAL flush.  Unless ``durable_outcomes=True``,
``claim`` and ``extend`` run as their ``_relaxed`` variants, and the outcome
writer's and shutdown release's transactions (``ack``, ``nack``, ``retry``,
``requeue`` and what rides with them) begin with ``begin_relaxed``, and a
batch of acks alone runs as ``ack_relaxed`` (one statement, one round trip): a
crash may lose the last of them, and their messages run again (see _claim).
``rescue``, ``release_unseen``, ``cancel`` and the purges stay durable (rare,
off the hot path).
"""

from __future__ import annotations

import re
from functools import cache

from psycopg import sql

#: Schema, channel and queue names we accept: plain identifiers (queue names
#: may also hold Dramatiq's ``.`` and ``-``).
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


#: Every statement that joins message rows to a list of ids also says
#: ``message_id = ANY(those ids)``: an index condition on the primary key
#: whatever the join order.  A hot queue's table is near empty whenever
#: (auto)analyze looks, and with such statistics the planner otherwise
#: liked a full scan of an index as the outer side of the join (all of the
#: primary key, or of the lease index), which is cheap until another
#: session's old snapshot keeps every dead entry in it (50-85 ms per ack
#: and per claim after two minutes at 300 messages/s).  _BY_IDS: for a CTE o.
_BY_IDS = "m.message_id = ANY(ARRAY(SELECT o.id FROM o))"


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
#: A row's state as operators say it: one its fenced transaction committed is done (its outcome
#: writer finishes it within milliseconds; see exactly_once.py).
_STATE = "CASE state WHEN 'committed' THEN 'done' ELSE state END"

_TEMPLATES = {
    # Payloads are queue names, or "queue<TAB>ms" for "due in ms" (see retry_wakes).
    "notify": "SELECT pg_notify(%s, q) FROM unnest(%s::text[]) AS q",
    # -- turns: one listening process per database does the idle chores at a time (turns.py) --
    # The lowest free seat of each group's advisory lock (first key), for the LISTEN connection's
    # session (it holds them while it lives).  LIMIT 1 ends each scan at the first lock taken.
    "turn_take": """
        SELECT k, (SELECT s FROM generate_series(0, 65535) AS s WHERE pg_try_advisory_lock(k, s) LIMIT 1)
          FROM unnest(%(keys)s::int[]) AS k
    """,
    # Who holds a seat of each group: one row per group and session (its lowest seat), in seat order;
    # the sessions waiting for the door %(door)s (seat -1; see turn_door), whose turn it is next; and
    # its holder (seat 0) with the seconds since its session last ran a statement, if idle (it reads
    # the seats every few seconds: long idle, its process is stopped or starved).
    "turn_seats": """
        SELECT l.classid::bigint::int, l.pid, min(CASE WHEN l.granted THEN l.objid::bigint ELSE -1 END) AS seat,
               max(CASE WHEN l.granted AND l.classid = %(door)s::int::oid AND a.state = 'idle'
                        THEN extract(epoch FROM now() - a.state_change) END)::float8 AS idle
          FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
         WHERE l.locktype = 'advisory' AND l.objsubid = 2
           AND (l.granted AND l.classid = ANY(%(keys)s::int[]::oid[] || %(door)s::int::oid)
                OR NOT l.granted AND l.classid = %(door)s::int::oid AND l.objid = 0)
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
         GROUP BY 1, 2 ORDER BY 1, 3
    """,
    # The door of a set of queues: the one lock whose holder LISTENs for them (turns.py, "wake one").
    # Waits at most the session's lock_timeout (turn_door_patience), in the queue of sessions waiting
    # for it: the server hands it to the one that waited longest.
    "turn_door": "SELECT pg_advisory_lock(%(key)s::int, 0)",
    "turn_door_leave": "SELECT pg_advisory_unlock(%(key)s::int, 0)",
    "turn_door_patience": "SELECT set_config('lock_timeout', %(ms)s, false)",
    # -- claim: see _claim below ----------------------------------------------
    # Seconds until the queue's next delayed row is due (NULL: none), read
    # after a claim comes back short.  One probe of the claim index per
    # priority in use (a loose index scan), not a scan of the delayed rows.
    "next_due": """
        WITH RECURSIVE pr(priority) AS (
            (SELECT priority FROM {schema}.message
              WHERE queue_name = %(queue)s AND state = 'queued' ORDER BY priority LIMIT 1)
            UNION ALL
            SELECT (SELECT m.priority FROM {schema}.message AS m
                     WHERE m.queue_name = %(queue)s AND m.state = 'queued' AND m.priority > pr.priority
                     ORDER BY m.priority LIMIT 1)
              FROM pr WHERE pr.priority IS NOT NULL
        )
        SELECT extract(epoch FROM min(nd.at) - clock_timestamp())::float8
          FROM pr CROSS JOIN LATERAL (
                SELECT m.available_at AS at FROM {schema}.message AS m
                 WHERE m.queue_name = %(queue)s AND m.state = 'queued' AND m.priority = pr.priority
                   AND m.available_at > now()
                 ORDER BY m.available_at LIMIT 1
               ) AS nd
         WHERE pr.priority IS NOT NULL
    """,
    # Rows a claim of ours leased but whose response never arrived: leased to
    # the consumers whose claim failed in flight (each consumer has an id of
    # its own, so a sibling's fresh claim is never touched), running, yet not
    # held.  They go back now, not when their lease runs out; the next claim
    # bumps the attempt.
    "release_unseen": f"""
        UPDATE {{schema}}.message AS m
           SET {_LOST}
         WHERE state = 'running' AND lease_expires_at IS NOT NULL
           AND consumer_id = ANY(%(consumers)s::text[]) AND queue_name = %(queue)s
           AND message_id <> ALL(%(held)s::uuid[])
        RETURNING message_id, state
    """,
    # -- fenced outcomes (batched: unnest of ids and delivery tokens) ------
    "requeue": f"""
        WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS o(id, delivery))
        UPDATE {{schema}}.message AS m
           SET state = 'queued', lease_expires_at = NULL, consumer_id = NULL,
               {_retake("m", finished_too=False)}
          FROM o
         WHERE {_BY_IDS} AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
        RETURNING m.message_id, m.delivery
    """,
    # extend: see _extend below.  The rows still under these deliveries' tokens, running or
    # cancelled, read without locking.  Of the deliveries an extension did not come back with:
    # those running are locked by another session (not lost); those cancelled get their actor
    # interrupted (interrupt_on_cancel).  The cancel watch reads the running interruptible ones.
    "delivery_states": f"""
        WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS o(id, delivery))
        SELECT m.message_id, m.delivery, m.state FROM {{schema}}.message AS m
          JOIN o ON m.message_id = o.id AND m.delivery = o.delivery
         WHERE {_BY_IDS} AND m.state IN ('running', 'committed', 'cancelled')
    """,
    # What a stale writer is told: the row as it is now.
    "current": """
        SELECT message_id, state, attempt, delivery FROM {schema}.message WHERE message_id = ANY(%s::uuid[])
    """,
    # Counter names: "stale_writes" (all), "stale_writes:<queue>" (per queue, when known).
    "count_stale": """
        INSERT INTO {schema}.counter (name, value)
        SELECT name, sum(n) FROM unnest(%s::text[], %s::bigint[]) AS c(name, n) GROUP BY name ORDER BY name
        ON CONFLICT (name) DO UPDATE SET value = counter.value + EXCLUDED.value
    """,
    "counters": "SELECT name, value FROM {schema}.counter",
    # -- maintenance -------------------------------------------------------
    # Expired leases go back to the queue; the next claim bumps the attempt.
    # Like requeue and release_unseen, this keeps available_at: the message
    # takes its old place in the queue, not a place behind the backlog.
    # Each rescued lease is a redelivery to come: counted for operators.
    # SKIP LOCKED: a row locked by an open fenced transaction (exactly_once.py) is being finished
    # by its delivery, whose lease the keeper cannot extend meanwhile: it is left alone, and is
    # gone if the block commits, rescued at a later pass if it rolls back.
    "rescue": f"""
        WITH expired AS (
            SELECT message_id FROM {{schema}}.message
             WHERE state = 'running' AND lease_expires_at < now()
               FOR UPDATE SKIP LOCKED
        ), back AS (
            UPDATE {{schema}}.message AS m
               SET {_LOST}
              FROM expired
             WHERE m.message_id = expired.message_id
            RETURNING m.message_id, m.queue_name, m.attempt, m.state
        ), counted AS (
            INSERT INTO {{schema}}.counter AS c (name, value)
            SELECT 'redeliveries', count(*) FROM back WHERE state = 'queued' HAVING count(*) > 0
            ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
        )
        SELECT message_id, queue_name, attempt, state FROM back
    """,
    "purge_finished": """
        DELETE FROM {schema}.message
         WHERE state IN ('dead', 'cancelled') AND finished_at < now() - %s * interval '1 second'
    """,
    # -- administration ----------------------------------------------------
    # Cancelling a running (maybe prefetched) message also announces it on
    # the wake channel: "!cancel <id>", so a worker holding it unstarted
    # hears of it at once and never starts it, and "!interrupt <id>
    # <delivery>", so a worker running it with interrupt_on_cancel stops that
    # delivery, and no later one of the same id (interrupt.py).  Sent whatever
    # the canceller's own ``listen`` (the CLI and a dashboard behind PgBouncer
    # have none; the workers may listen): nobody listening, it costs nothing.
    # The row keeps its token, its holder and its lease: the lease keeper and
    # the cancel watch find it cancelled under it, and the lease says its actor
    # may still run (see extend_cancelled).  %(seq)s (NULL: any): only the
    # incarnation an operator saw (its id inserted again is another message).
    "cancel": """
        WITH old AS (
            SELECT message_id, state, attempt FROM {schema}.message
             WHERE message_id = %(id)s AND (%(seq)s::bigint IS NULL OR seq = %(seq)s::bigint) FOR UPDATE
        )
        UPDATE {schema}.message AS m
           SET state = 'cancelled', finished_at = now(),
               lease_expires_at = CASE WHEN old.state = 'running' THEN m.lease_expires_at END
          FROM old
         WHERE m.message_id = old.message_id AND old.state IN ('queued', 'running')
        RETURNING old.state, old.attempt,
                  CASE WHEN old.state = 'running'
                       THEN pg_notify(%(channel)s, '!cancel ' || m.message_id::text) END,
                  CASE WHEN old.state = 'running'
                       THEN pg_notify(%(channel)s, '!interrupt ' || m.message_id::text || ' ' || m.delivery::text) END
    """,
    # A cancelled delivery's actor still runs in this process: its lease goes on
    # (see the docstring), fenced on its token.  Never brings back a lease the
    # end of the delivery cleared (IS NOT NULL); SKIP LOCKED: the keeper never
    # waits for an operator's lock (a re-drive then clears it anyway).
    "extend_cancelled": f"""
        WITH o AS (SELECT * FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[]) AS o(id, delivery)),
        mine AS (
            SELECT m.message_id FROM {{schema}}.message AS m JOIN o ON m.message_id = o.id AND m.delivery = o.delivery
             WHERE {_BY_IDS} AND m.state = 'cancelled' AND m.lease_expires_at IS NOT NULL
               FOR UPDATE OF m SKIP LOCKED
        )
        UPDATE {{schema}}.message AS m SET lease_expires_at = now() + %(lease)s * interval '1 second'
          FROM mine WHERE m.message_id = mine.message_id
        RETURNING m.message_id
    """,
    # A cancelled delivery ended (its outcome fenced out, refused at the start
    # gate, or never started): the row stops saying its actor runs.
    "cancel_ended": f"""
        WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS o(id, delivery)),
        mine AS (
            SELECT m.message_id FROM {{schema}}.message AS m JOIN o ON m.message_id = o.id AND m.delivery = o.delivery
             WHERE {_BY_IDS} AND m.state = 'cancelled' AND m.lease_expires_at IS NOT NULL
               FOR UPDATE OF m SKIP LOCKED
        )
        UPDATE {{schema}}.message AS m SET lease_expires_at = NULL
          FROM mine WHERE m.message_id = mine.message_id
    """,
    # Of these messages, the cancelled ones whose actor still runs, where and since when.
    "still_running": f"""
        SELECT message_id, consumer_id, claimed_at FROM {{schema}}.message
         WHERE message_id = ANY(%s::uuid[]) AND {STILL_RUNNING}
    """,
    # Claimed rows leave dead entries at the head of the claim index that every
    # claim steps over until a vacuum; SKIP_LOCKED: one at a time is enough.
    "vacuum": "VACUUM (SKIP_LOCKED) {schema}.message",
    # compact(): give back what a drained backlog left allocated.  Plain
    # VACUUM can neither shrink index files nor move the few live rows off
    # the end of the heap; VACUUM FULL rewrites both, under an exclusive lock
    # held as long as copying the live rows takes (short when near empty).
    # SKIP_LOCKED: a table in use is skipped at once (with a WARNING), rather
    # than waited for at the head of the lock queue, where every enqueue and
    # claim would wait behind it.  No lock_timeout, so no session setting that
    # could outlive the statement (PgBouncer).  Whether the table was
    # rewritten shows in its file node.
    "message_size": "SELECT pg_total_relation_size(to_regclass(%s))",
    "compact": "VACUUM (FULL, SKIP_LOCKED) {schema}.message",
    "file_node": "SELECT pg_relation_filenode(to_regclass(%s))",
    # Whether this role may vacuum the table (else VACUUM only warns): its
    # owner's privileges, a superuser, or (PostgreSQL 17+) MAINTAIN.
    "may_vacuum": """
        SELECT pg_has_role(c.relowner, 'USAGE')
            OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
            OR CASE WHEN current_setting('server_version_num')::int >= 170000
                    THEN has_table_privilege(c.oid, 'MAINTAIN') ELSE false END
          FROM pg_class c
         WHERE c.oid = to_regclass(%s)
    """,
    # Before the cancel, in its transaction: how long it may wait for the row's lock.  Outcomes,
    # claims and extensions hold it for a statement; a fenced transaction for its whole block
    # (a stopped process: indefinitely), and the cancel answers that rather than wait.
    "cancel_lock_timeout": "SELECT set_config('lock_timeout', %s, true)",
    "state_of": "SELECT state, attempt, seq FROM {schema}.message WHERE message_id = %s",
    # Which of these ids this database holds (operators over several databases: where an action goes).
    "held_among": "SELECT message_id FROM {schema}.message WHERE message_id = ANY(%s::uuid[])",
    # May a delivery that waited in the prefetch still start?
    # Of the deliveries waiting in a worker's prefetch (leases.StartGate), those whose row still runs
    # under their token: one primary-key probe each.
    "still_held_many": """
        SELECT m.message_id::text, m.delivery::text
          FROM {schema}.message AS m
          JOIN unnest(%s::uuid[], %s::uuid[]) AS w(id, delivery) ON m.message_id = w.id
         WHERE m.delivery = w.delivery AND m.state = 'running'
    """,
    "inspect": f"""
        SELECT message_id, queue_name, actor_name, priority, {_STATE} AS state, attempt,
               enqueued_at, available_at, lease_expires_at, consumer_id,
               finished_at, last_error, lost_deliveries, claimed_at, unique_key, unique_until,
               {version("m")} AS version, coalesce({_still_running("m")}, false) AS still_running, payload
          FROM {{schema}}.message AS m WHERE message_id = %s
    """,
    "flush": "DELETE FROM {schema}.message WHERE queue_name = ANY(%s::text[])",
    # 'committed': a fenced transaction's row, whose actor may still be running after its block.
    "pending": """
        SELECT count(*) FROM {schema}.message
         WHERE queue_name = %s AND state IN ('queued', 'running', 'committed')
    """,
    "dead_letters": """
        SELECT message_id, last_error FROM {schema}.message
         WHERE queue_name = %s AND state = 'dead'
         ORDER BY finished_at LIMIT 1
    """,
    "queue_stats": f"""
        SELECT queue_name, {_STATE}, count(*) FROM {{schema}}.message GROUP BY 1, 2
    """,
}


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
def _enqueue_unique(*, relaxed: bool) -> str:
    return f"""
        WITH m AS MATERIALIZED (
            SELECT * FROM unnest(%b::uuid[], %b::text[], %b::text[], %b::int[], %b::bigint[], %b::bytea[],
                                 %b::text[], %b::text[])
                   WITH ORDINALITY AS m(id, queue, actor, priority, delay_ms, payload, key, until, n)
        ), ins AS (
            INSERT INTO {{schema}}.message
                (message_id, queue_name, actor_name, priority, available_at, payload, unique_key, unique_until)
            SELECT m.id, m.queue, m.actor, m.priority,
                   now() + m.delay_ms * interval '1 millisecond', m.payload, m.key, m.until
              FROM m{_RELAXED if relaxed else _DURABLE}
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


# -- claim and lease extension, durable or relaxed -------------------------------
# Both variants are the same statement; the relaxed one only adds _RELAXED to
# its FROM list (a claim's FROM list is that alone).  A claim lost in a crash leaves the row queued at its old
# attempt; its next claim draws a new delivery token, so the token stays
# unique per delivery even though the attempt number repeats.
def _claim(*, relaxed: bool, telling: bool = False) -> str:
    # A paused queue (a row in paused_queue) is skipped: the NOT EXISTS does
    # not depend on the row, so it runs once per claim (one primary-key probe).
    # (priority, available_at, seq) >= (%(from_priority)s, %(from_at)s, %(from_seq)s) is where the
    # index scan starts: a consumer that knows nothing is claimable before that
    # point skips the entries its earlier claims left dead at the head of the
    # index, which no vacuum may remove while another session's snapshot is
    # older (see consumer.Floor).  consumer.HEAD starts at the head.  now() comes back with the rows: the database's clock sets the floor.
    # One UPDATE of the rows its subquery locked: no CTE to fill and join back (the simpler statement;
    # paced claims with the consumer's own parameters were no slower, at best ~50 µs faster:
    # docs/performance.md).
    update = f"""
        UPDATE {{schema}}.message AS m
           SET state = 'running', attempt = m.attempt + 1, delivery = gen_random_uuid(),
               lease_expires_at = now() + %(lease)s * interval '1 second',
               consumer_id = %(consumer)s, claimed_at = now(){(" FROM " + _RELAXED[2:]) if relaxed else ""}
         WHERE m.message_id = ANY(ARRAY(
            SELECT message_id FROM {{schema}}.message
             WHERE queue_name = %(queue)s AND state = 'queued' AND available_at <= now()
               AND (priority, available_at, seq)
                   >= (%(from_priority)s::int, %(from_at)s::timestamptz, %(from_seq)s::bigint)
               AND NOT EXISTS (SELECT FROM {{schema}}.paused_queue AS p WHERE p.queue_name = %(queue)s)
             ORDER BY priority, available_at, seq
             LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED))
        RETURNING m.message_id::text, m.attempt, m.delivery::text, m.payload, m.priority, m.available_at, m.seq, now()
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


def _extend(*, relaxed: bool) -> str:
    # SKIP LOCKED: a row some other session has locked (an operator's
    # SELECT ... FOR UPDATE, a cancel in progress) never holds up the others;
    # delivery_states tells it apart from a lost row without locking.
    return f"""
        WITH mine AS (
            SELECT m.message_id FROM {{schema}}.message AS m
              JOIN unnest(%(ids)s::uuid[], %(deliveries)s::uuid[]) AS o(id, delivery)
                ON m.message_id = o.id AND m.delivery = o.delivery
             WHERE m.message_id = ANY(%(ids)s::uuid[]) AND m.state = 'running'
               FOR UPDATE OF m SKIP LOCKED
        )
        UPDATE {{schema}}.message AS m
           SET lease_expires_at = now() + %(lease)s * interval '1 second'
          FROM mine{_RELAXED if relaxed else ""}
         WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM mine)) AND m.message_id = mine.message_id
        RETURNING m.message_id
    """


_TEMPLATES.update(
    {
        "claim": _claim(relaxed=False),
        "claim_relaxed": _claim(relaxed=True),
        "claim_telling": _claim(relaxed=False, telling=True),
        "claim_telling_relaxed": _claim(relaxed=True, telling=True),
        "extend": _extend(relaxed=False),
        "extend_relaxed": _extend(relaxed=True),
        # How the outcome writer's and the shutdown release's transactions
        # begin unless durable_outcomes=True: one simple query (no
        # parameters), so one round trip, as a plain BEGIN; SET LOCAL ends
        # with the transaction (nothing left on a pooled connection).
        "begin_relaxed": "BEGIN; SET LOCAL synchronous_commit = off",
    }
)


# -- the relay of a routed broker (routing.py, migration 017) ----------------------
# A database's outbox is its message table: queued rows of queues routed to
# another database (a delivery's follow-ups, written with its outcome).  The
# relay takes a batch (SKIP LOCKED: relays of several processes share the
# work) and deletes it in a transaction it commits only after relay_put
# committed there; relay_put inserts a message only with its relayed row
# (message id, source database, its seq there), so moving the same row again
# inserts nothing.  The delay left goes with it (each server
# counts it by its own clock).  A move whose message the target refuses (its
# id is there already, or another message holds its unique key) inserts its
# relayed row only: it is counted ("relay_conflicts") and returned, for the
# relay to log; a hot counter row is touched only then.
_TEMPLATES.update(
    {
        "relay_take": """
            WITH taken AS (
                SELECT message_id FROM {schema}.message
                 WHERE state = 'queued' AND queue_name = ANY(%(queues)s::text[])
                 ORDER BY seq LIMIT %(limit)s FOR UPDATE SKIP LOCKED
            )
            DELETE FROM {schema}.message AS m USING taken WHERE m.message_id = taken.message_id
            RETURNING m.message_id, m.queue_name, m.actor_name, m.priority,
                      greatest(0, ceil(extract(epoch FROM m.available_at - now()) * 1000))::bigint,
                      m.payload, m.unique_key, m.unique_until, m.seq
        """,
        "relay_put": f"""
            WITH m AS MATERIALIZED (
                SELECT * FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::int[], %s::bigint[], %s::bytea[],
                                     %s::text[], %s::text[], %s::bigint[])
                       AS m(id, queue, actor, priority, delay_ms, payload, key, until, seq)
            ), fresh AS (
                INSERT INTO {{schema}}.relayed (message_id, source, source_seq)
                SELECT id, %s, seq FROM m ON CONFLICT DO NOTHING
                RETURNING message_id
            ), ins AS (
                INSERT INTO {{schema}}.message
                    (message_id, queue_name, actor_name, priority, available_at, payload, unique_key, unique_until)
                SELECT m.id, m.queue, m.actor, m.priority, now() + m.delay_ms * interval '1 millisecond', m.payload,
                       m.key, m.until
                  FROM m JOIN fresh ON fresh.message_id = m.id
                ON CONFLICT DO NOTHING
                RETURNING message_id, queue_name, available_at
            ), conflicts AS (
                SELECT f.message_id FROM fresh AS f
                 WHERE NOT EXISTS (SELECT FROM ins WHERE ins.message_id = f.message_id)
            ), counted AS (
                INSERT INTO {{schema}}.counter AS c (name, value)
                SELECT 'relay_conflicts', count(*) FROM conflicts HAVING count(*) > 0
                ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
            ), {_RING}
            SELECT (SELECT count(*) FROM ins) AS inserted, (SELECT count(*) FROM rung) AS rung,
                   ARRAY(SELECT message_id::text FROM conflicts ORDER BY 1) AS conflicts
        """,
        # The countdowns of group members in other databases (groups.py), moved to the group's home:
        # each is applied only with its relayed row, as relay_put inserts a message.
        "relay_mark": """
            INSERT INTO {schema}.relayed (message_id, source, source_seq)
            SELECT id, %(source)s, seq FROM unnest(%(ids)s::uuid[], %(seqs)s::bigint[]) AS m(id, seq)
            ON CONFLICT DO NOTHING
            RETURNING message_id::text
        """,
        # An outbox row its target cannot take (a countdown row that is none) goes back where it was,
        # dead, and is counted with the conflicts, in the relay's transaction that deleted it.
        "relay_dead": """
            WITH dead AS (
                INSERT INTO {schema}.message
                    (message_id, queue_name, actor_name, priority, state, finished_at, last_error, payload)
                VALUES (%(id)s, %(queue)s, %(actor)s, %(priority)s, 'dead', now(), %(error)s, %(payload)s)
                RETURNING message_id
            )
            INSERT INTO {schema}.counter AS c (name, value)
            SELECT 'relay_conflicts', count(*) FROM dead
            ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
        """,
        "relay_waiting": """
            SELECT count(*) FROM {schema}.message WHERE state = 'queued' AND queue_name = ANY(%s::text[])
        """,
        # ... or still running there (a queue being moved: routing.RoutedBroker.move_queue).
        "relay_left": """
            SELECT count(*) FROM {schema}.message
             WHERE state IN ('queued', 'running', 'committed') AND queue_name = ANY(%s::text[])
        """,
        "relay_purge": "DELETE FROM {schema}.relayed WHERE relayed_at < now() - %s * interval '1 second'",
    }
)


_TEMPLATES.update(
    {
        "enqueue": _enqueue("many", relaxed=False),
        "enqueue_relaxed": _enqueue("many", relaxed=True),
        "enqueue_one": _enqueue("one", relaxed=False),
        "enqueue_one_relaxed": _enqueue("one", relaxed=True),
        "enqueue_unique": _enqueue_unique(relaxed=False),
        "enqueue_unique_relaxed": _enqueue_unique(relaxed=True),
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
# countdown) is written only if it takes the row, so at most once.  No lease
# keeps a committed row (the keeper extends running rows), and the rescue
# takes running rows only: a committed row is never delivered again.  One left
# by a worker that died before its writer wrote it is finished by maintenance
# (finish_committed), without those effects.
_FENCE = """
    UPDATE {schema}.message SET state = 'committed'
     WHERE message_id = %s AND delivery = %s AND state = 'running'
    RETURNING attempt
"""


def _finish_committed(*, keep: bool) -> str:
    return f"""
        WITH finished AS (
            DELETE FROM {{schema}}.message AS m
             WHERE m.state = 'committed' AND m.lease_expires_at < now() - %(grace)s * interval '1 second'
            {_finished(keep)}
        ),
        {_KEEP if keep else ""}
        {_tally("done")}
        SELECT count(*) FROM finished
    """


_TEMPLATES.update(
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

_TEMPLATES.update(
    {
        # Counted in the writer's throughput row (retried), as ack and nack count theirs.
        "retry": f"""
            WITH o AS (SELECT * FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(payloads)s::bytea[],
                                            %(delays)s::bigint[], %(errors)s::text[])
                                     AS o(id, delivery, payload, delay_ms, error)),
            finished AS (
                UPDATE {{schema}}.message AS m
                   SET state = 'queued', payload = o.payload, last_error = o.error,
                       available_at = now() + o.delay_ms * interval '1 millisecond',
                       lease_expires_at = NULL, consumer_id = NULL,
                       {_retake("m", finished_too=False)}
                  FROM o
                 WHERE {_BY_IDS} AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
                RETURNING m.message_id, m.delivery, m.queue_name
            ),
            {_tally("retried")}
            SELECT message_id::text, delivery::text FROM finished
        """,
        "ack": _ack(keep=False),
        "ack_keep": _ack(keep=True),
        "ack_relaxed": _ack(keep=False, relaxed=True),
        "ack_keep_relaxed": _ack(keep=True, relaxed=True),
        "nack": f"""
            WITH finished AS (
                UPDATE {{schema}}.message AS m
                   SET state = 'dead', finished_at = now(), last_error = o.error, lease_expires_at = NULL
                  FROM unnest(%(ids)s::uuid[], %(deliveries)s::uuid[], %(errors)s::text[])
                       AS o(id, delivery, error)
                 WHERE m.message_id = ANY(%(ids)s::uuid[])
                   AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
                RETURNING m.message_id, m.delivery, m.queue_name
            ),
            {_tally("dead")}
            SELECT message_id::text, delivery::text FROM finished
        """,
    }
)

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


_TEMPLATES.update(
    {
        # Per queue: what the stats, the metrics and the dashboard's first page show.
        # busy: actors running now per queue, from the heartbeats of live processes
        # (processes.py): of the claimed rows, that many run, the rest wait in a prefetch.
        # Outcomes of the last minute and hour ("recent"): whole minutes, plus
        # the older minute's share of the window (a sliding-window estimate).
        "overview": f"""
            WITH RECURSIVE
            queued(name) AS (
                (SELECT queue_name FROM {{schema}}.message WHERE state = 'queued' ORDER BY queue_name LIMIT 1)
                UNION ALL
                SELECT (SELECT m.queue_name FROM {{schema}}.message AS m
                         WHERE m.state = 'queued' AND m.queue_name > queued.name ORDER BY m.queue_name LIMIT 1)
                  FROM queued WHERE queued.name IS NOT NULL
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
                SELECT name FROM queued WHERE name IS NOT NULL
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
              LEFT JOIN running AS r ON r.queue_name = q.name
              LEFT JOIN busy AS b ON b.queue_name = q.name
              LEFT JOIN recent AS t ON t.queue_name = q.name
              LEFT JOIN {{schema}}.paused_queue AS p ON p.queue_name = q.name
              LEFT JOIN {{schema}}.counter AS sc ON sc.name = 'stale_writes:' || q.name
              LEFT JOIN LATERAL (
                  WITH RECURSIVE pr(p) AS (
                      (SELECT priority FROM {{schema}}.message
                        WHERE queue_name = q.name AND state = 'queued' ORDER BY priority LIMIT 1)
                      UNION ALL
                      SELECT (SELECT m.priority FROM {{schema}}.message AS m
                               WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority > pr.p
                               ORDER BY m.priority LIMIT 1)
                        FROM pr WHERE pr.p IS NOT NULL
                  )
                  SELECT sum(due.n)::bigint AS due, sum(later.n)::bigint AS delayed,
                         min(head.at) FILTER (WHERE head.at <= now()) AS oldest
                    FROM pr
                   CROSS JOIN LATERAL (
                         SELECT count(*) AS n FROM (
                             SELECT FROM {{schema}}.message AS m
                              WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority = pr.p
                                AND m.available_at <= now() ORDER BY m.available_at LIMIT %(cap)s) AS d) AS due
                   CROSS JOIN LATERAL (
                         SELECT count(*) AS n FROM (
                             SELECT FROM {{schema}}.message AS m
                              WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority = pr.p
                                AND m.available_at > now() ORDER BY m.available_at LIMIT %(cap)s) AS d) AS later
                   CROSS JOIN LATERAL (
                         SELECT m.available_at AS at FROM {{schema}}.message AS m
                          WHERE m.queue_name = q.name AND m.state = 'queued' AND m.priority = pr.p
                          ORDER BY m.available_at LIMIT 1) AS head
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
        # whatever its state and attempt: its payload never becomes the old one's.
        "redrive_read": f"""
            SELECT message_id, {version("m")}, payload FROM {{schema}}.message AS m
             WHERE message_id = ANY(%s::uuid[]) AND state IN ('dead', 'cancelled')
        """,
        "redrive": f"""
            WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::text[], %s::bytea[]) AS o(id, version, payload))
            UPDATE {{schema}}.message AS m
               SET state = 'queued', payload = o.payload, available_at = now(), finished_at = NULL,
                   lease_expires_at = NULL, consumer_id = NULL,
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
        # Maintenance: bounded deletes of the oldest history, a batch at a time.
        "purge_history": """
            DELETE FROM {schema}.history WHERE ctid = ANY(ARRAY(
                SELECT ctid FROM {schema}.history
                 WHERE finished_at < now() - %s * interval '1 second'
                 ORDER BY finished_at LIMIT %s FOR UPDATE SKIP LOCKED))
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

# -- worker processes (processes.py, migration 011) -------------------------------
# One row per worker process: written at boot and every heartbeat by its
# maintenance loop (one upsert, in place), deleted at a clean shutdown; a row
# left by a process that died is purged an hour after its last heartbeat.
_TEMPLATES.update(
    {
        "process_beat": """
            INSERT INTO {schema}.process AS p
                (process_id, host, pid, queues, threads, busy, prefetched, per_queue, running, version, beat_seconds)
            VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(threads)s, %(busy)s, %(prefetched)s,
                    %(per_queue)s::jsonb, %(running)s::uuid[], %(version)s, %(beat_seconds)s)
            ON CONFLICT (process_id) DO UPDATE
               SET queues = EXCLUDED.queues, threads = EXCLUDED.threads, busy = EXCLUDED.busy,
                   prefetched = EXCLUDED.prefetched, per_queue = EXCLUDED.per_queue, running = EXCLUDED.running,
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
        # Of these messages, those whose actor runs (as of the heartbeats of live processes).
        "process_started": f"""
            SELECT DISTINCT r.id FROM {{schema}}.process AS p CROSS JOIN LATERAL unnest(p.running) AS r(id)
             WHERE {_LIVE_PROCESS} AND r.id = ANY(%(ids)s::uuid[])
        """,
        "process_purge": "DELETE FROM {schema}.process WHERE heartbeat_at < now() - %s * interval '1 second'",
    }
)

# -- the charts' samples (charts.py, migration 013) ------------------------------
# One process at a time (a transaction-scoped advisory lock on the table's oid),
# once per minute (the '' row of this minute is the mark): the queues' depth and
# oldest due age, read by the overview statement in the same transaction, then
# the outcome tallies of the minutes that are over and not copied yet.
_TEMPLATES.update(
    {
        "sample_claim": """
            SELECT pg_try_advisory_xact_lock(1684107597, '{schema}.queue_minute'::regclass::oid::int)
                   AND NOT EXISTS (SELECT FROM {schema}.queue_minute
                                    WHERE queue_name = '' AND minute = date_trunc('minute', now())
                                      AND due IS NOT NULL)
        """,
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
LISTED_ERROR_CHARS = 2000


def _listed_error() -> str:
    head, tail = LISTED_ERROR_CHARS // 4, LISTED_ERROR_CHARS - LISTED_ERROR_CHARS // 4
    return (
        f"CASE WHEN char_length(last_error) <= {LISTED_ERROR_CHARS} THEN last_error"
        f" ELSE left(last_error, {head}) || chr(10) || '[... ' || (char_length(last_error) - {LISTED_ERROR_CHARS})"
        f" || ' characters cut; inspect shows all ...]' || chr(10) || right(last_error, {tail}) END"
    )


# -- search (search.py, migration 014) ------------------------------------------
# Keyset pages in (message_id, table, seq) order: the message table's primary key
# and history's message_id index, so a search adds no index to the hot table.  Each
# table's next %(scan)s rows after the cursor are read in key order and filtered;
# the last row read (edge) says how far that table was searched.
_SEARCH_FILTER = """
    (%(queue)s::text IS NULL OR queue_name = %(queue)s)
    AND (%(actor)s::text IS NULL OR actor_name = %(actor)s)
    AND (%(state)s::text IS NULL OR state = %(state)s)
    AND (%(arguments)s::jsonb IS NULL OR {schema}.message_arguments(payload) @> %(arguments)s::jsonb)
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


_TEMPLATES.update(
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


_TEMPLATES.update(
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
    _TEMPLATES[f"redrive_ids_{_state}"] = f"""
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
    _TEMPLATES[f"count_queue_{_state}"] = f"""
        SELECT count(*) FROM (SELECT FROM {{schema}}.message
                               WHERE queue_name = %(queue)s AND {_purgeable} LIMIT %(cap)s) AS n
    """
    # Bounded: a batch at a time, skipping rows someone holds.
    _TEMPLATES[f"purge_queue_{_state}"] = f"""
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
"""
_TEMPLATES.update(
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
_TEMPLATES.update(
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


# -- schedules (migrations 007 and 009, schedules.py) ------------------------------
# The definition columns of a schedule row, as the declaring statement takes
# them (arrays: one element per schedule the declaring process installs).
_SCHEDULE_ROWS = """
        SELECT * FROM unnest(%(names)s::text[], %(actors)s::text[], %(queues)s::text[], %(crons)s::text[],
                             %(timezones)s::text[], %(every_ms)s::bigint[], %(missed)s::text[],
                             %(grace_ms)s::bigint[], %(versions)s::bigint[], %(fingerprints)s::text[])
                      AS d(name, actor_name, queue_name, cron, timezone, every_ms, missed, grace_ms, version,
                           fingerprint)
         ORDER BY name
"""
_SCHEDULE_COLUMNS = "name, actor_name, queue_name, cron, timezone, every_ms, missed, grace_ms, version, fingerprint"
_TEMPLATES.update(
    {
        # A scheduler declares its schedules (at start, then every 30 s), in
        # one transaction, these four statements in order.  Declarations take
        # turns (this lock; ticks and reads do not wait for it), so each one
        # sees every definition declared before it.
        "schedule_versions_lock": "LOCK TABLE {schema}.schedule_version IN SHARE ROW EXCLUSIVE MODE",
        # This process's definitions are declared now: a definition never
        # declared before is first seen now (it is the newest).
        "schedule_versions_seen": """
            INSERT INTO {schema}.schedule_version AS v (name, fingerprint, version)
            SELECT * FROM unnest(%(names)s::text[], %(fingerprints)s::text[], %(versions)s::bigint[])
            ON CONFLICT (name, fingerprint) DO UPDATE SET last_seen = clock_timestamp()
        """,
        # For each of this process's schedules: the definition that wins (of
        # those declared in the last %(live)s seconds, the highest version,
        # then the one first seen last), and the stored row, locked: ticks of
        # the old definition wait until the change is committed, then find
        # their fingerprint gone.  The row's old definition says which of its
        # ticks are still owed (Scheduler.declare).
        "schedule_winners": """
            SELECT n.name, w.fingerprint, s.fingerprint, s.cron, s.timezone, s.every_ms, s.missed, s.grace_ms,
                   s.last_tick, s.changed_at, now()
              FROM unnest(%(names)s::text[]) AS n(name)
             CROSS JOIN LATERAL (
                   SELECT v.fingerprint FROM {schema}.schedule_version AS v
                    WHERE v.name = n.name AND v.last_seen > clock_timestamp() - %(live)s * interval '1 second'
                    ORDER BY v.version DESC, v.first_seen DESC, v.fingerprint DESC LIMIT 1) AS w
              LEFT JOIN LATERAL (
                   SELECT * FROM {schema}.schedule AS s WHERE s.name = n.name FOR UPDATE) AS s ON true
             ORDER BY n.name
        """,
        # The winning definitions become the schedules' (a forgotten row comes
        # back, afresh); changed_at moves when the definition did, and
        # last_tick stays (ticks never go backwards).
        "schedule_declare": f"""
            INSERT INTO {{schema}}.schedule AS s ({_SCHEDULE_COLUMNS})
            {_SCHEDULE_ROWS}
            ON CONFLICT (name) DO UPDATE
               SET actor_name = EXCLUDED.actor_name, queue_name = EXCLUDED.queue_name, cron = EXCLUDED.cron,
                   timezone = EXCLUDED.timezone, every_ms = EXCLUDED.every_ms, missed = EXCLUDED.missed,
                   grace_ms = EXCLUDED.grace_ms, version = EXCLUDED.version, fingerprint = EXCLUDED.fingerprint,
                   seen_at = now(),
                   changed_at = CASE WHEN s.fingerprint = EXCLUDED.fingerprint THEN s.changed_at ELSE now() END
        """,
        # The losing ones: a running process still declares an older
        # definition (it enqueues nothing; shown to operators).
        "schedule_outdated": """
            UPDATE {schema}.schedule SET outdated_seen_at = now() WHERE name = ANY(%s::text[])
        """,
        # The database clock, and where each of this process's schedules
        # stands (one row with NULLs when none is stored yet).
        "schedule_read": """
            SELECT c.now, s.name, s.fingerprint, s.last_tick, s.changed_at
              FROM (SELECT clock_timestamp() AS now) AS c
              LEFT JOIN {schema}.schedule AS s ON s.name = ANY(%s::text[])
        """,
        # Enqueue one tick, exactly once across every process, in one
        # statement (atomic in autocommit):
        # - advanced: the schedule's last_tick moves to this tick, only while
        #   the stored definition is the caller's, the tick is due by the
        #   database clock, and it is later than last_tick.  Concurrent
        #   callers queue on the row's lock; each re-checks the WHERE on the
        #   row as the winner left it (READ COMMITTED) and finds the tick
        #   taken.  A caller that computed the tick long ago (paused) finds
        #   it taken too: last_tick never goes back.
        # - ticked: the (schedule, tick) row, unique: a second guard.
        # - ins: the message, only if both guards let the tick through,
        #   and the doorbell of its queue (as enqueue_one rings it).
        "schedule_tick": """
            WITH advanced AS (
                UPDATE {schema}.schedule AS s
                   SET last_tick = %(tick)s::timestamptz, last_message_id = %(id)s::uuid, last_enqueued_at = now()
                 WHERE s.name = %(name)s AND s.fingerprint = %(fingerprint)s
                   AND (s.last_tick IS NULL OR s.last_tick < %(tick)s::timestamptz)
                   AND %(tick)s::timestamptz <= now()
                RETURNING s.name
            ), ticked AS (
                INSERT INTO {schema}.schedule_tick (name, tick, message_id)
                SELECT name, %(tick)s::timestamptz, %(id)s::uuid FROM advanced
                ON CONFLICT (name, tick) DO NOTHING
                RETURNING message_id
            ), ins AS (
                INSERT INTO {schema}.message (message_id, queue_name, actor_name, priority, available_at, payload)
                SELECT t.message_id, %(queue)s::text, %(actor)s::text, %(priority)s::int, now(), %(payload)s::bytea
                  FROM ticked AS t
                ON CONFLICT (message_id) DO NOTHING
                RETURNING queue_name
            ), rung AS (
                SELECT pg_notify(%(channel)s, queue_name) FROM ins WHERE %(listen)s
            )
            SELECT (SELECT count(*) FROM ins) AS inserted, (SELECT count(*) FROM rung) AS rung
        """,
        "schedule_list": """
            SELECT name, actor_name, queue_name, cron, timezone, every_ms, missed, grace_ms, version, created_at,
                   changed_at, seen_at, outdated_seen_at, last_tick, last_message_id, last_enqueued_at,
                   clock_timestamp() AS now
              FROM {schema}.schedule ORDER BY name
        """,
        # An operator removes a schedule's row (a running scheduler that still
        # declares the winning definition puts it back, with no last tick: it
        # starts afresh).  The definitions' order (schedule_version) stays.
        "schedule_forget": "DELETE FROM {schema}.schedule WHERE name = %s RETURNING name",
        "schedule_ticks": """
            SELECT tick, message_id, enqueued_at FROM {schema}.schedule_tick
             WHERE name = %s ORDER BY tick DESC LIMIT %s
        """,
        # Bounded: the oldest tick records, a batch at a time.
        "schedule_purge_ticks": """
            DELETE FROM {schema}.schedule_tick WHERE ctid = ANY(ARRAY(
                SELECT ctid FROM {schema}.schedule_tick
                 WHERE enqueued_at < now() - %s * interval '1 second'
                 ORDER BY enqueued_at LIMIT %s FOR UPDATE SKIP LOCKED))
        """,
    }
)


def results_channel(schema: str) -> str:
    """The NOTIFY channel of result writes (payload: the result key)."""
    return f"{check_schema(schema)}_results"


def rate_limits_channel(schema: str) -> str:
    """The NOTIFY channel of rate-limiter events (payload: the event key)."""
    return f"{check_schema(schema)}_rate_limits"


class Statements:
    """Every statement, bound to one schema: bytes ready to execute; read-only.

    A plain class, not a frozen dataclass: generating a dataclass's methods
    for a hundred fields took a few milliseconds of every worker's start.
    """

    def __init__(self, **bound: bytes) -> None:
        missing, unknown = self.__annotations__.keys() - bound.keys(), bound.keys() - self.__annotations__.keys()
        if missing or unknown:
            raise TypeError(f"Statements: missing {sorted(missing)}, unknown {sorted(unknown)}")
        self.__dict__.update(bound)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Statements are read-only (setting {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Statements are read-only (deleting {name!r})")

    notify: bytes
    turn_take: bytes
    turn_seats: bytes
    turn_door: bytes
    turn_door_leave: bytes
    turn_door_patience: bytes
    claim: bytes
    claim_relaxed: bytes
    claim_telling: bytes
    claim_telling_relaxed: bytes
    next_due: bytes
    release_unseen: bytes
    ack: bytes
    ack_keep: bytes
    ack_relaxed: bytes
    ack_keep_relaxed: bytes
    fence_lock: bytes
    fence_begin: bytes
    committed_done: bytes
    committed_done_relaxed: bytes
    committed_done_keep: bytes
    committed_done_keep_relaxed: bytes
    committed_seen: bytes
    finish_committed: bytes
    finish_committed_keep: bytes
    relay_take: bytes
    relay_put: bytes
    relay_mark: bytes
    relay_dead: bytes
    relay_waiting: bytes
    relay_left: bytes
    relay_purge: bytes
    nack: bytes
    retry: bytes
    requeue: bytes
    extend: bytes
    delivery_states: bytes
    extend_relaxed: bytes
    begin_relaxed: bytes
    current: bytes
    count_stale: bytes
    counters: bytes
    rescue: bytes
    purge_finished: bytes
    cancel: bytes
    vacuum: bytes
    message_size: bytes
    compact: bytes
    file_node: bytes
    may_vacuum: bytes
    cancel_lock_timeout: bytes
    state_of: bytes
    held_among: bytes
    still_held_many: bytes
    inspect: bytes
    flush: bytes
    pending: bytes
    dead_letters: bytes
    queue_stats: bytes
    enqueue: bytes
    enqueue_relaxed: bytes
    enqueue_one: bytes
    enqueue_one_relaxed: bytes
    enqueue_unique: bytes
    enqueue_unique_relaxed: bytes
    unique_holders: bytes
    overview: bytes
    no_jit: bytes
    pause: bytes
    resume: bytes
    paused: bytes
    paused_among: bytes
    extend_cancelled: bytes
    cancel_ended: bytes
    still_running: bytes
    known_queues: bytes
    redrive_read: bytes
    redrive: bytes
    redrive_ids_dead: bytes
    redrive_ids_cancelled: bytes
    inspect_history: bytes
    purge_history: bytes
    purge_throughput: bytes
    outcome_totals: bytes
    purge_queue_queued: bytes
    purge_queue_dead: bytes
    purge_queue_cancelled: bytes
    purge_queue_done: bytes
    count_queue_queued: bytes
    count_queue_dead: bytes
    count_queue_cancelled: bytes
    count_queue_done: bytes
    list_queued: bytes
    list_running: bytes
    list_dead: bytes
    list_cancelled: bytes
    list_done: bytes
    result_get: bytes
    result_drop_expired: bytes
    result_store: bytes
    result_store_fenced: bytes
    result_purge: bytes
    rate_limit_add: bytes
    rate_limit_upsert: bytes
    rate_limit_update: bytes
    rate_limit_placeholders: bytes
    rate_limit_lock: bytes
    rate_limit_set: bytes
    rate_limit_notify: bytes
    rate_limit_event: bytes
    rate_limit_purge: bytes
    schedule_versions_lock: bytes
    schedule_versions_seen: bytes
    schedule_winners: bytes
    schedule_declare: bytes
    schedule_outdated: bytes
    schedule_read: bytes
    schedule_tick: bytes
    schedule_list: bytes
    schedule_forget: bytes
    schedule_ticks: bytes
    schedule_purge_ticks: bytes
    process_beat: bytes
    process_delete: bytes
    process_list: bytes
    process_purge: bytes
    process_busy: bytes
    process_started: bytes
    bulk_live: bytes
    bulk_kept: bytes
    bulk_purge_live: bytes
    bulk_purge_kept: bytes
    bulk_run_now: bytes
    audit_begin: bytes
    audit_end: bytes
    audit_page: bytes
    search_live: bytes
    search_kept: bytes
    search_id: bytes
    sample_claim: bytes
    sample_depth: bytes
    sample_outcomes: bytes
    sample_purge: bytes
    series: bytes


@cache
def statements(schema: str) -> Statements:
    """The statements bound to *schema* (checked, quoted once), built once per schema.

    ``str.format`` puts the quoted name in, as ``psycopg.sql.SQL.format`` would (the same
    ``{{``/``}}`` escapes; a template's only field is ``{schema}``): composing each of the 140-odd
    templates with psycopg took about 5 ms of every worker's start-up, measured; this takes under 1."""
    quoted = sql.Identifier(check_schema(schema)).as_string(None)
    return Statements(**{name: bind(text, quoted) for name, text in _TEMPLATES.items()})


def bind(text: str, schema: str) -> bytes:
    """Put the quoted *schema* into a template; whitespace folded for the logs."""
    return " ".join(text.split()).format(schema=schema).encode()
