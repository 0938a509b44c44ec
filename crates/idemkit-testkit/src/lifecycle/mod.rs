//! Conformance cases for the multi-step lifecycle (the behaviour contract, `docs/spec.md` §6 and §7): phases and
//! recovery points ([`KeyStore::advance`], [`TransactionalStore::advance_in_tx`]),
//! parking for human review ([`KeyStore::park`]), the completer's work list
//! ([`KeyStore::abandoned`]), the reaper ([`KeyStore::reap`],
//! [`KeyStore::review`]) and the operator's view ([`KeyStore::list`],
//! [`KeyStore::force_release`]).
//!
//! Each case takes a fresh, empty store and the [`ManualClock`] it reads time
//! from; time moves by hand, never by sleeping. Use
//! [`crate::lifecycle_conformance_tests!`] and
//! [`crate::transactional_lifecycle_tests!`] to run them for a backend.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, FORCE_RELEASED, FencingToken, KeyStore, Lease, ListFilter,
    MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, RecordState, Scope,
    StoreError, TransactionalStore,
};
use serde_json::json;

use crate::ManualClock;
use crate::suite::{LEASE, WINDOW, claim_req, must_claim, response, scope};
use crate::tx_suite::BusinessProbe;

mod holders;
mod operator;
mod phases;
mod review;

pub use holders::*;
pub use operator::*;
pub use phases::*;
pub use review::*;

/// The reap threshold the cases use: three replay windows (the behaviour contract's §6 default, 72 h).
pub const REAP: Duration = Duration::from_secs(3 * 24 * 3600);

/// Every case of [`crate::lifecycle_conformance_tests!`], by name (see
/// [`crate::suite::cases`]).
pub fn cases<S: KeyStore>() -> Vec<(&'static str, crate::Case<S>)> {
    crate::__lifecycle_cases!(__case_table { store lifecycle, S; })
}

/// Every case of [`crate::transactional_lifecycle_tests!`], by name.
pub fn tx_cases<S: TransactionalStore, P: BusinessProbe<S> + 'static>()
-> Vec<(&'static str, crate::TxCase<S, P>)> {
    crate::__tx_lifecycle_cases!(__case_table { tx lifecycle, S, P; })
}

/// A phase update reaching `point`, saving `step` when given.
pub fn phase(point: &str, step: Option<(&str, serde_json::Value)>) -> PhaseUpdate {
    PhaseUpdate {
        recovery_point: point.to_owned(),
        step: step.map(|(name, value)| (name.to_owned(), value)),
    }
}

async fn record<S: KeyStore + ?Sized>(store: &S, s: &Scope) -> Record {
    store.get(s).await.expect("get").expect("record exists")
}

fn assert_fenced<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(r, Err(StoreError::Fenced)),
        "{what}: expected Fenced, got {r:?}"
    );
}

fn keys(records: &[Record]) -> Vec<&str> {
    records.iter().map(|r| r.scope.key.as_str()).collect()
}

/// Claims `key` (lease mode) and returns its scope and lease.
async fn claimed<S: KeyStore + ?Sized>(store: &S, key: &str) -> (Scope, Lease) {
    let s = scope("acct-l", key);
    let lease = must_claim(store, &claim_req(&s, &format!(r#"{{"key":"{key}"}}"#))).await;
    (s, lease)
}
