-- The completer looks for in-flight records whose lease has run out; the
-- completed ones, the bulk of the table, are found by scope (the primary key)
-- or by age (`idemkit_keys_created`). A partial index holds only in-flight
-- records, so completing one adds no entry to it: one index write fewer per
-- request. Other state queries (the reaper's, an operator's listing) filter
-- on `created_at` or are rare enough to scan.
DROP INDEX IF EXISTS idemkit_keys_state_lease;
CREATE INDEX IF NOT EXISTS idemkit_keys_in_flight ON idemkit_keys (lease_expires_at)
    WHERE state = 'in_flight';
