//! The SQL text of every statement the store runs. Times are the store's
//! clock ([`now_sql`]); tokens come from one store-wide sequence
//! ([`NEXT_TOKEN`]). The fenced writes bind account `$1`, key `$2` and the
//! holder's token `$3` first, then the test clock where `now_sql` reads it.

use std::sync::LazyLock;
use std::time::Duration;

use idemkit_core::{
    FencingToken, PhaseUpdate, Scope, StoreResult, StoredHeader, StoredRequest, StoredResponse,
};
use sqlx::Postgres;

use crate::{CHANNEL, Isolation, PgConfig};

/// Wraps a fenced `UPDATE` so that a changed row somebody waits for (its
/// `has_waiters` is set) wakes this schema's waiters in the same round trip; the
/// statement answers how many rows it changed.
pub(crate) fn notifying(update: &str) -> String {
    format!(
        "WITH u AS ({update} RETURNING account, idem_key, has_waiters) \
         SELECT count(*) FROM (SELECT CASE WHEN has_waiters THEN \
         pg_notify('{CHANNEL}', json_build_array(current_schema(), account, idem_key)::text) END FROM u) AS n"
    )
}

/// The store's clock in SQL: the database's `clock_timestamp()` in Unix
/// milliseconds, unless a test clock is bound at `$n` (`PgStore::with_test_clock`, feature `testing`).
/// Every lease is judged by it, so an instance whose own clock is skewed can
/// never take over a live lease (the behaviour contract, `docs/spec.md` §3).
pub(crate) fn now_sql(n: usize) -> String {
    now_with(&format!("${n}"))
}

/// [`now_sql`] with the test clock given as an SQL expression (a parameter, a
/// literal, or `NULL` for none).
fn now_with(test_clock: &str) -> String {
    format!("COALESCE({test_clock}::bigint, (extract(epoch from clock_timestamp()) * 1000)::bigint)")
}

/// A fresh fencing token from the store-wide sequence (see the migration).
pub(crate) const NEXT_TOKEN: &str = "nextval('idemkit_fencing_seq')";

/// A lease length in milliseconds, as SQL adds it to the store's clock.
pub(crate) fn lease_ms(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}

/// The 18 record columns, in [`crate::decode`]'s order.
pub(crate) const RECORD_COLUMNS: &str = "account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error";

pub(crate) const SELECT_RECORD: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE account = $1 AND idem_key = $2";

/// [`SELECT_RECORD`], optionally locking the row `FOR UPDATE`.
pub(crate) fn select_record(lock: bool) -> String {
    if lock {
        format!("{SELECT_RECORD} FOR UPDATE")
    } else {
        SELECT_RECORD.to_owned()
    }
}

/// The record (columns from 1) and the store's clock (column 0, test clock at
/// `$3`); a row with NULL record columns when the key is absent.
pub(crate) static SELECT_WITH_NOW: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, k.* FROM (SELECT 1) AS one LEFT JOIN ({SELECT_RECORD}) AS k ON true",
        now_sql(3)
    )
});

/// The completer's work list: in-flight records whose lease has expired (by the
/// store's clock, test clock at `$1`).
pub(crate) static SELECT_ABANDONED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {RECORD_COLUMNS} FROM idemkit_keys WHERE state = 'in_flight' AND lease_expires_at <= {} \
         AND created_at <= $2 ORDER BY created_at, account, idem_key LIMIT $3",
        now_sql(1)
    )
});

/// Operator listing: records matching an optional state (`$1`) and account
/// (`$2`), newest claim first.
pub(crate) const SELECT_LIST: &str = "SELECT account, idem_key, fingerprint, state, created_at, completed_at, \
     lease_expires_at, fencing_token, recovery_point, step_outputs, req_method, req_path, req_headers, \
     req_body, resp_status, resp_headers, resp_body, last_error \
     FROM idemkit_keys WHERE ($1::text IS NULL OR state = $1) AND ($2::text IS NULL OR account = $2) \
     ORDER BY created_at DESC, account, idem_key LIMIT $3";

/// The review table, oldest claim first (columns in [`crate::decode`]'s review order).
pub(crate) const SELECT_REVIEW: &str = "SELECT account, idem_key, state, created_at, reaped_at, recovery_point, step_outputs, \
     last_error, req_method, req_path, req_headers, req_body \
     FROM idemkit_review ORDER BY created_at, id LIMIT $1";

/// Whether the caller still holds the record (`begin_fenced`).
pub(crate) const HELD: &str = "SELECT 1 FROM idemkit_keys WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 \
     AND state = 'in_flight'";

// Opening.

/// Serialises `CREATE SCHEMA IF NOT EXISTS` across instances.
pub(crate) const SCHEMA_LOCK: &str = "SELECT pg_advisory_xact_lock(7345243911)";

/// Creates the store's schema (a name [`crate::config`] has checked).
pub(crate) fn create_schema(config: &PgConfig) -> String {
    format!("CREATE SCHEMA IF NOT EXISTS {}", config.schema)
}

/// How many of the key table and the migrations table schema `$1` holds.
pub(crate) const STORE_TABLES: &str = "SELECT count(*) FROM information_schema.tables \
     WHERE table_schema = $1 AND table_name IN ('idemkit_keys', '_sqlx_migrations')";

/// The migrations applied (on the pool's `search_path`).
pub(crate) const APPLIED_MIGRATIONS: &str = "SELECT version FROM _sqlx_migrations WHERE success";

// Claims.

/// The lease-mode claim, autocommitted: inserts the in-flight row at recovery
/// point `$11` with attempt id `$12` (unless `$10`, a resume), or returns the existing record with the
/// store's clock, in one statement. Columns: the new token and lease (NULL when
/// nothing was inserted), the store's clock, then the existing record from
/// column 3 (NULL columns when a row was inserted, or when the conflicting row
/// was committed after this statement's snapshot).
pub(crate) static CLAIM: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH now AS (SELECT {} AS ms), \
         ins AS (INSERT INTO idemkit_keys (account, idem_key, fingerprint, state, created_at, \
         lease_expires_at, fencing_token, req_method, req_path, req_headers, req_body, recovery_point, \
         claim_attempt) \
         SELECT $1, $2, $3, 'in_flight', ms, ms + $5, {NEXT_TOKEN}, $6, $7, $8, $9, $11, $12 FROM now \
         WHERE NOT $10 \
         ON CONFLICT (account, idem_key) DO NOTHING RETURNING fencing_token, lease_expires_at) \
         SELECT (SELECT fencing_token FROM ins), (SELECT lease_expires_at FROM ins), \
         (SELECT ms FROM now), k.* FROM (SELECT 1) AS one \
         LEFT JOIN ({SELECT_RECORD}) AS k ON NOT EXISTS (SELECT 1 FROM ins)",
        now_sql(4)
    )
});

/// Opens a single-step claim's transaction at `isolation` holding the key's
/// advisory lock (`lock`, see `claim::lock_id`), in one round trip: the
/// simple-query protocol runs the statements in order, and skips the rest
/// after an error. At READ COMMITTED the transaction takes the lock itself.
/// Without a wait (`wait_ms` `None`) a held lock raises SQLSTATE 55P03 at once
/// (`idemkit_try_lock`, migration `20261220000001`); with one, the wait is
/// bounded by `lock_timeout`, which raises the same error when it runs out and
/// is lifted for the handler's own statements once the lock is held. READ
/// COMMITTED is what the check after the lock needs: each statement sees what
/// the lock's previous holder committed. At a snapshot level (see
/// [`Isolation::takes_lock_first`]) the snapshot would predate the lock, so the
/// lock is taken first, by [`session_lock`] in its own round trip, and the
/// transaction's first statement moves it to transaction scope (migration
/// `20261221000001`).
pub(crate) fn begin_locked(isolation: Isolation, wait_ms: Option<u128>, lock: i64, schema: &str) -> String {
    let begin = isolation.begin();
    if isolation.takes_lock_first() {
        return format!("{begin}; SELECT {schema}.idemkit_lock_to_xact({lock})");
    }
    match wait_ms {
        None => format!("{begin}; SELECT {schema}.idemkit_try_lock({lock})"),
        Some(ms) => format!(
            "{begin}; SET LOCAL lock_timeout = {ms}; SELECT pg_advisory_xact_lock({lock}); \
             SET LOCAL lock_timeout = 0"
        ),
    }
}

/// The key's session-level lock, taken before a snapshot-level transaction
/// begins (see [`begin_locked`]): lock `$1`, wait `$2` milliseconds (NULL: a
/// try-lock); SQLSTATE 55P03 when not acquired.
pub(crate) fn session_lock(schema: &str) -> String {
    format!("SELECT {schema}.idemkit_session_lock($1, $2)")
}

/// [`begin_locked`], then the check that the key has no record, in the same
/// round trip: SQLSTATE `IK003` when it has one, which aborts the transaction
/// (see the migrations of `idemkit_single_step_open` and
/// `idemkit_single_step_absent`). The opening's rows never reach the caller,
/// so an error is how it answers. Without a wait, the try-lock and the check
/// are one function call, which must stay VOLATILE (PostgreSQL's default): a
/// STABLE function keeps its statement's snapshot, taken before the lock is
/// granted, and would miss what the lock's previous holder committed.
/// Literals as in [`fused_completion`].
pub(crate) fn begin_locked_absent(
    isolation: Isolation,
    wait_ms: Option<u128>,
    lock: i64,
    schema: &str,
    scope: &Scope,
) -> String {
    let begin = isolation.begin();
    let account = literal::text(scope.account.as_str());
    let key = literal::text(scope.key.as_str());
    match wait_ms {
        None if !isolation.takes_lock_first() => {
            format!("{begin}; SELECT {schema}.idemkit_single_step_open({lock}, {account}::text, {key}::text)")
        }
        _ => format!(
            "{}; SELECT {schema}.idemkit_single_step_absent({account}::text, {key}::text)",
            begin_locked(isolation, wait_ms, lock, schema),
        ),
    }
}

/// After [`begin_locked_absent`] found a record: the aborted transaction's
/// `ROLLBACK`, then the store's clock (column 0; the test clock when given)
/// and the record (from column 1), in one round trip. No row if the record
/// went away since.
pub(crate) fn rollback_and_read(scope: &Scope, test_now: Option<i64>) -> String {
    format!(
        "ROLLBACK; SELECT {}, {RECORD_COLUMNS} FROM idemkit_keys WHERE account = {} AND idem_key = {}",
        now_with(&nullable(test_now)),
        literal::text(scope.account.as_str()),
        literal::text(scope.key.as_str()),
    )
}

/// Compare-and-swap of a record to a new holder on a fresh token, only if it is
/// still exactly as seen (token `$11`, state `$12`, lease `$13`). Takeover
/// (`$4`) keeps progress (a record without a recovery point takes the claim's
/// `$14`, and returns it); reuse starts at `$14`. The new holder's attempt id
/// is `$15` (NULL in single-step mode).
pub(crate) static MOVE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, lease_expires_at = $3, \
         state = 'in_flight', \
         fingerprint = CASE WHEN $4 THEN fingerprint ELSE $5 END, \
         created_at = CASE WHEN $4 THEN created_at ELSE $6 END, completed_at = NULL, \
         recovery_point = CASE WHEN $4 THEN COALESCE(recovery_point, $14) ELSE $14 END, \
         step_outputs = CASE WHEN $4 THEN step_outputs ELSE '{{}}' END, \
         req_method = $7, req_path = $8, req_headers = $9, req_body = $10, \
         resp_status = NULL, resp_headers = NULL, resp_body = NULL, \
         last_error = CASE WHEN $4 THEN last_error END, claim_attempt = $15 \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $11 AND state = $12 \
         AND lease_expires_at = $13 \
         RETURNING fencing_token, recovery_point"
    )
});

/// A lease-mode claim's own record after its reply was lost: the token, lease
/// and recovery point of the key's record, and whether attempt `$3` holds it
/// (in flight, its lease alive by the store's clock, test clock at `$4`). Any
/// other writer that can change the record without replacing the attempt id
/// (an operator's release, the reaper) needs the lease expired or leaves it
/// parked.
///
/// The row is read `FOR SHARE`, with the attempt tested in the select list,
/// not in the `WHERE`: a claim whose connection broke while its statement
/// waited on the row lock (a lapsed holder's phase transaction) is still run
/// by its backend, which commits the move once the lock is free. A plain read
/// would see the row as before the move and answer "not ours" while our own
/// attempt then holds the key for a lease; the share lock waits behind the
/// move (a writer of the row), and READ COMMITTED's re-check then reads the
/// row as it committed. (A condition on the attempt in the `WHERE` would be
/// judged on the snapshot's row first, which no move has touched, and would
/// not wait at all.)
pub(crate) static CLAIMED_BY_ATTEMPT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT fencing_token, lease_expires_at, recovery_point, \
         COALESCE(claim_attempt = $3 AND state = 'in_flight' AND lease_expires_at > {}, false) \
         FROM idemkit_keys WHERE account = $1 AND idem_key = $2 FOR SHARE",
        now_sql(4)
    )
});

// The holder's fenced writes.

/// The holder's completion; the request body is dropped (a completed record
/// replays its answer, nothing reads the request again).
pub(crate) static COMPLETE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET state = 'completed', completed_at = {}, resp_status = $5, \
         resp_headers = $6, resp_body = $7, last_error = NULL, req_body = ''::bytea \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
        now_sql(4)
    )
});

/// SQL literals for the statements sent without bind parameters: a
/// single-step request's completion, fused with its `COMMIT` (the simple-query
/// protocol runs several statements in one round trip, but binds nothing).
/// Both kinds are escape strings (`E'…'`), which the server reads the same way
/// whatever `standard_conforming_strings` says: text with its quotes doubled,
/// its backslashes doubled and every ASCII control character as a `\x` escape;
/// bytes as `\x` and hex digits for `bytea`'s input. So no input can end its
/// literal, and the server parses constants, not function calls.
mod literal {
    use std::fmt::Write;

    pub(super) fn bytes(b: &[u8]) -> String {
        format!(r"E'\\x{}'", hex::encode(b))
    }

    pub(super) fn text(s: &str) -> String {
        let mut out = String::with_capacity(s.len() + 3);
        out.push_str("E'");
        for c in s.chars() {
            match c {
                '\'' => out.push_str("''"),
                '\\' => out.push_str(r"\\"),
                c if c.is_ascii_control() => {
                    let _ = write!(out, r"\x{:02x}", u32::from(c));
                }
                c => out.push(c),
            }
        }
        out.push('\'');
        out
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn literals_escape_what_would_end_them() {
            assert_eq!(
                super::text("a'b\\c\n\u{e9}"),
                r"E'a''b\\c\x0a".to_owned() + "\u{e9}'"
            );
            assert_eq!(super::bytes(&[0, 0x27, 0xff]), r"E'\\x0027ff'");
        }
    }
}

/// A single-step request's completion and its transaction's `COMMIT`, in one
/// round trip, through the `idemkit_complete_single_step` function (see its
/// migration: it refuses, aborting the transaction before the `COMMIT`, unless
/// exactly one row changes). See [`fused_completion`].
pub(crate) fn complete_and_commit(
    schema: &str,
    scope: &Scope,
    token: FencingToken,
    test_now: Option<i64>,
    response: &Answer<'_>,
) -> String {
    let lead = format!("{}::bigint, {}::bigint, ", token.0, nullable(test_now));
    fused_completion(schema, "idemkit_complete_single_step", scope, &lead, response)
}

/// The request half of a single-step record, as SQL literals (see
/// [`insert_and_commit`]): built when the claim reads the key absent, so the
/// request is not kept twice until the completion.
pub(crate) fn request_literals(
    fingerprint: &[u8],
    recovery_point: Option<&str>,
    request: &StoredRequest,
    headers: &str,
) -> String {
    format!(
        "{fingerprint}::bytea, {recovery}::text, {method}::text, {path}::text, {headers}::text, {body}::bytea",
        fingerprint = literal::bytes(fingerprint),
        recovery = recovery_point.map_or_else(|| "NULL".to_owned(), literal::text),
        method = literal::text(&request.method),
        path = literal::text(&request.path),
        headers = literal::text(headers),
        body = literal::bytes(&request.body),
    )
}

/// A single-step record written once, completed, and its transaction's
/// `COMMIT`, in one round trip, through `idemkit_insert_single_step_at_commit`
/// (see its migration: it draws the record's token, and refuses, aborting the
/// transaction before the `COMMIT`, when the key's row appeared since the
/// claim). `created_at` is the store's clock when the claim read the key
/// absent (`None`: the claim did not read it, and the record is created at
/// commit); `request` is [`request_literals`]. See [`fused_completion`].
pub(crate) fn insert_and_commit(
    schema: &str,
    scope: &Scope,
    test_now: Option<i64>,
    (created_at, lease_ms): (Option<i64>, i64),
    request: &str,
    response: &Answer<'_>,
) -> String {
    let lead = format!(
        "{}::bigint, {}::bigint, {lease_ms}::bigint, {request}, ",
        nullable(test_now),
        nullable(created_at)
    );
    fused_completion(
        schema,
        "idemkit_insert_single_step_at_commit",
        scope,
        &lead,
        response,
    )
}

/// A number as an SQL literal, or `NULL`.
fn nullable(n: Option<i64>) -> String {
    n.map_or_else(|| "NULL".to_owned(), |n| n.to_string())
}

/// The answer a single-step completion stores: status, encoded headers, body.
pub(crate) struct Answer<'a> {
    status: u16,
    headers: String,
    body: &'a [u8],
}

impl<'a> Answer<'a> {
    pub(crate) fn of(response: &'a StoredResponse) -> StoreResult<Self> {
        Ok(Self {
            status: response.status,
            headers: StoredHeader::encode_list(&response.headers)?,
            body: &response.body,
        })
    }
}

/// `SELECT <schema>.<function>(account, key, <lead> status, headers, body);
/// COMMIT; BEGIN`: both single-step completions, whose functions take the same
/// leading and trailing arguments (`lead`, the function's own, ends with a
/// comma). Qualified by the store's schema and every argument typed, so no
/// function of the same name elsewhere on the search path (`public`) can be
/// chosen. The trailing `BEGIN` opens an empty transaction for the caller's
/// transaction handle to roll back when dropped, so sqlx's bookkeeping stays
/// true without another round trip.
fn fused_completion(
    schema: &str,
    function: &str,
    scope: &Scope,
    lead: &str,
    response: &Answer<'_>,
) -> String {
    format!(
        "SELECT {schema}.{function}({account}::text, {key}::text, {lead}\
         {status}::integer, {headers}::text, {body}::bytea); COMMIT; BEGIN",
        account = literal::text(scope.account.as_str()),
        key = literal::text(scope.key.as_str()),
        status = response.status,
        headers = literal::text(&response.headers),
        body = literal::bytes(response.body),
    )
}

/// [`COMPLETE`], waking waiters.
pub(crate) static COMPLETE_NOTIFYING: LazyLock<String> = LazyLock::new(|| notifying(&COMPLETE));

pub(crate) static HEARTBEAT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET lease_expires_at = {} + $5 \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight' \
         RETURNING lease_expires_at",
        now_sql(4)
    )
});

/// A phase's fenced progress write. A step output is set as a top-level key of
/// the JSON object (`||` replaces a key, it does not merge nested objects); the
/// step name is bound as text and the output as JSON text, so neither is parsed
/// as a path or as SQL.
pub(crate) const ADVANCE: &str = "UPDATE idemkit_keys SET recovery_point = $4, \
     step_outputs = CASE WHEN $5::text IS NULL THEN step_outputs \
     ELSE (step_outputs::jsonb || jsonb_build_object($5::text, $6::jsonb))::text END \
     WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'";

/// The bound [`ADVANCE`] statement.
pub(crate) fn advance_query(
    scope: &Scope,
    token: FencingToken,
    update: &PhaseUpdate,
) -> sqlx::query::Query<'static, Postgres, sqlx::postgres::PgArguments> {
    let (name, value) = match &update.step {
        Some((name, value)) => (Some(name.clone()), Some(value.to_string())),
        None => (None, None),
    };
    sqlx::query(ADVANCE)
        .bind(scope.account.as_str().to_owned())
        .bind(scope.key.as_str().to_owned())
        .bind(token.0)
        .bind(update.recovery_point.clone())
        .bind(name)
        .bind(value)
}

/// The holder's release. The row stays (state `released`, behaving as absent)
/// so the next claim's token is higher than any this record ever handed out.
/// A record with recorded progress is abandoned instead (see the trait).
pub(crate) static RELEASE: LazyLock<String> = LazyLock::new(|| {
    const CLEAN: &str = "recovery_point IS NULL AND step_outputs = '{}'";
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, \
         state = CASE WHEN {CLEAN} THEN 'released' ELSE state END, \
         lease_expires_at = CASE WHEN {CLEAN} THEN 0 ELSE {now} END, \
         req_body = CASE WHEN {CLEAN} THEN ''::bytea ELSE req_body END, \
         last_error = CASE WHEN {CLEAN} THEN last_error ELSE $5 END \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
        now = now_sql(4)
    )
});

/// The holder's release that discards recorded progress (see
/// `KeyStore::release_discarding`).
pub(crate) static RELEASE_DISCARDING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, state = 'released', lease_expires_at = 0, \
         recovery_point = NULL, step_outputs = '{{}}', req_body = ''::bytea \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'"
    )
});

/// The holder gives up; a fresh token, so a heartbeat of this holder still on
/// its way is refused.
pub(crate) static ABANDON: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, lease_expires_at = {}, last_error = $5 \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
        now_sql(4)
    )
});

/// The holder parks the record for an operator.
pub(crate) static PARK: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, state = 'parked', \
         lease_expires_at = {}, last_error = $5 \
         WHERE account = $1 AND idem_key = $2 AND fencing_token = $3 AND state = 'in_flight'",
        now_sql(4)
    )
});

// Operators and the reaper.

/// An operator's release of a record nobody holds (parked, or in flight with
/// its lease expired by the store's clock, test clock at `$3`), on a fresh
/// token: the same tombstone as a holder's release, or resumable when progress
/// was recorded (see [`idemkit_core::KeyStore::force_release`]).
pub(crate) static FORCE_RELEASE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, last_error = $4, \
         state = CASE WHEN {clean} THEN 'released' ELSE 'in_flight' END, \
         lease_expires_at = CASE WHEN {clean} THEN 0 ELSE LEAST(lease_expires_at, {now}) END, \
         req_body = CASE WHEN {clean} THEN ''::bytea ELSE req_body END \
         WHERE account = $1 AND idem_key = $2 \
         AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= {now}))",
        clean = "recovery_point IS NULL AND step_outputs = '{}'",
        now = now_sql(3)
    )
});

/// An operator's release that discards recorded progress, waking waiters.
pub(crate) static DISCARD: LazyLock<String> = LazyLock::new(|| {
    notifying(&format!(
        "UPDATE idemkit_keys SET fencing_token = {NEXT_TOKEN}, state = 'released', lease_expires_at = 0, \
         recovery_point = NULL, step_outputs = '{{}}', req_body = ''::bytea, last_error = $4 \
         WHERE account = $1 AND idem_key = $2 \
         AND (state = 'parked' OR (state = 'in_flight' AND lease_expires_at <= {}))",
        now_sql(3)
    ))
});

/// One reaper pass in one statement (so one transaction). Records that never
/// completed and were claimed before `$1` (in flight with a lease expired by the
/// store's clock, test clock at `$2`, or parked) are listed in `idemkit_review`
/// once and stay in the key table, parked on a fresh token (last error `$3`), so
/// their key is never claimed again as a new request; completed records finished
/// before `$1` and released ones claimed before it are deleted (tokens come from
/// a sequence, so a deleted key's tokens never repeat). Live leases never match.
/// `completed_at >= created_at`, so the `created_at` bound only lets the index
/// narrow the scan.
///
/// The records to park are locked first (`locked`, `FOR UPDATE`), and both the
/// park and the review entry take their values from that locked row: a row a
/// lapsed holder changed while this pass waited on its lock (a phase's intent
/// committed) is re-read, as committed, by the lock (READ COMMITTED's re-check),
/// and re-checked against the conditions; a statement-snapshot read of the key
/// table would copy the row as it was before that commit, and the review list
/// would show an operator a record without the intent it was parked with.
///
/// That re-check sees the locked row as committed, but the statement's
/// subqueries still read its snapshot: a second pass overlapping this one
/// (another instance's reaper) that waited on the same row lock would find the
/// row parked by the first, its review entry invisible to `NOT EXISTS`, and
/// park it again and file a second entry (a copy of the parked row, `last_error`
/// the reaper's own). So the locked row must still be on the token the snapshot
/// saw (the scalar subquery reads the snapshot, the re-check the new row): a
/// row moved to a new token meanwhile (parked by another pass, taken over,
/// abandoned, released) is left for the next pass, which judges it afresh; a
/// lapsed holder's phase keeps the token, so its intent is still parked and
/// listed as committed.
pub(crate) static REAP: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH now AS (SELECT {now} AS ms), \
         locked AS (SELECT k.account, k.idem_key, k.state, k.created_at, k.recovery_point, \
         k.step_outputs, k.last_error, k.req_method, k.req_path, k.req_headers, k.req_body, \
         k.lease_expires_at \
         FROM idemkit_keys k, now WHERE k.created_at < $1 \
         AND (k.state = 'parked' OR (k.state = 'in_flight' AND k.lease_expires_at <= now.ms)) \
         AND NOT EXISTS (SELECT 1 FROM idemkit_review r WHERE r.account = k.account \
         AND r.idem_key = k.idem_key AND r.created_at = k.created_at) \
         AND k.fencing_token = (SELECT o.fencing_token FROM idemkit_keys o \
         WHERE o.account = k.account AND o.idem_key = k.idem_key) \
         FOR UPDATE OF k), \
         listed AS (UPDATE idemkit_keys k SET fencing_token = {NEXT_TOKEN}, state = 'parked', \
         lease_expires_at = LEAST(l.lease_expires_at, (SELECT ms FROM now)), last_error = $3 \
         FROM locked l WHERE k.account = l.account AND k.idem_key = l.idem_key \
         RETURNING 1), \
         reviewed AS (INSERT INTO idemkit_review (account, idem_key, state, created_at, reaped_at, \
         recovery_point, step_outputs, last_error, req_method, req_path, req_headers, req_body) \
         SELECT l.account, l.idem_key, l.state, l.created_at, (SELECT ms FROM now), l.recovery_point, \
         l.step_outputs, l.last_error, l.req_method, l.req_path, l.req_headers, l.req_body \
         FROM locked l ORDER BY l.created_at, l.account, l.idem_key RETURNING 1), \
         deleted AS (DELETE FROM idemkit_keys WHERE created_at < $1 \
         AND ((state = 'completed' AND COALESCE(completed_at, created_at) < $1) OR state = 'released') \
         RETURNING 1) \
         SELECT (SELECT count(*) FROM reviewed), (SELECT count(*) FROM deleted)",
        now = now_sql(2)
    )
});

// Waiters.

/// Flags an in-flight record as waited for, so its next change notifies.
pub(crate) const FLAG_WAITERS: &str = "UPDATE idemkit_keys SET has_waiters = true \
     WHERE account = $1 AND idem_key = $2 AND state = 'in_flight' AND NOT has_waiters";

/// Whether the record is (still) in flight.
pub(crate) const IS_IN_FLIGHT: &str =
    "SELECT state = 'in_flight' FROM idemkit_keys WHERE account = $1 AND idem_key = $2";
