//! [`SqliteConfig`]: pool size, lock wait, checkpoints and durability.

use std::time::Duration;

/// Settings of [`crate::SqliteStore::connect_with`]: the pool the store opens
/// and which of its commits wait for the disk. Built from
/// [`SqliteConfig::default`] with the `with_*` methods; fields are private so
/// settings can be added without breaking callers.
///
/// ```
/// use std::time::Duration;
/// use idemkit_sqlite::{Durability, SqliteConfig};
///
/// let config = SqliteConfig::default()
///     .with_busy_timeout(Duration::from_secs(2))
///     .with_durability(Durability::EveryCommit);
/// assert!(config.validate().is_ok());
/// ```
#[derive(Debug, Clone)]
pub struct SqliteConfig {
    pub(crate) max_connections: u32,
    pub(crate) busy_timeout: Duration,
    pub(crate) checkpoint_interval: Duration,
    pub(crate) durability: Durability,
}

/// Which commits sync the write-ahead log to disk ([`SqliteConfig::with_durability`]).
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
#[non_exhaustive]
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

/// A [`SqliteConfig`] that cannot work ([`SqliteConfig::validate`]).
/// [`crate::SqliteStore::connect_with`] answers it as
/// [`idemkit_core::StoreError::Config`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteConfigError {
    /// `max_connections` is zero: the pool could never hand out a connection.
    #[error("max_connections must be at least 1")]
    NoConnections,
    /// The location is neither a file path nor a `sqlite:` URL sqlx understands.
    #[error("invalid SQLite location {location:?}: {reason}")]
    BadLocation {
        /// The location given.
        location: String,
        /// Why sqlx refused it.
        reason: String,
    },
}

impl From<SqliteConfigError> for idemkit_core::StoreError {
    fn from(e: SqliteConfigError) -> Self {
        Self::Config(Box::new(e))
    }
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

impl SqliteConfig {
    /// Sets the largest number of pooled connections (default 8; at least 1).
    #[must_use]
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets how long a writer waits for SQLite's write lock before the request
    /// fails with a retryable `503` (default 10 s).
    #[must_use]
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout;
        self
    }

    /// Sets how often a background task checkpoints the write-ahead log into
    /// the database file (default 100 ms), so that no request's commit does
    /// it. SQLite's own checkpoint runs in the commit that crosses its
    /// threshold and syncs the database file there: a stall of milliseconds
    /// in that request. With the background task, that threshold is raised to
    /// 10 000 pages (~40 MiB of log), a bound for when the task cannot keep
    /// up. Zero turns the task off and leaves SQLite's default (1 000 pages).
    #[must_use]
    pub fn with_checkpoint_interval(mut self, interval: Duration) -> Self {
        self.checkpoint_interval = interval;
        self
    }

    /// Sets which commits wait for the disk (default [`Durability::Normal`]).
    #[must_use]
    pub fn with_durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The largest number of pooled connections.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// How long a writer waits for the write lock.
    pub fn busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// How often the log is checkpointed in the background (zero: never).
    pub fn checkpoint_interval(&self) -> Duration {
        self.checkpoint_interval
    }

    /// Which commits wait for the disk.
    pub fn durability(&self) -> Durability {
        self.durability
    }

    /// Checks the settings without opening anything.
    pub fn validate(&self) -> Result<(), SqliteConfigError> {
        if self.max_connections == 0 {
            return Err(SqliteConfigError::NoConnections);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates() {
        assert_eq!(SqliteConfig::default().validate(), Ok(()));
        assert_eq!(
            SqliteConfig::default().with_max_connections(0).validate(),
            Err(SqliteConfigError::NoConnections)
        );
    }
}
