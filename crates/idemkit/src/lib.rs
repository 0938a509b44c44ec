//! # idemkit
//!
//! Make retried API writes safe. Networks drop responses, clients retry, and a
//! charge, an order or a shipping label happens twice. idemkit gives a service
//! idempotency keys scoped per account, claimed atomically in a real store, with
//! payload fingerprints and faithful replay of the stored response, so a write is
//! **effectively once within the key scope and replay window** (at-least-once
//! delivery plus de-duplication); its client half retries only what is safe to
//! retry, reusing one key across attempts.
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use idemkit::sqlite::{SqliteStore, SqliteTx};
//! use idemkit::tower::{BearerTokenAccount, IdempotencyLayer, Tx};
//!
//! // Runs at most once per (account, key): the claim, this insert and the stored
//! // response commit in one transaction; retries get the stored 201 back.
//! async fn create(mut tx: Tx<SqliteTx>) -> http::StatusCode {
//!     sqlx::query("INSERT INTO orders DEFAULT VALUES").execute(&mut **tx).await.unwrap();
//!     http::StatusCode::CREATED
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = std::sync::Arc::new(SqliteStore::connect("app.db").await?);
//! let keys = IdempotencyLayer::transactional(store).resolver(BearerTokenAccount).build()?;
//! let app: Router = Router::new().route("/orders", post(create).layer(keys));
//! # let _ = app; Ok(()) }
//! ```
//!
//! The guide (getting started, the contract, stores, multi-step requests, the
//! client, gRPC, the proxy, the checker, operations) is the `book/` of the
//! repository, built from its `docs/` pages.
//!
//! ## Crate features
//!
#![doc = document_features::document_features!()]
//!
//! Whatever the features, [`open_store`] opens the store a URL names
//! (`sqlite://…` or a path, `postgres://…`, `redis://…`, `redis+cluster://…`),
//! refusing one whose feature is off.
#![cfg_attr(docsrs, feature(doc_cfg))]

mod open;

pub use open::{OpenError, OpenMode, OpenOptions, OpenedStore, StoreKind, open_store};

pub use idemkit_core as core;
pub use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, ErrorCode, Fingerprint, Fingerprinter, IdempotencyKey, KeyStore,
    Policy, Problem, Scope, StoreError, TransactionalStore,
};

/// The embedded SQLite key store.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idemkit_sqlite as sqlite;

/// The PostgreSQL key store.
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idemkit_postgres as postgres;

/// The Redis key store.
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use idemkit_redis as redis;

/// The tower layer, axum extractors and problem responses.
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub use idemkit_tower as tower;

/// The client half: a retry loop whose defaults make retries safe.
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub use idemkit_client as client;
