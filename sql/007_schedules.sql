-- Periodic messages (schedules.py): one row per declared schedule, one row per
-- enqueued tick.  No leader: every scheduler process runs the same statement
-- for a due tick, and only one of them can win it (see schedule_tick in sql.py).

-- A schedule as the process that declared it last defined it (fingerprint:
-- a hash of the whole definition; a process whose own definition differs does
-- not enqueue it).  last_tick only moves forward: the statement that enqueues
-- a tick advances it under the row's lock, so a tick at or before it is never
-- enqueued again, by any process, however late.  seen_at: when a running
-- scheduler last declared it (a removed schedule stops being seen: stale).
-- Updated in place every tick: room for HOT updates.
CREATE TABLE {schema}.schedule (
    name             text        PRIMARY KEY,
    actor_name       text        NOT NULL,
    queue_name       text        NOT NULL,
    cron             text,                     -- a cron expression, or NULL for an interval
    timezone         text,                     -- the cron expression's time zone (IANA name)
    every_ms         bigint,                   -- an interval (ticks at multiples of it since the Unix epoch)
    missed           text        NOT NULL CHECK (missed IN ('skip', 'once')),
    grace_ms         bigint      NOT NULL,
    fingerprint      text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    changed_at       timestamptz NOT NULL DEFAULT now(),
    seen_at          timestamptz NOT NULL DEFAULT now(),
    last_tick        timestamptz,
    last_message_id  uuid,
    last_enqueued_at timestamptz,
    CHECK ((cron IS NULL) <> (every_ms IS NULL))
) WITH (fillfactor = 50);

-- Every enqueued tick and its message: a second guard (one row per schedule
-- and tick), and the record operators and tests read.  Purged after a day by
-- the schedulers (the last tick stays in schedule.last_tick).
CREATE TABLE {schema}.schedule_tick (
    name        text        NOT NULL,
    tick        timestamptz NOT NULL,
    message_id  uuid        NOT NULL,
    enqueued_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, tick)
);

-- The purge: oldest first, a batch at a time.
CREATE INDEX schedule_tick_enqueued_idx ON {schema}.schedule_tick (enqueued_at);
