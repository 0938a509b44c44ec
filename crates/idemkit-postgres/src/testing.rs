//! Test hooks (feature `testing`): not part of the public API, outside the
//! semver promise, for this crate's benches and tests and the simulator.
//! See also [`crate::PgStore::with_test_clock`].

use crate::{Isolation, sql};

/// The text of the lease-mode claim and of the completion (waking waiters), as
/// `KeyStore::claim` and `KeyStore::complete` send them, for `benches/pgbench.rs`
/// to hand the same SQL to `pgbench`. Parameters: the claim binds account `$1`,
/// key `$2`, fingerprint `$3`, test clock `$4`, lease ms `$5`, method `$6`, path
/// `$7`, headers `$8`, body `$9`, resume `$10`, recovery point `$11`, attempt id `$12`; the
/// completion binds account, key, token, test clock, status, headers, body
/// (`$1`–`$7`).
pub fn claim_and_complete_sql() -> (String, String) {
    (sql::CLAIM.clone(), sql::COMPLETE_NOTIFYING.clone())
}

/// The single-step claim's opening as `TransactionalStore::claim_in_tx` sends
/// it for a first attempt: advisory lock `lock` (waiting at most
/// `lock_timeout_ms`, or a try-lock when `None`) and the check that `scope`
/// has no record; for `benches/pgbench.rs`.
pub fn single_step_sql(
    lock_timeout_ms: Option<u128>,
    lock: i64,
    schema: &str,
    scope: &idemkit_core::Scope,
) -> String {
    sql::begin_locked_absent(Isolation::ReadCommitted, lock_timeout_ms, lock, schema, scope)
}
