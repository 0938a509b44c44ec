//! [`PgConfig`]: schema, pool and timeouts.

use std::time::Duration;

use idemkit_core::{StoreError, StoreResult};

/// Settings of a [`crate::PgStore`].
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// Schema holding the store's table (created if missing; default `idemkit`).
    /// The pool's `search_path` is `<schema>, public`.
    pub schema: String,
    /// Pool size (default 5: three instances use 15 of PostgreSQL's default 100).
    pub max_connections: u32,
    /// How long a request waits for a pooled connection before a retryable 503
    /// (default 5 s).
    pub acquire_timeout: Duration,
    /// `statement_timeout` of every connection (default 10 s).
    pub statement_timeout: Duration,
    /// With in-flight = reject, how long a single-step claim waits on a
    /// concurrent holder's uncommitted claim before answering 409. Default
    /// zero: no wait (one more try after 20 ms, for a transaction that ended
    /// but whose rollback has not reached the server yet), and the opening is
    /// one function call (a try-lock and the absence check). A wait lets a duplicate that arrives
    /// just before the holder commits replay instead, for two more statements
    /// per first request (`SET LOCAL lock_timeout` before the lock and after).
    pub reject_lock_timeout: Duration,
    /// Attempts for an operation that hits a deadlock or serialization failure
    /// (default 3).
    pub max_attempts: u32,
    /// A pooled connection idle at least this long is pinged before it is
    /// handed out (default 1 s; zero pings every time). A ping is a round trip:
    /// paid on every operation it would double a busy store's round trips, so
    /// connections in steady use skip it, and one that sat idle long enough for
    /// the server to have gone away (a restart, a network cut) is checked and
    /// replaced. A connection dropped within the interval fails the one
    /// operation that picks it up with a retryable `Unavailable` (503).
    pub ping_if_idle_for: Duration,
    /// The isolation level of a single-step claim's transaction, the one the
    /// handler's writes run in (default [`Isolation::ReadCommitted`], as
    /// before this setting existed). See [`Isolation`] for what each level
    /// costs and what a request that loses a race is answered.
    pub single_step_isolation: Isolation,
}

/// The isolation level of single-step transactions
/// ([`PgConfig::single_step_isolation`]).
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
    /// Sets [`PgConfig::single_step_isolation`].
    #[must_use]
    pub fn with_single_step_isolation(mut self, isolation: Isolation) -> Self {
        self.single_step_isolation = isolation;
        self
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

/// Refuses a schema name that is not a plain identifier: it is formatted into SQL.
pub(crate) fn check_schema(schema: &str) -> StoreResult<()> {
    if valid_schema(schema) {
        Ok(())
    } else {
        Err(StoreError::Backend(
            format!("schema `{schema}` must match [a-z_][a-z0-9_]{{0,62}}").into(),
        ))
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
}
