//! [`SqliteConfig`]: pool size, lock wait and checkpoints.

use std::time::Duration;

/// Connection settings for [`crate::SqliteStore::open_with`].
#[derive(Debug, Clone)]
pub struct SqliteConfig {
    /// Largest number of pooled connections (default 8).
    pub max_connections: u32,
    /// How long a writer waits for SQLite's write lock before the request fails
    /// with a retryable `503` (default 10 s).
    pub busy_timeout: Duration,
    /// How often a background task checkpoints the write-ahead log into the
    /// database file (default 100 ms), so that no request's commit does it.
    /// SQLite's own checkpoint runs in the commit that crosses its threshold and
    /// syncs the database file there: a stall of milliseconds in that request.
    /// With the background task, that threshold is raised to 10 000 pages
    /// (~40 MiB of log), a bound for when the task cannot keep up. Zero turns
    /// the task off and leaves SQLite's default (1 000 pages).
    pub checkpoint_interval: Duration,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            max_connections: 8,
            busy_timeout: Duration::from_secs(10),
            checkpoint_interval: Duration::from_millis(100),
        }
    }
}
