-- Single-step claims written once, at commit (issue 16). The claim no longer
-- inserts an in-flight row that the completion then updates (two heap tuples
-- and five index entries per request): the transaction's opening takes a
-- transaction-scoped advisory lock on the key's hash, the claim reads the record
-- (its snapshot is taken after the lock), and the completion inserts the record
-- already completed (one tuple, two index entries), with the COMMIT.
--
-- The advisory lock arbitrates concurrent single-step claims of one key, across
-- instances: the loser waits for the holder's transaction to end, bounded by
-- the transaction's lock_timeout (in-flight = reject: 100 ms by default, then
-- SQLSTATE 55P03, 409 in progress), after which its read sees the committed
-- record (a replay). Lease-mode claims of the same key do not take the lock;
-- the completion's primary key arbitrates against them (below).

-- The completion of a claim that found the key absent: inserts the record,
-- completed, so that it rides with the COMMIT in one simple-query round trip
-- (`SELECT idemkit_insert_single_step(<literals>); COMMIT; BEGIN`). A row that
-- appeared since the claim read the key absent (a lease-mode claim, which takes
-- no advisory lock) wins: the exception (SQLSTATE IK002) aborts the transaction
-- before the COMMIT, so the handler's writes roll back, and the store reports a
-- conflict at commit.
CREATE OR REPLACE FUNCTION idemkit_insert_single_step(
    p_account TEXT, p_key TEXT, p_token BIGINT, p_now BIGINT, p_created_at BIGINT,
    p_lease_expires_at BIGINT, p_fingerprint BYTEA, p_recovery_point TEXT, p_method TEXT,
    p_path TEXT, p_req_headers TEXT, p_req_body BYTEA, p_status INTEGER, p_headers TEXT,
    p_body BYTEA
) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, completed_at,
        lease_expires_at, fencing_token, recovery_point, req_method, req_path, req_headers,
        req_body, resp_status, resp_headers, resp_body)
    VALUES (p_account, p_key, p_fingerprint, 'completed', p_created_at,
        GREATEST(p_created_at, COALESCE(p_now, (extract(epoch from clock_timestamp()) * 1000)::bigint)),
        p_lease_expires_at, p_token, p_recovery_point, p_method, p_path, p_req_headers,
        p_req_body, p_status, p_headers, p_body)
    ON CONFLICT (account, idem_key) DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'idemkit: another claim of this key committed first' USING ERRCODE = 'IK002';
    END IF;
END
$$;
