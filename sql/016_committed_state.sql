-- A fenced transaction (broker.fenced_transaction(), exactly_once.py) no longer acks its delivery
-- in the actor's transaction with a row in the committed table (migration 010): it moves the
-- message row from 'running' to 'committed' as it begins, under its token, and that state commits
-- with the actor's writes or rolls back with them.  The outcome writer finishes committed rows as
-- it finishes acks, batched and fenced on the token (sql.py, committed_done); maintenance finishes
-- those a dead worker left (finish_committed).  The block's end is a plain COMMIT.
ALTER TABLE {schema}.message DROP CONSTRAINT message_state_check;
ALTER TABLE {schema}.message ADD CONSTRAINT message_state_check
    CHECK (state IN ('queued', 'running', 'committed', 'dead', 'cancelled')) NOT VALID;
ALTER TABLE {schema}.message VALIDATE CONSTRAINT message_state_check;

-- Rows a worker of the previous version left (its block committed, its writer did not finish):
-- those messages are done.
DROP TABLE {schema}.committed;
