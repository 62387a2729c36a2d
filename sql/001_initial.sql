-- Messages live in one hot table; finished messages leave it (ack deletes),
-- dead letters and cancellations stay until retention purges them.
-- {schema} is replaced by the quoted schema identifier by migrations.py.

CREATE TABLE {schema}.message (
    message_id       uuid        PRIMARY KEY,
    seq              bigint      GENERATED ALWAYS AS IDENTITY,
    queue_name       text        NOT NULL,
    actor_name       text        NOT NULL,
    priority         integer     NOT NULL DEFAULT 0,
    state            text        NOT NULL DEFAULT 'queued'
                     CHECK (state IN ('queued', 'running', 'dead', 'cancelled')),
    attempt          integer     NOT NULL DEFAULT 0,
    enqueued_at      timestamptz NOT NULL DEFAULT now(),
    available_at     timestamptz NOT NULL DEFAULT now(),
    lease_expires_at timestamptz,
    consumer_id      text,
    finished_at      timestamptz,
    last_error       text,
    payload          bytea       NOT NULL
) WITH (
    fillfactor = 70,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- Claimable rows, in claim order.
CREATE INDEX message_claim_idx ON {schema}.message (queue_name, priority, available_at, seq)
    WHERE state = 'queued';

-- Held rows, by lease expiry (the rescuer scans only expired ones).
CREATE INDEX message_lease_idx ON {schema}.message (lease_expires_at)
    WHERE state = 'running';

-- Dead letters and cancellations, for retention and join(fail_fast=True).
CREATE INDEX message_finished_idx ON {schema}.message (queue_name, finished_at)
    WHERE state IN ('dead', 'cancelled');

-- Counters that survive restarts, for operators (stale writes and the like).
CREATE TABLE {schema}.counter (
    name  text   PRIMARY KEY,
    value bigint NOT NULL DEFAULT 0
);
