-- The console's charts (issue 26): one sample per queue and minute, kept a day (bounded: queues
-- x 1,440 rows), written by the maintenance loop of one process at a time (an advisory lock, and
-- at most one sample per minute).  queue_name '' holds the figures of all queues together.
-- due and oldest_due_seconds: the queue as it was at the minute's start (NULL: not sampled);
-- done, dead, retried: the outcomes of that minute, copied from the throughput tallies once the
-- minute is over (NULL: not copied yet; none were counted).  The tallies keep two hours; these
-- rows keep a day.
CREATE TABLE {schema}.queue_minute (
    queue_name         text        NOT NULL,
    minute             timestamptz NOT NULL,
    due                bigint,
    oldest_due_seconds float8,
    done               bigint,
    dead               bigint,
    retried            bigint,
    PRIMARY KEY (queue_name, minute)
) WITH (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- The purge of samples older than a day.
CREATE INDEX queue_minute_minute_idx ON {schema}.queue_minute (minute);
