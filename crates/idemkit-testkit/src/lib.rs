//! # idemkit-testkit
//!
//! Test support shared by every idemkit backend:
//!
//! - [`MemoryStore`], an in-memory [`KeyStore`](idemkit_core::KeyStore) (tests,
//!   benchmarks, single-process demos);
//! - [`ManualClock`], a clock tests move by hand, so lease expiry and replay windows
//!   are tested without sleeping;
//! - the **store conformance suite** ([`suite`], [`tx_suite`]) and the macros
//!   [`store_conformance_tests!`] and [`transactional_conformance_tests!`] that turn
//!   it into one `#[tokio::test]` per case for a backend;
//! - the **lifecycle suite** ([`lifecycle`]: phases, parking, the completer's work
//!   list, the reaper and its review list) with [`lifecycle_conformance_tests!`]
//!   and [`transactional_lifecycle_tests!`];
//! - [`mutants`]: deliberately broken stores, the suites' negative controls;
//! - [`Probed`]: any store with its claims counted and its reads failing on
//!   demand, for tests of what sits above the store;
//! - [`PgServer`]: a PostgreSQL server of a test's own, to crash and restart
//!   for real.
//!
//! ```
//! use std::sync::Arc;
//! use idemkit_testkit::{ManualClock, MemoryStore};
//!
//! async fn fresh(clock: Arc<ManualClock>) -> Arc<MemoryStore> {
//!     Arc::new(MemoryStore::with_clock(clock))
//! }
//! idemkit_testkit::store_conformance_tests!(fresh);
//! idemkit_testkit::lifecycle_conformance_tests!(fresh);
//! # fn main() {}
//! ```

mod clock;
pub mod lifecycle;
mod memory;
pub mod mutants;
mod pg_server;
mod probe;
mod process;
pub mod suite;
pub mod tx_suite;

pub use clock::{ManualClock, SkewedClock};
pub use memory::MemoryStore;
pub use pg_server::{PgServer, free_port, pg_bindir};
pub use probe::Probed;
pub use process::example_bin;

// The case lists, each written once. Every list macro hands its cases to the
// macro named first (`$crate::$callback!`), after the tokens in braces: the
// test-generating macros below and the case tables ([`suite::cases`] and
// friends, which the negative controls run against mutant stores) use the same
// list, so a case added here runs everywhere.

#[doc(hidden)]
#[macro_export]
macro_rules! __store_cases {
    ($callback:ident { $($pre:tt)* }) => {
        $crate::$callback! { $($pre)*
            first_claim_then_replay,
            replay_is_byte_identical,
            mismatch_is_reported_in_every_state,
            live_lease_is_in_progress,
            takeover_after_expiry_gets_new_token_and_fences_old_holder,
            expired_window_is_a_new_request,
            release_makes_key_absent_and_tokens_keep_growing,
            abandon_ends_lease_at_once,
            heartbeat_keeps_lease_alive,
            accounts_are_isolated,
            completion_is_fenced_once_completed,
            record_keeps_the_request,
            completion_drops_the_request_body,
            concurrent_claims_have_one_winner
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __tx_cases {
    ($callback:ident { $($pre:tt)* }) => {
        $crate::$callback! { $($pre)*
            claim_business_write_and_response_commit_together,
            dropped_transaction_rolls_back_claim_and_writes,
            stale_token_cannot_open_a_transaction,
            fenced_completion_rolls_back_business_writes,
            concurrent_single_step_requests_write_once,
            single_step_claim_over_a_record_raises_its_token,
            single_step_takeover_keeps_progress
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __lifecycle_cases {
    ($callback:ident { $($pre:tt)* }) => {
        $crate::$callback! { $($pre)*
            advance_saves_progress_and_takeover_resumes_from_it,
            stale_token_cannot_advance_or_park,
            parked_record_is_never_claimed_again,
            abandoned_lists_expired_in_flight_records_oldest_first,
            reap_deletes_old_records_and_moves_unfinished_ones_to_review,
            reaped_keys_can_be_claimed_anew,
            list_filters_by_state_and_account_newest_first,
            force_release_frees_only_records_nobody_holds,
            unfinished_record_past_the_window_is_taken_over_not_restarted,
            release_with_progress_is_refused_and_kept_resumable,
            release_discarding_frees_the_key_only_for_its_holder,
            a_claim_starts_at_its_recovery_point,
            abandon_moves_the_record_to_a_new_token,
            resume_claims_only_the_record_it_saw
        }
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __tx_lifecycle_cases {
    ($callback:ident { $($pre:tt)* }) => {
        $crate::$callback! { $($pre)*
            advance_in_tx_commits_with_the_business_writes,
            dropped_phase_rolls_back_progress_with_business_writes,
            stale_token_cannot_advance_in_a_tx
        }
    };
}

/// Builds a case table from a case list (see [`suite::cases`]).
#[doc(hidden)]
#[macro_export]
macro_rules! __case_table {
    (store $module:ident, $S:ident; $($case:ident),* $(,)?) => {
        ::std::vec![$(
            (
                ::std::stringify!($case),
                (|store: ::std::sync::Arc<$S>, clock: ::std::sync::Arc<$crate::ManualClock>| {
                    ::std::boxed::Box::pin($crate::$module::$case(store, clock))
                        as $crate::CaseFuture
                }) as $crate::Case<$S>,
            )
        ),*]
    };
    (tx $module:ident, $S:ident, $P:ident; $($case:ident),* $(,)?) => {
        ::std::vec![$(
            (
                ::std::stringify!($case),
                (|store: ::std::sync::Arc<$S>, probe: $P, clock: ::std::sync::Arc<$crate::ManualClock>| {
                    ::std::boxed::Box::pin($crate::$module::$case(store, probe, clock))
                        as $crate::CaseFuture
                }) as $crate::TxCase<$S, $P>,
            )
        ),*]
    };
}

/// The future a [`Case`] returns.
pub type CaseFuture = futures::future::BoxFuture<'static, ()>;

/// One conformance case on a store of type `S`, as a function pointer: a
/// fresh, empty store and its clock in, the case's future out. It panics when
/// the store does not conform.
pub type Case<S> = fn(std::sync::Arc<S>, std::sync::Arc<ManualClock>) -> CaseFuture;

/// One transactional conformance case (see [`Case`]), with the business probe.
pub type TxCase<S, P> = fn(std::sync::Arc<S>, P, std::sync::Arc<ManualClock>) -> CaseFuture;

/// Generates one `#[tokio::test]` per case of [`suite`] for a backend.
///
/// `$factory` is an async fn (or closure) taking `Arc<ManualClock>` and returning
/// `Arc<S>` for a *fresh, empty* store `S: KeyStore` that reads time from that clock.
///
/// With `optional` first, the factory returns `Option<Arc<S>>` and a `None`
/// (e.g. no database configured outside CI) ends the test early, with a notice.
#[macro_export]
macro_rules! store_conformance_tests {
    (optional $factory:expr) => {
        $crate::__store_cases!(store_conformance_tests {
            @cases (|clock| async move { ($factory)(clock).await }); @optional;
        });
    };
    ($factory:expr) => {
        $crate::__store_cases!(store_conformance_tests {
            @cases (|clock| async move { Some(($factory)(clock).await) }); @optional;
        });
    };
    (@cases $factory:expr; @optional; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let clock = ::std::sync::Arc::new($crate::ManualClock::new());
                let Some(store) = ($factory)(clock.clone()).await else {
                    eprintln!("store not configured: skipped");
                    return;
                };
                $crate::suite::$case(store, clock).await;
            }
        )*
    };
}

/// Generates one `#[tokio::test]` per case of [`tx_suite`] for a SQL backend.
///
/// `$factory` is as for [`store_conformance_tests!`] but returns `Arc<S>` with
/// `S: TransactionalStore`; `$probe` is an async fn taking `Arc<S>` and returning a
/// [`tx_suite::BusinessProbe`] for that store (it creates its business table).
///
/// With `optional` first, the factory returns `Option<Arc<S>>` as for
/// [`store_conformance_tests!`].
#[macro_export]
macro_rules! transactional_conformance_tests {
    (optional $factory:expr, $probe:expr) => {
        $crate::__tx_cases!(transactional_conformance_tests {
            @cases (|clock| async move { ($factory)(clock).await }), $probe;
        });
    };
    ($factory:expr, $probe:expr) => {
        $crate::__tx_cases!(transactional_conformance_tests {
            @cases (|clock| async move { Some(($factory)(clock).await) }), $probe;
        });
    };
    (@cases $factory:expr, $probe:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let clock = ::std::sync::Arc::new($crate::ManualClock::new());
                let Some(store) = ($factory)(clock.clone()).await else {
                    eprintln!("store not configured: skipped");
                    return;
                };
                let probe = ($probe)(store.clone()).await;
                $crate::tx_suite::$case(store, probe, clock).await;
            }
        )*
    };
}

/// Generates one `#[tokio::test]` per case of [`lifecycle`] that needs only a
/// [`KeyStore`](idemkit_core::KeyStore): phases, parking, the completer's work
/// list and the reaper.
///
/// `$factory` is as for [`store_conformance_tests!`], including the `optional`
/// form.
#[macro_export]
macro_rules! lifecycle_conformance_tests {
    (optional $factory:expr) => {
        $crate::__lifecycle_cases!(lifecycle_conformance_tests {
            @cases (|clock| async move { ($factory)(clock).await });
        });
    };
    ($factory:expr) => {
        $crate::__lifecycle_cases!(lifecycle_conformance_tests {
            @cases (|clock| async move { Some(($factory)(clock).await) });
        });
    };
    (@cases $factory:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let clock = ::std::sync::Arc::new($crate::ManualClock::new());
                let Some(store) = ($factory)(clock.clone()).await else {
                    eprintln!("store not configured: skipped");
                    return;
                };
                $crate::lifecycle::$case(store, clock).await;
            }
        )*
    };
}

/// Generates one `#[tokio::test]` per transactional case of [`lifecycle`]:
/// phase transactions opened with `begin_fenced` that advance the recovery
/// point together with their business writes.
///
/// `$factory` and `$probe` are as for [`transactional_conformance_tests!`]
/// (including the `optional` form). Phases that do not complete commit with
/// [`TransactionalStore::commit`](idemkit_core::TransactionalStore::commit), the
/// path the phases API takes.
#[macro_export]
macro_rules! transactional_lifecycle_tests {
    (optional $factory:expr, $probe:expr) => {
        $crate::__tx_lifecycle_cases!(transactional_lifecycle_tests {
            @cases (|clock| async move { ($factory)(clock).await }), $probe;
        });
    };
    ($factory:expr, $probe:expr) => {
        $crate::__tx_lifecycle_cases!(transactional_lifecycle_tests {
            @cases (|clock| async move { Some(($factory)(clock).await) }), $probe;
        });
    };
    (@cases $factory:expr, $probe:expr; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $case() {
                let clock = ::std::sync::Arc::new($crate::ManualClock::new());
                let Some(store) = ($factory)(clock.clone()).await else {
                    eprintln!("store not configured: skipped");
                    return;
                };
                let probe = ($probe)(store.clone()).await;
                $crate::lifecycle::$case(store, probe, clock).await;
            }
        )*
    };
}
