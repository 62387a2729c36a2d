-- Messages a relay moved into this database from another's outbox (routing.py, RoutedBroker: a
-- pipeline step, callback or with_ack() send whose queue lives here, written in the ack's
-- transaction in the delivery's own database).  The relay inserts the message here only with its
-- row here, in one statement, and deletes it there only after this commits: a relay that dies in
-- between moves the same row again, and this row makes that second insert nothing, even after the
-- message ran and left the message table.  A move is the row it moved: the message id, the source
-- database's name in the router's configuration and the row's seq there.  A message that comes
-- back to a database and leaves again (two configurations disagreeing during a deploy send it to
-- and fro) is another row there, another seq, so it is moved, not mistaken for a move done.
-- Rows are purged after a week (routing.RELAYED_KEEP).
CREATE TABLE {schema}.relayed (
    message_id uuid        NOT NULL,
    source     text        NOT NULL,
    source_seq bigint      NOT NULL,
    relayed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (message_id, source, source_seq)
);

CREATE INDEX relayed_at_idx ON {schema}.relayed (relayed_at);
