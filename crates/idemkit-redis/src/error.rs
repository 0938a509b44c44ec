//! Errors of this crate and the mapping of Redis errors to store error kinds.

use std::time::Duration;

use idemkit_core::StoreError;
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// A write reached the primary but fewer replicas than required acknowledged it
/// within the `WAIT` timeout. Surfaces as [`StoreError::Unavailable`] (a
/// retryable `503`): the write may still be on the primary, but it does not count.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("only {acknowledged} of {required} required replicas acknowledged the write within {timeout:?}")]
pub struct ReplicaShortfall {
    /// Replicas that acknowledged.
    pub acknowledged: u32,
    /// Replicas required by [`crate::RedisConfig::with_wait_replicas`].
    pub required: u32,
    /// The `WAIT` timeout.
    pub timeout: Duration,
}

/// The whole operation (connect, reconnect, redirects, `WAIT`) took longer than
/// [`crate::RedisConfig::with_operation_timeout`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("redis operation timed out after {0:?}")]
pub struct OperationTimedOut(pub Duration);

/// A business write of [`crate::RedisStore::advance_with`] that Redis would
/// refuse: a key of another type (as the batch's own earlier writes leave it),
/// an `INCRBY` operand or current value that is not a 64-bit integer by
/// Redis's rules (`"1.5"`, `"1e3"`, `"+1"`, `" 1"`, `"01"`), or a result outside
/// the signed 64-bit range. The whole advance was refused before anything was
/// written; the recovery point did not move. Surfaces as [`StoreError::Backend`]
/// (downcast the source to read it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("nothing was written: write {index} ({} `{key}`) is refused: {reason}", .op.as_str())]
#[non_exhaustive]
pub struct WriteRefused {
    /// The refused write's position in the batch (from 0).
    pub index: usize,
    /// What it does.
    pub op: crate::WriteOp,
    /// The key it writes.
    pub key: String,
    /// Why Redis would refuse it.
    pub reason: String,
}

/// A configuration that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RedisConfigError {
    /// No server URL was given.
    #[error("no redis URL given")]
    NoUrl,
    /// The key prefix is empty or contains `{` or `}` (it would break the hash tag).
    #[error("invalid key prefix {0:?}: it must be non-empty and contain no braces")]
    BadPrefix(String),
    /// `wait_replicas` asks for zero replicas or a zero timeout (which `WAIT` reads as "forever").
    #[error("wait_replicas needs at least one replica and a non-zero timeout")]
    BadWait,
    /// The URL could not be understood.
    #[error("invalid redis URL {0:?}")]
    BadUrl(String),
}

impl From<RedisConfigError> for StoreError {
    fn from(e: RedisConfigError) -> Self {
        StoreError::Config(Box::new(e))
    }
}

/// Normalises a Redis error: anything that says "the store cannot answer right
/// now" (I/O, dropped or refused connections, timeouts, a failover in progress,
/// a server still loading) is [`StoreError::Unavailable`], a retryable `503`;
/// a URL the client refuses is [`StoreError::Config`]; the rest is
/// [`StoreError::Backend`].
pub(crate) fn map_err(e: RedisError) -> StoreError {
    if e.kind() == ErrorKind::InvalidClientConfig {
        return StoreError::Config(Box::new(e));
    }
    let unavailable = e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_cluster_error()
        || matches!(
            e.kind(),
            ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(
                    ServerErrorKind::BusyLoading
                        | ServerErrorKind::TryAgain
                        | ServerErrorKind::ClusterDown
                        | ServerErrorKind::MasterDown
                        | ServerErrorKind::ReadOnly
                        | ServerErrorKind::Moved
                        | ServerErrorKind::Ask
                )
        )
        // OOM (maxmemory reached) and BUSY (a slow script) clear by themselves.
        || matches!(e.code(), Some("OOM" | "BUSY" | "LOADING" | "NOREPLICAS"));
    let cause = cause(e);
    if unavailable {
        StoreError::Unavailable(cause)
    } else {
        StoreError::Backend(cause)
    }
}

/// A Redis error as a store error's source. The redis crate prints an I/O
/// error's text in its own message and also returns that I/O error as its
/// source, so a chain printer would show it twice; such an error is wrapped in
/// [`Deduplicated`], which keeps the message and ends the chain there. Any
/// other is the [`RedisError`] itself.
fn cause(e: RedisError) -> Box<dyn std::error::Error + Send + Sync> {
    use std::error::Error as _;
    let repeats = e
        .source()
        .is_some_and(|source| e.to_string().contains(&source.to_string()));
    if repeats {
        Box::new(Deduplicated(e))
    } else {
        Box::new(e)
    }
}

/// A [`RedisError`] whose message already holds its source's text.
#[derive(Debug)]
struct Deduplicated(RedisError);

impl std::fmt::Display for Deduplicated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Deduplicated {}

pub(crate) fn corrupt(what: impl Into<String>) -> StoreError {
    StoreError::Corrupt(what.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_unavailable() {
        let e = RedisError::from(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset"));
        assert!(matches!(map_err(e), StoreError::Unavailable(_)));
        let e = RedisError::from((ErrorKind::Server(ServerErrorKind::ClusterDown), "down"));
        assert!(matches!(map_err(e), StoreError::Unavailable(_)));
        let e = RedisError::from((ErrorKind::Server(ServerErrorKind::ResponseError), "ERR bad"));
        assert!(matches!(map_err(e), StoreError::Backend(_)));
    }

    /// Every cause in a printed chain appears once, although the redis
    /// crate's I/O errors print their source in their own message.
    #[test]
    fn a_chain_prints_each_cause_once() {
        let e = RedisError::from(std::io::Error::new(
            std::io::ErrorKind::ConnectionRefused,
            "refused-here",
        ));
        let mut chain = Vec::new();
        let err = map_err(e);
        let mut next: Option<&dyn std::error::Error> = Some(&err);
        while let Some(cause) = next {
            chain.push(cause.to_string());
            next = cause.source();
        }
        let joined = chain.join(": ");
        assert_eq!(joined.matches("refused-here").count(), 1, "{joined}");
    }
}
