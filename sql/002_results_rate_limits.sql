-- Actor results (Dramatiq's Results middleware) and rate-limiter keys
-- (ConcurrentRateLimiter, WindowRateLimiter, BucketRateLimiter, Barrier,
-- GroupCallbacks), so neither needs Redis or Memcached.
-- Both expire: expired rows read as missing and are purged in batches.

-- One row per result key (Dramatiq's message key: an md5 or a readable
-- "namespace:queue:actor:message_id").  attempt is the delivery that stored it
-- (NULL when stored outside a delivery): a result is only replaced by the same
-- or a later attempt.
CREATE TABLE {schema}.result (
    key        text        PRIMARY KEY,
    message_id text        NOT NULL,
    attempt    integer,
    data       bytea       NOT NULL,
    stored_at  timestamptz NOT NULL DEFAULT now(),
    expires_at timestamptz NOT NULL
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_delay = 0
);

-- The purge deletes the oldest expired rows first.
CREATE INDEX result_expires_idx ON {schema}.result (expires_at);

-- Counters and events of the rate limiters.  Rows are updated in place all the
-- time: no index besides the key, and room on each page, so updates stay HOT.
-- The table stays small (keys expire), so the purge may scan it.
CREATE TABLE {schema}.rate_limit (
    key        text        PRIMARY KEY,
    value      bigint      NOT NULL,
    expires_at timestamptz NOT NULL
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_vacuum_cost_delay = 0
);
