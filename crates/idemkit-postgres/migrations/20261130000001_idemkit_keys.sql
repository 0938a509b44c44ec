-- idemkit key store (PostgreSQL). Created in the store's own schema: the pool's
-- search_path starts with it. One row per (account, key); the primary key is the
-- unique constraint that arbitrates claims.
CREATE TABLE IF NOT EXISTS idemkit_keys (
    account          TEXT    NOT NULL,
    idem_key         TEXT    NOT NULL,
    fingerprint      BYTEA   NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'released')),
    created_at       BIGINT  NOT NULL,
    completed_at     BIGINT,
    lease_expires_at BIGINT  NOT NULL,
    fencing_token    BIGINT  NOT NULL CHECK (fencing_token > 0),
    recovery_point   TEXT,
    step_outputs     TEXT    NOT NULL DEFAULT '{}',
    req_method       TEXT    NOT NULL,
    req_path         TEXT    NOT NULL,
    req_headers      TEXT    NOT NULL,
    req_body         BYTEA   NOT NULL,
    resp_status      INTEGER,
    resp_headers     TEXT,
    resp_body        BYTEA,
    last_error       TEXT,
    -- Set by an instance waiting for this key; only then do completions NOTIFY.
    has_waiters      BOOLEAN NOT NULL DEFAULT false,
    PRIMARY KEY (account, idem_key)
);

CREATE INDEX IF NOT EXISTS idemkit_keys_state_lease ON idemkit_keys (state, lease_expires_at);
CREATE INDEX IF NOT EXISTS idemkit_keys_created ON idemkit_keys (created_at);

-- Waiters LISTEN on `idemkit_changes` after setting `has_waiters`; the statements
-- that complete, release or end a lease early notify in the same round trip when
-- that flag is set (see `notifying` in lib.rs). A NOTIFY costs the listeners a
-- transaction each, so records nobody waits for never send one.
