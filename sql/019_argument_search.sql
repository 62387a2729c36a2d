-- message_arguments (014) was declared PARALLEL SAFE, but its EXCEPTION block starts a
-- subtransaction, which a parallel worker refuses ("cannot start subtransactions during a
-- parallel operation", and so does the leader of a parallel plan): a search or a bulk selection by
-- argument planned as a parallel scan (a large table) failed.  Unsafe: no plan that calls it is parallel.  The search by a plain value
-- (issue 42) uses it too, with jsonb_path_exists: no index, so sends, claims and acks pay
-- nothing for it (a read of 100,000 rows takes about half a second).
ALTER FUNCTION {schema}.message_arguments(bytea) PARALLEL UNSAFE;
