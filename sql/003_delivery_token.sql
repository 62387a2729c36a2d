-- A fence token no other delivery can hold.  The attempt number alone is not
-- one: it restarts at 1 when a message id is inserted again after its row was
-- acked (a re-send, a duplicate pipeline step), so a stale delivery of the old
-- row could settle the new one.  Every claim draws a random token; every
-- fenced write names it.  options["attempt"] stays the number users read.
ALTER TABLE {schema}.message ADD COLUMN delivery uuid;

-- Results remember the delivery that stored them, so a fenced result write
-- (results.py) is checked against the row's token too.
ALTER TABLE {schema}.result ADD COLUMN delivery uuid;
