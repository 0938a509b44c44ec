//! The race suite on a single Redis node: a private `redis-server` started for
//! this test (its keyspace holds only this run's records, so the reaper's and
//! completer's `SCAN`s cost what one schedule's records cost), emptied before
//! each schedule (schedules run one after another). One store whose scripts
//! read the schedule's test clock in place of `TIME`; the retrier's handle has
//! an application clock running [`SKEW`] ahead, which the scripts must ignore.
//! `IDEMKIT_RACE` picks the schedules (default: a seeded sample of 400 per
//! scenario; `all` for the whole space).

use std::sync::Arc;

use idemkit_core::KeyStore;
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::ManualClock;
use idemkit_testkit::race::{Explore, RaceTarget, SKEW, SkewedClock, TargetFactory, run_all};

use crate::common::{have_redis_binaries, unique_prefix};
use crate::harness::Standalone;

#[tokio::test(flavor = "multi_thread", worker_threads = 6)]
async fn race_suite() {
    if !have_redis_binaries() {
        return;
    }
    let server = tokio::task::spawn_blocking(|| Standalone::start(&["--appendonly", "no"]))
        .await
        .unwrap();
    let url = server.url();
    let base = RedisStore::connect_with(&url, RedisConfig::default().with_prefix(unique_prefix("race")))
        .await
        .expect("connect to the private redis-server");
    let admin = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let factory: TargetFactory = Arc::new(move |clock: Arc<ManualClock>| {
        let (base, mut admin) = (base.clone(), admin.clone());
        Box::pin(async move {
            // The previous schedule is over: start from an empty server.
            let () = redis::cmd("FLUSHDB").query_async(&mut admin).await.unwrap();
            let store: Arc<dyn KeyStore> = Arc::new(base.clone().with_test_clock(clock.clone()));
            let skewed = SkewedClock {
                base: clock.clone(),
                ahead: SKEW,
            };
            let second: Arc<dyn KeyStore> =
                Arc::new(base.with_test_clock(clock).with_clock(Arc::new(skewed)));
            RaceTarget {
                store,
                second,
                yield_points: &[],
            }
        })
    });
    let reports = run_all(factory, Explore::from_env(400)).await;
    assert!(!reports.is_empty());
    drop(server);
}
