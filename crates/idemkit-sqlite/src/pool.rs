//! Opening the database: connection options, the pool, the migrations.

use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use idemkit_core::{StoreError, StoreResult, SystemClock};
use sqlx::SqlitePool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use tokio::sync::Mutex;

use crate::checkpoint::{Checkpointer, LOG_BOUND_PAGES};
use crate::error::map_err;
use crate::known::KnownKeys;
use crate::{Durability, MIGRATOR, SqliteConfig, SqliteConfigError, SqliteStore};

impl SqliteStore {
    /// Opens (creating if missing) the database at `location` with the
    /// default settings: `location` is a file path or a `sqlite:` URL (the
    /// forms `IDEMKIT_KEYSTORE` takes), and the embedded migrations run.
    pub async fn connect(location: impl AsRef<Path>) -> StoreResult<Self> {
        Self::connect_with(location, SqliteConfig::default()).await
    }

    /// [`SqliteStore::connect`] with these settings.
    pub async fn connect_with(location: impl AsRef<Path>, config: SqliteConfig) -> StoreResult<Self> {
        config.validate()?;
        let path = location.as_ref();
        let options = match path.to_str() {
            Some(url) if url.starts_with("sqlite:") => {
                SqliteConnectOptions::from_str(url).map_err(|e| SqliteConfigError::BadLocation {
                    location: url.to_owned(),
                    reason: e.to_string(),
                })?
            }
            _ => SqliteConnectOptions::new().filename(path),
        }
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        // NORMAL in WAL mode never corrupts; a power loss may drop the last commits.
        // Single-step records are written in the same transaction as the business
        // rows, so they are lost (or kept) together; see `Durability`.
        .synchronous(if config.durability == Durability::EveryCommit {
            SqliteSynchronous::Full
        } else {
            SqliteSynchronous::Normal
        })
        .busy_timeout(config.busy_timeout)
        .foreign_keys(true);
        // Checkpoints run in the background (see `checkpoint`); a commit does
        // one only past this bound.
        let options = if config.checkpoint_interval.is_zero() {
            options
        } else {
            options.pragma("wal_autocheckpoint", LOG_BOUND_PAGES.to_string())
        };
        let pool = SqlitePoolOptions::new()
            .max_connections(config.max_connections)
            // A local file cannot drop a connection the way a network can; the
            // ping sqlx would send on every acquire is a wasted round trip.
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await
            .map_err(map_err)?;
        let mut store = Self::from_pool(pool).await?;
        if config.durability == Durability::Claims {
            // Claims queue on the writer slot anyway: one connection.
            store.claims = Some(
                SqlitePoolOptions::new()
                    .max_connections(1)
                    .test_before_acquire(false)
                    .connect_with(options.synchronous(SqliteSynchronous::Full))
                    .await
                    .map_err(map_err)?,
            );
        }
        if !config.checkpoint_interval.is_zero() {
            store.checkpointer = Some(Arc::new(Checkpointer::spawn(
                store.pool.clone(),
                config.checkpoint_interval,
            )));
        }
        Ok(store)
    }

    /// Uses an existing pool (the application's own, so business tables and keys
    /// live in one database), running the embedded migrations.
    pub async fn from_pool(pool: SqlitePool) -> StoreResult<Self> {
        MIGRATOR
            .run(&pool)
            .await
            .map_err(|e| StoreError::Backend(Box::new(e)))?;
        let known = Arc::new(KnownKeys::default());
        known.spawn_load(pool.clone());
        Ok(Self {
            pool,
            clock: Arc::new(SystemClock),
            writer: Arc::new(Mutex::new(())),
            pending: Arc::default(),
            known,
            checkpointer: None,
            claims: None,
        })
    }
}
