//! The SQL text of every statement the store runs, byte for byte as the
//! migrations' schema expects it. Placeholders are SQLite's numbered `?N`;
//! each statement's binding order is the one its caller uses.

use std::sync::LazyLock;

/// One record by scope; the 18 record columns in [`crate::decode`]'s order.
pub(crate) const SELECT_RECORD: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2";

/// The completer's work list: in-flight records whose lease has expired.
pub(crate) const SELECT_ABANDONED: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE state = 'in_flight' AND lease_expires_at <= ?1 AND created_at <= ?2 \
     ORDER BY created_at, account, idem_key LIMIT ?3";

/// Operator listing: records matching an optional state (`?1`) and account
/// (`?2`), newest claim first.
pub(crate) const SELECT_LIST: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE (?1 IS NULL OR state = ?1) AND (?2 IS NULL OR account = ?2) \
     ORDER BY created_at DESC, account, idem_key LIMIT ?3";

/// The review table, oldest claim first (columns in [`crate::decode`]'s review order).
pub(crate) const SELECT_REVIEW: &str = "SELECT account, idem_key, state, created_at, reaped_at, recovery_point, step_outputs, \
     last_error, req_method, req_path, req_headers, req_body \
     FROM idemkit_review ORDER BY created_at, id LIMIT ?1";

/// A lease-mode claim of an absent key: the new in-flight row, its token one
/// above the reaper's floor, at the claim's recovery point `?10`, carrying the
/// claim's attempt id `?11`. Returns nothing when the key exists.
pub(crate) const CLAIM_INSERT: &str = "INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, lease_expires_at, \
     fencing_token, req_method, req_path, req_headers, req_body, recovery_point, claim_attempt) \
     VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5, (SELECT floor + 1 FROM idemkit_token_floor), \
     ?6, ?7, ?8, ?9, ?10, ?11) ON CONFLICT (account, idem_key) DO NOTHING RETURNING fencing_token";

/// What a claim whose reply was lost reads back: whether the record is in
/// flight under its attempt id `?3`, and the lease it then holds.
pub(crate) const SELECT_CLAIM_ATTEMPT: &str = "SELECT fencing_token, lease_expires_at, recovery_point FROM idemkit_keys \
     WHERE account = ?1 AND idem_key = ?2 AND state = 'in_flight' AND claim_attempt = ?3";

/// Moves an existing record to a new holder (compare-and-swap on the token as
/// read). Takeover (`?5`) keeps the claim's progress and request (a record
/// without a recovery point takes the claim's `?13`); window reuse starts
/// clean, at `?13`. The claim's attempt id is `?14`.
pub(crate) const CLAIM_MOVE: &str = "UPDATE idemkit_keys SET fencing_token = ?3, lease_expires_at = ?4, state = 'in_flight', \
     claim_attempt = ?14, \
     fingerprint = CASE WHEN ?5 THEN fingerprint ELSE ?6 END, \
     created_at = CASE WHEN ?5 THEN created_at ELSE ?7 END, completed_at = NULL, \
     recovery_point = CASE WHEN ?5 THEN COALESCE(recovery_point, ?13) ELSE ?13 END, \
     step_outputs = CASE WHEN ?5 THEN step_outputs ELSE '{}' END, \
     req_method = ?8, req_path = ?9, req_headers = ?10, req_body = ?11, \
     resp_status = NULL, resp_headers = NULL, resp_body = NULL, \
     last_error = CASE WHEN ?5 THEN last_error END \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?12";

/// A pending single-step claim of an absent key, written already completed,
/// and the transaction's `COMMIT`, in one call to the connection's worker. A
/// row that appeared meanwhile (another process) fails the insert on the
/// primary key, and SQLite runs nothing of the string after an error, so the
/// business writes are not committed.
pub(crate) const INSERT_COMPLETED_AND_COMMIT: &str = "INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, req_method, req_path, req_headers, req_body, resp_status, \
     resp_headers, resp_body) \
     VALUES (?1, ?2, ?3, 'completed', ?4, ?5, ?5, \
     MAX(?6, (SELECT floor + 1 FROM idemkit_token_floor)), ?7, ?8, ?9, ?10, ?11, ?12, ?13); \
     COMMIT";

/// A pending single-step claim over an existing record, written already
/// completed, only if the record is exactly as read (token `?14`, state `?16`,
/// lease `?17`).
pub(crate) const REPLACE_COMPLETED: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fingerprint = ?3, state = 'completed', \
     created_at = CASE WHEN ?15 THEN created_at ELSE ?4 END, completed_at = ?5, \
     lease_expires_at = ?5, fencing_token = ?6, req_method = ?7, req_path = ?8, req_headers = ?9, \
     req_body = ?10, resp_status = ?11, resp_headers = ?12, resp_body = ?13, last_error = NULL, \
     recovery_point = CASE WHEN ?15 THEN recovery_point END, \
     step_outputs = CASE WHEN ?15 THEN step_outputs ELSE '{}' END \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?14 AND state = ?16 \
     AND lease_expires_at = ?17";

/// Whether the caller still holds the record (`begin_fenced`).
pub(crate) const HELD: &str = "SELECT 1 FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 \
     AND state = 'in_flight'";

// Every write below that hands the record on (a new token, or another state)
// clears `claim_attempt`: a lost claim reply read back after it is not the
// claim's any more.

// The fenced writes below bind account `?1`, key `?2` and the holder's token `?3` first.

/// The holder's completion; the request body is dropped (a completed record
/// replays its answer, nothing reads the request again).
pub(crate) const COMPLETE: &str = "UPDATE idemkit_keys SET state = 'completed', completed_at = ?4, resp_status = ?5, \
     resp_headers = ?6, resp_body = ?7, last_error = NULL, req_body = x'' \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// The step outputs a phase merges into (read under the write lock).
pub(crate) const SELECT_STEP_OUTPUTS: &str = "SELECT step_outputs FROM idemkit_keys WHERE account = ?1 AND idem_key = ?2 \
     AND fencing_token = ?3 AND state = 'in_flight'";

/// A phase's progress.
pub(crate) const ADVANCE: &str = "UPDATE idemkit_keys SET recovery_point = ?4, step_outputs = COALESCE(?5, step_outputs) \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// A heartbeat: the lease ends at `?4`.
pub(crate) const HEARTBEAT: &str = "UPDATE idemkit_keys SET lease_expires_at = ?4 \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// The holder's release: a `released` tombstone, or (with recorded progress)
/// abandoned at `?4` with last error `?5`.
pub(crate) const RELEASE: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, \
     state = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 'released' ELSE state END, \
     lease_expires_at = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 0 ELSE ?4 END, \
     req_body = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN x'' ELSE req_body END, \
     last_error = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN last_error ELSE ?5 END \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// The holder's release that discards recorded progress (see
/// `KeyStore::release_discarding`).
pub(crate) const RELEASE_DISCARDING: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, \
     state = 'released', lease_expires_at = 0, recovery_point = NULL, step_outputs = '{}', req_body = x'' \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// The holder gives up: the lease ends now (`?4`), on a fresh token.
pub(crate) const ABANDON: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, lease_expires_at = ?4, last_error = ?5 \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// The holder parks the record for an operator.
pub(crate) const PARK: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, state = 'parked', \
     lease_expires_at = ?4, last_error = ?5 \
     WHERE account = ?1 AND idem_key = ?2 AND fencing_token = ?3 AND state = 'in_flight'";

/// An operator's release of a record nobody holds (now at `?3`, last error
/// `?4`): the same tombstone as `release` (or, with recorded progress,
/// resumable: see the trait); the state check replaces the token check.
pub(crate) const FORCE_RELEASE: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, last_error = ?4, \
     state = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 'released' ELSE 'in_flight' END, \
     lease_expires_at = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN 0 \
     ELSE MIN(lease_expires_at, ?3) END, \
     req_body = CASE WHEN recovery_point IS NULL AND step_outputs = '{}' THEN x'' ELSE req_body END \
     WHERE account = ?1 AND idem_key = ?2 \
     AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?3))";

/// An operator's release that discards recorded progress (now at `?3`, last
/// error `?4`).
pub(crate) const DISCARD: &str = "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, state = 'released', \
     lease_expires_at = 0, recovery_point = NULL, step_outputs = '{}', req_body = x'', last_error = ?4 \
     WHERE account = ?1 AND idem_key = ?2 \
     AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?3))";

// The reaper's pass: four statements in one transaction.

/// Never completed and claimed before `?1`: in flight with a lease expired
/// at `?2` (now), or parked; live leases never match. Listed once per park by
/// the reaper: its park marks the record (last error `?3`,
/// `MOVED_TO_REVIEW`), a marked record is skipped, and only an operator moves
/// a parked record (a release or a discard, which replace the mark), so a
/// record that is released, resumed and parked again is listed again. The
/// record stays,
/// parked, so it keeps fencing and is never claimed again as a new request.
///
/// The one definition of what a pass lists and parks: both statements below
/// select with it, in one transaction that holds the write lock, so they
/// select the same rows (the listing writes only the review table, which this
/// predicate does not read; the review table is the operator's to prune).
const UNFINISHED: &str = "created_at < ?1 \
     AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= ?2)) \
     AND (last_error IS NULL OR last_error <> ?3)";

/// Lists the unfinished records in the review table (binds `?1`–`?3` as
/// [`REAP_PARK`] does).
pub(crate) static REAP_REVIEW: LazyLock<String> = LazyLock::new(|| {
    format!(
        "INSERT INTO idemkit_review (account, idem_key, state, created_at, reaped_at, recovery_point, \
         step_outputs, last_error, req_method, req_path, req_headers, req_body) \
         SELECT account, idem_key, state, created_at, ?2, recovery_point, step_outputs, last_error, \
         req_method, req_path, req_headers, req_body FROM idemkit_keys WHERE {UNFINISHED} \
         ORDER BY created_at, account, idem_key"
    )
});

/// Parks the records just listed, marking them (last error `?3`): the same
/// rows as [`REAP_REVIEW`], by the same predicate.
pub(crate) static REAP_PARK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET claim_attempt = NULL, fencing_token = fencing_token + 1, state = 'parked', \
         lease_expires_at = MIN(lease_expires_at, ?2), last_error = ?3 WHERE {UNFINISHED}"
    )
});

/// Completed records finished before `?1` and released ones claimed before it.
/// `completed_at >= created_at`, so the `created_at` bound only lets the
/// `created_at` index narrow the scan.
const EXPIRED: &str = "created_at < ?1 AND \
     ((state = 'completed' AND COALESCE(completed_at, created_at) < ?1) OR state = 'released')";

/// Raises the token floor over the records about to be deleted, so no later
/// claim of a deleted key reuses one of its tokens.
pub(crate) static REAP_RAISE_FLOOR: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_token_floor SET floor = MAX(floor, \
         COALESCE((SELECT MAX(fencing_token) FROM idemkit_keys WHERE {EXPIRED}), 0))"
    )
});

/// Deletes the expired records, returning their scopes.
pub(crate) static REAP_DELETE: LazyLock<String> =
    LazyLock::new(|| format!("DELETE FROM idemkit_keys WHERE {EXPIRED} RETURNING account, idem_key"));
