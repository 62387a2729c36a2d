-- Running is running (issue 42): when each of a process's running actors started, aligned with
-- its running ids (written by its heartbeat, as those are): lists and the message page show a
-- running message's run time so far, and tell it from one waiting in a worker's prefetch.  Nothing
-- on the hot path: the start is kept in the process's memory, written once per heartbeat.
ALTER TABLE {schema}.process ADD COLUMN running_since timestamptz[] NOT NULL DEFAULT ARRAY[]::timestamptz[];
