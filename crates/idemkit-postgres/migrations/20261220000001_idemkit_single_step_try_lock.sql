-- Single-step openings without a lock wait (issue 16). With in-flight = reject
-- and no configured wait (`PgConfig::reject_lock_timeout` zero, the default), a
-- claim that finds the key's advisory lock held answers "in progress" at once:
-- the holder is a live request with this key. So the opening needs no
-- `SET LOCAL lock_timeout` before the lock and none after it, and the try-lock
-- and the absence check go in one function call:
--
--   BEGIN; SELECT idemkit_single_step_open(<lock>, <account>, <key>)
--
-- instead of five statements. "Not acquired" raises SQLSTATE 55P03
-- (lock_not_available), the error a `lock_timeout` raises, so both forms are
-- answered the same way. The function is VOLATILE (the default), so its
-- EXISTS takes a snapshot after the lock is granted: it sees what the lock's
-- previous holder committed, whose commit is visible before its locks are
-- released.

-- Takes the key's transaction-scoped advisory lock, or raises 55P03.
CREATE OR REPLACE FUNCTION idemkit_try_lock(p_lock BIGINT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RAISE EXCEPTION 'idemkit: another request holds this key' USING ERRCODE = '55P03';
    END IF;
END
$$;

-- `idemkit_try_lock`, then `idemkit_single_step_absent`'s check (IK003 when the
-- key has a record), in one statement.
CREATE OR REPLACE FUNCTION idemkit_single_step_open(p_lock BIGINT, p_account TEXT, p_key TEXT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RAISE EXCEPTION 'idemkit: another request holds this key' USING ERRCODE = '55P03';
    END IF;
    IF EXISTS (SELECT 1 FROM idemkit_keys WHERE account = p_account AND idem_key = p_key) THEN
        RAISE EXCEPTION 'idemkit: the key has a record' USING ERRCODE = 'IK003';
    END IF;
END
$$;
