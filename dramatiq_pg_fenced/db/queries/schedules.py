"""Schedules (``features/schedules.py``, migrations 007 and 009)."""

from __future__ import annotations

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
TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
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
        # changed_at: the later of the definition's change and the last resume (ticks that fell while
        # paused are not owed); paused: the scheduler skips the schedule (schedule_tick refuses it anyway).
        "schedule_read": """
            SELECT c.now, s.name, s.fingerprint, s.last_tick, greatest(s.changed_at, s.resumed_at),
                   s.paused_at IS NOT NULL
              FROM (SELECT clock_timestamp() AS now) AS c
              LEFT JOIN {schema}.schedule AS s ON s.name = ANY(%s::text[])
        """,
        # Enqueue one tick, exactly once across every process, in one
        # statement (atomic in autocommit):
        # - advanced: the schedule's last_tick moves to this tick, only while
        #   the schedule is not paused (migration 022: a pause committed
        #   before this statement locks the row stops it, on every process),
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
                   AND %(tick)s::timestamptz <= now() AND s.paused_at IS NULL
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
                   paused_at, paused_by, resumed_at,
                   (SELECT count(*) FROM {schema}.schedule_run AS r
                     WHERE r.name = s.name AND r.message_id IS NULL) AS runs_pending,
                   clock_timestamp() AS now
              FROM {schema}.schedule AS s ORDER BY name
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
# -- operators acting on schedules (migration 022, features/schedule_control.py) ---------------------
TEMPLATES.update(
    {
        # (whether the schedule exists, whether this call changed it); the row locked while deciding.
        "schedule_pause": """
            WITH s AS (SELECT name, paused_at FROM {schema}.schedule WHERE name = %(name)s FOR UPDATE),
            changed AS (
                UPDATE {schema}.schedule AS t SET paused_at = now(), paused_by = %(who)s
                  FROM s WHERE t.name = s.name AND s.paused_at IS NULL RETURNING t.name)
            SELECT (SELECT count(*) FROM s), (SELECT count(*) FROM changed)
        """,
        "schedule_resume": """
            WITH s AS (SELECT name, paused_at FROM {schema}.schedule WHERE name = %(name)s FOR UPDATE),
            changed AS (
                UPDATE {schema}.schedule AS t SET paused_at = NULL, paused_by = NULL, resumed_at = now()
                  FROM s WHERE t.name = s.name AND s.paused_at IS NOT NULL RETURNING t.name)
            SELECT (SELECT count(*) FROM s), (SELECT count(*) FROM changed)
        """,
        # One click of "run now": recorded once per click id (a form sent again adds nothing).
        "schedule_run_request": """
            INSERT INTO {schema}.schedule_run (click, name, who, audit_id)
            SELECT %(click)s::uuid, s.name, %(who)s, %(audit)s FROM {schema}.schedule AS s WHERE s.name = %(name)s
            ON CONFLICT (click) DO NOTHING
            RETURNING click
        """,
        "schedule_run_seen": "SELECT 1 FROM {schema}.schedule_run WHERE click = %s",
        "schedule_exists": "SELECT 1 FROM {schema}.schedule WHERE name = %s",
        "schedule_runs_pending": """
            SELECT click, name FROM {schema}.schedule_run
             WHERE message_id IS NULL AND name = ANY(%s::text[])
             ORDER BY requested_at LIMIT 100
        """,
        # Take one click and enqueue its message, exactly once across processes: the click's row moves
        # to this message only while it has none (concurrent takers queue on its lock and find it taken)
        # and while the stored definition is the caller's; the audit row is completed with it.
        "schedule_run_take": """
            WITH taken AS (
                UPDATE {schema}.schedule_run AS r SET message_id = %(id)s::uuid, enqueued_at = now()
                  FROM {schema}.schedule AS s
                 WHERE r.click = %(click)s::uuid AND r.message_id IS NULL
                   AND s.name = r.name AND s.fingerprint = %(fingerprint)s
                RETURNING r.message_id, r.audit_id
            ), ins AS (
                INSERT INTO {schema}.message (message_id, queue_name, actor_name, priority, available_at, payload)
                SELECT t.message_id, %(queue)s::text, %(actor)s::text, %(priority)s::int, now(), %(payload)s::bytea
                  FROM taken AS t
                ON CONFLICT (message_id) DO NOTHING
                RETURNING queue_name
            ), audited AS (
                UPDATE {schema}.audit AS a SET touched = (SELECT count(*) FROM ins), skipped = 0, ended_at = now()
                  FROM taken AS t WHERE a.id = t.audit_id RETURNING a.id
            ), rung AS (
                SELECT pg_notify(%(channel)s, queue_name) FROM ins WHERE %(listen)s
            )
            SELECT (SELECT count(*) FROM ins), (SELECT count(*) FROM audited), (SELECT count(*) FROM rung)
        """,
        # An action on a schedule in the audit log: one row, done as it is written.
        "schedule_audit": """
            INSERT INTO {schema}.audit (who, action, selection, previewed, touched, skipped, ended_at)
            VALUES (%(who)s, %(action)s, %(selection)s::jsonb, 1, %(touched)s, 0,
                    CASE WHEN %(touched)s::int IS NULL THEN NULL ELSE now() END)
            RETURNING id
        """,
    }
)
