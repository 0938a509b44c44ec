//! [`SqliteConfig`]: pool size, lock wait, checkpoints and durability.

use std::time::Duration;

/// Connection settings for [`crate::SqliteStore::connect_with`].
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
    /// Which commits wait for the disk (default [`Durability::Normal`]).
    pub durability: Durability,
}

/// Which commits sync the write-ahead log to disk ([`SqliteConfig::durability`]).
///
/// With SQLite's `synchronous = NORMAL` a commit survives the process being
/// killed, not the host crashing or losing power: the last commits (up to the
/// operating system's write-back delay, seconds) may be lost. The layer's
/// single-step records commit with the business rows they guard, so those are
/// lost together. A record guarding an effect outside this database is not:
/// the proxy's intent, written before it forwards a request, if lost, lets the
/// retry forward it again. A synced commit costs a disk flush (about 0.2 ms on
/// the machine the benchmarks ran on), inside SQLite's single writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// No commit waits for the disk (`synchronous = NORMAL`).
    #[default]
    Normal,
    /// A lease-mode claim (an absent key's insert, or a record moved to a new
    /// holder) syncs the log, which also makes every earlier commit durable;
    /// no other commit waits. One flush per request. Made for a claim that
    /// records its own intent, as `idemkit proxy`'s does (recovery point
    /// `forwarded`): a later write lost with the host (a completion, a
    /// release) leaves the record in flight at that intent, which the next
    /// attempt treats as "maybe executed". It does not cover a handler whose
    /// effects follow the claim: a lost completion there means a takeover runs
    /// the handler again, and a phase's progress (`Phases`, written by
    /// `advance` and `begin_fenced` transactions) is not synced. Use
    /// [`Durability::EveryCommit`] for those.
    Claims,
    /// Every commit syncs the log (`synchronous = FULL`).
    EveryCommit,
}

impl Default for SqliteConfig {
    fn default() -> Self {
        Self {
            max_connections: 8,
            busy_timeout: Duration::from_secs(10),
            checkpoint_interval: Duration::from_millis(100),
            durability: Durability::Normal,
        }
    }
}
