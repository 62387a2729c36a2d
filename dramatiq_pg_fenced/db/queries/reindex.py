"""The reindex chore's reads (``core/reindex.py``): the message table's indexes and what holds back its horizon.

The ``REINDEX`` and ``DROP INDEX`` themselves name an index: composed with ``psycopg.sql`` there.
"""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    # The message table's indexes: name, bytes, whether valid (an invalid one is the copy a reindex
    # left when it failed: PostgreSQL updates it on every write, and no query reads it), and the
    # table's live rows (the larger of the planner's and the statistics' estimates: either may lag) and dead ones.
    "reindex_indexes": """
        SELECT c.relname, pg_relation_size(c.oid), i.indisvalid,
               greatest(t.reltuples, coalesce(s.n_live_tup, 0), 0)::bigint, coalesce(s.n_dead_tup, 0)
          FROM pg_index AS i
          JOIN pg_class AS c ON c.oid = i.indexrelid
          JOIN pg_class AS t ON t.oid = i.indrelid
          LEFT JOIN pg_stat_user_tables AS s ON s.relid = i.indrelid
         WHERE i.indrelid = to_regclass(%(table)s)
         ORDER BY 2 DESC
    """,
    # Transactions of this database's clients older than %(old)s seconds, this session's aside: a
    # reindex started now would wait for each (vacuum's are not waited for, nor counted here).
    "reindex_old_transactions": """
        SELECT count(*) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
           AND backend_xmin IS NOT NULL AND xact_start < now() - %(old)s * interval '1 second'
    """,
}
