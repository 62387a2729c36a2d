-- Worker processes, for operators (issue 26): one row per process that runs a
-- Dramatiq worker on this schema.  Its maintenance loop updates it every
-- heartbeat (processes.HEARTBEAT_SECONDS: one small statement per process);
-- the worker deletes it on a clean shutdown; a row whose heartbeat stopped is
-- shown stale (three of its intervals late), and the maintenance loop of any process purges it an hour later.
-- busy / prefetched (and per_queue: per queue, an array [busy, prefetched]) are the
-- process's own counts at its last heartbeat: actors running, and deliveries
-- claimed but not started.  Updated in place: room for HOT updates.
CREATE TABLE {schema}.process (
    process_id   text        PRIMARY KEY,  -- the writer / lease holder prefix: host:pid:suffix
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    queues       text[]      NOT NULL,
    threads      integer     NOT NULL,
    busy         integer     NOT NULL DEFAULT 0,
    prefetched   integer     NOT NULL DEFAULT 0,
    per_queue    jsonb       NOT NULL DEFAULT jsonb_build_object(),
    running      uuid[]      NOT NULL DEFAULT ARRAY[]::uuid[],  -- the messages whose actor runs (busy ones)
    version      text        NOT NULL,
    beat_seconds float8      NOT NULL,  -- its heartbeat's interval: stale after a few of them
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
) WITH (
    fillfactor = 50,
    autovacuum_vacuum_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);
