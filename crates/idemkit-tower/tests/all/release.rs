//! `release_key`, the library function behind `idemkit keys release`: what it
//! refuses, and what it keeps or discards of a record's progress.

use super::*;
use idemkit_core::{Account, ClaimOutcome, FencingToken, IdempotencyKey, KeyStore, RecordState, Scope};
use idemkit_engine::{Engine, Incoming};
use idemkit_tower::{ReleaseRefused, Released, release_key};

/// Claims `key` with a 1 s lease, its claim writing `recovery_point`.
async fn claim(store: &Arc<dyn KeyStore>, key: &str, recovery_point: Option<&str>) -> (Scope, FencingToken) {
    let scope = Scope::new(Account::new("acct"), IdempotencyKey::parse(key).unwrap());
    let engine = Engine::lease(store.clone(), Policy::new().with_lease(Duration::from_secs(1))).unwrap();
    let mut req = engine.claim_request(Incoming {
        scope: scope.clone(),
        method: "POST",
        target: "/op",
        headers: Vec::new(),
        body: b"{}",
        resume: None,
    });
    req.recovery_point = recovery_point.map(str::to_owned);
    match store.claim(&req).await.unwrap() {
        ClaimOutcome::Claimed(lease) => (scope, lease.token),
        other => panic!("not claimed: {other:?}"),
    }
}

#[tokio::test]
async fn release_key_refuses_what_it_must_and_keeps_or_discards_progress_as_told() {
    let clock = Arc::new(ManualClock::new());
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));

    let nobody = Scope::new(Account::new("acct"), IdempotencyKey::parse("none").unwrap());
    assert_eq!(
        release_key(&*store, &nobody, false).await.unwrap(),
        Err(ReleaseRefused::NoRecord)
    );

    let (live, _) = claim(&store, "live", Some("forwarded")).await;
    assert!(matches!(
        release_key(&*store, &live, true).await.unwrap(),
        Err(ReleaseRefused::LiveLease { .. })
    ));

    let (done, token) = claim(&store, "done", None).await;
    let answer = idemkit_core::StoredResponse {
        status: 201,
        headers: Vec::new(),
        body: b"ok".to_vec(),
    };
    store.complete(&done, token, &answer).await.unwrap();
    assert_eq!(
        release_key(&*store, &done, true).await.unwrap(),
        Err(ReleaseRefused::Completed)
    );

    let (kept, _) = claim(&store, "kept", Some("forwarded")).await;
    let (discarded, _) = claim(&store, "discarded", Some("forwarded")).await;
    clock.advance(Duration::from_secs(5));
    // The lease ran out: released, progress kept unless the operator says
    // the downstream did nothing.
    assert_eq!(
        release_key(&*store, &kept, false).await.unwrap(),
        Ok(Released::KeptProgress)
    );
    let record = store.get(&kept).await.unwrap().unwrap();
    assert_eq!(
        record.recovery_point.as_deref(),
        Some("forwarded"),
        "the progress is kept"
    );
    assert_eq!(
        release_key(&*store, &discarded, true).await.unwrap(),
        Ok(Released::DiscardedProgress)
    );
    let record = store.get(&discarded).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Released);
    assert_eq!(record.recovery_point, None, "the progress is discarded");
    assert_eq!(
        release_key(&*store, &discarded, true).await.unwrap(),
        Err(ReleaseRefused::AlreadyReleased)
    );
}
