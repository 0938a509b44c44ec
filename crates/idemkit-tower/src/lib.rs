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
//! let store = SqliteStore::connect("app.db").await?;
//! let secret = std::env::var("ACCOUNT_SECRET")?; // the same on every instance
//! let layer = IdempotencyLayer::single_step(store, BearerTokenAccount::new(secret)).build()?;
//! let app: Router = Router::new().route("/orders", post(create)).layer(layer);
//! # let _ = app; Ok(()) }
//! ```
//!
//! Errors the layer (and [`Json`]) produce are RFC 9457 problem documents with a
//! stable `code` and a `retryable` flag; see [`idemkit_core::ErrorCode`].

pub mod config;
mod conventions;
mod extract;
mod future;
mod jobs;
mod layer;
mod phases;
mod problem;
pub mod render;
mod response;
mod service;
mod shared;
mod status;

pub use extract::Tx;
pub use future::ResponseFuture;
pub use idemkit_core::wire;
pub use idemkit_engine::metrics;
pub use idemkit_engine::{
    AccountResolver, BearerTokenAccount, ClaimMode, IdempotencyContext, Override, ProblemResponse,
    TrustedHeaderAccount, Unscoped, bearer_token,
};
pub use jobs::{
    Completer, CompleterReport, ReapThresholdTooShort, Reaper, ReleaseRefused, Released, release_key,
};
pub use layer::{BuildError, IdempotencyLayer, IdempotencyLayerBuilder};
pub use phases::{CallError, Downstream, PhaseError, Phases};
pub use problem::{Json, method_not_allowed, not_found};
pub use service::Idempotency;
pub use shared::{DEFAULT_STATUS_PATH, KeySource, REPEATABILITY_CLOCK_SKEW};
