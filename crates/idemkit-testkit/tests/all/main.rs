//! The in-memory store passes the conformance suite it ships.

use std::sync::Arc;

use idemkit_testkit::{ManualClock, MemoryStore};

async fn fresh(clock: Arc<ManualClock>) -> Arc<MemoryStore> {
    Arc::new(MemoryStore::with_clock(clock))
}

idemkit_testkit::store_conformance_tests!(fresh);

mod lifecycle {
    use super::*;
    idemkit_testkit::lifecycle_conformance_tests!(fresh);
}
/// The negative controls of the conformance and lifecycle suites: every case
/// runs against each mutant store, and each mutant must fail at least one.
mod negative_controls {
    use std::sync::Arc;
    use std::time::Duration;

    use idemkit_core::KeyStore;
    use idemkit_testkit::mutants::{MutantStore, Mutation};
    use idemkit_testkit::{Case, ManualClock, MemoryStore, lifecycle, suite};

    /// Runs every case on a fresh store from `make`; returns the failed ones.
    async fn failing_cases<S: KeyStore>(make: impl Fn(Arc<ManualClock>) -> S) -> Vec<&'static str> {
        let cases: Vec<(&str, Case<S>)> = suite::cases().into_iter().chain(lifecycle::cases()).collect();
        assert!(cases.len() > 20, "{} cases", cases.len());
        let mut failed = Vec::new();
        for (name, case) in cases {
            let clock = Arc::new(ManualClock::new());
            let store = Arc::new(make(clock.clone()));
            let run = tokio::spawn(tokio::time::timeout(Duration::from_secs(30), case(store, clock)));
            match run.await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => panic!("{name} hung"),
                Err(e) if e.is_panic() => failed.push(name),
                Err(e) => panic!("{name}: {e}"),
            }
        }
        failed
    }

    /// The harness itself: the store the mutants wrap passes every case, so a
    /// failure below is the mutation's.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_unmutated_store_passes_every_case() {
        let failed = failing_cases(|clock| MemoryStore::with_clock(clock)).await;
        assert!(failed.is_empty(), "the memory store fails {failed:?}");
    }

    /// Each mutant fails some case; where a case exists for the defect, that
    /// case is among the failures.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn the_suites_catch_every_mutant() {
        let expected: &[(Mutation, &str)] = &[
            (
                Mutation::RestartAfterWindow,
                "unfinished_record_past_the_window_is_taken_over_not_restarted",
            ),
            (
                Mutation::ReaperDeletesUnfinished,
                "reap_deletes_old_records_and_moves_unfinished_ones_to_review",
            ),
            (
                Mutation::ResumeIgnoresToken,
                "resume_claims_only_the_record_it_saw",
            ),
            (
                Mutation::NoFencing,
                "takeover_after_expiry_gets_new_token_and_fences_old_holder",
            ),
            (
                Mutation::ReleaseWipesProgress,
                "release_with_progress_is_refused_and_kept_resumable",
            ),
            (
                Mutation::TokensDoNotRise,
                "takeover_after_expiry_gets_new_token_and_fences_old_holder",
            ),
            (
                Mutation::AbandonKeepsToken,
                "abandon_moves_the_record_to_a_new_token",
            ),
            (Mutation::CheckThenInsert, "concurrent_claims_have_one_winner"),
            (Mutation::TakeoverIgnoresState, "expired_window_is_a_new_request"),
            (Mutation::TakeoverIgnoresLease, "live_lease_is_in_progress"),
        ];
        assert_eq!(
            expected.len(),
            Mutation::ALL.len(),
            "every mutation has a case that exists for it"
        );
        let mut missed = Vec::new();
        for &(m, case) in expected {
            let failed = failing_cases(|clock| MutantStore::new(m, clock)).await;
            eprintln!("{m:?} caught by {failed:?}");
            if !failed.contains(&case) {
                missed.push(format!("{m:?}: {case} passed (failures: {failed:?})"));
            }
        }
        assert!(missed.is_empty(), "mutants not caught:\n{}", missed.join("\n"));
    }
}
