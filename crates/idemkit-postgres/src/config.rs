//! [`PgConfig`]: schema, pool and timeouts.

use std::time::Duration;

use idemkit_core::StoreError;

/// Settings of a [`crate::PgStore`]: its schema, the pool
/// [`crate::PgStore::connect_with`] opens, and how single-step claims behave.
/// Built from [`PgConfig::default`] with the `with_*` methods; fields are
/// private so settings can be added without breaking callers.
///
/// ```
/// use std::time::Duration;
/// use idemkit_postgres::{Isolation, PgConfig};
///
/// let config = PgConfig::default()
///     .with_schema("shop_keys")
///     .with_max_connections(10)
///     .with_single_step_isolation(Isolation::RepeatableRead);
/// assert!(config.validate().is_ok());
/// assert!(PgConfig::default().with_schema("shop-keys").validate().is_err());
/// ```
#[derive(Debug, Clone)]
pub struct PgConfig {
    pub(crate) schema: String,
    pub(crate) max_connections: u32,
    pub(crate) acquire_timeout: Duration,
    pub(crate) statement_timeout: Duration,
    pub(crate) reject_lock_timeout: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) ping_if_idle_for: Duration,
    pub(crate) single_step_isolation: Isolation,
}

/// A [`PgConfig`] that cannot work ([`PgConfig::validate`]).
/// [`crate::PgStore::connect_with`] and [`crate::PgStore::from_pool`] answer it
/// as [`idemkit_core::StoreError::Config`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PgConfigError {
    /// The schema is not a plain identifier (it is formatted into SQL).
    #[error("schema `{0}` must match [a-z_][a-z0-9_]{{0,62}}")]
    BadSchema(String),
    /// `max_connections` is zero: the pool could never hand out a connection.
    #[error("max_connections must be at least 1")]
    NoConnections,
    /// `max_attempts` is zero: no operation would ever be tried.
    #[error("max_attempts must be at least 1")]
    NoAttempts,
    /// The URL is not one sqlx understands (`postgres://…`).
    #[error("invalid PostgreSQL URL: {0}")]
    BadUrl(String),
}

impl From<PgConfigError> for StoreError {
    fn from(e: PgConfigError) -> Self {
        Self::Config(Box::new(e))
    }
}

/// The isolation level of single-step transactions
/// ([`PgConfig::with_single_step_isolation`]).
///
/// Whatever the level, the key's advisory lock keeps two single-step claims of
/// one key from running at once, and a claim never runs its handler on a read
/// older than the lock's previous holder's commit: a duplicate that waited
/// for the lock (in-flight = wait) replays the winner, one that found it held
/// (in-flight = reject) is answered `409` in progress. What the level changes
/// is the handler's own reads and writes, and the answer to a race the lock
/// does not cover (a lease-mode claim of the same key, or, under the two
/// snapshot levels, another transaction's writes that conflict with the
/// handler's): the commit is refused, everything rolls back, and the request
/// is answered as the key then answers (a replay of the winner, or a retryable
/// `409` in progress), never a `500`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Isolation {
    /// `READ COMMITTED`, whatever the database's default (the default, and
    /// the only behaviour before this setting). Each statement of the handler
    /// sees what was committed before it began. The opening is one round trip
    /// (`BEGIN` with the lock and the absence check).
    #[default]
    ReadCommitted,
    /// `REPEATABLE READ`: the handler's statements share one snapshot, taken
    /// after the key's lock is granted. A row the handler updates that another
    /// transaction changed since that snapshot raises a serialization failure
    /// (SQLSTATE 40001) in the handler's statement (the handler's own error to
    /// answer, retryable); one raised by the store's completion at commit is
    /// answered as the key now answers (see above). The opening takes the
    /// key's lock in its own round trip before `BEGIN` (one round trip more
    /// per request), so that the snapshot sees the lock's previous holder.
    RepeatableRead,
    /// `SERIALIZABLE`: as [`Isolation::RepeatableRead`], and PostgreSQL also
    /// refuses, with a serialization failure at a statement or at commit, any
    /// transaction whose effects no serial order explains. Handlers must
    /// expect 40001 from any statement and answer it as retryable.
    Serializable,
    /// No level in `BEGIN`: the connection's `default_transaction_isolation`
    /// (the database's or the role's setting) applies. The opening is taken as
    /// for [`Isolation::RepeatableRead`] (the lock first, in its own round
    /// trip), since the default may be a snapshot level.
    DatabaseDefault,
}

impl Isolation {
    /// The `BEGIN` that opens a transaction at this level.
    pub(crate) fn begin(self) -> &'static str {
        match self {
            Self::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Self::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Self::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
            Self::DatabaseDefault => "BEGIN",
        }
    }

    /// Whether the transaction's reads may come from one snapshot taken at its
    /// first statement, so the key's lock must be held before it begins.
    pub(crate) fn takes_lock_first(self) -> bool {
        !matches!(self, Self::ReadCommitted)
    }
}

impl PgConfig {
    /// Sets the schema holding the store's table (created if missing; default
    /// `idemkit`; a plain identifier, `[a-z_][a-z0-9_]{0,62}`). The pool's
    /// `search_path` is `<schema>, public`.
    #[must_use]
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// Sets the pool size (default 5: three instances use 15 of PostgreSQL's
    /// default 100).
    #[must_use]
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets how long a request waits for a pooled connection before a
    /// retryable 503 (default 5 s).
    #[must_use]
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets the `statement_timeout` of every connection (default 10 s).
    #[must_use]
    pub fn with_statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// With in-flight = reject, how long a single-step claim waits on a
    /// concurrent holder's uncommitted claim before answering 409. Default
    /// zero: no wait (one more try after 20 ms, for a transaction that ended
    /// but whose rollback has not reached the server yet), and the opening is
    /// one function call (a try-lock and the absence check). A wait lets a
    /// duplicate that arrives just before the holder commits replay instead,
    /// for two more statements per first request (`SET LOCAL lock_timeout`
    /// before the lock and after).
    #[must_use]
    pub fn with_reject_lock_timeout(mut self, timeout: Duration) -> Self {
        self.reject_lock_timeout = timeout;
        self
    }

    /// Sets the attempts for an operation that hits a deadlock or
    /// serialization failure (default 3; at least 1).
    #[must_use]
    pub fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// A pooled connection idle at least this long is pinged before it is
    /// handed out (default 1 s; zero pings every time). A ping is a round
    /// trip: paid on every operation it would double a busy store's round
    /// trips, so connections in steady use skip it, and one that sat idle long
    /// enough for the server to have gone away (a restart, a network cut) is
    /// checked and replaced. A connection dropped within the interval fails
    /// the one operation that picks it up with a retryable `Unavailable` (503).
    #[must_use]
    pub fn with_ping_if_idle_for(mut self, idle: Duration) -> Self {
        self.ping_if_idle_for = idle;
        self
    }

    /// Sets the isolation level of a single-step claim's transaction, the one
    /// the handler's writes run in (default [`Isolation::ReadCommitted`]). See
    /// [`Isolation`] for what each level costs and what a request that loses a
    /// race is answered.
    #[must_use]
    pub fn with_single_step_isolation(mut self, isolation: Isolation) -> Self {
        self.single_step_isolation = isolation;
        self
    }

    /// The schema holding the store's table.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The pool size.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// How long a request waits for a pooled connection.
    pub fn acquire_timeout(&self) -> Duration {
        self.acquire_timeout
    }

    /// The `statement_timeout` of every connection.
    pub fn statement_timeout(&self) -> Duration {
        self.statement_timeout
    }

    /// How long a rejecting single-step claim waits on a concurrent holder.
    pub fn reject_lock_timeout(&self) -> Duration {
        self.reject_lock_timeout
    }

    /// Attempts for an operation that hits a deadlock or serialization failure.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long a pooled connection may sit idle before it is pinged.
    pub fn ping_if_idle_for(&self) -> Duration {
        self.ping_if_idle_for
    }

    /// The isolation level of single-step transactions.
    pub fn single_step_isolation(&self) -> Isolation {
        self.single_step_isolation
    }

    /// Checks the settings without connecting.
    pub fn validate(&self) -> Result<(), PgConfigError> {
        if !valid_schema(&self.schema) {
            return Err(PgConfigError::BadSchema(self.schema.clone()));
        }
        if self.max_connections == 0 {
            return Err(PgConfigError::NoConnections);
        }
        if self.max_attempts == 0 {
            return Err(PgConfigError::NoAttempts);
        }
        Ok(())
    }
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            schema: "idemkit".into(),
            max_connections: 5,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(10),
            reject_lock_timeout: Duration::ZERO,
            max_attempts: 3,
            ping_if_idle_for: Duration::from_secs(1),
            single_step_isolation: Isolation::ReadCommitted,
        }
    }
}

fn valid_schema(s: &str) -> bool {
    let mut chars = s.chars();
    matches!(chars.next(), Some(c) if c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.len() <= 63
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(valid_schema("idemkit"));
        assert!(valid_schema("t_1"));
        assert!(!valid_schema("1t"));
        assert!(!valid_schema("a-b"));
        assert!(!valid_schema("a; drop table x"));
        assert!(!valid_schema(""));
        assert!(!valid_schema(&"a".repeat(64)));
    }

    #[test]
    fn validates() {
        assert_eq!(PgConfig::default().validate(), Ok(()));
        assert_eq!(
            PgConfig::default().with_schema("a-b").validate(),
            Err(PgConfigError::BadSchema("a-b".into()))
        );
        assert_eq!(
            PgConfig::default().with_max_connections(0).validate(),
            Err(PgConfigError::NoConnections)
        );
        assert_eq!(
            PgConfig::default().with_max_attempts(0).validate(),
            Err(PgConfigError::NoAttempts)
        );
    }
}
