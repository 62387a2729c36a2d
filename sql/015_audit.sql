-- The console's bulk actions (issue 26): each is recorded here as it starts (who, when, what,
-- the filter or the ids, how many its preview counted) and completed with how many it touched
-- and skipped (NULL: it did not finish, e.g. its process died).  Rare rows, kept.
CREATE TABLE {schema}.audit (
    id        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    who       text        NOT NULL,
    action    text        NOT NULL,
    selection jsonb       NOT NULL,
    previewed integer     NOT NULL,
    touched   integer,
    skipped   integer,
    ended_at  timestamptz
);
