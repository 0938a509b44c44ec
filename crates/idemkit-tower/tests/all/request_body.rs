//! A lease-mode attempt hands its claimed request body back
//! (`Attempt::take_request_body`), so an adapter forwards the bytes the claim
//! stored instead of keeping a second copy of them.

use super::*;
use idemkit_core::{Account, IdempotencyKey, Policy, Scope};
use idemkit_engine::{Engine, Incoming};

#[tokio::test]
async fn a_lease_mode_attempt_gives_its_request_body_back_once() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::lease(store.clone(), Policy::new()).unwrap();
    let body = vec![b'x'; 4096];
    let scope = Scope::new(
        Account::keyed(b"test-secret", b"a"),
        IdempotencyKey::parse("take-body").unwrap(),
    );
    let claim = engine.claim_request(Incoming {
        scope: scope.clone(),
        method: "POST",
        target: "/orders",
        headers: vec![],
        body: &body,
        resume: None,
    });
    let mut attempt = engine.begin(claim).await.unwrap();
    assert_eq!(
        attempt.take_request_body().as_deref(),
        Some(&body[..]),
        "the claimed body is handed back"
    );
    assert_eq!(
        attempt.take_request_body().as_deref(),
        Some(&[][..]),
        "and only once"
    );
    // The store wrote its own copy with the claim.
    let record = store.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.request.body, body);
}
