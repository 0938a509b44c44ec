-- Single-step first requests in the handler's own round trips (issue 16). The
-- round trip that opens the transaction and takes the key's advisory lock also
-- checks that the key has no record, so a first request sends nothing beyond
-- the handler's BEGIN, its statements and its COMMIT:
--
--   BEGIN; SET LOCAL lock_timeout = …; SELECT pg_advisory_xact_lock(…);
--   SET LOCAL lock_timeout = 0; SELECT idemkit_single_step_absent(<account>, <key>)
--
-- The opening's rows never reach the client (sqlx reads its BEGIN's answer and
-- discards rows), so the check answers the one way that does: an error. A key
-- with a record (a replay, a conflict, a record to take over) raises SQLSTATE
-- IK003, which aborts the transaction; the store then rolls back and reads the
-- record in one round trip, and decides as before. The check runs after the
-- lock is granted, in a statement of its own, so its snapshot includes what
-- the lock's previous holder committed.
CREATE OR REPLACE FUNCTION idemkit_single_step_absent(p_account TEXT, p_key TEXT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM idemkit_keys WHERE account = p_account AND idem_key = p_key) THEN
        RAISE EXCEPTION 'idemkit: the key has a record' USING ERRCODE = 'IK003';
    END IF;
END
$$;

-- The completion of a single-step claim that found the key absent, with the
-- COMMIT: the record inserted completed, its fencing token drawn now (the
-- claim that skipped the read drew none), created at `p_created_at` (the store's
-- clock when the claim read the key, or a test clock) or, when NULL, now.
-- As `idemkit_insert_single_step` (which instances of the previous version keep
-- calling during a rolling upgrade): a row that appeared since the claim (a
-- lease-mode claim, which takes no advisory lock) wins, and the exception
-- (SQLSTATE IK002) aborts the transaction before its COMMIT.
CREATE OR REPLACE FUNCTION idemkit_insert_single_step_at_commit(
    p_account TEXT, p_key TEXT, p_now BIGINT, p_created_at BIGINT, p_lease_ms BIGINT,
    p_fingerprint BYTEA, p_recovery_point TEXT, p_method TEXT, p_path TEXT, p_req_headers TEXT,
    p_req_body BYTEA, p_status INTEGER, p_headers TEXT, p_body BYTEA
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_now BIGINT := COALESCE(p_now, (extract(epoch from clock_timestamp()) * 1000)::bigint);
    v_created BIGINT := COALESCE(p_created_at, v_now);
BEGIN
    INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, completed_at,
        lease_expires_at, fencing_token, recovery_point, req_method, req_path, req_headers,
        req_body, resp_status, resp_headers, resp_body)
    VALUES (p_account, p_key, p_fingerprint, 'completed', v_created, GREATEST(v_created, v_now),
        v_created + p_lease_ms, nextval('idemkit_fencing_seq'), p_recovery_point, p_method, p_path,
        p_req_headers, p_req_body, p_status, p_headers, p_body)
    ON CONFLICT (account, idem_key) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemkit: another claim of this key committed first' USING ERRCODE = 'IK002';
    END IF;
END
$$;
