//! # idemkit-proxy
//!
//! The idempotency contract in front of an existing HTTP API, as a library: the
//! request path of `idemkit proxy`, built on the protocol-neutral engine
//! (`idemkit_engine`). [`router`] gives an axum [`Router`] that keys the
//! writes and forwards everything to the upstream; [`serve`] runs it on a
//! listener with connection limits and a graceful stop.
//!
//! ```no_run
//! use idemkit_proxy::{ProxyOptions, router};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! // Every POST, PUT, PATCH and DELETE to the upstream is keyed by its
//! // `Idempotency-Key`, scoped to the caller's `Authorization` header.
//! let options = ProxyOptions::new(
//!     "http://127.0.0.1:3000",
//!     "sqlite://idemkit-proxy.db",
//!     "a secret shared by every proxy on this store",
//! );
//! let app = router(options).await?;
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
//!
//! What it does and what it cannot do is written down in `docs/proxy.md`. In
//! short:
//!
//! - Keyed routes: with `--config`, the routes of the TOML file that are
//!   `retry_safe` (method and one normalised spelling of the path; every
//!   other spelling of a keyed path is refused, `paths`); without it, every `POST`, `PUT`,
//!   `PATCH` and `DELETE` (the methods the layer guards by default). Every other
//!   request, and every safe method, is streamed through untouched.
//! - A keyed request needs the credential header (`--account-header`, default
//!   `Authorization`): without it the proxy answers `401 unauthorized` and the
//!   upstream never sees it. The scope's account is `HMAC-SHA256(secret,
//!   credential)` in hex; the credential itself is never stored.
//! - The key is validated as the layer does; the claim is a lease-mode engine
//!   claim (fenced) that writes the intent (`recovery_point = "forwarded"`) with
//!   the record, before the request is forwarded with the caller's own key
//!   header; the upstream's answer is stored or released by the route policy
//!   (`Disposition::of`), with only the policy's allowlisted headers kept;
//!   replays carry `Idempotent-Replayed: true`.
//! - A record found with an intent and no answer (the proxy died, or the upstream
//!   timed out, after forwarding) is re-sent with the same key only when the
//!   upstream is declared key-honouring (`--upstream-honours-keys`); otherwise it
//!   is parked (`409 idempotency_request_parked`) and never forwarded twice.
//!
//! ## Features
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri, header};
use http_body_util::{BodyExt, Limited};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use idemkit_core::{Account, ErrorCode, IdempotencyKey, KeyStore, Policy, Problem, Scope};
use idemkit_engine::metrics::outcome;
use idemkit_engine::{
    Attempt, Detached, Disposition, Engine, Finished, Incoming, Panicked, ProblemResponse, Refusal, Refused,
    STORED_REQUEST_HEADERS, key_from_json, key_problem, stored_request_headers, stored_response,
};
use idemkit_tower::Reaper;
use idemkit_tower::render::replay_response_to;
use tokio::net::TcpListener;

mod answers;
mod config;
mod execute;
mod linger;
mod listen;
mod options;
mod paths;
mod upstream;

use answers::{accept_encoding, bad_gateway, key_outcome, problem, refusal_response};
use tracing::Instrument;

pub use config::{ProxyConfig, route_name};
pub use listen::shutdown_signal;
pub use options::*;
pub use upstream::{UpstreamError, UpstreamService};

/// The recovery point recorded just before a request is forwarded: the upstream
/// may have executed it. A record found here without an answer is re-sent only
/// to a key-honouring upstream, and parked otherwise.
pub const FORWARDED: &str = "forwarded";

/// The proxy's own Prometheus metrics (the layer's series: requests by
/// outcome, store latency, fenced writes, …), out of the way of the upstream's
/// paths; on `--metrics-listen` instead when it is set. Every path outside
/// `/_idemkit/` goes upstream, `/healthz` included.
pub const METRICS_PATH: &str = "/_idemkit/metrics";

/// Liveness: `200` while the proxy process serves requests.
pub const LIVE_PATH: &str = "/_idemkit/live";

/// Readiness: `200` when the key store answers, `503` otherwise.
pub const READY_PATH: &str = "/_idemkit/ready";

/// Hop-by-hop headers (RFC 9110 §7.6.1): never forwarded, never stored.
const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// The forwarding headers (RFC 7239 and the de-facto `X-Forwarded-*`).
const FORWARDING: &[&str] = &[
    "forwarded",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
];

/// Where a keyed route reads its key.
#[derive(Debug, Clone)]
enum KeySource {
    Header(HeaderName),
    JsonField(String),
}

struct Route {
    method: Method,
    /// `None`: every path (the default table). A configured path is a
    /// template as the service's routes write it (`/orders/{id}/confirm`),
    /// matched segment by segment against one normalised spelling.
    path: Option<paths::Template>,
    engine: Engine,
    key: KeySource,
    /// The `5xx` statuses the operator declared "not executed" for this route.
    not_executed: Vec<u16>,
}

impl Route {
    fn matches(&self, method: &Method, path: &str) -> paths::PathMatch {
        if self.method != method {
            return paths::PathMatch::No;
        }
        self.path
            .as_ref()
            .map_or(paths::PathMatch::Exact, |t| t.matches(path))
    }
}

/// The proxy's state.
struct Proxy {
    routes: Vec<Route>,
    store: Arc<dyn KeyStore>,
    /// Where forwards go.
    client: upstream::Upstream,
    /// The upstream's base URL.
    upstream: String,
    account_header: HeaderName,
    secret: Vec<u8>,
    honours_keys: bool,
    timeout: Duration,
    /// After a timeout, how much longer a key-honouring upstream's answer is
    /// awaited (holding the lease).
    grace: Duration,
    max_request_body: usize,
    body_read_timeout: Duration,
    trust_forwarded: bool,
    /// Detached forwards and background stores, waited for on a stop.
    tasks: Arc<listen::Tracker>,
    /// The upstream's time to answer an unkeyed request's head.
    passthrough_timeout: Duration,
    /// HTTP/2 (prior knowledge) to the upstream.
    http2: bool,
    /// The budget of keyed body bytes held at once (one permit a byte).
    body_budget: Arc<tokio::sync::Semaphore>,
}

/// Why the proxy could not be built ([`router`], [`ProxyServer::new`]).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProxyError {
    /// An option or the configuration is invalid (the message names which, and
    /// why).
    #[error("{0}")]
    Invalid(String),
    /// The key store did not open. Its URL's password, and every occurrence of
    /// it in the store's message, is replaced by `***`.
    #[error("opening the key store {url}: {message}")]
    Store {
        /// The store's URL, its password redacted ([`redact_url`]).
        url: String,
        /// What the store said, redacted.
        message: String,
    },
}

impl ProxyError {
    /// An [`Invalid`](Self::Invalid) error: `context`, then `error` and its
    /// sources, joined by `: `.
    fn invalid(context: impl std::fmt::Display, error: &(dyn std::error::Error + 'static)) -> Self {
        Self::Invalid(format!("{context}: {}", error_chain(error)))
    }
}

/// An error and its sources, joined by `: ` (as `anyhow` prints `{:#}`).
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        out.push_str(": ");
        out.push_str(&e.to_string());
        source = e.source();
    }
    out
}

/// A proxy built from its [`ProxyOptions`]: its store open and its reaper
/// running, ready to [`serve`](Self::serve) or to hand out its
/// [`router`](Self::router).
pub struct ProxyServer {
    router: Router,
    proxy: Arc<Proxy>,
    limits: listen::Limits,
}

impl std::fmt::Debug for ProxyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyServer")
            .field("upstream", &self.proxy.upstream)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl ProxyServer {
    /// Checks `options`, reads the configuration, opens the key store and
    /// starts the reaper on the current runtime.
    pub async fn new(options: ProxyOptions) -> Result<Self, ProxyError> {
        let limits = listen::Limits::of(&options);
        let (router, proxy) = build(options, None).await?;
        Ok(Self {
            router,
            proxy,
            limits,
        })
    }

    /// The proxy over a key store already open and an upstream served in
    /// the same process: what a test or a simulator builds (the project's
    /// simulator runs the proxy's request path this way, over its
    /// instrumented stores). `options.database_url` is not opened and
    /// `options.upstream` is not dialled; the upstream URL still names the
    /// authority of the forwarded requests' URIs. The reaper starts on the
    /// current runtime, as with [`new`](Self::new).
    pub async fn in_process(
        options: ProxyOptions,
        store: Arc<dyn KeyStore>,
        upstream: UpstreamService,
    ) -> Result<Self, ProxyError> {
        let limits = listen::Limits::of(&options);
        let (router, proxy) = build(options, Some((store, upstream))).await?;
        Ok(Self {
            router,
            proxy,
            limits,
        })
    }

    /// The proxy's router (see [`router`]), to serve by other means than
    /// [`serve`](Self::serve) (without its connection limits and graceful stop).
    pub fn router(&self) -> Router {
        self.router.clone()
    }

    /// Serves the proxy on `listener` until `shutdown` resolves; then it stops
    /// accepting, lets the requests in flight finish and store (bounded by the
    /// upstream timeout, its grace with a key-honouring upstream, and a margin
    /// for the store), and returns. Each connection has the options'
    /// header-read timeout; at most `max_connections` are served at once.
    pub async fn serve(self, listener: TcpListener, shutdown: impl Future<Output = ()>) {
        listen::serve(
            listener,
            self.router,
            self.limits,
            self.proxy.tasks.clone(),
            shutdown,
        )
        .await;
    }
}

/// Builds the proxy from `options` and serves it on `listener` until
/// `shutdown` resolves ([`ProxyServer::serve`]; e.g. [`shutdown_signal`]).
pub async fn serve(
    listener: TcpListener,
    options: ProxyOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<(), ProxyError> {
    ProxyServer::new(options).await?.serve(listener, shutdown).await;
    Ok(())
}

/// What a stop allows on top of the upstream's time: the store writes after it.
const STORE_MARGIN: Duration = Duration::from_secs(5);

/// The proxy's router: `/_idemkit/live`, `/_idemkit/ready` and (with
/// [`ProxyOptions::metrics`]) `/_idemkit/metrics` for the proxy itself, every
/// other `/_idemkit/` path `404`, everything else to the upstream. Also starts
/// the reaper on the current runtime.
pub async fn router(options: ProxyOptions) -> Result<Router, ProxyError> {
    Ok(build(options, None).await?.0)
}

/// The password of a URL's user information replaced by `***`, for messages.
pub fn redact_url(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    let Some(at) = authority.rfind('@') else {
        return url.to_owned();
    };
    let userinfo = &authority[..at];
    let user = match userinfo.find(':') {
        Some(colon) => format!("{}:***", &userinfo[..colon]),
        None if userinfo.is_empty() => String::new(),
        // `redis://secret@host`: a lone user part is the password there.
        None if url.starts_with("redis") => "***".to_owned(),
        None => userinfo.to_owned(),
    };
    format!("{}{user}{}", &url[..scheme_end + 3], &rest[at..])
}

/// Builds the proxy; `parts` replaces the store its URL names and the HTTP
/// upstream ([`ProxyServer::in_process`]).
async fn build(
    args: ProxyOptions,
    parts: Option<(Arc<dyn KeyStore>, UpstreamService)>,
) -> Result<(Router, Arc<Proxy>), ProxyError> {
    if args.scope_secret.is_empty() {
        return Err(ProxyError::Invalid("--scope-secret must not be empty".to_owned()));
    }
    let upstream = args.upstream.trim_end_matches('/').to_owned();
    let parsed: Uri = upstream
        .parse()
        .map_err(|e| ProxyError::invalid(format!("--upstream {upstream}"), &e))?;
    if !(matches!(parsed.scheme_str(), Some("http" | "https")) && parsed.authority().is_some()) {
        return Err(ProxyError::Invalid(
            "--upstream must be an http://host:port or https://host:port URL".to_owned(),
        ));
    }
    if args.upstream_ca.is_some() && parsed.scheme_str() != Some("https") {
        return Err(ProxyError::Invalid(
            "--upstream-ca is for an https:// upstream".to_owned(),
        ));
    }
    let (given_store, client) = match parts {
        Some((store, service)) => (Some(store), upstream::Upstream::Service(service)),
        None => (None, upstream::Upstream::Http(Box::new(upstream_client(&args)?))),
    };
    // Read before the store is opened: a bad file is reported as itself.
    let config = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ProxyError::invalid(format!("reading {}", path.display()), &e))?;
            let mut config = ProxyConfig::from_toml(&text)
                .map_err(|e| ProxyError::Invalid(format!("--config {}: {e}", path.display())))?;
            if let Some(ms) = args.lease_ms {
                config.idemkit = config
                    .idemkit
                    .with_lease(Duration::from_millis(ms))
                    .map_err(|e| ProxyError::Invalid(error_chain(&e)))?;
            }
            Some(config)
        }
        None => None,
    };
    let store = match given_store {
        Some(store) => store,
        None => {
            // The URL's password never reaches a log or a terminal, nor does the
            // store's own message (a driver may quote its connection string).
            let (store_url, open_options) = args.store_target()?;
            let opened = idemkit::open_store(&store_url, &open_options)
                .await
                .map_err(|e| ProxyError::Store {
                    url: redact_url(&args.database_url),
                    message: redact_all(&e.to_string(), &args.database_url),
                })?;
            opened.key_store()
        }
    };
    let mut reap = Policy::new();
    let routes = match &config {
        Some(config) => {
            let mut routes = Vec::new();
            reap = reap
                .with_reap_threshold(config.idemkit.defaults.reap_threshold)
                .with_replay_window(config.idemkit.defaults.replay_window);
            for r in config.idemkit.routes.iter().filter(|r| r.retry_safe) {
                let method = Method::from_bytes(r.method.to_ascii_uppercase().as_bytes())
                    .map_err(|e| ProxyError::invalid(format!("route method {}", r.method), &e))?;
                // Safe methods (RFC 9110 §9.2.1) always pass through.
                if method.is_safe() {
                    tracing::warn!(
                        method = %method,
                        path = %r.path,
                        "proxy: a safe method is never keyed; this route passes through"
                    );
                    continue;
                }
                let template = paths::Template::parse(&r.path)?;
                let key = match &r.key_field {
                    Some(pointer) => KeySource::JsonField(pointer.clone()),
                    None => KeySource::Header(
                        HeaderName::from_bytes(r.key_header().as_bytes())
                            .map_err(|e| ProxyError::invalid(format!("key header {}", r.key_header()), &e))?,
                    ),
                };
                let mut policy = r.policy();
                for h in config.replayed_headers(&r.method, &r.path) {
                    policy = policy.with_replayed_header(h.clone());
                }
                if policy.replay_window > reap.replay_window {
                    reap = reap.with_replay_window(policy.replay_window);
                }
                routes.push(Route {
                    method,
                    path: Some(template),
                    engine: Engine::lease(store.clone(), policy)
                        .map_err(|e| ProxyError::invalid(format!("route {} {}", r.method, r.path), &e))?,
                    key,
                    not_executed: config.not_executed(&r.method, &r.path).to_vec(),
                });
            }
            routes
        }
        None => {
            let mut policy = Policy::new();
            if let Some(ms) = args.lease_ms {
                policy = policy.with_lease(Duration::from_millis(ms));
            }
            let engine =
                Engine::lease(store.clone(), policy).map_err(|e| ProxyError::Invalid(error_chain(&e)))?;
            [Method::POST, Method::PUT, Method::PATCH, Method::DELETE]
                .into_iter()
                .map(|method| Route {
                    method,
                    path: None,
                    engine: engine.clone(),
                    key: KeySource::Header(HeaderName::from_static(idemkit_tower::wire::IDEMPOTENCY_KEY)),
                    not_executed: Vec::new(),
                })
                .collect()
        }
    };
    // As `idemkit serve` does: records past the reap threshold are deleted,
    // unfinished ones listed for review.
    Reaper::with_threshold(
        store.clone(),
        reap.reap_threshold.max(reap.replay_window),
        reap.replay_window,
    )
    .map_err(|e| ProxyError::Invalid(error_chain(&e)))?
    .spawn(Duration::from_millis(args.reap_interval_ms.max(1)));
    let proxy = Arc::new(Proxy {
        routes,
        store,
        client,
        upstream,
        account_header: HeaderName::from_bytes(args.account_header.as_bytes())
            .map_err(|e| ProxyError::invalid(format!("--account-header {}", args.account_header), &e))?,
        secret: args.scope_secret.into_bytes(),
        honours_keys: args.upstream_honours_keys,
        timeout: Duration::from_millis(args.upstream_timeout_ms),
        grace: Duration::from_millis(args.timeout_grace_ms),
        max_request_body: args.max_request_body,
        body_read_timeout: Duration::from_millis(args.body_read_timeout_ms),
        trust_forwarded: args.trust_forwarded_headers,
        tasks: Arc::default(),
        passthrough_timeout: Duration::from_millis(args.passthrough_timeout_ms),
        http2: args.upstream_http2,
        body_budget: Arc::new(tokio::sync::Semaphore::new(
            args.max_inflight_body_bytes
                .min(tokio::sync::Semaphore::MAX_PERMITS),
        )),
    });
    let mut app = Router::new()
        .route(LIVE_PATH, get(live))
        .route(READY_PATH, get(ready));
    if let Some(render) = args.metrics.clone() {
        app = app.route(METRICS_PATH, get(move || metrics_endpoint(render.clone())));
    }
    let app = app
        .route("/_idemkit", axum::routing::any(own_path))
        .route("/_idemkit/{*rest}", axum::routing::any(own_path))
        .fallback(handle)
        .with_state(proxy.clone());
    Ok((app, proxy))
}

/// The client to the upstream: plain HTTP, or TLS (rustls, `ring`) to an
/// `https://` upstream, verified against the host's trust store
/// (`rustls-native-certs`) or, with [`ProxyOptions::upstream_ca`], only
/// against the CAs of that PEM file.
/// HTTP/1.1, or HTTP/2 with [`ProxyOptions::upstream_http2`] (prior knowledge
/// over `http://`, ALPN `h2` over `https://`).
fn upstream_client(
    args: &ProxyOptions,
) -> Result<Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>, ProxyError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = match &args.upstream_ca {
        Some(path) => {
            let mut roots = rustls::RootCertStore::empty();
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
                .map_err(|e| ProxyError::invalid(format!("--upstream-ca {}", path.display()), &e))?;
            if certs.is_empty() {
                return Err(ProxyError::Invalid(format!(
                    "--upstream-ca {}: no PEM certificate in it",
                    path.display()
                )));
            }
            for cert in certs {
                roots
                    .add(cert)
                    .map_err(|e| ProxyError::invalid(format!("--upstream-ca {}", path.display()), &e))?;
            }
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ProxyError::invalid("TLS", &e))?
                .with_root_certificates(roots)
                .with_no_client_auth()
        }
        // The host's trust store, read only for an `https://` upstream (a
        // host without one can still run in front of an `http://` upstream).
        None if args.upstream.starts_with("https://") => {
            use hyper_rustls::ConfigBuilderExt;
            rustls::ClientConfig::builder_with_provider(provider)
                .with_safe_default_protocol_versions()
                .map_err(|e| ProxyError::invalid("TLS", &e))?
                .with_native_roots()
                .map_err(|e| {
                    ProxyError::invalid(
                        "--upstream https://…: the host's CA certificates could not be read (pass --upstream-ca FILE)",
                        &e,
                    )
                })?
                .with_no_client_auth()
        }
        None => rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| ProxyError::invalid("TLS", &e))?
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth(),
    };
    let mut connector = HttpConnector::new();
    connector.enforce_http(false);
    connector.set_nodelay(true);
    // A connect that fails is "not sent" (the key is freed), but only
    // if it fails before the upstream timeout, which would make it
    // "maybe executed": an unreachable host that never resets would
    // park every request.
    connector.set_connect_timeout(Some(
        (Duration::from_millis(args.upstream_timeout_ms) / 2).min(Duration::from_secs(10)),
    ));
    let tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http();
    // Upgrades (WebSocket) need HTTP/1.1: `h2` is offered only when asked for.
    let connector = if args.upstream_http2 {
        tls.enable_http2().wrap_connector(connector)
    } else {
        tls.enable_http1().wrap_connector(connector)
    };
    Ok(Client::builder(TokioExecutor::new())
        // Idle connections are dropped before the upstream's keep-alive
        // closes them under a request being written (a "maybe
        // executed" for a request the upstream never read).
        .pool_idle_timeout(Duration::from_millis(args.upstream_idle_timeout_ms))
        .pool_timer(TokioTimer::new())
        // A request that never left on a reused connection (it closed
        // first) is sent again on a new one: hyper knows it was not sent.
        .retry_canceled_requests(true)
        .http2_only(args.upstream_http2)
        .build(connector))
}

/// Every occurrence of `url` in `text`, redacted (and its password alone).
fn redact_all(text: &str, url: &str) -> String {
    let mut out = text.replace(url, &redact_url(url));
    if let Some(password) = password_of(url)
        && !password.is_empty()
    {
        out = out.replace(password, "***");
    }
    out
}

fn password_of(url: &str) -> Option<&str> {
    let rest = &url[url.find("://")? + 3..];
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let userinfo = &authority[..authority.rfind('@')?];
    Some(userinfo.split_once(':').map_or(userinfo, |(_, p)| p))
}

/// The Prometheus text of `render`.
async fn metrics_endpoint(render: RenderMetrics) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        render(),
    )
        .into_response()
}

async fn live() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"status":"live"}"#,
    )
}

/// Ready when the key store answers a read within a second.
async fn ready(State(proxy): State<Arc<Proxy>>) -> Response {
    let scope = Scope::new(
        Account::new("_idemkit"),
        IdempotencyKey::parse("readiness-probe").expect("a valid key"),
    );
    match tokio::time::timeout(Duration::from_secs(1), proxy.store.get(&scope)).await {
        Ok(Ok(_)) => (
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"ready"}"#,
        )
            .into_response(),
        Ok(Err(e)) => problem(
            ErrorCode::StoreUnavailable,
            format!("not ready: the key store failed: {e}"),
        )
        .into_response(),
        Err(_) => problem(
            ErrorCode::StoreUnavailable,
            "not ready: the key store did not answer within 1 s",
        )
        .into_response(),
    }
}

/// `/_idemkit/…` belongs to the proxy: never forwarded.
async fn own_path() -> Response {
    problem(ErrorCode::NotFound, "no such path of the proxy's own")
}

async fn handle(State(proxy): State<Arc<Proxy>>, req: Request) -> Response {
    let mut ambiguous = false;
    let mut keyed = None;
    for (i, r) in proxy.routes.iter().enumerate() {
        match r.matches(req.method(), req.uri().path()) {
            paths::PathMatch::Exact => {
                keyed = Some(i);
                break;
            }
            paths::PathMatch::Ambiguous => ambiguous = true,
            paths::PathMatch::No => {}
        }
    }
    match keyed {
        Some(i) => proxy.keyed_encoded(i, req).await,
        // Another spelling of a keyed path: the upstream may route it to the
        // keyed handler, where it would run unkeyed.
        None if ambiguous => {
            idemkit_engine::metrics::request(outcome::REJECTED);
            problem(
                ErrorCode::ValidationFailed,
                format!(
                    "the path {} is another spelling of a keyed route's path (letter case, an empty, `.` or `..` \
                     segment, a trailing slash, `;` parameters or a percent-encoded character that needs none); \
                     send the route's own spelling",
                    req.uri().path()
                ),
            )
        }
        None => match tokio::time::timeout(proxy.passthrough_timeout, proxy.pass_through(req)).await {
            Ok(Ok(res)) => res,
            Ok(Err(e)) => bad_gateway(&e),
            Err(_) => {
                let mut p = Problem::new(
                    ErrorCode::Internal,
                    format!(
                        "the upstream did not answer within {} ms",
                        proxy.passthrough_timeout.as_millis()
                    ),
                )
                .with_status(504);
                p.retryable = true;
                ProblemResponse::from(p).into_response()
            }
        },
    }
}

/// Whether `headers` ask to switch protocols (`Connection: upgrade` and an
/// `Upgrade` header): a WebSocket handshake and the like.
fn is_upgrade(headers: &HeaderMap) -> bool {
    headers.contains_key(header::UPGRADE) && connection_names(headers).contains(&header::UPGRADE)
}

/// The header names a `Connection` header lists.
fn connection_names(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// Removes the hop-by-hop headers, and those the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_names(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

impl Proxy {
    /// An unkeyed request: forwarded as it streams; a protocol upgrade
    /// (WebSocket) is passed through, and once the upstream switches, bytes
    /// are copied both ways until either side closes.
    async fn pass_through(&self, mut req: Request) -> Result<Response, UpstreamError> {
        if self.http2 || !is_upgrade(req.headers()) {
            return self.forward(req).await;
        }
        let client_side = req.extensions_mut().remove::<hyper::upgrade::OnUpgrade>();
        let upgrade = req.headers().get(header::UPGRADE).cloned();
        let (mut parts, body) = req.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        if let Some(u) = upgrade {
            parts.headers.insert(header::UPGRADE, u);
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        }
        let (target, version) = self.target(&parts.uri);
        parts.uri = target;
        parts.version = version;
        let host = parts.headers.remove(header::HOST);
        self.forwarding_headers(&mut parts.headers, listen::client_addr(&parts.extensions), host);
        let mut res = self.client.send(Request::from_parts(parts, body)).await?;
        if res.status() != http::StatusCode::SWITCHING_PROTOCOLS {
            let (mut parts, body) = res.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            return Ok(Response::from_parts(parts, body));
        }
        let upstream_side = hyper::upgrade::on(&mut res);
        tokio::spawn(async move {
            let (Some(client_side), Ok(upstream)) = (client_side, upstream_side.await) else {
                return;
            };
            let Ok(client) = client_side.await else { return };
            let mut client = hyper_util::rt::TokioIo::new(client);
            let mut upstream = hyper_util::rt::TokioIo::new(upstream);
            let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        });
        let (parts, _) = res.into_parts();
        Ok(Response::from_parts(parts, Body::empty()))
    }

    /// The upstream URI of a request target, and the HTTP version to use.
    fn target(&self, uri: &Uri) -> (Uri, http::Version) {
        let target = uri.path_and_query().map_or("/", |p| p.as_str());
        let uri = format!("{}{target}", self.upstream)
            .parse()
            .expect("an http base URL and a request target make a URI");
        let version = if self.http2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        (uri, version)
    }

    /// Sends `req` to the upstream, streaming both bodies.
    async fn forward(&self, req: Request) -> Result<Response, UpstreamError> {
        let (mut parts, body) = req.into_parts();
        let (target, version) = self.target(&parts.uri);
        parts.uri = target;
        parts.version = version;
        strip_hop_by_hop(&mut parts.headers);
        let host = parts.headers.remove(header::HOST).or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        self.forwarding_headers(&mut parts.headers, listen::client_addr(&parts.extensions), host);
        let res = self.client.send(Request::from_parts(parts, body)).await?;
        let (mut parts, body) = res.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, body))
    }

    /// Adds the client's address to `X-Forwarded-For` and `Forwarded`, and
    /// the host and scheme it asked for; what the client sent in them is kept
    /// (and appended to) only with `--trust-forwarded-headers`.
    fn forwarding_headers(
        &self,
        headers: &mut HeaderMap,
        client: Option<SocketAddr>,
        host: Option<HeaderValue>,
    ) {
        if !self.trust_forwarded {
            for name in FORWARDING {
                headers.remove(*name);
            }
        }
        let Some(client) = client else { return };
        let ip = client.ip().to_string();
        let joined = |headers: &HeaderMap, name: &str| {
            let all: Vec<&str> = headers
                .get_all(name)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            (!all.is_empty()).then(|| all.join(", "))
        };
        let xff = match joined(headers, "x-forwarded-for") {
            Some(prev) => format!("{prev}, {ip}"),
            None => ip.clone(),
        };
        let mut node = if client.is_ipv6() {
            format!("for=\"[{ip}]\"")
        } else {
            format!("for={ip}")
        };
        if let Some(h) = host.as_ref().and_then(|h| h.to_str().ok()) {
            node.push_str(&format!(";host=\"{}\"", h.replace(['"', '\\'], "")));
        }
        node.push_str(";proto=http");
        let forwarded = match joined(headers, "forwarded") {
            Some(prev) => format!("{prev}, {node}"),
            None => node,
        };
        for (name, value) in [("x-forwarded-for", xff), ("forwarded", forwarded)] {
            if let Ok(v) = HeaderValue::from_str(&value) {
                headers.insert(name, v);
            }
        }
        if !headers.contains_key("x-forwarded-host")
            && let Some(h) = host
        {
            headers.insert("x-forwarded-host", h);
        }
        if !headers.contains_key("x-forwarded-proto") {
            headers.insert("x-forwarded-proto", HeaderValue::from_static("http"));
        }
    }

    /// The account of a credential: hex `HMAC-SHA256(secret, credential)`.
    fn account(&self, credential: &[u8]) -> Account {
        Account::keyed(&self.secret, credential)
    }

    /// A keyed request's answer, first or replayed, compressed for its caller
    /// (`tower-http`'s compression: gzip or deflate as its `Accept-Encoding`
    /// asks, none without one; streams of server-sent events and answers
    /// already encoded are left as they are). The upstream is asked for
    /// identity and the store keeps identity bytes, so a first answer and every
    /// replay reach each caller encoded the same way.
    async fn keyed_encoded(self: &Arc<Self>, route: usize, req: Request) -> Response {
        use tower::{Layer, ServiceExt};
        let this = self.clone();
        // A body refused unread is drained, not reset under its sender.
        let req = req.map(|body| {
            Body::new(linger::Lingering::new(
                body,
                self.max_request_body,
                self.body_read_timeout,
            ))
        });
        let keyed = tower::service_fn(move |req: Request| {
            let this = this.clone();
            async move { Ok::<_, std::convert::Infallible>(this.keyed(route, req).await) }
        });
        match tower_http::compression::CompressionLayer::new()
            .layer(keyed)
            .oneshot(req)
            .await
        {
            Ok(res) => res.map(Body::new),
            Err(never) => match never {},
        }
    }

    /// One keyed request: counted once in `idemkit_requests_total` by outcome
    /// and traced as an `idemkit.request` span (method, path, outcome), as
    /// the layer does.
    async fn keyed(self: &Arc<Self>, route: usize, req: Request) -> Response {
        let span = tracing::info_span!(
            "idemkit.request",
            method = %req.method(),
            path = req.uri().path(),
            outcome = tracing::field::Empty
        );
        let (outcome, res) = self.keyed_inner(route, req).instrument(span.clone()).await;
        span.record("outcome", outcome);
        idemkit_engine::metrics::request(outcome);
        res
    }

    async fn keyed_inner(self: &Arc<Self>, route_index: usize, req: Request) -> (&'static str, Response) {
        let route = &self.routes[route_index];
        let (parts, body) = req.into_parts();
        // A `Connection` header naming the credential or the key header would
        // have it stripped as hop-by-hop after it scoped (or keyed) the
        // request: the upstream would act for a caller it never saw.
        let key_header = match &route.key {
            KeySource::Header(name) => Some(name),
            KeySource::JsonField(_) => None,
        };
        if let Some(named) = connection_names(&parts.headers)
            .into_iter()
            .find(|n| *n == self.account_header || Some(n) == key_header)
        {
            return (
                outcome::REJECTED,
                problem(
                    ErrorCode::ValidationFailed,
                    format!(
                        "the `Connection` header names `{named}`, which scopes or keys this request and must reach \
                         the upstream: remove it from `Connection`"
                    ),
                ),
            );
        }
        // Exactly one non-empty credential: an empty one would put every caller
        // that sends it in one scope, and of two, the upstream may authenticate
        // another than the one the scope is made of.
        // The completer's replay of an abandoned record (`idemkit keys
        // complete`, or a `Completer` over this router) carries the record's
        // scope: no credential is stored, so none is read.
        let resumed = idemkit_engine::completer_resume(&parts.extensions).map(|(s, t)| (s.clone(), t));
        let mut credentials = parts.headers.get_all(&self.account_header).iter();
        let credential = match (credentials.next(), credentials.next()) {
            _ if resumed.is_some() => None,
            (Some(v), None) if !v.as_bytes().trim_ascii().is_empty() => Some(v),
            (first, _) => {
                let which = if first.is_none() {
                    "requires"
                } else {
                    "requires exactly one non-empty"
                };
                return (
                    outcome::REJECTED,
                    problem(
                        ErrorCode::Unauthorized,
                        format!(
                            "this route {which} `{}` header: idempotency keys are scoped to the caller",
                            self.account_header
                        ),
                    ),
                );
            }
        };
        let header_key = match &route.key {
            _ if resumed.is_some() => None,
            KeySource::Header(name) => Some(IdempotencyKey::from_header_values(
                parts.headers.get_all(name).iter().map(HeaderValue::as_bytes),
            )),
            KeySource::JsonField(_) => None,
        };
        if let Some(Err(e)) = &header_key {
            return (
                key_outcome(e),
                ProblemResponse::from(key_problem(e)).into_response(),
            );
        }
        // Bounded memory: the body's bytes are reserved before it is read and
        // held until the request's work ends.
        let declared = parts
            .headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
            .unwrap_or(self.max_request_body)
            .min(self.max_request_body)
            .max(1);
        let Ok(reserved) = self
            .body_budget
            .clone()
            .try_acquire_many_owned(u32::try_from(declared).unwrap_or(u32::MAX))
        else {
            let mut p = Problem::new(
                ErrorCode::Internal,
                "the proxy holds as many request bodies as its budget allows (--max-inflight-body-bytes); \
                 nothing was claimed or forwarded: retry after `Retry-After`",
            )
            .with_status(503);
            p.retryable = true;
            return (
                outcome::REJECTED,
                ProblemResponse::from(p)
                    .retry_after(Duration::from_secs(1))
                    .into_response(),
            );
        };
        let read = tokio::time::timeout(
            self.body_read_timeout,
            idemkit_tower::render::read_body(body, self.max_request_body),
        );
        let bytes = match read.await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(refused)) => return (outcome::REJECTED, refused.into_response()),
            Err(_) => {
                return (
                    outcome::REJECTED,
                    problem(
                        ErrorCode::ValidationFailed,
                        format!(
                            "the request body did not arrive within {} ms; nothing was claimed or forwarded",
                            self.body_read_timeout.as_millis()
                        ),
                    )
                    .into_response(),
                );
            }
        };
        let (scope, resume) = match (resumed, credential, header_key, &route.key) {
            (Some((scope, token)), ..) => (scope, Some(token)),
            (None, Some(credential), Some(Ok(k)), _) => {
                (Scope::new(self.account(credential.as_bytes()), k), None)
            }
            (None, Some(credential), _, KeySource::JsonField(pointer)) => {
                match key_from_json(&bytes, pointer) {
                    Ok(k) => (Scope::new(self.account(credential.as_bytes()), k), None),
                    Err(p) => {
                        let counted = match p.code {
                            ErrorCode::KeyMissing => outcome::KEY_MISSING,
                            ErrorCode::KeyInvalid => outcome::KEY_INVALID,
                            _ => outcome::REJECTED,
                        };
                        return (counted, ProblemResponse::from(p).into_response());
                    }
                }
            }
            _ => unreachable!("the credential and header keys were checked above"),
        };
        let target = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |p| p.as_str());
        let mut claim = route.engine.claim_request(Incoming {
            scope,
            method: parts.method.as_str(),
            target,
            headers: stored_request_headers(&parts.headers, STORED_REQUEST_HEADERS),
            body: &bytes,
            resume,
        });
        // One copy per body: the claim's, which the store writes and the
        // attempt then hands back for the forward (`Attempt::take_request_body`).
        drop(bytes);
        // The intent, written by the claim itself, before anything leaves the
        // proxy: what is forwarded is the request the claim stores, to the
        // upstream the proxy runs with.
        claim.recovery_point = Some(FORWARDED.to_owned());
        // The claim, the forward and the store go on even if the caller hangs
        // up: a claim cut off after its write committed would leave an intent
        // with no holder (its retry parked, though nothing was sent), and a
        // forward cut off would leave a stuck key instead of a replay. A stop
        // (SIGTERM) waits for them too.
        let (this, engine) = (self.clone(), route.engine.clone());
        let caller = accept_encoding(&parts.headers);
        let tracked = self.tasks.track();
        let work = async move {
            let _tracked = tracked;
            let _reserved = reserved;
            let mut attempt = match engine.begin(claim).await {
                Ok(attempt) => attempt,
                Err(refused) => {
                    return (
                        refused.outcome,
                        refusal_response(refused.refusal, engine.policy(), &caller),
                    );
                }
            };
            let bytes = Bytes::from(
                attempt
                    .take_request_body()
                    .expect("a lease-mode attempt, just begun, gives its request body up"),
            );
            this.execute(route_index, attempt, parts, bytes).await
        };
        match Detached::new(work).await {
            Ok(res) => res,
            Err(Panicked) => {
                tracing::error!("proxy: the forwarding task panicked");
                (
                    outcome::ERROR,
                    problem(ErrorCode::Internal, "the proxy failed while forwarding"),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_passwords_are_redacted() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/x"),
            "postgres://app:***@db:5432/x"
        );
        assert_eq!(redact_url("redis://:pw@127.0.0.1/0"), "redis://:***@127.0.0.1/0");
        assert_eq!(redact_url("redis://pw@127.0.0.1"), "redis://***@127.0.0.1");
        assert_eq!(redact_url("sqlite://a.db"), "sqlite://a.db");
        assert_eq!(
            redact_all(
                "failed: postgres://app:s3cret@db/x (s3cret)",
                "postgres://app:s3cret@db/x"
            ),
            "failed: postgres://app:***@db/x (***)"
        );
    }
}
