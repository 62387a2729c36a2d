-- Counters for Prometheus (issue 26): messages finished, dead-lettered and retried per queue,
-- ever.  The throughput tallies count per minute and are purged after two hours; the purge
-- adds what it deletes to outcome_total in the same statement, so a tally's sum over both
-- tables never goes down.  The retry statement tallies its retries too (a column of its own,
-- added with a default: nothing is rewritten).
ALTER TABLE {schema}.throughput ADD COLUMN retried bigint NOT NULL DEFAULT 0;

CREATE TABLE {schema}.outcome_total (
    queue_name text   PRIMARY KEY,
    done       bigint NOT NULL DEFAULT 0,
    dead       bigint NOT NULL DEFAULT 0,
    retried    bigint NOT NULL DEFAULT 0
);
