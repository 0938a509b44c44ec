//! [`SqliteConfig`]: pool size, lock wait, checkpoints and durability.

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
    /// Sync the write-ahead log to disk at every commit (`synchronous = FULL`;
    /// default off: `NORMAL`). With `NORMAL` a commit survives the process
    /// being killed but not the host crashing or losing power: the last
    /// commits (up to the operating system's write-back delay) may be lost.
    /// The layer's single-step records commit with the business rows they
    /// guard, so those are lost together. A record guarding an effect outside
    /// this database (a lease-mode claim before a call to another service, the
    /// proxy's intent before it forwards) is not: if it is lost, the retry runs
    /// the effect again. Turn this on for those; each commit then waits for
    /// the disk (about 0.2 ms on the machine the benchmarks ran on).
    pub sync_every_commit: bool,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            max_connections: 8,
            busy_timeout: Duration::from_secs(10),
            checkpoint_interval: Duration::from_millis(100),
            sync_every_commit: false,
        }
    }
}
