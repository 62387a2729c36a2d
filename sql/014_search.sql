-- The console's search by argument value (issue 26): a message's args and kwargs as jsonb, for
-- JSON containment (@>).  NULL for a payload that is not JSON (Dramatiq's encoder is pluggable:
-- a pickled message is not searchable by argument, and never an error).
CREATE FUNCTION {schema}.message_arguments(payload bytea) RETURNS jsonb
    LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    message jsonb;
BEGIN
    message := convert_from(payload, 'UTF8')::jsonb;
    RETURN jsonb_build_object('args', message -> 'args', 'kwargs', message -> 'kwargs');
EXCEPTION WHEN others THEN
    RETURN NULL;
END
$$;
