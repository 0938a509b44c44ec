//! The store conformance suite: the behaviour every [`KeyStore`] must have.
//!
//! Each case takes a fresh, empty store and the [`ManualClock`] it reads time from.
//! Use [`crate::store_conformance_tests!`] to run them all for a backend.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, FencingToken, Fingerprinter, IdempotencyKey, KeyStore, Lease,
    RecordState, Scope, StoreError, StoredHeader, StoredRequest, StoredResponse,
};

use crate::ManualClock;

/// Lease used by the suite.
pub const LEASE: Duration = Duration::from_secs(30);
/// Replay window used by the suite.
pub const WINDOW: Duration = Duration::from_secs(24 * 3600);

/// Every case of this suite, by name, in the order
/// [`crate::store_conformance_tests!`] runs them (the negative controls run
/// them against mutant stores).
pub fn cases<S: KeyStore>() -> Vec<(&'static str, crate::Case<S>)> {
    crate::__store_cases!(__case_table { store suite, S; })
}

/// A scope for `account` and `key`.
pub fn scope(account: &str, key: &str) -> Scope {
    Scope::new(
        Account::new(account),
        IdempotencyKey::parse(key).expect("valid test key"),
    )
}

/// A claim request for `scope` with a JSON body.
pub fn claim_req(scope: &Scope, body: &str) -> ClaimRequest {
    ClaimRequest {
        scope: scope.clone(),
        fingerprint: Fingerprinter::new().compute("POST", "/orders", body.as_bytes()),
        request: StoredRequest {
            method: "POST".into(),
            path: "/orders".into(),
            headers: vec![StoredHeader {
                name: "content-type".into(),
                value: b"application/json".to_vec(),
            }],
            body: body.as_bytes().to_vec(),
        },
        lease: LEASE,
        replay_window: WINDOW,
        lock_wait: Duration::ZERO,
        resume: None,
        recovery_point: None,
    }
}

/// A response with a recognisable body.
pub fn response(status: u16, body: &str) -> StoredResponse {
    StoredResponse {
        status,
        headers: vec![
            StoredHeader {
                name: "content-type".into(),
                value: b"application/json".to_vec(),
            },
            StoredHeader {
                name: "location".into(),
                value: b"/orders/1".to_vec(),
            },
        ],
        body: body.as_bytes().to_vec(),
    }
}

/// Claims and expects to win.
pub async fn must_claim<S: KeyStore + ?Sized>(store: &S, req: &ClaimRequest) -> Lease {
    match store.claim(req).await.expect("claim") {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

fn assert_fenced<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(r, Err(StoreError::Fenced)),
        "{what}: expected Fenced, got {r:?}"
    );
}

/// Absent → claimed → completed → the same request replays the stored response.
pub async fn first_claim_then_replay<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-1");
    let req = claim_req(&s, r#"{"sku":"A","quantity":1}"#);
    let lease = must_claim(&*store, &req).await;
    assert!(lease.token > FencingToken(0));
    assert_eq!(lease.resumed_from, None);
    let resp = response(201, r#"{"id":1}"#);
    store.complete(&s, lease.token, &resp).await.expect("complete");
    for _ in 0..3 {
        assert_eq!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::Replay(resp.clone())
        );
    }
    let rec = store.get(&s).await.unwrap().expect("record");
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.response, Some(resp));
    assert!(rec.completed_at.is_some());
}

/// Stored bodies and header values come back byte for byte, including non-UTF-8.
pub async fn replay_is_byte_identical<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-bytes");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&*store, &req).await;
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let resp = StoredResponse {
        status: 200,
        headers: vec![
            StoredHeader {
                name: "content-type".into(),
                value: b"application/octet-stream".to_vec(),
            },
            StoredHeader {
                name: "x-weird".into(),
                value: vec![b'a', 0xff, 0x80, b'z'],
            },
        ],
        body,
    };
    store.complete(&s, lease.token, &resp).await.unwrap();
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Replay(resp));
}

/// A different request under the same key is `Mismatch`, whether the first is
/// in flight (live or expired) or completed. It never replays.
pub async fn mismatch_is_reported_in_every_state<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-mm");
    let a = claim_req(&s, r#"{"quantity":1}"#);
    let b = claim_req(&s, r#"{"quantity":2}"#);
    must_claim(&*store, &a).await;
    assert_eq!(
        store.claim(&b).await.unwrap(),
        ClaimOutcome::Mismatch,
        "live lease"
    );
    clock.advance(LEASE * 2);
    assert_eq!(
        store.claim(&b).await.unwrap(),
        ClaimOutcome::Mismatch,
        "expired lease"
    );
    let lease = must_claim(&*store, &a).await; // takeover by the same request
    store
        .complete(&s, lease.token, &response(201, "{}"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(&b).await.unwrap(),
        ClaimOutcome::Mismatch,
        "completed"
    );
}

/// A live lease answers `InProgress` with the time left on it.
pub async fn live_lease_is_in_progress<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-live");
    let req = claim_req(&s, "{}");
    must_claim(&*store, &req).await;
    clock.advance(Duration::from_secs(10));
    match store.claim(&req).await.unwrap() {
        ClaimOutcome::InProgress { retry_after } => {
            assert!(retry_after <= LEASE - Duration::from_secs(10), "{retry_after:?}");
            assert!(retry_after >= LEASE - Duration::from_secs(11), "{retry_after:?}");
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
}

/// After the lease expires the next attempt takes over with a strictly greater
/// token; every write with the old token is refused; the replay is the new holder's.
pub async fn takeover_after_expiry_gets_new_token_and_fences_old_holder<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let s = scope("acct-a", "k-take");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    clock.advance(LEASE + Duration::from_millis(1));
    let b = must_claim(&*store, &req).await;
    assert!(b.token > a.token, "{b:?} !> {a:?}");
    assert_fenced(store.heartbeat(&s, a.token, LEASE).await, "stale heartbeat");
    assert_fenced(
        store.complete(&s, a.token, &response(201, "A")).await,
        "stale complete",
    );
    assert_fenced(store.release(&s, a.token).await, "stale release");
    assert_fenced(store.abandon(&s, a.token, "x").await, "stale abandon");
    store.complete(&s, b.token, &response(201, "B")).await.unwrap();
    assert_eq!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "B"))
    );
}

/// After the replay window a completed key is a new request, whatever its body.
pub async fn expired_window_is_a_new_request<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-win");
    let a = claim_req(&s, r#"{"n":1}"#);
    let first = must_claim(&*store, &a).await;
    store
        .complete(&s, first.token, &response(201, "1"))
        .await
        .unwrap();
    clock.advance(WINDOW - Duration::from_secs(1));
    assert_eq!(
        store.claim(&a).await.unwrap(),
        ClaimOutcome::Replay(response(201, "1"))
    );
    clock.advance(Duration::from_secs(2));
    let b = claim_req(&s, r#"{"n":2}"#);
    let second = must_claim(&*store, &b).await;
    assert!(second.token > first.token);
    assert_eq!(second.resumed_from, None);
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.response, None);
    assert_eq!(rec.request.body, br#"{"n":2}"#.to_vec());
    store
        .complete(&s, second.token, &response(201, "2"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(&b).await.unwrap(),
        ClaimOutcome::Replay(response(201, "2"))
    );
}

/// A released key behaves as absent, and its next claim gets a higher token
/// (so a holder of the released token can never write again).
pub async fn release_makes_key_absent_and_tokens_keep_growing<S: KeyStore>(
    store: Arc<S>,
    _clock: Arc<ManualClock>,
) {
    let s = scope("acct-a", "k-rel");
    let first = must_claim(&*store, &claim_req(&s, r#"{"bad":true}"#)).await;
    store.release(&s, first.token).await.unwrap();
    // The corrected request (a different body) may reuse the key.
    let fixed = claim_req(&s, r#"{"bad":false}"#);
    let second = must_claim(&*store, &fixed).await;
    assert!(second.token > first.token);
    assert_fenced(
        store.complete(&s, first.token, &response(201, "old")).await,
        "released token",
    );
    store
        .complete(&s, second.token, &response(201, "new"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(&fixed).await.unwrap(),
        ClaimOutcome::Replay(response(201, "new"))
    );
}

/// `abandon` ends the lease now: the next attempt takes over without waiting.
pub async fn abandon_ends_lease_at_once<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-ab");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    store.abandon(&s, a.token, "courier timed out").await.unwrap();
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.last_error.as_deref(), Some("courier timed out"));
    assert_eq!(rec.state, RecordState::InFlight);
    let b = must_claim(&*store, &req).await;
    assert!(b.token > a.token);
}

/// Heartbeats keep a slow holder's lease alive past its original expiry.
pub async fn heartbeat_keeps_lease_alive<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-hb");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    for _ in 0..5 {
        clock.advance(LEASE / 2);
        let until = store.heartbeat(&s, a.token, LEASE).await.unwrap();
        assert_eq!(until, store.now().plus(LEASE));
        assert!(matches!(
            store.claim(&req).await.unwrap(),
            ClaimOutcome::InProgress { .. }
        ));
    }
    store.complete(&s, a.token, &response(200, "slow")).await.unwrap();
}

/// The same key in two accounts is two records.
pub async fn accounts_are_isolated<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let a = scope("acct-a", "shared-key");
    let b = scope("acct-b", "shared-key");
    let la = must_claim(&*store, &claim_req(&a, "{}")).await;
    let lb = must_claim(&*store, &claim_req(&b, "{}")).await;
    store.complete(&a, la.token, &response(201, "A")).await.unwrap();
    store.complete(&b, lb.token, &response(201, "B")).await.unwrap();
    assert_eq!(
        store.claim(&claim_req(&a, "{}")).await.unwrap(),
        ClaimOutcome::Replay(response(201, "A"))
    );
    assert_eq!(
        store.claim(&claim_req(&b, "{}")).await.unwrap(),
        ClaimOutcome::Replay(response(201, "B"))
    );
}

/// A completed record refuses further lease-holder writes, even with its own token.
pub async fn completion_is_fenced_once_completed<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-once");
    let a = must_claim(&*store, &claim_req(&s, "{}")).await;
    store
        .complete(&s, a.token, &response(201, "first"))
        .await
        .unwrap();
    assert_fenced(
        store.complete(&s, a.token, &response(201, "second")).await,
        "second complete",
    );
    assert_fenced(store.release(&s, a.token).await, "release after complete");
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.response, Some(response(201, "first")));
}

/// The record keeps the request (the completer needs it) and the fingerprint.
pub async fn record_keeps_the_request<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-req");
    let req = claim_req(&s, r#"{"sku":"Z"}"#);
    let a = must_claim(&*store, &req).await;
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.request, req.request);
    assert_eq!(rec.fingerprint, req.fingerprint);
    assert_eq!(rec.fencing_token, a.token);
    assert_eq!(rec.lease_expires_at, a.expires_at);
    assert!(store.get(&scope("acct-a", "nope")).await.unwrap().is_none());
}

/// The completion drops the request body (the record replays its answer,
/// nothing reads the request again: a store of completed records does not
/// keep every request body for the replay window), and the replay is intact.
pub async fn completion_drops_the_request_body<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-drop");
    let req = claim_req(&s, &format!(r#"{{"pad":"{}"}}"#, "x".repeat(4096)));
    let a = must_claim(&*store, &req).await;
    store.complete(&s, a.token, &response(201, "done")).await.unwrap();
    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Completed);
    assert!(
        rec.request.body.is_empty(),
        "the completed record still holds its {}-byte request body",
        rec.request.body.len()
    );
    assert_eq!(
        rec.request.method, req.request.method,
        "the rest of the request is kept"
    );
    assert_eq!(rec.fingerprint, req.fingerprint);
    assert_eq!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "done")),
        "the same request still replays"
    );
}

/// 64 concurrent claims of one key: exactly one wins, every other sees it in
/// progress; after completion, 64 concurrent claims all replay.
pub async fn concurrent_claims_have_one_winner<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-a", "k-race");
    let req = claim_req(&s, "{}");
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let handles: Vec<_> = (0..64)
        .map(|_| {
            let (store, req, barrier) = (store.clone(), req.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&req).await.expect("claim")
            })
        })
        .collect();
    let mut winners = Vec::new();
    for h in handles {
        match h.await.unwrap() {
            ClaimOutcome::Claimed(lease) => winners.push(lease),
            ClaimOutcome::InProgress { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one winner");
    store
        .complete(&s, winners[0].token, &response(201, "won"))
        .await
        .unwrap();
    let replays = futures::future::join_all((0..64).map(|_| {
        let (store, req) = (store.clone(), req.clone());
        async move { store.claim(&req).await.unwrap() }
    }))
    .await;
    assert!(
        replays
            .iter()
            .all(|o| *o == ClaimOutcome::Replay(response(201, "won")))
    );
}
