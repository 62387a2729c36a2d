-- Which declaration of a schedule is the newer one (schedules.py, Scheduler.declare).
--
-- One row per definition a schedule has had (name, fingerprint): when it was
-- first declared and when a running scheduler last declared it, by the
-- database clock.  Of the definitions declared in the last two minutes, the
-- one with the highest version (the optional version= of a schedule), then
-- the one first declared last, is the schedule's: an older definition never
-- overwrites a newer one, however late its process starts.  A definition
-- nobody declares any more gives way (a rollback once the newer processes are
-- gone).  Rows are kept, an operator's --forget included: the order must
-- outlive the schedule row, or an old process would come back as new.
-- Only declarations write here, one transaction at a time (they lock the table).
CREATE TABLE IF NOT EXISTS {schema}.schedule_version (
    name        text        NOT NULL,
    fingerprint text        NOT NULL,
    version     bigint      NOT NULL DEFAULT 0,
    first_seen  timestamptz NOT NULL DEFAULT clock_timestamp(),
    last_seen   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (name, fingerprint)
);

-- The definitions stored before this migration are known, as of when they
-- were installed: a definition declared for the first time from now on is
-- newer than they are.
INSERT INTO {schema}.schedule_version (name, fingerprint, first_seen, last_seen)
SELECT name, fingerprint, changed_at, seen_at FROM {schema}.schedule
ON CONFLICT (name, fingerprint) DO NOTHING;

-- The schedule row says which version is in force, and when a running
-- scheduler last declared an older definition (its processes enqueue nothing:
-- a rolling deploy not finished yet), for `dramatiq-pg-fenced schedules`.
ALTER TABLE {schema}.schedule ADD COLUMN IF NOT EXISTS version bigint NOT NULL DEFAULT 0;
ALTER TABLE {schema}.schedule ADD COLUMN IF NOT EXISTS outdated_seen_at timestamptz;
