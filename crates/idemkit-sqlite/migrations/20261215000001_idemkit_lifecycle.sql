-- Multi-step lifecycle (SPEC §6, §7): the `parked` state and the review table.
--
-- SQLite cannot change a CHECK constraint in place, so the key table is rebuilt
-- the documented way (create the new shape, copy, drop, rename, re-create the
-- indexes), inside this migration's transaction.
CREATE TABLE idemkit_keys_new (
    account          TEXT    NOT NULL,
    idem_key         TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'released', 'parked')),
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

INSERT INTO idemkit_keys_new (account, idem_key, fingerprint, state, created_at, completed_at,
    lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers,
    req_body, resp_status, resp_headers, resp_body, last_error)
SELECT account, idem_key, fingerprint, state, created_at, completed_at,
    lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers,
    req_body, resp_status, resp_headers, resp_body, last_error
FROM idemkit_keys;

DROP TABLE idemkit_keys;
ALTER TABLE idemkit_keys_new RENAME TO idemkit_keys;

-- The completer looks for expired leases (state, lease_expires_at); the reaper
-- for old records (created_at; completed_at >= created_at, so it serves the
-- completed-record cut too).
CREATE INDEX idemkit_keys_state_lease ON idemkit_keys (state, lease_expires_at);
CREATE INDEX idemkit_keys_created ON idemkit_keys (created_at);

-- Requests that never completed (in flight with an expired lease, or parked),
-- moved here by the reaper for a human to look at: where each got to
-- (recovery_point, step_outputs as a JSON object), why it stopped (last_error)
-- and what was asked (req_*). Times are Unix milliseconds. A key can be reaped
-- more than once over its life, hence the surrogate id.
CREATE TABLE idemkit_review (
    id             INTEGER PRIMARY KEY AUTOINCREMENT,
    account        TEXT    NOT NULL,
    idem_key       TEXT    NOT NULL,
    state          TEXT    NOT NULL CHECK (state IN ('in_flight', 'parked')),
    created_at     INTEGER NOT NULL,
    reaped_at      INTEGER NOT NULL,
    recovery_point TEXT,
    step_outputs   TEXT    NOT NULL DEFAULT '{}',
    last_error     TEXT,
    req_method     TEXT    NOT NULL,
    req_path       TEXT    NOT NULL,
    req_headers    TEXT    NOT NULL,
    req_body       BLOB    NOT NULL
);

CREATE INDEX idemkit_review_created ON idemkit_review (created_at);
CREATE INDEX idemkit_review_scope ON idemkit_review (account, idem_key);
