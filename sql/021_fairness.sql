-- Fair shares between keys (tenants, accounts) of one queue (sending/fairness.py, docs/fairness.md).
--
-- fairness_key  the message's key (NULL: none; the row is claimed exactly as before).
-- fair_tag      its place in the queue's weighted round robin, set at enqueue (start-time fair
--               queuing): the key's last tag, or the queue's virtual time if that is later (a key
--               that was idle earns no credit), plus 1/weight per message.  The fair claim serves
--               the lowest tags first, and, within a key, its due rows in the usual order
--               (priority, then available_at).  NULL without a key.
--
-- Nullable columns without a default: adding them rewrites nothing.  The indexes are partial on
-- keyed rows: a row without a key is in neither, so a send without one pays a predicate check.
ALTER TABLE {schema}.message ADD COLUMN fairness_key text;
ALTER TABLE {schema}.message ADD COLUMN fair_tag double precision;

-- The fair claim's slots: the queue's due keyed rows by tag (and the queue's virtual time: the
-- lowest tag queued).
CREATE INDEX message_fair_tag_idx ON {schema}.message (queue_name, fair_tag, seq)
    WHERE state = 'queued' AND fair_tag IS NOT NULL;

-- Which rows of a key fill its slots: the key's due rows in claim order.
CREATE INDEX message_fair_key_idx ON {schema}.message (queue_name, fairness_key, priority, available_at, seq)
    WHERE state = 'queued' AND fairness_key IS NOT NULL;

-- Per queue and key: the last tag given (the next message of the key starts after it) and the
-- step of the last enqueue (1/weight times its messages of the key).  One row per key ever sent
-- (kept: no purge yet).
CREATE TABLE {schema}.fairness_tag (
    queue_name text             NOT NULL,
    key        text             NOT NULL,
    last_tag   double precision NOT NULL,
    step       double precision NOT NULL,
    PRIMARY KEY (queue_name, key)
) WITH (fillfactor = 70);

CREATE INDEX fairness_tag_last_idx ON {schema}.fairness_tag (queue_name, last_tag);

-- Weights per queue and key (default 1): a key of weight 3 gets three times the share of a key of
-- weight 1 while both have rows due.  Read at enqueue: a change applies to the messages sent after it.
CREATE TABLE {schema}.fairness_weight (
    queue_name text             NOT NULL,
    key        text             NOT NULL,
    weight     double precision NOT NULL CHECK (weight > 0 AND weight < 'Infinity'),
    PRIMARY KEY (queue_name, key)
);
