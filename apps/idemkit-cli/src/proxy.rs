//! `idemkit proxy`: its flags, mapped to [`idemkit_proxy::ProxyOptions`], and
//! the process around the library (the runtime, the crash point, the
//! Prometheus recorder, the listeners). The request path is the
//! `idemkit-proxy` crate; what the proxy does is written down in
//! `docs/proxy.md`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use axum::Router;
use axum::routing::get;
use idemkit_proxy::{METRICS_PATH, ProxyOptions, ProxyServer, SqliteSync};

/// Arguments of `idemkit proxy`.
#[derive(Debug, clap::Args)]
pub struct ProxyArgs {
    /// Address to listen on, e.g. `127.0.0.1:8080`.
    #[arg(long)]
    pub listen: SocketAddr,
    /// The upstream's base URL (`http://host:port` or `https://host:port`);
    /// the request's path and query are appended.
    #[arg(long)]
    pub upstream: String,
    /// A PEM file of the CA certificates an `https://` upstream's certificate
    /// is verified against, instead of the host's trust store (a private CA,
    /// a self-signed upstream).
    #[arg(long, value_name = "FILE")]
    pub upstream_ca: Option<PathBuf>,
    /// The key store: `sqlite://FILE` (or a file path), `postgres://…`,
    /// `redis://…`, `redis+cluster://…`.
    #[arg(long, default_value = idemkit_proxy::DEFAULT_DATABASE_URL)]
    pub database_url: String,
    /// The idempotency configuration (TOML, the service's format): its
    /// `retry_safe` routes are the keyed ones. Without it, every POST, PUT, PATCH
    /// and DELETE is keyed with the default policy.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The header carrying the caller's credential; the scope's account is a
    /// keyed hash of its value.
    #[arg(long, default_value = idemkit_proxy::DEFAULT_ACCOUNT_HEADER)]
    pub account_header: String,
    /// The secret of the keyed hash that turns a credential into an account.
    /// Every proxy sharing one store must use the same secret.
    #[arg(long, env = "IDEMKIT_PROXY_SECRET", hide_env_values = true)]
    pub scope_secret: String,
    /// The upstream de-duplicates by `Idempotency-Key` itself: a request whose
    /// outcome is unknown is re-sent with the same key instead of being parked.
    #[arg(long)]
    pub upstream_honours_keys: bool,
    /// How long the upstream may take to answer a keyed request, in
    /// milliseconds; past it the request is "maybe executed".
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_UPSTREAM_TIMEOUT_MS)]
    pub upstream_timeout_ms: u64,
    /// Overrides the lease of every keyed route, in milliseconds (default: the
    /// configuration's, 30 s). A proxy that dies leaves its requests to the next
    /// attempt after this long.
    #[arg(long)]
    pub lease_ms: Option<u64>,
    /// The largest keyed request body accepted, in bytes.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_MAX_REQUEST_BODY)]
    pub max_request_body: usize,
    /// A SQLite key store's durability. `claims` (the default) syncs the log
    /// at each claim, so the intent recorded before a forward survives a host
    /// crash or power loss (a completion lost with the host leaves that intent:
    /// the retry is parked, or re-sent to a key-honouring upstream). `full`
    /// syncs every commit, so completions survive too. `normal` survives the
    /// proxy being killed, not the host: the last commits may be lost, and a
    /// request whose claim is lost is forwarded again when retried.
    #[arg(long, value_enum, default_value_t = SqliteSyncArg::from_library(idemkit_proxy::DEFAULT_SQLITE_SYNC))]
    pub sqlite_synchronous: SqliteSyncArg,
    /// How long an idle pooled connection to the upstream is kept, in
    /// milliseconds. Below the common upstream keep-alives (Node 5 s, nginx
    /// 75 s), so the upstream never closes a connection the proxy is about to
    /// reuse (a request lost that way would be "maybe executed").
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_UPSTREAM_IDLE_TIMEOUT_MS)]
    pub upstream_idle_timeout_ms: u64,
    /// With `--upstream-honours-keys`: how much longer than
    /// `--upstream-timeout-ms` the proxy keeps waiting, in the background and
    /// holding the key's lease, for an answer that came too late for the
    /// caller, in milliseconds. A retry meanwhile gets `409 in progress`, and
    /// an answer that arrives is stored for it. 0: give up at the timeout.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_TIMEOUT_GRACE_MS)]
    pub timeout_grace_ms: u64,
    /// How long a client may take to send a request's head, and how long an
    /// idle keep-alive connection stays open, in milliseconds.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_HEADER_READ_TIMEOUT_MS)]
    pub header_read_timeout_ms: u64,
    /// How long a client may take to send a request body, in milliseconds.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_BODY_READ_TIMEOUT_MS)]
    pub body_read_timeout_ms: u64,
    /// The most client connections served at once; further ones wait in the
    /// listen backlog until one closes.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_MAX_CONNECTIONS)]
    pub max_connections: usize,
    /// Keep the `X-Forwarded-For`, `Forwarded`, `X-Forwarded-Host` and
    /// `X-Forwarded-Proto` headers clients send (append to them) instead of
    /// replacing them: only behind a load balancer that sets them itself.
    #[arg(long)]
    pub trust_forwarded_headers: bool,
    /// Serve the proxy's Prometheus metrics on this address (at
    /// `/_idemkit/metrics` and `/metrics`) instead of on `--listen`.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// The most keyed request-body bytes held at once, across all requests
    /// (each counted at its `Content-Length`, or at `--max-request-body` when
    /// it has none). A request beyond it is answered `503` with `Retry-After`
    /// before its body is read.
    /// A body is held once while it is forwarded (the claim's bytes, handed
    /// back by the engine), and about twice at its peak (those bytes and the
    /// key store's own bound copy while its claim is written or waits for the
    /// store), so the proxy's memory grows by up to about twice this budget.
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_MAX_INFLIGHT_BODY_BYTES)]
    pub max_inflight_body_bytes: usize,
    /// How long the upstream may take to send the head of its answer to a
    /// request the proxy does not key, in milliseconds (`504` after it; the
    /// body then streams without a limit).
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_PASSTHROUGH_TIMEOUT_MS)]
    pub passthrough_timeout_ms: u64,
    /// Speak HTTP/2 to the upstream instead of HTTP/1.1: cleartext with prior
    /// knowledge (`h2c`) to an `http://` upstream, ALPN `h2` to an `https://`
    /// one. WebSocket upgrades then do not pass.
    #[arg(long)]
    pub upstream_http2: bool,
    /// How often the reaper runs, in milliseconds (as in `idemkit serve`:
    /// records past the reap threshold are deleted, unfinished ones listed for
    /// review).
    #[arg(long, default_value_t = idemkit_proxy::DEFAULT_REAP_INTERVAL_MS)]
    pub reap_interval_ms: u64,
}

/// `--sqlite-synchronous`: which of a SQLite key store's commits wait for the
/// disk ([`idemkit_proxy::SqliteSync`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SqliteSyncArg {
    /// Claims (`idemkit::stores::sqlite::Durability::Claims`).
    Claims,
    /// Every commit (`PRAGMA synchronous = FULL`).
    Full,
    /// None: checkpoints only (`PRAGMA synchronous = NORMAL`).
    Normal,
}

impl SqliteSyncArg {
    /// The flag's value of the library's setting.
    const fn from_library(sync: SqliteSync) -> Self {
        match sync {
            SqliteSync::Full => Self::Full,
            SqliteSync::Normal => Self::Normal,
            // `SqliteSync` is non-exhaustive; the default is `Claims`.
            _ => Self::Claims,
        }
    }
}

impl From<SqliteSyncArg> for SqliteSync {
    fn from(arg: SqliteSyncArg) -> Self {
        match arg {
            SqliteSyncArg::Claims => Self::Claims,
            SqliteSyncArg::Full => Self::Full,
            SqliteSyncArg::Normal => Self::Normal,
        }
    }
}

impl From<ProxyArgs> for ProxyOptions {
    /// Every flag but `--listen` and `--metrics-listen` (where the CLI binds);
    /// no metrics route (`run` adds it when metrics stay on `--listen`).
    fn from(args: ProxyArgs) -> Self {
        let mut options = ProxyOptions::new(&args.upstream, &args.database_url, &args.scope_secret);
        options.config = args.config;
        options.upstream_ca = args.upstream_ca;
        options.account_header = args.account_header;
        options.upstream_honours_keys = args.upstream_honours_keys;
        options.upstream_timeout_ms = args.upstream_timeout_ms;
        options.lease_ms = args.lease_ms;
        options.max_request_body = args.max_request_body;
        options.sqlite_synchronous = args.sqlite_synchronous.into();
        options.upstream_idle_timeout_ms = args.upstream_idle_timeout_ms;
        options.timeout_grace_ms = args.timeout_grace_ms;
        options.header_read_timeout_ms = args.header_read_timeout_ms;
        options.body_read_timeout_ms = args.body_read_timeout_ms;
        options.max_connections = args.max_connections;
        options.trust_forwarded_headers = args.trust_forwarded_headers;
        options.max_inflight_body_bytes = args.max_inflight_body_bytes;
        options.passthrough_timeout_ms = args.passthrough_timeout_ms;
        options.upstream_http2 = args.upstream_http2;
        options.reap_interval_ms = args.reap_interval_ms;
        options
    }
}

/// Runs the proxy until SIGTERM or SIGINT; then it stops accepting, lets the
/// requests in flight finish and store (bounded by the upstream timeout and
/// its grace), and exits.
pub fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    crate::install_crash_point();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        crate::install_metrics()?;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let metrics = match args.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding --metrics-listen {addr}"))?,
            ),
            None => None,
        };
        let mut options = ProxyOptions::from(args);
        if metrics.is_none() {
            // The recorder is installed above: there is always a text to render.
            options = options.with_metrics(Arc::new(|| {
                idemkit_labels::service::render_metrics().unwrap_or_default()
            }));
        }
        let proxy = ProxyServer::new(options).await?;
        println!("idemkit proxy listening on http://{}", listener.local_addr()?);
        if let Some(m) = metrics {
            println!("idemkit proxy metrics on http://{}", m.local_addr()?);
            let app = Router::new()
                .route(METRICS_PATH, get(idemkit_labels::service::metrics_endpoint))
                .route("/metrics", get(idemkit_labels::service::metrics_endpoint));
            tokio::spawn(async move { axum::serve(m, app).await });
        }
        {
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
        proxy.serve(listener, idemkit_proxy::shutdown_signal()).await;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SQLite key store syncs its claims unless told otherwise: the intent
    /// written before a forward must outlive the host. (Which connection a
    /// claim commits on under each setting is the store's test,
    /// `claims_commit_on_the_syncing_connection_and_nothing_else_does`.)
    #[tokio::test]
    async fn the_sqlite_key_store_syncs_claims_by_default() {
        use clap::Parser;
        use idemkit::stores::sqlite::Durability;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            proxy: ProxyArgs,
        }
        let dir = std::env::temp_dir().join(format!("idemkit-proxy-sync-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cases = [
            (None, Durability::Claims),
            (Some("claims"), Durability::Claims),
            (Some("full"), Durability::EveryCommit),
            (Some("normal"), Durability::Normal),
        ];
        for (flag, expected) in cases {
            let db = dir.join(format!("{flag:?}.db"));
            let url = format!("sqlite://{}", db.display());
            let mut argv = vec![
                "proxy",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                "http://127.0.0.1:1",
            ];
            argv.extend(["--database-url", &url, "--scope-secret", "s"]);
            if let Some(flag) = flag {
                argv.extend(["--sqlite-synchronous", flag]);
            }
            let options =
                idemkit_proxy::ProxyOptions::from(Cli::try_parse_from(argv).unwrap().proxy).open_options();
            assert_eq!(options.sqlite_durability, expected, "{flag:?}");
            let opened = idemkit::open_store(&url, &options).await.unwrap();
            let idemkit::OpenedStore::Sqlite(store) = opened else {
                panic!("a SQLite store")
            };
            let synchronous: i64 = sqlx::query_scalar("PRAGMA synchronous")
                .fetch_one(store.pool())
                .await
                .unwrap();
            // 1 NORMAL, 2 FULL; under `Claims` the pool does not wait, its claims connection does.
            assert_eq!(
                synchronous,
                if expected == Durability::EveryCommit { 2 } else { 1 }
            );
            assert_eq!(
                store.claims_pool().is_some(),
                expected == Durability::Claims,
                "{flag:?}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
