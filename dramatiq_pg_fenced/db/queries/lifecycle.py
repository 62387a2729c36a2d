"""A row's life outside the enqueue and the outcome: the turns, the next due row, a lost claim's release, the requeue at shutdown, maintenance's rescue and purge, an operator's cancel, inspect and counts."""

from __future__ import annotations

from .pieces import (
    _ATTEMPT_LOG,
    _BY_IDS,
    _HOLDER_BEFORE,
    _LOST,
    _STATE,
    STILL_RUNNING,
    _retake,
    _still_running,
    version,
)

# -- the statements that end a delivery without an outcome of its own, plain or _logged -----------
# The _logged variants (run while keep_finished > 0) record the delivery they end in the attempt log
# (migration 023), in the same statement: only the rows the update took.  Each clears the row's
# consumer (and the rescue and release_unseen its token): the logged variants read them first, the
# rescue from the rows it locked, the others from the statement's snapshot (nothing else changes them
# while the row runs under that token).


# Rows a claim of ours leased but whose response never arrived: leased to
# the consumers whose claim failed in flight (each consumer has an id of
# its own, so a sibling's fresh claim is never touched), running, yet not
# held.  They go back now, not when their lease runs out; the next claim
# bumps the attempt.  Only unexpired leases (lease_expires_at > now(), by the lease index): an
# expired one is the rescue's, and the index's entries of every lease taken since another
# session's snapshot (acked rows', which no vacuum may remove meanwhile) lie behind now() but
# for the last lease's worth (issue 41).  Logged as 'claim lost'.
def _release_unseen(*, logged: bool) -> str:
    where = """state = 'running' AND lease_expires_at > now()
           AND consumer_id = ANY(%(consumers)s::text[]) AND queue_name = %(queue)s
           AND message_id <> ALL(%(held)s::uuid[])"""
    update = f"""
        UPDATE {{schema}}.message AS m
           SET {_LOST}
         WHERE {where}
        RETURNING message_id, state"""
    if not logged:
        return update
    return f"""
        WITH was AS MATERIALIZED (
            SELECT message_id, seq, attempt, delivery, consumer_id, claimed_at FROM {{schema}}.message WHERE {where}
        ), back AS ({update}, queue_name, last_error
        ), logged AS ({_ATTEMPT_LOG}
            SELECT b.message_id, w.seq, w.attempt, w.delivery, b.queue_name, w.consumer_id, w.claimed_at, now(),
                   'claim lost', CASE WHEN b.state = 'dead' THEN b.last_error END
              FROM back AS b JOIN was AS w ON w.message_id = b.message_id
        )
        SELECT message_id, state FROM back
    """


# The release at shutdown, fenced (batched: unnest of ids and delivery tokens).  Logged as 'requeued'.
def _requeue(*, logged: bool) -> str:
    was = _HOLDER_BEFORE
    update = f"""
        UPDATE {{schema}}.message AS m
           SET state = 'queued', lease_expires_at = NULL, consumer_id = NULL,
               {_retake("m", finished_too=False)}
          FROM o
         WHERE {_BY_IDS} AND m.message_id = o.id AND m.delivery = o.delivery AND m.state = 'running'
        RETURNING m.message_id, m.delivery"""
    head = "WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS o(id, delivery))"
    if not logged:
        return head + update
    return f"""{head},{was}
        back AS ({update}, m.seq, m.attempt, m.queue_name, m.claimed_at
        ), logged AS ({_ATTEMPT_LOG}
            SELECT b.message_id, b.seq, b.attempt, b.delivery, b.queue_name, w.consumer_id, b.claimed_at, now(),
                   'requeued', NULL
              FROM back AS b LEFT JOIN was AS w ON w.message_id = b.message_id AND w.delivery = b.delivery
        )
        SELECT message_id, delivery FROM back
    """


# Expired leases go back to the queue; the next claim bumps the attempt.
# Like requeue and release_unseen, this keeps available_at: the message
# takes its old place in the queue, not a place behind the backlog.
# Each rescued lease is a redelivery to come: counted for operators.
# SKIP LOCKED: a row locked by an open fenced transaction (exactly_once.py) is being finished
# by its delivery, whose lease the keeper cannot extend meanwhile: it is left alone, and is
# gone if the block commits, rescued at a later pass if it rolls back.
# %(since)s (NULL: no bound, a full pass): the lease index keeps an entry for every lease ever
# taken or extended, and while another session's snapshot is older no vacuum removes those of
# acked rows, so "lease_expires_at < now()" alone would walk every one of them at each pass
# (issue 41).  A periodic pass (maintenance.py) starts at what its previous pass could not take:
# the oldest expired lease it saw locked ("held", read without locking), else that pass's
# now(), less a margin; a full pass now and then takes what landed behind it (a claim that
# committed later than the margin, a clock set back).  The last row (no message) says where
# the next pass starts.  Logged as 'lease lost', ended as it is taken back (when the message's story
# moves on: the lease's own expiry may lie further back, an operator's action after it).
# A message cancelled while it ran keeps its lease while its actor runs (leases.py) and loses it
# when the delivery ends (cancel_ended); one whose holder died or stopped past the lease ends here:
# its lease and delivery token go (a late write of that holder is fenced out), logged 'cancelled'.
def _rescue(*, logged: bool) -> str:
    columns = "message_id, state" + (", seq, attempt, delivery, consumer_id, claimed_at" if logged else "")
    log = f"""
        logged AS ({_ATTEMPT_LOG}
            SELECT e.message_id, e.seq, e.attempt, e.delivery, b.queue_name, e.consumer_id, e.claimed_at,
                   now(), 'lease lost', CASE WHEN b.state = 'dead' THEN b.last_error END
              FROM back AS b JOIN expired AS e ON e.message_id = b.message_id
             UNION ALL
            SELECT e.message_id, e.seq, e.attempt, e.delivery, g.queue_name, e.consumer_id, e.claimed_at,
                   now(), 'cancelled', NULL
              FROM gone AS g JOIN expired AS e ON e.message_id = g.message_id
        ),"""
    return f"""
        WITH expired AS (
            SELECT {columns} FROM {{schema}}.message
             WHERE state IN ('running', 'cancelled') AND lease_expires_at < now()
               AND lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
               FOR UPDATE SKIP LOCKED
        ), held AS (
            SELECT min(lease_expires_at) AS at FROM {{schema}}.message
             WHERE state IN ('running', 'cancelled') AND lease_expires_at < now()
               AND lease_expires_at >= coalesce(%(since)s::timestamptz, '-infinity')
               AND message_id <> ALL(ARRAY(SELECT message_id FROM expired))
        ), back AS (
            UPDATE {{schema}}.message AS m
               SET {_LOST}
              FROM expired
             WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM expired WHERE state = 'running'))
               AND m.message_id = expired.message_id AND expired.state = 'running'
            RETURNING m.message_id, m.queue_name, m.attempt, m.state{", m.last_error" if logged else ""}
        ), gone AS (
            UPDATE {{schema}}.message AS m
               SET lease_expires_at = NULL, delivery = NULL
              FROM expired
             WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM expired WHERE state = 'cancelled'))
               AND m.message_id = expired.message_id AND expired.state = 'cancelled'
            RETURNING m.message_id, m.queue_name
        ),{log if logged else ""} counted AS (
            INSERT INTO {{schema}}.counter AS c (name, value)
            SELECT 'redeliveries', count(*) FROM back WHERE state = 'queued' HAVING count(*) > 0
            ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
        )
        SELECT message_id, queue_name, attempt, state, NULL::timestamptz FROM back
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, least(now(), held.at) FROM held
    """


TEMPLATES: dict[str, str] = {
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
    # after a claim comes back short.  One probe of the delayed index (migration
    # 018) from now() on: the rows due later lie after every entry a claim left
    # dead (a row is claimed once due), so it never walks them, however many an
    # old snapshot keeps (issue 41).  A delayed row is one due later than its
    # enqueue (available_at > enqueued_at): only a row relayed from a database
    # whose clock is ahead by more than its delay could be due later yet not
    # counted; it is claimed at the next idle poll after it is due.
    "next_due": """
        SELECT extract(epoch FROM min(available_at) - clock_timestamp())::float8 FROM {schema}.message
         WHERE queue_name = %(queue)s AND state = 'queued' AND available_at > enqueued_at
           AND available_at > now()
    """,
    # The database's clock, read by a consumer whose claim found nothing and that has not seen
    # it for a while (floor.ServerClock): where such a claim puts its floor.
    "server_clock": "SELECT now()",
    # A lost claim's rows, put back (see _release_unseen above).
    "release_unseen": _release_unseen(logged=False),
    "release_unseen_logged": _release_unseen(logged=True),
    # -- fenced outcomes (batched: unnest of ids and delivery tokens) ------
    "requeue": _requeue(logged=False),
    "requeue_logged": _requeue(logged=True),
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
    # Expired leases go back to the queue (see _rescue above).
    "rescue": _rescue(logged=False),
    "rescue_logged": _rescue(logged=True),
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
         WHERE m.message_id = %(id)s AND m.message_id = old.message_id AND old.state IN ('queued', 'running')
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
          FROM mine WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM mine)) AND m.message_id = mine.message_id
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
          FROM mine WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM mine)) AND m.message_id = mine.message_id
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
    # under their token: one primary-key probe each.  _BY_IDS (pieces.py) makes it so: joined to
    # the list alone, with tens of ids and statistics of a near-empty table, the planner hashed a
    # scan of the whole table (or of the primary key) instead, which under another session's old
    # snapshot walks every dead row since: 4,000 buffers 20 s into a pin, 28,000 at 140 s, under the
    # start gate's process-wide lock (issue 41; tests/test_pinned_horizon.py).
    "still_held_many": f"""
        WITH o AS (SELECT * FROM unnest(%s::uuid[], %s::uuid[]) AS o(id, delivery))
        SELECT m.message_id::text, m.delivery::text
          FROM {{schema}}.message AS m JOIN o ON m.message_id = o.id AND m.delivery = o.delivery
         WHERE {_BY_IDS} AND m.state = 'running'
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
