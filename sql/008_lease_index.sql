-- The lease index covers the rows that hold a lease (running ones), by the
-- lease's expiry, for the rescuer.  It was partial on state = 'running', and
-- every fenced write (ack, nack, retry, requeue, extend, the start check)
-- filters on state = 'running' by message id: with statistics that saw few
-- running rows, the planner chose to scan the whole lease index for them
-- instead of looking the ids up in the primary key.  While another session
-- holds an old snapshot, that index keeps every lease ever taken since, and
-- each ack walked all of them (10-20 ms per ack after two minutes at 300
-- messages/s).  A predicate no fenced write implies leaves them the primary
-- key; the statements that want this index say lease_expires_at IS NOT NULL
-- (or compare it, which implies it).  Only running rows hold a lease.
DROP INDEX {schema}.message_lease_idx;
CREATE INDEX message_lease_idx ON {schema}.message (lease_expires_at) WHERE lease_expires_at IS NOT NULL;
