-- A lost claim reply never holds a key with no holder (SPEC §3): each lease-mode
-- claim writes an attempt id of its own with its claim, and a claim that cannot
-- tell whether its write committed (the write went out, the answer did not come
-- back) reads the record: carrying its attempt id, the claim is its own. Every
-- write that hands the record on (a new token) clears it. Additive: a release
-- that does not know the column leaves it NULL, which matches no attempt.
ALTER TABLE idemkit_keys ADD COLUMN claim_attempt TEXT;
