//! A lease-mode claim whose write committed but whose reply was lost (issue
//! 30, item 5, the store's half): the claim recognises its own write by its
//! attempt id and answers the lease, so no key is held with no holder.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, PhaseUpdate};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
use serde_json::json;

use super::fresh;

/// Failpoints are process-wide: one test at a time configures them.
static FAILPOINTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const REPLY_LOST: &str = "idemkit_sqlite::claim_reply_lost";

/// Claims `req` with its reply lost after the commit, and expects the lease.
async fn claim_with_reply_lost(store: &impl KeyStore, req: &idemkit_core::ClaimRequest) -> ClaimOutcome {
    fail::cfg(REPLY_LOST, &format!("return({})", req.scope.key.as_str())).unwrap();
    let outcome = store.claim(req).await;
    fail::remove(REPLY_LOST);
    outcome.expect("a claim whose write committed answers its lease, not the lost reply's error")
}

/// A new key (the autocommitted insert): the claim answers its lease, and the
/// lease is the record's (its token completes it).
#[tokio::test]
async fn a_lost_insert_reply_is_recognised_by_the_attempt_id() {
    let _one = FAILPOINTS.lock().await;
    let clock = Arc::new(ManualClock::new());
    let store = fresh(clock.clone()).await;
    let s = scope("acct", "k-lost-insert");
    let req = claim_req(&s, "{}");
    let ClaimOutcome::Claimed(lease) = claim_with_reply_lost(&*store, &req).await else {
        panic!("claimed")
    };
    assert_eq!(lease.resumed_from, None);
    let record = store.get(&s).await.unwrap().unwrap();
    assert_eq!(
        (record.fencing_token, record.lease_expires_at),
        (lease.token, lease.expires_at)
    );
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the answered lease holds the key");
}

/// A takeover (a record moved in a transaction): the lease resumes from the
/// record's recovery point; a later claim with another attempt id is not
/// mistaken for this one.
#[tokio::test]
async fn a_lost_takeover_reply_is_recognised_by_the_attempt_id() {
    let _one = FAILPOINTS.lock().await;
    let clock = Arc::new(ManualClock::new());
    let store = fresh(clock.clone()).await;
    let s = scope("acct", "k-lost-move");
    let req = claim_req(&s, "{}");
    let first = must_claim(&*store, &req).await;
    store
        .advance(
            &s,
            first.token,
            &PhaseUpdate {
                recovery_point: "label".into(),
                step: Some(("label".into(), json!({ "done": 1 }))),
            },
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
    let ClaimOutcome::Claimed(lease) = claim_with_reply_lost(&*store, &req).await else {
        panic!("taken over")
    };
    assert!(lease.token > first.token);
    assert_eq!(lease.resumed_from.as_deref(), Some("label"));
    // The recognised lease is live: another attempt is told it is in progress.
    assert!(matches!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::InProgress { .. }
    ));
    store
        .complete(&s, lease.token, &response(201, "done"))
        .await
        .expect("the answered lease holds the key");
}

/// A claim whose write did not commit (the key is someone else's) keeps its
/// answer: the read-back finds another attempt's record.
#[tokio::test]
async fn an_error_without_a_committed_claim_is_not_taken_for_one() {
    let _one = FAILPOINTS.lock().await;
    let clock = Arc::new(ManualClock::new());
    let store = fresh(clock.clone()).await;
    let s = scope("acct", "k-held");
    let req = claim_req(&s, "{}");
    let _held = must_claim(&*store, &req).await;
    fail::cfg(REPLY_LOST, "return(k-held)").unwrap();
    let outcome = store.claim(&req).await;
    fail::remove(REPLY_LOST);
    assert!(
        matches!(outcome, Ok(ClaimOutcome::InProgress { .. })),
        "{outcome:?}"
    );
}
