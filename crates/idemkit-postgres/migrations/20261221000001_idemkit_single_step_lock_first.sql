-- Single-step transactions at a snapshot isolation level (issue 30, item 11:
-- `PgConfig::single_step_isolation`). Under REPEATABLE READ or SERIALIZABLE a
-- transaction reads from one snapshot, taken at its first statement; a lock
-- taken by that statement (`pg_advisory_xact_lock`) is granted after the
-- snapshot, which then misses what the lock's previous holder committed. So
-- those openings take the key's lock first, at session level, in a statement
-- of its own before `BEGIN`:
--
--   SELECT idemkit_session_lock(<lock>, <wait ms or NULL>)
--   BEGIN ISOLATION LEVEL ...; SELECT idemkit_lock_to_xact(<lock>); ...
--
-- and the transaction's first statement moves it to transaction scope (taken
-- again at transaction level, which a lock the session holds grants at once,
-- then the session-level hold released), so the lock ends with the
-- transaction as at READ COMMITTED, and the snapshot is taken holding it.

-- Takes the key's session-level advisory lock: at once (`p_wait_ms` NULL) or
-- waiting at most `p_wait_ms`; "not acquired" raises SQLSTATE 55P03 either way,
-- as `idemkit_try_lock` and a `lock_timeout` do. Run outside a transaction:
-- the `lock_timeout` it sets ends with the statement's own transaction.
CREATE OR REPLACE FUNCTION idemkit_session_lock(p_lock BIGINT, p_wait_ms BIGINT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF p_wait_ms IS NULL THEN
        IF NOT pg_try_advisory_lock(p_lock) THEN
            RAISE EXCEPTION 'idemkit: another request holds this key' USING ERRCODE = '55P03';
        END IF;
    ELSE
        PERFORM set_config('lock_timeout', p_wait_ms::text, true);
        PERFORM pg_advisory_lock(p_lock);
    END IF;
END
$$;

-- Moves the key's lock from the session (`idemkit_session_lock`) to the
-- current transaction; IK004 if the session did not hold it.
CREATE OR REPLACE FUNCTION idemkit_lock_to_xact(p_lock BIGINT)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(p_lock);
    IF NOT pg_advisory_unlock(p_lock) THEN
        RAISE EXCEPTION 'idemkit: the key''s session lock was not held' USING ERRCODE = 'IK004';
    END IF;
END
$$;
