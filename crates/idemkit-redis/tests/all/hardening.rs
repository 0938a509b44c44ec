//! Regression tests for Redis (SPEC §3): leases judged by the server's clock,
//! unfinished work never restarted by the replay window.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, SystemClock};

use idemkit_testkit::ManualClock;
use idemkit_testkit::SkewedClock;
use idemkit_testkit::suite::{LEASE, WINDOW, claim_req, must_claim, response, scope};
use serde_json::json;

use crate::common::{connect_single, redis_url, single_config};

/// An instance whose own clock runs well ahead still sees a live lease as
/// live: the scripts read the server's `TIME`.
#[tokio::test]
async fn a_skewed_instance_cannot_take_over_a_live_lease() {
    if redis_url().is_none() {
        return;
    }
    let ahead = Arc::new(SkewedClock {
        base: Arc::new(SystemClock),
        ahead: LEASE + Duration::from_secs(25),
    });
    let config = single_config("skew");
    let honest = connect_single(config.clone()).await.unwrap();
    let skewed = connect_single(config).await.unwrap().with_clock(ahead);
    let s = scope("a", "skew");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&honest, &req).await;
    match skewed.claim(&req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => {
            assert!(retry_after > LEASE - Duration::from_secs(5), "{retry_after:?}")
        }
        other => panic!("a skewed instance took over a live lease: {other:?}"),
    }
    honest
        .complete(&s, lease.token, &response(201, "mine"))
        .await
        .unwrap();
}

/// The replay window applies to completed records only: an abandoned request
/// with recorded progress, claimed again long after its window, is taken over
/// with its progress, never restarted as a new request.
#[tokio::test]
async fn unfinished_work_past_the_window_is_taken_over() {
    if redis_url().is_none() {
        return;
    }
    let clock = Arc::new(ManualClock::new());
    let store = connect_single(single_config("window"))
        .await
        .unwrap()
        .with_test_clock(clock.clone());
    let s = scope("a", "old-work");
    let req = claim_req(&s, "{}");
    let first = must_claim(&store, &req).await;
    store
        .record_phase(
            &s,
            first.token,
            "charged",
            Some(("charge", &json!({"id": "ch_1"}))),
        )
        .await
        .unwrap();
    clock.advance(WINDOW * 2);
    let again = must_claim(&store, &req).await;
    assert_eq!(again.resumed_from.as_deref(), Some("charged"));
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.step_outputs["charge"], json!({"id": "ch_1"}));
}
