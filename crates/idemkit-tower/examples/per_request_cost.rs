//! The layer's CPU cost per request, counted in instructions (which, unlike
//! times, repeat exactly on a shared machine): the JSON echo handler with and
//! without the lease-mode layer on an in-memory store, in process, on one
//! thread. Count two request totals and subtract, so start-up cancels out:
//!
//! ```text
//! cargo build --release -p idemkit-tower --example per_request_cost
//! for m in plain layer; do for n in 2000 4000; do
//!   valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!     target/release/examples/per_request_cost $m $n 2>&1 | grep Collected
//! done; done
//! ```
//!
//! (instructions at 4000 − at 2000) ÷ 2000 is the cost of one request.
//! SHA-256 runs in software under valgrind (it hides the CPU's SHA
//! extensions), so the fingerprint's share is larger there than in production.
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use http::{Request, StatusCode};
use idemkit_core::{KeyStore, Policy};
use idemkit_testkit::MemoryStore;
use idemkit_tower::{BearerTokenAccount, IdempotencyLayer, Json};
use serde_json::Value;
use tower::ServiceExt;

/// The same handler with and without the layer.
async fn echo(Json(v): Json<Value>) -> impl IntoResponse {
    (StatusCode::CREATED, axum::Json(v))
}

fn request(key: &str) -> Request<Body> {
    Request::post("/op")
        .header("authorization", "Bearer bench")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(
            r#"{"sku":"BENCH-1","quantity":2,"note":"a typical small order body"}"#,
        ))
        .unwrap()
}

/// `per_request_cost plain|layer [requests]`.
fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let n: usize = std::env::args()
        .nth(2)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10000);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let app = if mode == "layer" {
            let memory: Arc<dyn KeyStore> = Arc::new(MemoryStore::new());
            let layer = IdempotencyLayer::lease(memory, BearerTokenAccount::new("test-secret"))
                .policy(Policy::new())
                .build()
                .unwrap();
            Router::new().route("/op", post(echo).layer(layer))
        } else {
            Router::new().route("/op", post(echo))
        };
        for i in 0..n {
            let res = app.clone().oneshot(request(&format!("k-{i}"))).await.unwrap();
            assert_eq!(res.status(), 201);
            let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
        }
    });
}
