//! # idemkit-engine
//!
//! The adapters' crate: idemkit's request lifecycle with no HTTP framework in
//! it. An application wants [`idemkit-tower`](https://docs.rs/idemkit-tower)
//! (axum and tower) or [`idemkit-tonic`](https://docs.rs/idemkit-tonic) (gRPC),
//! which are built on this crate and re-export what a handler needs from it;
//! this crate is for writing another protocol adapter (as `idemkit proxy` is).
//!
//! An adapter hands the [`Engine`] a request reduced to what the contract needs
//! ([`Incoming`]: scope, method, target, selected headers, body bytes) and gets
//! back either an [`Attempt`] to run its handler under (heartbeat, fencing,
//! storing the answer) or a [`Refused`] (a stored answer to replay, or a
//! problem with its stable code) to answer without running anything. What the
//! adapters share sits beside it: the [`AccountResolver`]s that scope keys per
//! account, [`ProblemResponse`], the [`IdempotencyContext`] a handler reads,
//! the completer's [`Resume`] mark, what an HTTP adapter [stores](stored_response)
//! of a request and an answer, and the [`metrics`] every adapter emits.
//!
//! What this buys is *effectively once* within the key scope and replay
//! window, not delivery guarantees the network cannot give.
//!
//! ```
//! use idemkit_core::{Account, Policy, Scope, IdempotencyKey};
//! use idemkit_core::Fingerprinter;
//! use idemkit_engine::{Engine, EngineStore, Incoming};
//!
//! # async fn run(store: std::sync::Arc<dyn idemkit_core::KeyStore>) -> Result<(), Box<dyn std::error::Error>> {
//! let engine = Engine::new(EngineStore::lease(store), Policy::new(), Fingerprinter::new())?;
//! let claim = engine.claim_request(Incoming {
//!     scope: Scope::new(Account::new("acct_1"), IdempotencyKey::parse("k-1")?),
//!     method: "POST",
//!     target: "/orders",
//!     headers: vec![],
//!     body: b"{}",
//!     resume: None,
//! });
//! match engine.begin(claim).await {
//!     Ok(attempt) => { /* run the handler under `attempt`, then finish it */ let _ = attempt; }
//!     Err(refused) => { /* answer `refused.refusal` without running anything */ let _ = refused; }
//! }
//! # Ok(()) }
//! ```
//!
//! ## Features
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "axum")]
mod axum;
mod context;
mod engine;
pub mod metrics;
mod problem;
mod resolver;
mod resume;
mod stored;

pub use context::{ClaimMode, IdempotencyContext};
pub use engine::{
    Attempt, Detached, Disposition, Engine, EngineStore, Finished, Incoming, Override, Panicked, Refusal,
    Refused, key_from_json, key_problem, panic_detail, remaining, replay_status, store_problem,
};
pub use problem::{ProblemResponse, retry_after_secs};
pub use resolver::{AccountResolver, BearerTokenAccount, TrustedHeaderAccount, Unscoped, bearer_token};
pub use resume::{Resume, completer_resume};
pub use stored::{STORED_REQUEST_HEADERS, stored_request_headers, stored_response};
