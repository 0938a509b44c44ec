//! The reaper after an operator's hands: a release, a re-park, deleted review
//! rows (issue 30, item 10). Every pass must keep working and list each new
//! orphan.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, PhaseUpdate};
use idemkit_testkit::ManualClock;
use idemkit_testkit::suite::{claim_req, must_claim, scope};
use serde_json::json;

use super::fresh;

/// A request whose holder recorded an external intent and died: the record
/// stays in flight with progress, its lease run out.
async fn orphan(store: &impl KeyStore, clock: &ManualClock, key: &str) {
    let s = scope("acct", key);
    let lease = must_claim(store, &claim_req(&s, "{}")).await;
    store
        .advance(
            &s,
            lease.token,
            &PhaseUpdate {
                recovery_point: "label".into(),
                step: Some(("courier".into(), json!({ "intent": "dk-1" }))),
            },
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(3600));
}

/// The documented workflow: intent recorded, the holder dies, the reaper
/// parks and lists it, an operator releases it (`idemkit keys release`), the
/// completer takes it over and parks it again. The next passes work, list the
/// new park once, and list a later orphan too.
#[tokio::test]
async fn the_reaper_keeps_working_after_an_operator_release_and_a_new_park() {
    let clock = Arc::new(ManualClock::new());
    let store = fresh(clock.clone()).await;
    let s = scope("acct", "k-orphan");
    orphan(&*store, &clock, "k-orphan").await;
    let first = store.reap(store.now()).await.expect("first pass");
    assert_eq!(first.moved_to_review, 1);
    assert!(store.force_release(&s).await.unwrap(), "the operator releases it");
    // The completer resumes it (a takeover of the record it saw) and parks it:
    // the intent has no result and the downstream cannot be asked.
    let seen = store.get(&s).await.unwrap().unwrap();
    let mut resume = claim_req(&s, "{}");
    resume.resume = Some(seen.fencing_token);
    let ClaimOutcome::Claimed(lease) = store.claim(&resume).await.unwrap() else {
        panic!("the completer takes it over")
    };
    store
        .park(
            &s,
            lease.token,
            "external step `courier` has an intent and no result",
        )
        .await
        .unwrap();
    clock.advance(Duration::from_secs(60));
    let second = store
        .reap(store.now())
        .await
        .expect("the pass after the operator's release");
    assert_eq!(second.moved_to_review, 1, "the new park is listed");
    let third = store.reap(store.now()).await.expect("a later pass");
    assert_eq!(third.moved_to_review, 0, "listed once per park");
    orphan(&*store, &clock, "k-later").await;
    let fourth = store.reap(store.now()).await.expect("a pass with a new orphan");
    assert_eq!(fourth.moved_to_review, 1, "a new orphan is listed");
    let review = store.review(10).await.unwrap();
    let keys: Vec<&str> = review.iter().map(|e| e.scope.key.as_str()).collect();
    assert_eq!(keys, ["k-orphan", "k-orphan", "k-later"], "{review:#?}");
    assert_eq!(
        review[1].last_error.as_deref(),
        Some("external step `courier` has an intent and no result"),
        "the second entry is the completer's park"
    );
}

/// An operator deletes the review rows they handled: later passes still work
/// and list new orphans; the handled records stay parked tombstones, not
/// listed again.
#[tokio::test]
async fn the_reaper_keeps_working_after_handled_review_rows_are_deleted() {
    let clock = Arc::new(ManualClock::new());
    let store = fresh(clock.clone()).await;
    orphan(&*store, &clock, "k-handled").await;
    assert_eq!(store.reap(store.now()).await.unwrap().moved_to_review, 1);
    sqlx::query("DELETE FROM idemkit_review")
        .execute(store.pool())
        .await
        .unwrap();
    let after = store
        .reap(store.now())
        .await
        .expect("the pass after the deletion");
    assert_eq!(after.moved_to_review, 0, "a handled record is not listed again");
    orphan(&*store, &clock, "k-new").await;
    let next = store.reap(store.now()).await.expect("a pass with a new orphan");
    assert_eq!(next.moved_to_review, 1);
    let review = store.review(10).await.unwrap();
    let keys: Vec<&str> = review.iter().map(|e| e.scope.key.as_str()).collect();
    assert_eq!(keys, ["k-new"]);
    let handled = store.get(&scope("acct", "k-handled")).await.unwrap().unwrap();
    assert_eq!(handled.state.as_str(), "parked", "still a tombstone");
}
