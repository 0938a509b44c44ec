//! What the proxy runs with ([`ProxyOptions`]), and how its key store is opened.

use super::*;

/// The default key store (`--database-url`).
pub const DEFAULT_DATABASE_URL: &str = "sqlite://idemkit-proxy.db";
/// The default header carrying the caller's credential (`--account-header`).
pub const DEFAULT_ACCOUNT_HEADER: &str = "Authorization";
/// The default time the upstream may take to answer a keyed request, in
/// milliseconds (`--upstream-timeout-ms`).
pub const DEFAULT_UPSTREAM_TIMEOUT_MS: u64 = 30_000;
/// The default largest keyed request body, in bytes (`--max-request-body`).
pub const DEFAULT_MAX_REQUEST_BODY: usize = 1 << 20;
/// The default durability of a SQLite key store (`--sqlite-synchronous`).
pub const DEFAULT_SQLITE_SYNC: SqliteSync = SqliteSync::Claims;
/// The default time an idle pooled upstream connection is kept, in
/// milliseconds (`--upstream-idle-timeout-ms`).
pub const DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS: u64 = 4_000;
/// The default wait past the timeout for a key-honouring upstream's answer, in
/// milliseconds (`--timeout-grace-ms`).
pub const DEFAULT_TIMEOUT_GRACE_MS: u64 = 30_000;
/// The default time a client may take to send a request head, in
/// milliseconds (`--header-read-timeout-ms`).
pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 = 10_000;
/// The default time a client may take to send a request body, in
/// milliseconds (`--body-read-timeout-ms`).
pub const DEFAULT_BODY_READ_TIMEOUT_MS: u64 = 30_000;
/// The default cap on client connections served at once (`--max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// The default budget of keyed body bytes held at once
/// (`--max-inflight-body-bytes`).
pub const DEFAULT_MAX_INFLIGHT_BODY_BYTES: usize = 64 << 20;
/// The default time the upstream may take to send the head of its answer to
/// an unkeyed request, in milliseconds (`--passthrough-timeout-ms`).
pub const DEFAULT_PASSTHROUGH_TIMEOUT_MS: u64 = 60_000;
/// The default interval of the reaper, in milliseconds (`--reap-interval-ms`).
pub const DEFAULT_REAP_INTERVAL_MS: u64 = 3_600_000;

/// Renders the process's metrics in the Prometheus text format, served at
/// [`METRICS_PATH`] ([`ProxyOptions::with_metrics`]).
pub type RenderMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// What the proxy runs with: the flags of `idemkit proxy` other than where it
/// listens. [`ProxyOptions::new`] sets every default.
#[derive(Clone)]
#[non_exhaustive]
pub struct ProxyOptions {
    /// The upstream's base URL (`http://host:port` or `https://host:port`);
    /// the request's path and query are appended.
    pub upstream: String,
    /// A PEM file of the CA certificates an `https://` upstream's certificate
    /// is verified against, instead of the host's trust store (a private CA,
    /// a self-signed upstream).
    pub upstream_ca: Option<PathBuf>,
    /// The key store: `sqlite://FILE` (or a file path), `postgres://…`,
    /// `redis://…`, `redis+cluster://…`.
    pub database_url: String,
    /// The idempotency configuration (TOML, the service's format): its
    /// `retry_safe` routes are the keyed ones. Without it, every POST, PUT, PATCH
    /// and DELETE is keyed with the default policy.
    pub config: Option<PathBuf>,
    /// The header carrying the caller's credential; the scope's account is a
    /// keyed hash of its value.
    pub account_header: String,
    /// The secret of the keyed hash that turns a credential into an account.
    /// Every proxy sharing one store must use the same secret.
    pub scope_secret: String,
    /// The upstream de-duplicates by `Idempotency-Key` itself: a request whose
    /// outcome is unknown is re-sent with the same key instead of being parked.
    pub upstream_honours_keys: bool,
    /// How long the upstream may take to answer a keyed request, in
    /// milliseconds; past it the request is "maybe executed".
    pub upstream_timeout_ms: u64,
    /// Overrides the lease of every keyed route, in milliseconds (default: the
    /// configuration's, 30 s). A proxy that dies leaves its requests to the next
    /// attempt after this long.
    pub lease_ms: Option<u64>,
    /// The largest keyed request body accepted, in bytes.
    pub max_request_body: usize,
    /// A SQLite key store's durability (see [`SqliteSync`]).
    pub sqlite_synchronous: SqliteSync,
    /// How long an idle pooled connection to the upstream is kept, in
    /// milliseconds. Below the common upstream keep-alives (Node 5 s, nginx
    /// 75 s), so the upstream never closes a connection the proxy is about to
    /// reuse (a request lost that way would be "maybe executed").
    pub upstream_idle_timeout_ms: u64,
    /// With `upstream_honours_keys`: how much longer than
    /// `upstream_timeout_ms` the proxy keeps waiting, in the background and
    /// holding the key's lease, for an answer that came too late for the
    /// caller, in milliseconds. A retry meanwhile gets `409 in progress`, and
    /// an answer that arrives is stored for it. 0: give up at the timeout.
    pub timeout_grace_ms: u64,
    /// How long a client may take to send a request's head, and how long an
    /// idle keep-alive connection stays open, in milliseconds ([`serve`]).
    pub header_read_timeout_ms: u64,
    /// How long a client may take to send a request body, in milliseconds.
    pub body_read_timeout_ms: u64,
    /// The most client connections served at once; further ones wait in the
    /// listen backlog until one closes ([`serve`]).
    pub max_connections: usize,
    /// Keep the `X-Forwarded-For`, `Forwarded`, `X-Forwarded-Host` and
    /// `X-Forwarded-Proto` headers clients send (append to them) instead of
    /// replacing them: only behind a load balancer that sets them itself.
    pub trust_forwarded_headers: bool,
    /// The most keyed request-body bytes held at once, across all requests
    /// (each counted at its `Content-Length`, or at `max_request_body` when
    /// it has none). A request beyond it is answered `503` with `Retry-After`
    /// before its body is read.
    /// A body is held once while it is forwarded (the claim's bytes, handed
    /// back by the engine), and about twice at its peak (those bytes and the
    /// key store's own bound copy while its claim is written or waits for the
    /// store), so the proxy's memory grows by up to about twice this budget.
    pub max_inflight_body_bytes: usize,
    /// How long the upstream may take to send the head of its answer to a
    /// request the proxy does not key, in milliseconds (`504` after it; the
    /// body then streams without a limit).
    pub passthrough_timeout_ms: u64,
    /// Speak HTTP/2 to the upstream instead of HTTP/1.1: cleartext with prior
    /// knowledge (`h2c`) to an `http://` upstream, ALPN `h2` to an `https://`
    /// one. WebSocket upgrades then do not pass.
    pub upstream_http2: bool,
    /// How often the reaper runs, in milliseconds (as in `idemkit serve`:
    /// records past the reap threshold are deleted, unfinished ones listed for
    /// review).
    pub reap_interval_ms: u64,
    /// The metrics served at [`METRICS_PATH`] on the proxy's own router.
    /// `None` (the default): that path is not served (it answers `404`, as
    /// every other unknown `/_idemkit/` path); serve the metrics elsewhere, as
    /// `idemkit proxy --metrics-listen` does.
    pub metrics: Option<RenderMetrics>,
}

impl std::fmt::Debug for ProxyOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyOptions")
            .field("upstream", &self.upstream)
            .field("upstream_ca", &self.upstream_ca)
            .field("database_url", &redact_url(&self.database_url))
            .field("config", &self.config)
            .field("account_header", &self.account_header)
            .field("scope_secret", &"***")
            .field("upstream_honours_keys", &self.upstream_honours_keys)
            .field("upstream_timeout_ms", &self.upstream_timeout_ms)
            .field("lease_ms", &self.lease_ms)
            .field("max_request_body", &self.max_request_body)
            .field("sqlite_synchronous", &self.sqlite_synchronous)
            .field("upstream_idle_timeout_ms", &self.upstream_idle_timeout_ms)
            .field("timeout_grace_ms", &self.timeout_grace_ms)
            .field("header_read_timeout_ms", &self.header_read_timeout_ms)
            .field("body_read_timeout_ms", &self.body_read_timeout_ms)
            .field("max_connections", &self.max_connections)
            .field("trust_forwarded_headers", &self.trust_forwarded_headers)
            .field("max_inflight_body_bytes", &self.max_inflight_body_bytes)
            .field("passthrough_timeout_ms", &self.passthrough_timeout_ms)
            .field("upstream_http2", &self.upstream_http2)
            .field("reap_interval_ms", &self.reap_interval_ms)
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

/// Which of a SQLite key store's commits wait for the disk.
///
/// [`Claims`](SqliteSync::Claims) (the default) syncs the log at each claim,
/// so the intent recorded before a forward survives a host crash or power loss
/// (a completion lost with the host leaves that intent: the retry is parked,
/// or re-sent to a key-honouring upstream). [`Full`](SqliteSync::Full) syncs
/// every commit, so completions survive too. [`Normal`](SqliteSync::Normal)
/// survives the proxy being killed, not the host: the last commits may be
/// lost, and a request whose claim is lost is forwarded again when retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SqliteSync {
    /// Claims (`idemkit::stores::sqlite::Durability::Claims`).
    Claims,
    /// Every commit (`PRAGMA synchronous = FULL`).
    Full,
    /// None: checkpoints only (`PRAGMA synchronous = NORMAL`).
    Normal,
}

impl ProxyOptions {
    /// The options in front of `upstream` with the key store `database_url`
    /// and `scope_secret`: every other option at its default (the `DEFAULT_*`
    /// constants; no configuration, no metrics route).
    pub fn new(upstream: &str, database_url: &str, scope_secret: &str) -> Self {
        Self {
            upstream: upstream.to_owned(),
            upstream_ca: None,
            database_url: database_url.to_owned(),
            config: None,
            account_header: DEFAULT_ACCOUNT_HEADER.to_owned(),
            scope_secret: scope_secret.to_owned(),
            upstream_honours_keys: false,
            upstream_timeout_ms: DEFAULT_UPSTREAM_TIMEOUT_MS,
            lease_ms: None,
            max_request_body: DEFAULT_MAX_REQUEST_BODY,
            sqlite_synchronous: DEFAULT_SQLITE_SYNC,
            upstream_idle_timeout_ms: DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS,
            timeout_grace_ms: DEFAULT_TIMEOUT_GRACE_MS,
            header_read_timeout_ms: DEFAULT_HEADER_READ_TIMEOUT_MS,
            body_read_timeout_ms: DEFAULT_BODY_READ_TIMEOUT_MS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            trust_forwarded_headers: false,
            max_inflight_body_bytes: DEFAULT_MAX_INFLIGHT_BODY_BYTES,
            passthrough_timeout_ms: DEFAULT_PASSTHROUGH_TIMEOUT_MS,
            upstream_http2: false,
            reap_interval_ms: DEFAULT_REAP_INTERVAL_MS,
            metrics: None,
        }
    }

    /// Serves `render`'s text at [`METRICS_PATH`] on the proxy's router
    /// (`text/plain; version=0.0.4`, the Prometheus exposition format).
    #[must_use]
    pub fn with_metrics(mut self, render: RenderMetrics) -> Self {
        self.metrics = Some(render);
        self
    }

    /// Where and how the key store is opened, as `idemkit keys` and `idemkit
    /// serve` read the same URL: a Redis URL's `prefix` query parameter
    /// (percent-decoded, taken out of the URL), else `IDEMKIT_REDIS_PREFIX`,
    /// else the store's default (`idemkit`), is the key prefix; a PostgreSQL
    /// store is in the `idemkit` schema. The proxy's records are then listed
    /// by `idemkit keys list --database-url` with the proxy's own URL.
    pub fn store_target(&self) -> Result<(String, idemkit::OpenOptions), ProxyError> {
        let mut options = self.open_options();
        let url = &self.database_url;
        if idemkit::StoreKind::of(url) != idemkit::StoreKind::Redis {
            return Ok((url.clone(), options));
        }
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut prefix = std::env::var("IDEMKIT_REDIS_PREFIX")
            .ok()
            .filter(|p| !p.is_empty());
        let mut rest = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.strip_prefix("prefix=") {
                Some(p) => {
                    let decoded = percent_encoding::percent_decode_str(p)
                        .decode_utf8()
                        .map_err(|_| {
                            ProxyError::Invalid(format!(
                                "--database-url {}: its `prefix` is not UTF-8 once percent-decoded",
                                redact_url(url)
                            ))
                        })?;
                    prefix = Some(decoded.into_owned());
                }
                None => rest.push(pair),
            }
        }
        if let Some(prefix) = prefix {
            options = options.with_redis_prefix(prefix);
        }
        let base = if rest.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", rest.join("&"))
        };
        Ok((base, options))
    }

    /// How the key store is opened (`sqlite_synchronous` mapped to its
    /// [`idemkit::stores::sqlite::Durability`]; the Redis prefix is
    /// [`store_target`](Self::store_target)'s).
    pub fn open_options(&self) -> idemkit::OpenOptions {
        use idemkit::stores::sqlite::Durability;
        idemkit::OpenOptions::new().with_sqlite_durability(match self.sqlite_synchronous {
            SqliteSync::Claims => Durability::Claims,
            SqliteSync::Full => Durability::EveryCommit,
            SqliteSync::Normal => Durability::Normal,
        })
    }
}
