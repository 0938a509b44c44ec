//! The optional replay cache (`IdempotencyLayerBuilder::replay_cache`): a retry
//! of a request this process stored is answered from memory, byte for byte,
//! without a claim in the store; another request under the key still reaches
//! the store (and is refused there); nothing is served past the window.

use std::sync::Arc;
use std::time::Duration;

use axum::response::IntoResponse;
use http::StatusCode;
use idemkit_core::Policy;
use idemkit_testkit::{MemoryStore, Probed};
use serde_json::json;

use crate::{Runs, counting, generic, send, serve};

async fn route(policy: Policy, cache: Option<usize>) -> (String, Arc<Probed<MemoryStore>>, Runs) {
    let store = Arc::new(Probed::new(MemoryStore::default()));
    let mut builder = generic(store.clone(), policy);
    if let Some(capacity) = cache {
        builder = builder.replay_cache(capacity);
    }
    let runs = Runs::default();
    let app = counting(builder.build().unwrap(), runs.clone(), |run| {
        (StatusCode::CREATED, axum::Json(json!({ "run": run }))).into_response()
    });
    (serve(app).await, store, runs)
}

#[tokio::test]
async fn retries_of_a_stored_answer_skip_the_store() {
    let (base, store, runs) = route(Policy::new(), Some(100)).await;
    let first = send(&base, Some("hot"), "a", &json!({"n": 1})).await;
    assert_eq!(first.status, 201);
    assert_eq!(store.claims(), 1);
    for _ in 0..3 {
        let again = send(&base, Some("hot"), "a", &json!({"n": 1})).await;
        assert!(again.replayed());
        assert_eq!((again.status, &again.body), (201, &first.body));
    }
    assert_eq!(store.claims(), 1, "replays answered from memory");
    assert_eq!(runs.get(), 1);

    // Another request under the key, or another account's: the store decides.
    let other = send(&base, Some("hot"), "a", &json!({"n": 2})).await;
    assert_eq!(other.code(), "idempotency_key_reused");
    assert_eq!(send(&base, Some("hot"), "b", &json!({"n": 1})).await.status, 201);
    assert_eq!(store.claims(), 3);
    assert_eq!(runs.get(), 2);
}

/// The control: without the cache every replay is a claim in the store.
#[tokio::test]
async fn without_the_cache_every_replay_reaches_the_store() {
    let (base, store, _) = route(Policy::new(), None).await;
    assert_eq!(send(&base, Some("cold"), "a", &json!({})).await.status, 201);
    for _ in 0..3 {
        assert!(send(&base, Some("cold"), "a", &json!({})).await.replayed());
    }
    assert_eq!(store.claims(), 4);
}

/// An answer is not served from memory past its replay window: the retry goes
/// to the store, which (the window over) runs it as a new request.
#[tokio::test]
async fn nothing_is_served_past_the_window() {
    let policy = Policy::new()
        .with_lease(Duration::from_millis(100))
        .with_replay_window(Duration::from_millis(400))
        .with_reap_threshold(Duration::from_secs(5));
    let (base, store, runs) = route(policy, Some(100)).await;
    assert_eq!(send(&base, Some("w"), "a", &json!({})).await.status, 201);
    assert!(send(&base, Some("w"), "a", &json!({})).await.replayed());
    assert_eq!(store.claims(), 1);
    tokio::time::sleep(Duration::from_millis(450)).await;
    let later = send(&base, Some("w"), "a", &json!({})).await;
    assert_eq!(later.status, 201);
    assert!(!later.replayed(), "the window is over");
    assert_eq!(store.claims(), 2);
    assert_eq!(runs.get(), 2);
}
