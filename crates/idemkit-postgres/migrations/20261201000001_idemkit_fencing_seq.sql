-- Fencing tokens from one store-wide sequence (SPEC §3, §7). Every token a
-- record is moved to (claim, takeover, reuse, abandon, park, operator release,
-- reaper) is a fresh value, so tokens never repeat for a key, not even after the
-- reaper deleted its record: a holder paused since then can never match again.
-- Sequences are not transactional, so no snapshot can hand out an old value.
CREATE SEQUENCE IF NOT EXISTS idemkit_fencing_seq;
SELECT setval('idemkit_fencing_seq', GREATEST(m, 1), m > 0)
    FROM (SELECT COALESCE(MAX(fencing_token), 0) AS m FROM idemkit_keys) AS t;
