-- idemkit key store. One row per (account, key); the primary key is the unique
-- constraint that arbitrates claims.
CREATE TABLE IF NOT EXISTS idemkit_keys (
    account          TEXT    NOT NULL,
    idem_key         TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'released')),
    created_at       INTEGER NOT NULL,
    completed_at     INTEGER,
    lease_expires_at INTEGER NOT NULL,
    fencing_token    INTEGER NOT NULL CHECK (fencing_token > 0),
    recovery_point   TEXT,
    step_outputs     TEXT    NOT NULL DEFAULT '{}',
    req_method       TEXT    NOT NULL,
    req_path         TEXT    NOT NULL,
    req_headers      TEXT    NOT NULL,
    req_body         BLOB    NOT NULL,
    resp_status      INTEGER,
    resp_headers     TEXT,
    resp_body        BLOB,
    last_error       TEXT,
    PRIMARY KEY (account, idem_key)
);

-- The completer looks for expired leases; the reaper for old records.
CREATE INDEX IF NOT EXISTS idemkit_keys_state_lease ON idemkit_keys (state, lease_expires_at);
CREATE INDEX IF NOT EXISTS idemkit_keys_created ON idemkit_keys (created_at);
