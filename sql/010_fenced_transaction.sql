-- Deliveries whose fenced transaction (broker.fenced_transaction(), exactly_once.py) committed
-- their ack together with the actor's own writes, and whose later effects (the result the Results
-- middleware stores, the next pipeline step, callbacks, a group countdown: all caused after the
-- actor returns) are not written yet.  The block inserts the row in its own transaction; the
-- outcome writer deletes it and writes those effects only if it did (fenced on the row, as the
-- ack of any other delivery is fenced on the message row), so they are written at most once.
-- A row left by a worker that died in between is purged after dead_message_ttl.
CREATE TABLE {schema}.committed (
    delivery     uuid        PRIMARY KEY,  -- the delivery's fence token
    message_id   uuid        NOT NULL,
    queue_name   text        NOT NULL,  -- for the throughput tally, counted as the row goes
    committed_at timestamptz NOT NULL DEFAULT now()
) WITH (
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- The purge of rows left by workers that died after their block committed.
CREATE INDEX committed_at_idx ON {schema}.committed (committed_at);
