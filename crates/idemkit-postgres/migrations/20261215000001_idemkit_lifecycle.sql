-- Multi-step lifecycle (SPEC §6, §7): the `parked` state and the review table.

-- Widen the state check to admit `parked`. Every existing row satisfies the old,
-- narrower check, so the new one is added NOT VALID: no scan of the key table
-- while this migration holds its lock, and it still applies to every write.
ALTER TABLE idemkit_keys DROP CONSTRAINT IF EXISTS idemkit_keys_state_check;
ALTER TABLE idemkit_keys ADD CONSTRAINT idemkit_keys_state_check
    CHECK (state IN ('in_flight', 'completed', 'released', 'parked')) NOT VALID;

-- Requests that never completed (in flight with an expired lease, or parked),
-- moved here by the reaper for a human to look at: where each got to
-- (recovery_point, step_outputs as JSON object text: `step_outputs::jsonb`),
-- why it stopped (last_error) and what was asked (req_*). Times are Unix
-- milliseconds. A key can be reaped more than once over its life, hence the
-- surrogate id.
CREATE TABLE IF NOT EXISTS idemkit_review (
    id             BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    account        TEXT   NOT NULL,
    idem_key       TEXT   NOT NULL,
    state          TEXT   NOT NULL CHECK (state IN ('in_flight', 'parked')),
    created_at     BIGINT NOT NULL,
    reaped_at      BIGINT NOT NULL,
    recovery_point TEXT,
    step_outputs   TEXT   NOT NULL DEFAULT '{}',
    last_error     TEXT,
    req_method     TEXT   NOT NULL,
    req_path       TEXT   NOT NULL,
    req_headers    TEXT   NOT NULL,
    req_body       BYTEA  NOT NULL
);

CREATE INDEX IF NOT EXISTS idemkit_review_created ON idemkit_review (created_at);
CREATE INDEX IF NOT EXISTS idemkit_review_scope ON idemkit_review (account, idem_key);
