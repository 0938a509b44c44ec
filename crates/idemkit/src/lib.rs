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
//! use idemkit::prelude::*;
//!
//! // Runs at most once per (account, key): the claim, this insert and the stored
//! // response commit in one transaction; retries get the stored 201 back.
//! async fn create(mut tx: Tx<SqliteTx>) -> Result<http::StatusCode, ProblemResponse> {
//!     sqlx::query("INSERT INTO orders DEFAULT VALUES")
//!         .execute(&mut **tx)
//!         .await
//!         .map_err(|e| ProblemResponse::new(ErrorCode::Internal, e.to_string()))?;
//!     Ok(http::StatusCode::CREATED)
//! }
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let store = SqliteStore::connect("app.db").await?;
//! let secret = std::env::var("ACCOUNT_SECRET")?;
//! let keys = IdempotencyLayer::single_step(store, BearerTokenAccount::new(secret)).build()?;
//! let app: Router = Router::new().route("/orders", post(create).layer(keys));
//! # let _ = app; Ok(()) }
//! ```
//!
//! ## Your own accounts
//!
//! Keys are scoped per account. [`BearerTokenAccount`](prelude::BearerTokenAccount)
//! derives one from the bearer token with a server secret (the token itself is
//! never stored). A service whose authentication layer already knows the
//! caller passes its own resolver: any closure or function over the request's
//! `http::request::Parts` will do.
//!
//! ```
//! use idemkit::prelude::*;
//!
//! /// What the authentication middleware put in the request's extensions.
//! #[derive(Clone)]
//! struct Caller {
//!     account_id: String,
//! }
//!
//! fn accounts(parts: &http::request::Parts) -> Result<Account, ProblemResponse> {
//!     match parts.extensions.get::<Caller>() {
//!         Some(caller) => Ok(Account::new(&caller.account_id)),
//!         None => Err(ProblemResponse::new(ErrorCode::Unauthorized, "sign in first")),
//!     }
//! }
//!
//! # fn layer(store: SqliteStore) -> Result<(), idemkit::layer::BuildError> {
//! let keys = IdempotencyLayer::single_step(store, accounts).build()?;
//! # let _ = keys; Ok(()) }
//! ```
//!
//! ## Where things are
//!
//! | module | what | feature |
//! |---|---|---|
//! | [`prelude`] | what a service needs: the layer, its extractors, the stores that are on | |
//! | [`layer`] | the HTTP layer (tower, axum extractors, `Phases`, completer, reaper) | `axum` |
//! | [`grpc`] | the gRPC layer (tonic) | `tonic` |
//! | [`stores`] | the key stores: SQLite, PostgreSQL, Redis | `sqlite`, `postgres`, `redis` |
//! | [`client`] | the retry loop (reqwest middleware, tower and tonic layers) | `client`, `client-tonic` |
//! | [`backend`] | the store traits and record types, for store authors and adapters | |
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

pub use idemkit_core::{Account, ErrorCode, IdempotencyKey, Policy, Scope, StoreError};

/// The store traits, record types and fingerprints (the `idemkit-core` crate),
/// for those who write a store or an adapter. A service does not need them.
pub mod backend {
    pub use idemkit_core::*;
}

/// The key stores, each behind its feature: the main types here, each store's
/// whole crate (configuration, migrations, its `sqlx`) as a module.
pub mod stores {
    /// The embedded SQLite key store (the `idemkit-sqlite` crate).
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub use idemkit_sqlite as sqlite;
    #[cfg(feature = "sqlite")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
    pub use idemkit_sqlite::{SqliteStore, SqliteTx};

    /// The PostgreSQL key store (the `idemkit-postgres` crate).
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub use idemkit_postgres as postgres;
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub use idemkit_postgres::{PgStore, PgTx};

    /// The Redis key store, lease mode only (the `idemkit-redis` crate).
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub use idemkit_redis as redis;
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    pub use idemkit_redis::RedisStore;
}

/// The HTTP layer: tower `Layer`, axum extractors, problem responses,
/// `Phases`, the completer and the reaper (the `idemkit-tower` crate).
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
pub mod layer {
    pub use idemkit_tower::*;
}

/// The gRPC layer for tonic servers (the `idemkit-tonic` crate).
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod grpc {
    pub use idemkit_tonic::*;
}

/// The client half: a retry loop whose defaults make retries safe (the
/// `idemkit-client` crate, with the integrations its features turn on).
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client {
    pub use idemkit_client::*;
}

/// What a service needs, in one `use idemkit::prelude::*;`: the HTTP layer
/// and its extractors (feature `axum`), the stores whose features are on, and
/// the client's policy (feature `client`). The gRPC layer, whose names match
/// the HTTP layer's, stays in `grpc`.
pub mod prelude {
    pub use idemkit_core::{Account, ErrorCode, IdempotencyKey, Policy};

    #[cfg(feature = "axum")]
    pub use idemkit_tower::{
        AccountResolver, BearerTokenAccount, Completer, IdempotencyContext, IdempotencyLayer, Json, Override,
        Phases, ProblemResponse, Reaper, Tx,
    };

    #[cfg(feature = "redis")]
    pub use crate::stores::RedisStore;
    #[cfg(feature = "postgres")]
    pub use crate::stores::{PgStore, PgTx};
    #[cfg(feature = "sqlite")]
    pub use crate::stores::{SqliteStore, SqliteTx};

    #[cfg(feature = "client")]
    pub use idemkit_client::{RetryConfig, RetryPolicy};
}
