//! # idemkit-tower
//!
//! The server half of idemkit as a tower [`Layer`](tower::Layer): routes under
//! [`IdempotencyLayer`] require an `Idempotency-Key`, claim it atomically in a
//! [`KeyStore`](idemkit_core::KeyStore) scoped per account, execute the handler at
//! most once per key within the replay window, and replay the stored response
//! (status, allowlisted headers, byte-identical body, `Idempotent-Replayed: true`)
//! to every retry. What this buys is *effectively once* within the key scope and
//! replay window, not delivery guarantees the network cannot give.
//!
//! ```no_run
//! use std::sync::Arc;
//! use axum::{Router, routing::post};
//! use idemkit_sqlite::{SqliteStore, SqliteTx};
//! use idemkit_tower::{BearerTokenAccount, IdempotencyLayer, Json, Tx};
//!
//! #[derive(serde::Deserialize)]
//! struct NewOrder { sku: String }
//!
//! // The claim, this insert and the stored response commit together.
//! async fn create(mut tx: Tx<SqliteTx>, Json(o): Json<NewOrder>) -> (http::StatusCode, String) {
//!     sqlx::query("INSERT INTO orders (sku) VALUES (?1)").bind(o.sku).execute(&mut **tx).await.unwrap();
//!     (http::StatusCode::CREATED, "created".into())
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(SqliteStore::connect("app.db").await?);
//! let layer = IdempotencyLayer::transactional(store).resolver(BearerTokenAccount).build()?;
//! let app: Router = Router::new().route("/orders", post(create)).layer(layer);
//! # let _ = app; Ok(()) }
//! ```
//!
//! Errors the layer (and [`Json`]) produce are RFC 9457 problem documents with a
//! stable `code` and a `retryable` flag; see [`idemkit_core::ErrorCode`].

pub mod config;
mod conventions;
pub mod engine;
mod extract;
mod future;
mod jobs;
mod layer;
pub mod metrics;
mod outcome;
mod phases;
mod problem;
mod resolver;
mod response;
mod service;
mod shared;
mod status;

pub use conventions::accepts_encoding;
pub use extract::{IdempotencyContext, Tx};
pub use future::ResponseFuture;
pub use jobs::{Completer, CompleterReport, ReapThresholdTooShort, Reaper, completer_resume};
pub use layer::{ConfigError, IdempotencyLayer, IdempotencyLayerBuilder};
pub use outcome::Outcome;
pub use phases::{CallError, Downstream, PhaseError, Phases};
pub use problem::{Json, ProblemResponse, method_not_allowed, not_found};
pub use resolver::{AccountResolver, BearerTokenAccount, TrustedHeaderAccount, bearer_token};
pub use response::{
    STORED_REQUEST_HEADERS, replay_response, replay_response_to, stored_request_headers, stored_response,
};
pub use service::{Idempotency, read_body};
pub use shared::{
    DEFAULT_STATUS_PATH, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, KeySource, REPEATABILITY_CLOCK_SKEW,
    REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID, REPEATABILITY_RESULT,
};
