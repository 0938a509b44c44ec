//! [`SqliteConfig`]: pool size and lock wait.

use std::time::Duration;

/// Connection settings for [`crate::SqliteStore::open_with`].
#[derive(Debug, Clone)]
pub struct SqliteConfig {
    /// Largest number of pooled connections (default 8).
    pub max_connections: u32,
    /// How long a writer waits for SQLite's write lock before the request fails
    /// with a retryable `503` (default 10 s).
    pub busy_timeout: Duration,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            max_connections: 8,
            busy_timeout: Duration::from_secs(10),
        }
    }
}
