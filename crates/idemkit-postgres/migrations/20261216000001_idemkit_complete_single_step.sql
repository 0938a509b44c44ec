-- A single-step request's completion, as a function so it can ride with the
-- transaction's COMMIT in one simple-query round trip (which binds no
-- parameters) and still run a plan the session has cached: the caller sends
-- `SELECT idemkit_complete_single_step(<literals>); COMMIT; BEGIN`.
-- The update must change exactly one row; otherwise the exception aborts the
-- transaction before the COMMIT runs (the server skips the rest of a query
-- string after an error), so business writes never commit beside a record left
-- in flight. SQLSTATE IK001 is mapped to a fenced write by the store.
-- `p_now` is a test clock; NULL reads the database's.
CREATE OR REPLACE FUNCTION idemkit_complete_single_step(
    p_account TEXT, p_key TEXT, p_token BIGINT, p_now BIGINT,
    p_status INTEGER, p_headers TEXT, p_body BYTEA
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    UPDATE idemkit_keys SET state = 'completed',
        completed_at = COALESCE(p_now, (extract(epoch from clock_timestamp()) * 1000)::bigint),
        resp_status = p_status, resp_headers = p_headers, resp_body = p_body, last_error = NULL
    WHERE account = p_account AND idem_key = p_key AND fencing_token = p_token AND state = 'in_flight';
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemkit: the single-step record changed under its holder' USING ERRCODE = 'IK001';
    END IF;
END
$$;
