//! [`RedisConfig`]: where the store connects and how it behaves.

use std::num::NonZeroUsize;
use std::time::Duration;

use crate::error::RedisConfigError;

/// Default key prefix.
pub const DEFAULT_PREFIX: &str = "idemkit";
/// Default reap threshold (the behaviour contract, `docs/spec.md` §6): how long a record is kept after its last write.
pub const DEFAULT_REAP_AFTER: Duration = Duration::from_secs(72 * 3600);

/// Settings for [`crate::RedisStore::connect_with`]: how the store behaves.
/// Where it connects is the URL given next to it.
///
/// ```
/// use std::time::Duration;
/// use idemkit_redis::RedisConfig;
///
/// let config = RedisConfig::default()
///     .with_prefix("shop-keys")
///     .with_wait_replicas(1, Duration::from_millis(500));
/// # let _ = config;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RedisConfig {
    /// Server URL(s): one for a single node; one or more seed nodes for a
    /// cluster. Set by [`crate::RedisStore::connect_with`] from its URL.
    pub(crate) urls: Vec<String>,
    /// Whether `urls` are Redis Cluster seed nodes (the cluster client is used).
    pub(crate) cluster: bool,
    /// Prefix of every key and channel this store touches (default `idemkit`).
    /// Several stores (or test runs) share one server safely under distinct prefixes.
    pub(crate) key_prefix: String,
    /// Reap threshold: the TTL of a record after its last write (default 72 h).
    /// A record is always kept at least as long as the route's replay window.
    pub(crate) reap_after: Duration,
    /// Opt-in durability: after each write, `WAIT` until this many replicas have
    /// acknowledged it, or the timeout passes; fewer acknowledgements make the
    /// operation fail with a retryable `503`. `None` (the default) does not wait.
    pub(crate) wait_replicas: Option<(u32, Duration)>,
    /// Upper bound on one store operation, reconnects and redirects included
    /// (default 5 s; the `WAIT` timeout is added on top). Past it: a retryable `503`.
    pub(crate) operation_timeout: Duration,
    /// Timeout of one connection attempt (default 1 s).
    pub(crate) connect_timeout: Duration,
    /// Publish completion, release and abandon on a per-record channel so
    /// waiters wake at once instead of polling (default `true`).
    pub(crate) notifications: bool,
    /// Independent multiplexed connections used round-robin. `None` (the
    /// default): one, or eight with `wait_replicas` — `WAIT` blocks the
    /// connection it runs on, so one connection would queue every request
    /// behind the slowest acknowledgement.
    pub(crate) connections: Option<NonZeroUsize>,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            urls: Vec::new(),
            cluster: false,
            key_prefix: DEFAULT_PREFIX.to_owned(),
            reap_after: DEFAULT_REAP_AFTER,
            wait_replicas: None,
            operation_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
            notifications: true,
            connections: None,
        }
    }
}

/// Where a store connects: the servers a URL names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    pub(crate) urls: Vec<String>,
    pub(crate) cluster: bool,
}

impl Endpoint {
    /// Parses the form `IDEMKIT_KEYSTORE` uses: `redis://host:port[/db]`
    /// (also `rediss://`, `redis+unix://`) for one node, or
    /// `redis+cluster://host1:port1,host2:port2` for a cluster's seed nodes.
    pub(crate) fn parse(url: &str) -> Result<Self, RedisConfigError> {
        if let Some(rest) = url.strip_prefix("redis+cluster://") {
            let urls: Vec<String> = rest
                .trim_end_matches('/')
                .split(',')
                .filter(|s| !s.is_empty())
                .map(|node| format!("redis://{node}"))
                .collect();
            if urls.is_empty() {
                return Err(RedisConfigError::NoUrl);
            }
            Ok(Self { urls, cluster: true })
        } else if url.is_empty() {
            Err(RedisConfigError::NoUrl)
        } else if url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("redis+unix://")
        {
            Ok(Self {
                urls: vec![url.to_owned()],
                cluster: false,
            })
        } else {
            Err(RedisConfigError::BadUrl(url.to_owned()))
        }
    }
}

impl RedisConfig {
    /// Sets the key prefix.
    #[must_use]
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// Sets the reap threshold (the TTL after a record's last write).
    #[must_use]
    pub fn with_reap_after(mut self, reap_after: Duration) -> Self {
        self.reap_after = reap_after;
        self
    }

    /// Requires `replicas` acknowledgements within `timeout` for every write.
    #[must_use]
    pub fn with_wait_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.wait_replicas = Some((replicas, timeout));
        self
    }

    /// Sets the bound on one store operation.
    #[must_use]
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// Sets the timeout of one connection attempt.
    #[must_use]
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Turns change notifications on or off.
    #[must_use]
    pub fn with_notifications(mut self, on: bool) -> Self {
        self.notifications = on;
        self
    }

    /// Sets the number of independent connections (default: one, or eight with `WAIT`, which blocks the connection it runs on).
    #[must_use]
    pub fn with_connections(mut self, n: NonZeroUsize) -> Self {
        self.connections = Some(n);
        self
    }

    /// The key prefix.
    pub fn key_prefix(&self) -> &str {
        &self.key_prefix
    }

    /// The reap threshold (the TTL after a record's last write).
    pub fn reap_after(&self) -> Duration {
        self.reap_after
    }

    /// The replicas every write waits for, and for how long (`None`: no `WAIT`).
    pub fn wait_replicas(&self) -> Option<(u32, Duration)> {
        self.wait_replicas
    }

    /// The bound on one store operation (the `WAIT` timeout comes on top).
    pub fn operation_timeout(&self) -> Duration {
        self.operation_timeout
    }

    /// The timeout of one connection attempt.
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Whether changes are published to waiters.
    pub fn notifications(&self) -> bool {
        self.notifications
    }

    /// The number of connections, if set (see [`RedisConfig::with_connections`]).
    pub fn connections(&self) -> Option<NonZeroUsize> {
        self.connections
    }

    /// The number of connections [`crate::RedisStore::connect_with`] opens.
    pub fn connection_count(&self) -> usize {
        match (self.connections, self.wait_replicas) {
            (Some(n), _) => n.get(),
            (None, None) => 1,
            (None, Some(_)) => 8,
        }
    }

    /// Checks the settings without connecting.
    pub fn validate(&self) -> Result<(), RedisConfigError> {
        if self.key_prefix.is_empty() || self.key_prefix.contains(['{', '}']) {
            return Err(RedisConfigError::BadPrefix(self.key_prefix.clone()));
        }
        if let Some((n, t)) = self.wait_replicas
            && (n == 0 || t.is_zero())
        {
            return Err(RedisConfigError::BadWait);
        }
        Ok(())
    }

    /// The bound on one operation, `WAIT` included.
    pub(crate) fn op_budget(&self) -> Duration {
        self.operation_timeout + self.wait_replicas.map_or(Duration::ZERO, |(_, t)| t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let c = Endpoint::parse("redis://127.0.0.1:6379/0").unwrap();
        assert!(!c.cluster);
        assert_eq!(c.urls, ["redis://127.0.0.1:6379/0"]);
        let c = Endpoint::parse("redis+cluster://a:1,b:2/").unwrap();
        assert!(c.cluster);
        assert_eq!(c.urls, ["redis://a:1", "redis://b:2"]);
        assert_eq!(
            Endpoint::parse("http://x"),
            Err(RedisConfigError::BadUrl("http://x".into()))
        );
        assert_eq!(Endpoint::parse("redis+cluster://"), Err(RedisConfigError::NoUrl));
        assert_eq!(Endpoint::parse(""), Err(RedisConfigError::NoUrl));
    }

    #[test]
    fn validates() {
        assert!(RedisConfig::default().validate().is_ok());
        assert_eq!(
            RedisConfig::default().with_prefix("a{b").validate(),
            Err(RedisConfigError::BadPrefix("a{b".into()))
        );
        assert_eq!(
            RedisConfig::default()
                .with_wait_replicas(0, Duration::from_secs(1))
                .validate(),
            Err(RedisConfigError::BadWait)
        );
    }
}
