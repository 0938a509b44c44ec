//! # idemkit-postgres
//!
//! A [`KeyStore`] on PostgreSQL for services that run many instances on one
//! database. Both claim modes of the contract:
//!
//! - **single-step** ([`TransactionalStore`]): the handler's own transaction
//!   opens holding the key's transaction-scoped advisory lock, reads the key,
//!   and writes the record, completed, with its `COMMIT` (one row written per
//!   request). With in-flight = reject (the default), a concurrent duplicate
//!   finds the lock held and answers `409` at once, so no pool connection is
//!   held waiting (`PgConfig::reject_lock_timeout` can grant it a short wait,
//!   after which it replays a winner that committed meanwhile); with in-flight
//!   = wait, it waits on the lock until the winner commits, then reads the
//!   completed record and replays it. The primary key still
//!   arbitrates against lease-mode claims of the same key, which take no lock:
//!   the later commit is refused and rolled back.
//! - **lease** ([`KeyStore::claim`]): the claim commits on its own as
//!   `in_flight` with a lease and a fencing token; every later write is
//!   `… WHERE fencing_token = $mine`.
//!
//! Waiters for an in-flight key are woken by `LISTEN/NOTIFY` (the statement that
//! completes, releases or ends a lease notifies when somebody waits), not by
//! polling. Deadlocks and serialization failures are retried
//! inside the store a bounded number of times; a lost connection surfaces as
//! [`StoreError::Unavailable`] (a retryable `503`).
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemkit_core::StoreError> {
//! use idemkit_postgres::PgStore;
//! let store = PgStore::connect("postgres://app@127.0.0.1/app").await?;
//! # let _ = store; Ok(()) }
//! ```
//!
//! ## Layout
//!
//! `config` (settings), `pool` (connecting, schema, migrations), `sql` (every
//! statement's text), `claim` (the claim algorithm), `store` (the [`KeyStore`]
//! methods), `tx` (single-step transactions, [`TransactionalStore`]),
//! `listener` (`LISTEN/NOTIFY` and waiters), `decode` (rows to records),
//! `error` (sqlx errors to store error kinds) and `retry` (bounded retries of
//! deadlocks and serialization failures).
//!
//! [`KeyStore`]: idemkit_core::KeyStore
//! [`KeyStore::claim`]: idemkit_core::KeyStore::claim
//! [`TransactionalStore`]: idemkit_core::TransactionalStore
//! [`StoreError::Unavailable`]: idemkit_core::StoreError::Unavailable

mod claim;
mod config;
mod decode;
mod error;
mod listener;
mod pool;
mod recent;
mod retry;
mod sql;
mod store;
mod tx;

use std::sync::Arc;

use idemkit_core::Clock;
use sqlx::PgPool;
use tokio::sync::broadcast;

#[cfg(feature = "testing")]
pub mod testing;

pub use config::{Isolation, PgConfig, PgConfigError};
pub use listener::CHANNEL;
/// The sqlx this crate is built with: its pool ([`PgStore::pool`]),
/// connection (a [`PgTx`] derefs to [`sqlx::PgConnection`]) and error
/// ([`PgTx::commit`]) types are this crate's API, so handlers use them from
/// here and need no version of their own to keep in step.
pub use sqlx;
pub use tx::{PROVISIONAL_TOKEN, PgTx};

use listener::AbortOnDrop;

/// Embedded migrations, run in the store's schema.
///
/// Versions applied by a newer release are tolerated (sqlx's
/// `ignore_missing`): migrations are additive, none changes or removes what an
/// earlier release's SQL calls, so an older instance that restarts during a
/// rolling upgrade, or after a rollback, keeps working on the newer schema.
pub static MIGRATOR: sqlx::migrate::Migrator = {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.ignore_missing = true;
    migrator
};

/// A [`KeyStore`](idemkit_core::KeyStore) on PostgreSQL.
#[derive(Clone)]
pub struct PgStore {
    pool: PgPool,
    /// The application's clock: only [`KeyStore::now`](idemkit_core::KeyStore::now)
    /// (coarse cutoffs for the completer and the reaper) reads it.
    clock: Arc<dyn Clock>,
    /// Replaces the database's clock in every statement (tests only).
    test_clock: Option<Arc<dyn Clock>>,
    /// Awaited at named points inside an operation (tests only).
    test_pause: Option<PauseHook>,
    config: Arc<PgConfig>,
    /// Keys this process claimed in single-step mode lately: which way to open
    /// the next claim of a key (see `recent`).
    recent: Arc<recent::RecentKeys>,
    changes: broadcast::Sender<(String, String)>,
    _listener: Arc<AbortOnDrop>,
}

/// What a test pause awaits (see `PgStore::with_test_pause`).
type PauseFuture = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// An async pause at a named point inside an operation (tests only).
type PauseHook = Arc<dyn Fn(&'static str) -> PauseFuture + Send + Sync>;

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// Replaces the application clock, which only
    /// [`KeyStore::now`](idemkit_core::KeyStore::now) reads (the completer's and
    /// the reaper's coarse cutoffs). Leases, windows and every stored time are
    /// judged by the database's clock whatever this clock says, so instances
    /// whose clocks disagree still agree on who holds a key.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Replaces the database's clock, for every decision of this handle, with
    /// `clock` (and the application clock too). For tests that move time by
    /// hand; never in production, where instances must share one clock. A
    /// test hook behind the `testing` feature, outside the semver promise.
    #[cfg(feature = "testing")]
    pub fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock.clone();
        self.test_clock = Some(clock);
        self
    }

    /// Awaits `pause(point)` at named points inside an operation, between two
    /// statements that another actor may act between: today
    /// `claim::before_move`, after a lease-mode claim read a record it may
    /// take over and before its compare-and-swap, and `retry`, which replaces
    /// the backoff sleep before an operation's next attempt (after a
    /// compare-and-swap found the record changed, say). For a scheduler that decides
    /// who runs there (the simulator); never in production. A test hook behind
    /// the `testing` feature, outside the semver promise.
    #[cfg(feature = "testing")]
    pub fn with_test_pause(
        mut self,
        pause: impl Fn(&'static str) -> PauseFuture + Send + Sync + 'static,
    ) -> Self {
        self.test_pause = Some(Arc::new(pause));
        self
    }

    /// The test clock's time, bound where SQL reads the store's clock.
    fn test_now(&self) -> Option<i64> {
        self.test_clock.as_ref().map(|c| c.now().0)
    }

    /// The test pause at `point`, if one is set (see `with_test_pause`).
    async fn test_pause(&self, point: &'static str) {
        if let Some(pause) = &self.test_pause {
            pause(point).await;
        }
    }

    /// The wait before an operation's next attempt: the test pause at
    /// `retry` instead when one is set (the scheduler then decides when the
    /// attempt runs; a sleep inside a store call would stall it).
    async fn backoff(&self, backoff: std::time::Duration) {
        match &self.test_pause {
            Some(pause) => pause("retry").await,
            None => tokio::time::sleep(backoff).await,
        }
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The settings in force.
    pub fn config(&self) -> &PgConfig {
        &self.config
    }
}
