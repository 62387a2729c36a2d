-- A message's whole story (issue 42): one row per delivery that ended without an ack, written in the
-- same statement as the outcome it records, so it commits with it and is fenced the same way: the
-- retry ('retried'), the dead letter ('dead'), the rescue of a lapsed lease ('lease lost'), the
-- release of a claim whose response was lost ('claim lost'), the release at shutdown ('requeued');
-- and, written with the writer's stale-write report, a write refused by the fence ('fenced out': a
-- stale delivery's late retry, nack or ack) or the end of a delivery whose message was cancelled
-- while it ran ('cancelled').  The ack itself goes to history, as before.  Written only while the
-- broker keeps history (keep_finished > 0), and purged with it, by the same age.  Append-only: no
-- room kept for updates, no primary key (nothing looks a row up by id; id orders the rows).
CREATE TABLE {schema}.attempt_log (
    id          bigint      GENERATED ALWAYS AS IDENTITY,
    message_id  uuid        NOT NULL,
    seq         bigint,               -- the message row's seq (its incarnation); NULL: a fenced-out write
    attempt     integer     NOT NULL,
    delivery    uuid,                 -- the delivery's fence token
    queue_name  text,
    consumer_id text,                 -- the consumer that claimed it (a fenced-out write: its process)
    claimed_at  timestamptz,          -- NULL: not known (a fenced-out write)
    ended_at    timestamptz NOT NULL,
    outcome     text        NOT NULL,
    error       text
) WITH (
    autovacuum_vacuum_scale_factor = 0.02,
    autovacuum_vacuum_insert_scale_factor = 0.05,
    autovacuum_vacuum_cost_delay = 0
);

-- inspect(message_id) and the message page.
CREATE INDEX attempt_log_message_idx ON {schema}.attempt_log (message_id);
-- The purge: oldest first, a batch at a time (as history_finished_idx).
CREATE INDEX attempt_log_ended_idx ON {schema}.attempt_log (ended_at);

-- The message page's audit rows of one message: the bulk actions that named it by id (their
-- selection's "ids"), found without reading every audit row.
CREATE INDEX audit_ids_idx ON {schema}.audit USING gin ((selection -> 'ids'));
