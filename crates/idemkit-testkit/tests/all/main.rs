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

mod race {
    use std::sync::Arc;

    use idemkit_core::KeyStore;
    use idemkit_testkit::mutants::{MutantStore, Mutation};
    use idemkit_testkit::race::{self, Explore, RaceTarget, SCENARIOS, TargetFactory};
    use idemkit_testkit::{ManualClock, MemoryStore};

    async fn memory(clock: Arc<ManualClock>) -> Option<RaceTarget> {
        let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock));
        Some(RaceTarget {
            second: store.clone(),
            store,
            yield_points: &[],
        })
    }

    idemkit_testkit::race_tests!(memory, 400);

    /// The memory store is cheap enough to run every schedule of every scenario.
    #[tokio::test(flavor = "multi_thread", worker_threads = 6)]
    async fn every_schedule_on_the_memory_store() {
        let factory: TargetFactory = Arc::new(|clock| Box::pin(async move { memory(clock).await.unwrap() }));
        let reports = race::run_all(factory, Explore::All { limit: 200_000 }).await;
        for r in &reports {
            assert!(
                r.complete,
                "{} was cut off after {} schedules",
                r.scenario, r.schedules
            );
            assert!(
                r.schedules > 10,
                "{} explored only {} schedules",
                r.scenario,
                r.schedules
            );
        }
    }

    fn mutant(m: Mutation) -> TargetFactory {
        Arc::new(move |clock| {
            Box::pin(async move {
                let store: Arc<dyn KeyStore> = Arc::new(MutantStore::new(m, clock));
                RaceTarget {
                    second: store.clone(),
                    store,
                    yield_points: &[],
                }
            })
        })
    }

    /// The negative control: each defect the suite exists for is caught in
    /// some scenario (every schedule explored).
    #[tokio::test(flavor = "multi_thread", worker_threads = 6)]
    async fn the_race_suite_catches_every_mutant() {
        for m in [
            Mutation::RestartAfterWindow,
            Mutation::ReaperDeletesUnfinished,
            Mutation::ResumeIgnoresToken,
            Mutation::NoFencing,
        ] {
            let mut caught = Vec::new();
            for (name, roles) in SCENARIOS {
                if let Err(v) = race::explore(mutant(m), name, roles, Explore::All { limit: 200_000 }).await {
                    caught.push(v.to_string());
                }
            }
            assert!(!caught.is_empty(), "the race suite missed {m:?}");
            eprintln!("{m:?} caught:\n  {}", caught.join("\n  "));
        }
    }
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
