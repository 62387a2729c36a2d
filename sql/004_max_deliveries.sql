-- Deliveries of a message that ended without any outcome: the worker crashed
-- or lost its lease (the rescue statement puts the row back), or the claim's
-- response was lost (release_unseen).  At the broker's max_deliveries the
-- message is dead-lettered instead of queued again, so a message that kills
-- its worker does not do so forever.  Retries and releases at shutdown are
-- outcomes: they do not count.
-- A column with a constant default: no table rewrite (PostgreSQL 11+).

ALTER TABLE {schema}.message ADD COLUMN lost_deliveries integer NOT NULL DEFAULT 0;
