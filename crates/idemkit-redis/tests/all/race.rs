//! The race suite on a single Redis node: one store (each schedule has its own
//! key) whose scripts read the schedule's test clock in place of `TIME`; the
//! retrier's handle has an application clock running [`SKEW`] ahead, which the
//! scripts must ignore.

use std::sync::Arc;

use idemkit_core::KeyStore;
use idemkit_redis::RedisStore;
use idemkit_testkit::ManualClock;
use idemkit_testkit::race::{RaceTarget, SKEW, SkewedClock};
use tokio::sync::OnceCell;

use crate::common::{redis_url, single_config};

async fn target(clock: Arc<ManualClock>) -> Option<RaceTarget> {
    static BASE: OnceCell<Option<RedisStore>> = OnceCell::const_new();
    let base = BASE
        .get_or_init(|| async {
            redis_url()?;
            Some(
                RedisStore::connect(single_config("race"))
                    .await
                    .expect("connect to redis"),
            )
        })
        .await
        .as_ref()?;
    let store: Arc<dyn KeyStore> = Arc::new(base.clone().with_test_clock(clock.clone()));
    let skewed = SkewedClock {
        base: clock.clone(),
        ahead: SKEW,
    };
    let second: Arc<dyn KeyStore> =
        Arc::new(base.clone().with_test_clock(clock).with_clock(Arc::new(skewed)));
    Some(RaceTarget {
        store,
        second,
        yield_points: &[],
    })
}

idemkit_testkit::race_tests!(target, 400);
