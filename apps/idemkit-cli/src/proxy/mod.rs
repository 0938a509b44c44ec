//! `idemkit proxy`: the idempotency contract in front of an existing HTTP API
//! (issue 18), built on the protocol-neutral engine (`idemkit_tower::engine`).
//!
//! What it does and what it cannot do is written down in `docs/proxy.md`. In
//! short:
//!
//! - Keyed routes: with `--config`, the routes of the TOML file that are
//!   `retry_safe` (exact method and path); without it, every `POST`, `PUT`,
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

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
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
use hyper_util::rt::TokioExecutor;
use idemkit_core::{Account, ErrorCode, IdempotencyKey, KeyStore, Policy, Problem, Scope};
use idemkit_tower::config::IdemkitConfig;
use idemkit_tower::engine::{
    Attempt, Detached, Disposition, Engine, Finished, Incoming, Panicked, Refusal, Refused, key_from_json,
    key_problem,
};
use idemkit_tower::metrics::outcome;
use idemkit_tower::{
    ProblemResponse, STORED_REQUEST_HEADERS, replay_response, stored_request_headers, stored_response,
};
use sha2::Sha256;

mod answers;
mod args;
mod execute;

use answers::{bad_gateway, key_outcome, problem, refusal_response, store_response};
use tracing::Instrument;

pub use args::{ProxyArgs, SqliteSync};

/// The recovery point recorded just before a request is forwarded: the upstream
/// may have executed it. A record found here without an answer is re-sent only
/// to a key-honouring upstream, and parked otherwise.
pub const FORWARDED: &str = "forwarded";

/// The proxy's own Prometheus metrics (the layer's series: requests by
/// outcome, store latency, fenced writes, …), out of the way of the upstream's
/// paths; `/healthz` is the proxy's too. Every other path goes upstream.
pub const METRICS_PATH: &str = "/_idemkit/metrics";

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
    /// matched segment by segment against the request's path as sent.
    path: Option<matchit::Router<()>>,
    engine: Engine,
    key: KeySource,
}

impl Route {
    fn matches(&self, method: &Method, path: &str) -> bool {
        self.method == method && self.path.as_ref().is_none_or(|p| p.at(path).is_ok())
    }
}

/// The proxy's state.
struct Proxy {
    routes: Vec<Route>,
    store: Arc<dyn KeyStore>,
    client: Client<HttpConnector, Body>,
    upstream: String,
    account_header: HeaderName,
    secret: Vec<u8>,
    honours_keys: bool,
    timeout: Duration,
    max_request_body: usize,
}

/// Runs the proxy until interrupted.
pub fn run(args: ProxyArgs) -> anyhow::Result<ExitCode> {
    crate::install_crash_point();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(async move {
        crate::install_metrics()?;
        let listener = tokio::net::TcpListener::bind(args.listen)
            .await
            .with_context(|| format!("binding {}", args.listen))?;
        let app = router(args).await?;
        println!("idemkit proxy listening on http://{}", listener.local_addr()?);
        // Both directions stream (pass-through bodies arrive in chunks): no
        // Nagle delay on a chunk written while the previous one is unacknowledged.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app)
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The proxy's router: `GET /healthz` for the proxy itself, everything else to
/// the upstream.
pub async fn router(args: ProxyArgs) -> anyhow::Result<Router> {
    anyhow::ensure!(!args.scope_secret.is_empty(), "--scope-secret must not be empty");
    let upstream = args.upstream.trim_end_matches('/').to_owned();
    let parsed: Uri = upstream
        .parse()
        .with_context(|| format!("--upstream {upstream}"))?;
    anyhow::ensure!(
        parsed.scheme_str() == Some("http") && parsed.authority().is_some(),
        "--upstream must be an http://host:port URL"
    );
    let opened = idemkit::open_store(&args.database_url, &args.open_options())
        .await
        .with_context(|| format!("opening the key store {}", args.database_url))?;
    let store = opened.key_store();
    let routes = match &args.config {
        Some(path) => {
            let mut config = IdemkitConfig::from_toml(
                &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
            )?;
            if let Some(ms) = args.lease_ms {
                config = config.with_lease(Duration::from_millis(ms))?;
            }
            let mut routes = Vec::new();
            for r in config.routes.iter().filter(|r| r.retry_safe) {
                let method = Method::from_bytes(r.method.to_ascii_uppercase().as_bytes())
                    .with_context(|| format!("route method {}", r.method))?;
                // Safe methods (RFC 9110 §9.2.1) always pass through.
                if method.is_safe() {
                    tracing::warn!(
                        method = %method,
                        path = %r.path,
                        "proxy: a safe method is never keyed; this route passes through"
                    );
                    continue;
                }
                let mut template = matchit::Router::new();
                template
                    .insert(r.path.as_str(), ())
                    .with_context(|| format!("route path {}", r.path))?;
                let key = match &r.key_field {
                    Some(pointer) => KeySource::JsonField(pointer.clone()),
                    None => KeySource::Header(
                        HeaderName::from_bytes(r.key_header().as_bytes())
                            .with_context(|| format!("key header {}", r.key_header()))?,
                    ),
                };
                routes.push(Route {
                    method,
                    path: Some(template),
                    engine: Engine::lease(store.clone(), r.policy())?,
                    key,
                });
            }
            routes
        }
        None => {
            let mut policy = Policy::new();
            if let Some(ms) = args.lease_ms {
                policy = policy.with_lease(Duration::from_millis(ms));
            }
            let engine = Engine::lease(store.clone(), policy)?;
            [Method::POST, Method::PUT, Method::PATCH, Method::DELETE]
                .into_iter()
                .map(|method| Route {
                    method,
                    path: None,
                    engine: engine.clone(),
                    key: KeySource::Header(HeaderName::from_static(idemkit_tower::IDEMPOTENCY_KEY)),
                })
                .collect()
        }
    };
    let proxy = Proxy {
        routes,
        store,
        client: {
            // As on the listening side (see `run`).
            let mut connector = HttpConnector::new();
            connector.set_nodelay(true);
            // A connect that fails is "not sent" (the key is freed), but only
            // if it fails before the upstream timeout, which would make it
            // "maybe executed": an unreachable host that never resets would
            // park every request.
            connector.set_connect_timeout(Some(
                (Duration::from_millis(args.upstream_timeout_ms) / 2).min(Duration::from_secs(10)),
            ));
            Client::builder(TokioExecutor::new()).build(connector)
        },
        upstream,
        account_header: HeaderName::from_bytes(args.account_header.as_bytes())
            .with_context(|| format!("--account-header {}", args.account_header))?,
        secret: args.scope_secret.into_bytes(),
        honours_keys: args.upstream_honours_keys,
        timeout: Duration::from_millis(args.upstream_timeout_ms),
        max_request_body: args.max_request_body,
    };
    Ok(Router::new()
        .route("/healthz", get(healthz))
        .route(METRICS_PATH, get(idemkit_labels::service::metrics_endpoint))
        .fallback(handle)
        .with_state(Arc::new(proxy)))
}

async fn healthz() -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "application/json")], r#"{"status":"ok"}"#)
}

async fn handle(State(proxy): State<Arc<Proxy>>, req: Request) -> Response {
    let route = proxy
        .routes
        .iter()
        .position(|r| r.matches(req.method(), req.uri().path()));
    match route {
        Some(i) => proxy.keyed(i, req).await,
        None => match proxy.forward(req).await {
            Ok(res) => res,
            Err(e) => bad_gateway(&e),
        },
    }
}

/// Removes the hop-by-hop headers, and those the `Connection` header names.
fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(*name);
    }
}

impl Proxy {
    /// Sends `req` to the upstream, streaming both bodies.
    async fn forward(&self, req: Request) -> Result<Response, hyper_util::client::legacy::Error> {
        let (mut parts, body) = req.into_parts();
        let target = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("{}{target}", self.upstream)
            .parse()
            .expect("an http base URL and a request target make a URI");
        parts.version = http::Version::HTTP_11;
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(header::HOST);
        let res = self.client.request(Request::from_parts(parts, body)).await?;
        let (mut parts, body) = res.into_parts();
        strip_hop_by_hop(&mut parts.headers);
        Ok(Response::from_parts(parts, Body::new(body)))
    }

    /// The account of a credential: hex `HMAC-SHA256(secret, credential)`.
    fn account(&self, credential: &[u8]) -> Account {
        Account::new(hex::encode(hmac_sha256(&self.secret, credential)))
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
        idemkit_tower::metrics::request(outcome);
        res
    }

    async fn keyed_inner(self: &Arc<Self>, route: usize, req: Request) -> (&'static str, Response) {
        let route = &self.routes[route];
        let (parts, body) = req.into_parts();
        // Exactly one non-empty credential: an empty one would put every caller
        // that sends it in one scope, and of two, the upstream may authenticate
        // another than the one the scope is made of.
        let mut credentials = parts.headers.get_all(&self.account_header).iter();
        let credential = match (credentials.next(), credentials.next()) {
            (Some(v), None) if !v.as_bytes().trim_ascii().is_empty() => v,
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
        let account = self.account(credential.as_bytes());
        let header_key = match &route.key {
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
        let bytes = match idemkit_tower::read_body(body, self.max_request_body).await {
            Ok(bytes) => bytes,
            Err(refused) => return (outcome::REJECTED, refused.into_response()),
        };
        let key = match (header_key, &route.key) {
            (Some(Ok(k)), _) => k,
            (_, KeySource::JsonField(pointer)) => match key_from_json(&bytes, pointer) {
                Ok(k) => k,
                Err(p) => {
                    let counted = match p.code {
                        ErrorCode::KeyMissing => outcome::KEY_MISSING,
                        ErrorCode::KeyInvalid => outcome::KEY_INVALID,
                        _ => outcome::REJECTED,
                    };
                    return (counted, ProblemResponse::from(p).into_response());
                }
            },
            _ => unreachable!("header keys were checked above"),
        };
        let target = parts
            .uri
            .path_and_query()
            .map_or_else(|| parts.uri.path(), |p| p.as_str());
        let mut claim = route.engine.claim_request(Incoming {
            scope: Scope::new(account, key),
            method: parts.method.as_str(),
            target,
            headers: stored_request_headers(&parts.headers, STORED_REQUEST_HEADERS),
            body: &bytes,
            resume: None,
        });
        // The intent, written by the claim itself, before anything leaves the
        // proxy: what is forwarded is the request the claim stores, to the
        // upstream the proxy runs with.
        claim.recovery_point = Some(FORWARDED.to_owned());
        // The claim, the forward and the store go on even if the caller hangs
        // up: a claim cut off after its write committed would leave an intent
        // with no holder (its retry parked, though nothing was sent), and a
        // forward cut off would leave a stuck key instead of a replay.
        let (this, engine) = (self.clone(), route.engine.clone());
        let work = async move {
            let attempt = match engine.begin(claim).await {
                Ok(attempt) => attempt,
                Err(refused) => {
                    return (
                        refused.outcome,
                        refusal_response(refused.refusal, engine.policy()),
                    );
                }
            };
            this.execute(attempt, parts, bytes).await
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

/// HMAC-SHA256 (RFC 2104), with the `hmac` crate.
fn hmac_sha256(secret: &[u8], message: &[u8]) -> [u8; 32] {
    use hmac::{KeyInit, Mac};
    let mut mac = hmac::Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
    mac.update(message);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        assert_eq!(
            hex::encode(hmac_sha256(b"Jefe", b"what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
