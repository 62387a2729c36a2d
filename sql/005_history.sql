-- The operator's console: history of finished messages, per-minute tallies of
-- outcomes, and paused queues.

-- When the current delivery was claimed, so history can say how long it was
-- held (claim to finish: prefetch wait included).  Nullable, no default: adding
-- it rewrites nothing.
ALTER TABLE {schema}.message ADD COLUMN claimed_at timestamptz;

-- Acked messages, kept for the broker's keep_finished seconds (0: none).  The
-- ack moves the row here in the same statement (DELETE ... RETURNING into
-- INSERT); the maintenance loop deletes the oldest in bounded batches.  Only
-- inserts and batched deletes: no room kept for updates.  A message id may
-- appear more than once (a message sent again under the same id after its ack).
CREATE TABLE {schema}.history (
    message_id  uuid        NOT NULL,
    seq         bigint      NOT NULL,  -- the message row's seq: a tie-breaker for paging
    queue_name  text        NOT NULL,
    actor_name  text        NOT NULL,
    priority    integer     NOT NULL,
    attempt     integer     NOT NULL,
    enqueued_at timestamptz NOT NULL,
    claimed_at  timestamptz,
    finished_at timestamptz NOT NULL,
    consumer_id text,
    last_error  text,          -- of an earlier, retried attempt
    payload     bytea       NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- inspect(message_id).
CREATE INDEX history_message_idx ON {schema}.history (message_id);
-- The dashboard's list of a queue's finished messages, newest first (keyset on finished_at, seq).
CREATE INDEX history_queue_idx ON {schema}.history (queue_name, finished_at, seq);
-- The purge: oldest first, a batch at a time.
CREATE INDEX history_finished_idx ON {schema}.history (finished_at);

-- Outcomes per queue and minute, one row per writing process (no two processes
-- ever wait on each other's row), for "done in the last minute / hour".
-- Rows older than two hours are purged.  Updated in place: room for HOT updates.
CREATE TABLE {schema}.throughput (
    queue_name text        NOT NULL,
    minute     timestamptz NOT NULL,
    writer     text        NOT NULL,
    done       bigint      NOT NULL DEFAULT 0,
    dead       bigint      NOT NULL DEFAULT 0,
    PRIMARY KEY (queue_name, minute, writer)
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- Paused queues: claims skip them (one primary-key probe per claim).  A row
-- survives restarts; resume deletes it.
CREATE TABLE {schema}.paused_queue (
    queue_name text        PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT now()
);
