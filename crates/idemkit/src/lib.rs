#![doc = include_str!("../../../README.md")]
//!
//! ## Crate features
//!
//! | feature  | default | what it adds |
//! |----------|---------|--------------|
//! | `sqlite` | yes     | [`sqlite::SqliteStore`], the embedded key store |
//! | `axum`   | yes     | [`tower`]: the `IdempotencyLayer`, extractors and problem responses |
//! | `postgres` | no    | [`postgres`]: `PgStore`, the store for many instances on one PostgreSQL |
//! | `redis`  | no      | [`redis`]: `RedisStore`, fenced Lua claims on Redis or Redis Cluster |
//! | `client` | no      | [`client`]: the retry loop with safe defaults (backoff, budget, deadline, auto keys) |
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
