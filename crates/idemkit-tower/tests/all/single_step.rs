//! Single-step routes on SQLite: the claim, the handler's writes and the
//! answer in one transaction.

use super::*;

#[tokio::test]
async fn response_too_large_to_store_rolls_everything_back() {
    let store = sqlite(None).await;
    let base = serve(tx_route(
        store.clone(),
        Policy::new().with_max_stored_body(1024),
        1025,
    ))
    .await;
    let a = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(a.status, 500);
    assert_eq!(a.code(), "idempotency_response_too_large");
    assert_eq!(a.json()["retryable"], false);
    assert_eq!(rows(&store).await, 0, "business write rolled back");
    let scope = idemkit_testkit::suite::scope("a", "big");
    assert!(store.get(&scope).await.unwrap().is_none(), "claim rolled back");
    // Exactly at the cap is fine.
    let base = serve(tx_route(
        store.clone(),
        Policy::new().with_max_stored_body(1024),
        1024,
    ))
    .await;
    let ok = send(&base, Some("fits"), "a", &json!({})).await;
    assert_eq!(ok.status, 201);
    assert_eq!(ok.body.len(), 1024);
    assert_eq!(send(&base, Some("fits"), "a", &json!({})).await.body, ok.body);
    assert_eq!(rows(&store).await, 1);
}

/// 64 concurrent single-step requests through the layer on SQLite: one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn single_step_concurrency_gate_on_sqlite() {
    let store = sqlite(None).await;
    let base = serve(tx_route(store.clone(), Policy::new(), 8)).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let answers = futures::future::join_all((0..64).map(|_| {
        let (base, barrier) = (base.clone(), barrier.clone());
        async move {
            barrier.wait().await;
            send(&base, Some("gate"), "a", &json!({"same": true})).await
        }
    }))
    .await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 201 || a.code() == "idempotency_request_in_progress")
    );
    assert_eq!(
        answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed())
            .count(),
        1
    );
    assert_eq!(rows(&store).await, 1);
}
