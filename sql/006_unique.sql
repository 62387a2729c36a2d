-- Unique messages: a send that carries a key is not inserted while another
-- message of the same actor holds that key; the sender gets the holder's id.
--
-- unique_key   the key, while the row may hold it (NULL: no key, or given up:
--              see sql.py, _RETAKE).
-- unique_until 'started': held while queued (retries waiting included);
--              'finished': held while queued or running.  NULL without a key.
--
-- Nullable columns without a default: adding them rewrites nothing.  The two
-- indexes are built in the migration's transaction: enqueues and claims wait
-- for the scan of the message table (short when the backlog is small; migrate
-- with the queues drained if it is not).
ALTER TABLE {schema}.message ADD COLUMN unique_key text;
ALTER TABLE {schema}.message ADD COLUMN unique_until text
    CHECK (unique_until IN ('started', 'finished'));

-- The guarantee itself: at most one holder per actor and key, across every
-- process and host.  Only rows with a key are in it, so a send without one
-- costs a predicate check and nothing more.  The enqueue's
-- ON CONFLICT DO NOTHING (no conflict target) covers this index too: a key
-- already held makes the insert do nothing, never fail.  A row leaves the
-- index when it is acked (deleted), dead-lettered or cancelled, and, with
-- 'started', when a worker claims it.
CREATE UNIQUE INDEX message_unique_idx ON {schema}.message (actor_name, unique_key)
    WHERE unique_key IS NOT NULL
      AND (state = 'queued' OR (state = 'running' AND unique_until = 'finished'));

-- Every row that still carries a key, by key: a row going back to the queue
-- (a retry, a release, a rescue, a re-drive) asks whether another row carries
-- its key before it takes the key back (sql.py, _retake).  Rows without a key
-- are not in it.
CREATE INDEX message_key_idx ON {schema}.message (actor_name, unique_key)
    WHERE unique_key IS NOT NULL;
