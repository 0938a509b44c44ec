//! Checkpoints of the write-ahead log, off the request path.
//!
//! In WAL mode SQLite appends every commit to the log and copies the log back
//! into the database file at a checkpoint, which syncs the file. By default the
//! commit that takes the log past 1 000 pages runs that checkpoint itself, so
//! one request in a few hundred waits for a sync of the database file
//! (milliseconds on an ordinary disk: the store's p99). A background task runs
//! a `PASSIVE` checkpoint every `SqliteConfig::checkpoint_interval` instead:
//! it waits for no reader or writer and copies what it can. The commit
//! threshold stays as a bound, raised (`LOG_BOUND_PAGES`) so that it only acts
//! when the task cannot keep up. A checkpoint is crash-safe whenever it stops.

use std::time::Duration;

use sqlx::SqlitePool;

/// The log size, in pages, at which a commit checkpoints by itself while the
/// background task runs (~40 MiB at the default 4 KiB page).
pub(crate) const LOG_BOUND_PAGES: u32 = 10_000;

/// The background checkpoint task; stopped when dropped (with the last clone
/// of the store that started it).
#[derive(Debug)]
pub(crate) struct Checkpointer(tokio::task::AbortHandle);

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Checkpointer {
    /// Starts checkpointing `pool`'s database every `every`.
    pub(crate) fn spawn(pool: SqlitePool, every: Duration) -> Self {
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                if pool.is_closed() {
                    break;
                }
                if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)").execute(&pool).await {
                    tracing::debug!(error = %e, "idemkit-sqlite: background checkpoint failed; the next one retries");
                }
            }
        });
        Self(task.abort_handle())
    }
}
