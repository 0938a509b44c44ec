//! # idemkit-sqlite
//!
//! The embedded default [`KeyStore`]: SQLite through sqlx, in WAL mode, with
//! embedded migrations. Claims are arbitrated by the table's primary key
//! `(account, idem_key)` with `INSERT … ON CONFLICT DO NOTHING RETURNING`; a
//! conflicting row is then read and moved on only by a compare-and-swap on its
//! fencing token, inside one `BEGIN IMMEDIATE` transaction. A write that is one
//! statement (a claim of a key read as absent, a heartbeat, a completion, a
//! release) runs autocommitted: SQLite makes one statement atomic on its own.
//! The store keeps an in-process set of the keys that have a row (loaded in
//! the background after opening, see [`SqliteStore::keys_loaded`]; about 16
//! bytes a record); a claim of a key outside it skips the read that would
//! find it absent, and lets the primary key arbitrate a row another process
//! wrote meanwhile.
//!
//! It also implements [`TransactionalStore`]: single-step requests claim, write
//! their business rows and store the response in one SQLite transaction.
//!
//! ```no_run
//! # async fn demo() -> Result<(), idemkit_core::StoreError> {
//! use idemkit_sqlite::SqliteStore;
//! let store = SqliteStore::connect("idemkit.db").await?;
//! # let _ = store; Ok(()) }
//! ```
//!
//! SQLite allows one writer at a time. In single-step mode the claim's
//! transaction is held while the handler runs, so concurrent duplicates queue
//! behind the first and then replay its stored response; other writers queue too
//! (up to the busy timeout). That is the right trade for an embedded store; use
//! PostgreSQL when many instances share keys.
//!
//! ## Layout
//!
//! `config` (settings), `pool` (opening, migrations), `checkpoint` (the
//! write-ahead log's checkpoints, in the background), `sql` (every statement's
//! text), `known` (the keys known to have a row), `claim` (the claim
//! algorithm), `store` (the [`KeyStore`] methods), `tx` (single-step
//! transactions, [`TransactionalStore`]), `decode` (rows to records) and
//! `error` (sqlx errors to store error kinds).
//!
//! [`KeyStore`]: idemkit_core::KeyStore
//! [`TransactionalStore`]: idemkit_core::TransactionalStore

mod checkpoint;
mod claim;
mod config;
mod decode;
mod error;
mod known;
mod pool;
mod sql;
mod store;
mod tx;

use std::collections::HashSet;
use std::sync::{Arc, Mutex as StdMutex};

use idemkit_core::Clock;
use sqlx::SqlitePool;
use tokio::sync::Mutex;

pub use config::{Durability, SqliteConfig, SqliteConfigError};
/// The sqlx this crate is built with: its pool ([`SqliteStore::pool`]),
/// connection (a [`SqliteTx`] derefs to [`sqlx::SqliteConnection`]) and error
/// ([`SqliteTx::commit`]) types are this crate's API, so handlers use them
/// from here and need no version of their own to keep in step.
pub use sqlx;
pub use tx::SqliteTx;

/// Embedded migrations (run by [`SqliteStore::connect`] and [`SqliteStore::from_pool`]).
///
/// Versions applied by a newer release are tolerated (sqlx's
/// `ignore_missing`): migrations are additive, none changes or removes what an
/// earlier release's SQL uses, so going back to an older binary on the same
/// file keeps working.
pub static MIGRATOR: sqlx::migrate::Migrator = {
    let mut migrator = sqlx::migrate!("./migrations");
    migrator.ignore_missing = true;
    migrator
};

/// A [`KeyStore`](idemkit_core::KeyStore) on SQLite.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
    clock: Arc<dyn Clock>,
    /// One writer at a time in this process (see [`SqliteTx`]).
    writer: Arc<Mutex<()>>,
    /// Scopes with a single-step claim in progress in this process.
    pending: Arc<StdMutex<HashSet<(String, String)>>>,
    /// Scopes this process knows to have a row (a claim of any other key
    /// skips its read; see `known`).
    known: Arc<known::KnownKeys>,
    /// Checkpoints the log in the background, for a store that opened its own
    /// pool (see `checkpoint`); the application's pool keeps its own settings.
    checkpointer: Option<Arc<checkpoint::Checkpointer>>,
    /// With [`Durability::Claims`]: one connection whose commits sync the
    /// log, for lease-mode claims (inserts and moves).
    claims: Option<SqlitePool>,
}

impl SqliteStore {
    /// Replaces the clock (tests move time with it).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// The pool, for the application's own queries.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The connection lease-mode claims use under [`Durability::Claims`]
    /// (`None` otherwise: they use [`Self::pool`]).
    pub fn claims_pool(&self) -> Option<&SqlitePool> {
        self.claims.as_ref()
    }

    /// Waits until the store has loaded the keys already in its table, which
    /// it does in the background once opened, and says whether it could.
    /// Until then every claim reads its key before writing; afterwards a claim
    /// of a key this process knows no row for skips that read (see the crate
    /// documentation). A service need not wait; benchmarks and tests that
    /// count statements do.
    pub async fn keys_loaded(&self) -> bool {
        self.known.wait().await
    }
}
