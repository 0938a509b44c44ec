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
