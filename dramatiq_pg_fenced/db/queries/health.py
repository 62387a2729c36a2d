"""The database's health (``ops/health.py``): what holds back cleanup, and how the queue tables grow.

All from the statistics views and catalogs, readable by any role (no table is scanned but
the history's oldest row, by ``history_finished_idx``):

- ``pg_stat_activity``: a session's ``xact_start``, ``state``, ``backend_xmin`` and
  ``backend_xid`` (what pins the cleanup horizon) are shown only for the role's own sessions,
  unless it is a member of ``pg_read_all_stats`` (or a superuser); other roles' sessions show
  ``'<insufficient privilege>'`` as their query: counted, so the page can say so;
- ``pg_replication_slots`` (a slot's ``xmin``: a standby's ``hot_standby_feedback``) and
  ``pg_prepared_xacts`` (a prepared transaction pins the horizon until committed or rolled back);
- ``pg_stat_user_tables`` and ``pg_total_relation_size`` of the schema's tables.

Only this database's sessions pin its tables' horizon (and a walsender's, ``datname`` NULL).
"""

from __future__ import annotations

TEMPLATES: dict[str, str] = {
    # The sessions holding a transaction id or a snapshot (or in a transaction), oldest first.
    "health_activity": """
        SELECT pid, usename, application_name, state, backend_type,
               extract(epoch FROM now() - xact_start)::float8,
               extract(epoch FROM now() - query_start)::float8,
               extract(epoch FROM now() - state_change)::float8,
               age(backend_xmin), age(backend_xid), left(query, 300), query_start
          FROM pg_stat_activity
         WHERE pid <> pg_backend_pid()
           AND (datname = current_database() OR (datname IS NULL AND backend_xmin IS NOT NULL))
           AND (xact_start IS NOT NULL OR backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
         ORDER BY greatest(age(backend_xmin), age(backend_xid)) DESC NULLS LAST, xact_start NULLS LAST
         LIMIT %(limit)s
    """,
    # What this role may see of the others' sessions: hidden ones, and whether it sees all.
    "health_visibility": """
        SELECT count(*) FILTER (WHERE query = '<insufficient privilege>' AND pid <> pg_backend_pid()),
               current_user,
               pg_has_role(current_user, 'pg_read_all_stats', 'USAGE')
          FROM pg_stat_activity
         WHERE datname = current_database()
    """,
    "health_slots": """
        SELECT slot_name, slot_type, active, age(xmin), age(catalog_xmin)
          FROM pg_replication_slots
         WHERE (xmin IS NOT NULL OR catalog_xmin IS NOT NULL)
           AND (database IS NULL OR database = current_database())
         ORDER BY greatest(age(xmin), age(catalog_xmin)) DESC
    """,
    "health_prepared": """
        SELECT gid, owner, extract(epoch FROM now() - prepared)::float8, age(transaction)
          FROM pg_prepared_xacts
         WHERE database = current_database()
         ORDER BY prepared
    """,
    # The schema's tables, largest first: rows, dead rows, size, vacuum and analyze.  The statistics
    # functions of pg_stat_user_tables called on the schema's tables alone: the view computes them for
    # every table of the database before the join (290 ms against 3 ms, measured on a database of 700
    # relations).
    "health_tables": """
        SELECT c.relname, pg_stat_get_live_tuples(c.oid), pg_stat_get_dead_tuples(c.oid), t.size,
               pg_stat_get_last_autovacuum_time(c.oid), pg_stat_get_last_vacuum_time(c.oid),
               pg_stat_get_last_autoanalyze_time(c.oid), pg_stat_get_autovacuum_count(c.oid),
               pg_stat_get_autoanalyze_count(c.oid), pg_stat_get_mod_since_analyze(c.oid)
          FROM pg_class AS c CROSS JOIN LATERAL (SELECT pg_total_relation_size(c.oid) AS size) AS t
         WHERE c.relnamespace = '{schema}'::regnamespace AND c.relkind IN ('r', 'p')
         ORDER BY t.size DESC, c.relname
    """,
    # The history's oldest row (history_finished_idx: one index probe).
    "health_history": "SELECT extract(epoch FROM now() - min(finished_at))::float8 FROM {schema}.history",
}
