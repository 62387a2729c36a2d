-- Schedules operators act on (issue 42, point 5).  A paused schedule enqueues no tick on any process:
-- schedule_tick's update checks paused_at on the row it locks.  resumed_at: the ticks that fell while
-- it was paused are not owed (the scheduler counts from the later of last_tick, changed_at, resumed_at).
ALTER TABLE {schema}.schedule
    ADD COLUMN paused_at  timestamptz,
    ADD COLUMN paused_by  text,
    ADD COLUMN resumed_at timestamptz;

-- "Run now": one row per click (the form's id for it, so a form sent twice asks once), taken by a
-- scheduler that declares the schedule's definition in force, which enqueues its message exactly once
-- (message_id set under the row's lock) and completes the click's audit row.
CREATE TABLE {schema}.schedule_run (
    click        uuid        PRIMARY KEY,
    name         text        NOT NULL,
    who          text        NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT now(),
    audit_id     bigint,
    message_id   uuid,        -- NULL: not enqueued yet (no scheduler of it has run since)
    enqueued_at  timestamptz
);
CREATE INDEX schedule_run_pending_idx ON {schema}.schedule_run (name, requested_at) WHERE message_id IS NULL;
