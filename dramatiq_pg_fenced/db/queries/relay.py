"""The relay of a routed broker (``routing/``, migration 017)."""

from __future__ import annotations

from .enqueue import _RING
from .pieces import _DURABLE

# -- the relay of a routed broker (routing.py, migration 017) ----------------------
# A database's outbox is its message table: queued rows of queues routed to
# another database (a delivery's follow-ups, written with its outcome).  The
# relay looks (relay_look), then takes a batch (relay_take, SKIP LOCKED: relays
# of several processes share the work) and deletes it in a transaction it
# commits only after relay_put committed there; relay_put inserts a message
# only with its relayed row (message id, source database, its seq there), so
# moving the same row again inserts nothing.  The delay left goes with it
# (each server counts it by its own clock), and so do the row's attempt, lost
# deliveries, last error and send time: a move never gives a message an
# attempt number it had already, nor forgets deliveries max_deliveries counts.
# A move whose message the target refuses (its id is there already, or
# another message holds its unique key) inserts its relayed row only: it is
# counted ("relay_conflicts") and returned, for the relay to log; a hot counter
# row is touched only then.
#
# Only rows whose commit is on disk are moved.  An outbox row is written by an
# ack that commits asynchronously by default (synchronous_commit off); moved
# before the WAL flush and then undone by a crash, its delivery runs again and
# sends it again: twice in the target.  relay_look reads the candidates (no
# lock, so it writes no WAL of its own) and, in the same statement, so after
# its snapshot, the WAL insert position: every commit that statement sees
# inserted its commit record before it became visible, so below that
# position.  If the WAL is not flushed up to there, the statement makes a
# durable write (a counter row, "relay_flushes"), and its commit, whose
# record comes after that position, flushes the WAL up to itself: every
# earlier record, so every async commit the look saw.  (A read-only
# transaction writes no commit record and flushes nothing: hence the write.)
# relay_take then deletes only those rows at the version the look saw (their
# xmin: the transaction that wrote that version, committed before the look),
# never a version written after it.  On a standby (recovery) the position is
# not read and the take fails as any write there does.
TEMPLATES: dict[str, str] = {}
TEMPLATES.update(
    {
        "relay_look": """
            WITH look AS MATERIALIZED (
                SELECT message_id, xmin::text AS version FROM {schema}.message
                 WHERE state = 'queued' AND queue_name = ANY(%(queues)s::text[])
                 ORDER BY seq LIMIT %(limit)s
            ), wal AS MATERIALIZED (
                SELECT pg_current_wal_insert_lsn() AS inserted, pg_current_wal_flush_lsn() AS flushed
                 WHERE EXISTS (SELECT FROM look) AND NOT pg_is_in_recovery()
            ), flushed AS (
                INSERT INTO {schema}.counter AS c (name, value)
                SELECT 'relay_flushes', 1
                  FROM wal, (SELECT CASE WHEN current_setting('synchronous_commit') = 'off'
                                         THEN set_config('synchronous_commit', 'on', true) END) AS durable
                 WHERE wal.flushed < wal.inserted
                ON CONFLICT (name) DO UPDATE SET value = c.value + 1
                RETURNING value
            )
            SELECT look.message_id, look.version, wal.inserted::text
              FROM look LEFT JOIN wal ON true
             WHERE (SELECT count(*) FROM flushed) >= 0
        """,
        "relay_take": """
            WITH taken AS (
                SELECT m.message_id FROM {schema}.message AS m
                  JOIN unnest(%(ids)s::uuid[], %(versions)s::text[]) AS l(id, version)
                    ON m.message_id = l.id AND m.xmin::text = l.version
                 WHERE m.message_id = ANY(%(ids)s::uuid[]) AND m.state = 'queued'
                   AND m.queue_name = ANY(%(queues)s::text[])
                 ORDER BY m.seq FOR UPDATE OF m SKIP LOCKED
            )
            DELETE FROM {schema}.message AS m USING taken
             WHERE m.message_id = ANY(ARRAY(SELECT message_id FROM taken)) AND m.message_id = taken.message_id
            RETURNING m.message_id, m.queue_name, m.actor_name, m.priority,
                      greatest(0, ceil(extract(epoch FROM m.available_at - now()) * 1000))::bigint,
                      m.payload, m.unique_key, m.unique_until, m.seq,
                      m.attempt, m.lost_deliveries, m.last_error, m.enqueued_at
        """,
        "relay_put": f"""
            WITH m AS MATERIALIZED (
                SELECT m.* FROM unnest(%s::uuid[], %s::text[], %s::text[], %s::int[], %s::bigint[], %s::bytea[],
                                       %s::text[], %s::text[], %s::bigint[], %s::int[], %s::int[], %s::text[],
                                       %s::timestamptz[])
                       AS m(id, queue, actor, priority, delay_ms, payload, key, until, seq,
                            attempt, lost, error, enqueued_at){_DURABLE}
            ), fresh AS (
                INSERT INTO {{schema}}.relayed (message_id, source, source_seq)
                SELECT id, %s, seq FROM m ON CONFLICT DO NOTHING
                RETURNING message_id
            ), ins AS (
                INSERT INTO {{schema}}.message
                    (message_id, queue_name, actor_name, priority, available_at, payload, unique_key, unique_until,
                     attempt, lost_deliveries, last_error, enqueued_at)
                SELECT m.id, m.queue, m.actor, m.priority, now() + m.delay_ms * interval '1 millisecond', m.payload,
                       m.key, m.until, coalesce(m.attempt, 0), coalesce(m.lost, 0), m.error,
                       coalesce(m.enqueued_at, now())
                  FROM m JOIN fresh ON fresh.message_id = m.id
                ON CONFLICT DO NOTHING
                RETURNING message_id, queue_name, available_at
            ), conflicts AS (
                SELECT f.message_id FROM fresh AS f
                 WHERE NOT EXISTS (SELECT FROM ins WHERE ins.message_id = f.message_id)
            ), counted AS (
                INSERT INTO {{schema}}.counter AS c (name, value)
                SELECT 'relay_conflicts', count(*) FROM conflicts HAVING count(*) > 0
                ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
            ), {_RING}
            SELECT (SELECT count(*) FROM ins) AS inserted, (SELECT count(*) FROM rung) AS rung,
                   ARRAY(SELECT message_id::text FROM conflicts ORDER BY 1) AS conflicts
        """,
        # The countdowns of group members in other databases (groups.py), moved to the group's home:
        # each is applied only with its relayed row, as relay_put inserts a message.
        # Durable (_DURABLE: sets it for the home's transaction, whatever the defaults): the relay deletes
        # the rows in their outbox once this commit returns.
        "relay_mark": f"""
            INSERT INTO {{schema}}.relayed (message_id, source, source_seq)
            SELECT id, %(source)s, seq FROM unnest(%(ids)s::uuid[], %(seqs)s::bigint[]) AS m(id, seq){_DURABLE}
            ON CONFLICT DO NOTHING
            RETURNING message_id::text
        """,
        # An outbox row its target cannot take (a countdown row that is none) goes back where it was,
        # dead, and is counted with the conflicts, in the relay's transaction that deleted it.
        "relay_dead": """
            WITH dead AS (
                INSERT INTO {schema}.message
                    (message_id, queue_name, actor_name, priority, state, finished_at, last_error, payload)
                VALUES (%(id)s, %(queue)s, %(actor)s, %(priority)s, 'dead', now(), %(error)s, %(payload)s)
                RETURNING message_id
            )
            INSERT INTO {schema}.counter AS c (name, value)
            SELECT 'relay_conflicts', count(*) FROM dead
            ON CONFLICT (name) DO UPDATE SET value = c.value + EXCLUDED.value
        """,
        "relay_waiting": """
            SELECT count(*) FROM {schema}.message WHERE state = 'queued' AND queue_name = ANY(%s::text[])
        """,
        # ... or still running there (a queue being moved: routing.RoutedBroker.move_queue).
        "relay_left": """
            SELECT count(*) FROM {schema}.message
             WHERE state IN ('queued', 'running', 'committed') AND queue_name = ANY(%s::text[])
        """,
        "relay_purge": "DELETE FROM {schema}.relayed WHERE relayed_at < now() - %s * interval '1 second'",
    }
)
