-- The delayed rows of each queue, by when they are due, for the consumer's next_due (db/queries/
-- lifecycle.py): one probe from now() on.  It read them by the claim index, a probe per priority in
-- use from the head of its range, and while another session holds an old snapshot the head of that
-- index keeps an entry for every row claimed since (no vacuum may remove them), so each probe walked
-- all of them (issue 41).  Here a row delayed past its enqueue only (available_at > enqueued_at:
-- sent with a delay, retried, relayed): a plain enqueue writes no entry, a claim leaves none behind
-- before now() (a row is claimed only once due).
CREATE INDEX message_delayed_idx ON {schema}.message (queue_name, available_at)
    WHERE state = 'queued' AND available_at > enqueued_at;
