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
