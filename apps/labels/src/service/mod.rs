//! The shipping-label service: `POST /labels` creates a label and books it with a
//! courier; retries with the same `idempotencyKey` never create a second label or
//! shipment. Built on idemkit's lease mode with phases (the courier call cannot be
//! rolled back), and idemkit's client for the courier call.

mod create;
mod db;
mod grpc;
mod keyed;
mod model;
mod openapi;
mod read;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::request::Parts;
use idemkit::{OpenOptions, OpenedStore};
use idemkit_client::{RetryConfig, RetryMiddleware};
use idemkit_core::{Account, ErrorCode, IdempotencyKey, KeyError};
use idemkit_tower::{AccountResolver, IdempotencyLayer, ProblemResponse, bearer_token};

pub use grpc::LABELS_DOMAIN;
pub use model::{Address, CourierName, CreateLabel, Label, LabelError, Parcel, Tracking, TrackingEvent};
pub use openapi::{openapi, openapi_json};

/// The public demo tokens: what `idemkit serve --demo-tokens` and `idemkit demo`
/// accept. Never accepted unless asked for.
pub const DEMO_TOKENS: &[(&str, &str)] = &[("demo-token-acme", "acme"), ("demo-token-globex", "globex")];

/// How the service runs.
#[derive(Debug, Clone)]
pub struct LabelsConfig {
    /// `postgres://…`, `sqlite://…` or a SQLite file path: the labels rows, and
    /// the key store unless [`LabelsConfig::keys`] names another.
    pub database: String,
    /// `redis://…` or `redis+cluster://…` (a `?prefix=` parameter namespaces the
    /// keys): the key store in Redis while the labels rows stay in `database`.
    /// `None`: the keys live in `database`, in each phase's own transaction.
    /// See `docs/redis.md` (*The labels service with keys on Redis*).
    pub keys: Option<String>,
    /// The courier's base URL.
    pub courier_url: String,
    /// Lease length of a label request.
    pub lease: Duration,
    /// Bearer token → account.
    pub tokens: HashMap<String, String>,
    /// The overall deadline of the courier call, retries included.
    pub courier_deadline: Duration,
    /// The idempotency policy (see `idemkit.toml`); its lease is replaced by
    /// `lease` so the published contract describes what runs.
    pub idempotency: idemkit_tower::config::IdemkitConfig,
    /// On PostgreSQL, the schema of the key store and the labels table; `None`:
    /// `IDEMKIT_PG_SCHEMA`, else [`DEFAULT_PG_SCHEMA`].
    pub pg_schema: Option<String>,
}

/// The service's PostgreSQL schema unless `IDEMKIT_PG_SCHEMA` or
/// [`LabelsConfig::pg_schema`] names another.
pub const DEFAULT_PG_SCHEMA: &str = "labels";

impl LabelsConfig {
    /// Parses a token list: entries `token=account`, separated by commas or
    /// newlines; blank entries and lines starting with `#` are skipped, and
    /// whitespace around a token or an account is trimmed.
    ///
    /// An entry splits at its **last** `=`: a token may contain `=` (base64
    /// padding such as `dG9rZW4=`), an account may not. Neither may contain a
    /// comma. An empty token or account, or a token listed twice, is an error;
    /// so is a list with no entries at all.
    pub fn parse_tokens(spec: &str) -> anyhow::Result<HashMap<String, String>> {
        let mut tokens = HashMap::new();
        for entry in spec
            .split([',', '\n'])
            .map(str::trim)
            .filter(|s| !s.is_empty() && !s.starts_with('#'))
        {
            let (tok, acct) = entry
                .rsplit_once('=')
                .map(|(t, a)| (t.trim(), a.trim()))
                .filter(|(t, a)| !t.is_empty() && !a.is_empty())
                .with_context(|| format!("`{}` is not token=account", redact(entry)))?;
            if tokens.insert(tok.to_owned(), acct.to_owned()).is_some() {
                anyhow::bail!("token `{}` is listed twice", redact(tok));
            }
        }
        anyhow::ensure!(
            !tokens.is_empty(),
            "the token list has no `token=account` entries"
        );
        Ok(tokens)
    }

    /// The demo tokens.
    pub fn demo_tokens() -> HashMap<String, String> {
        DEMO_TOKENS
            .iter()
            .map(|(t, a)| ((*t).to_owned(), (*a).to_owned()))
            .collect()
    }
}

/// A token as error messages show it: its first four characters only.
fn redact(token: &str) -> String {
    let shown: String = token.chars().take(4).collect();
    if shown.len() < token.len() {
        format!("{shown}…")
    } else {
        shown
    }
}

/// Bearer token → account; anything else is `401`.
#[derive(Debug, Clone)]
struct Tokens(Arc<HashMap<String, String>>);

impl AccountResolver for Tokens {
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
        bearer_token(parts)
            .and_then(|t| self.0.get(t))
            .map(Account::new)
            .ok_or_else(|| {
                ProblemResponse::new(
                    ErrorCode::Unauthorized,
                    "send `Authorization: Bearer <token>` with a valid token",
                )
            })
    }
}

struct App<S> {
    /// The labels rows' database (and, without a separate key store, the keys).
    store: Arc<S>,
    /// The key store: `store` itself, or Redis.
    keys: Arc<dyn idemkit_core::KeyStore>,
    tokens: Tokens,
    courier_url: String,
    courier: reqwest_middleware::ClientWithMiddleware,
    http: reqwest::Client,
}

impl<S> Clone for App<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            keys: self.keys.clone(),
            tokens: self.tokens.clone(),
            courier_url: self.courier_url.clone(),
            courier: self.courier.clone(),
            http: self.http.clone(),
        }
    }
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shipment {
    order_number: String,
    tracking_number: String,
    shipment: i64,
}

fn idempotency(
    store: Arc<dyn idemkit_core::KeyStore>,
    tokens: Tokens,
    config: &idemkit_tower::config::IdemkitConfig,
) -> anyhow::Result<IdempotencyLayer> {
    let route = config
        .route("POST", "/labels")
        .context("the configuration has no `POST /labels` route")?;
    Ok(route
        .configure(IdempotencyLayer::lease(store, tokens))?
        .validate_body(|_, body| validate_create(body))
        .max_request_body(64 * 1024)
        .build()?)
}

/// The layer of `POST /repeatable/labels`: the same store, resolver and limits
/// as `POST /labels`, speaking OASIS Repeatable Requests (`key =
/// "repeatability"` in `idemkit.toml`).
fn repeatable_idempotency(
    store: Arc<dyn idemkit_core::KeyStore>,
    tokens: Tokens,
    config: &idemkit_tower::config::IdemkitConfig,
) -> anyhow::Result<Option<IdempotencyLayer>> {
    let Some(route) = config.route("POST", REPEATABLE_PATH) else {
        return Ok(None);
    };
    Ok(Some(
        route
            .configure(IdempotencyLayer::lease(store, tokens))?
            .validate_body(|_, body| validate_repeatable(body))
            .max_request_body(64 * 1024)
            .build()?,
    ))
}

/// The path of the OASIS Repeatable Requests form of label creation.
pub const REPEATABLE_PATH: &str = "/repeatable/labels";

/// `POST /repeatable/labels` bodies are labels without `idempotencyKey` (the key
/// travels in `Repeatability-Request-ID`); one that carries it is refused, so
/// no request is ever read with two keys.
fn validate_repeatable(body: &[u8]) -> Result<(), ProblemResponse> {
    let Ok(serde_json::Value::Object(mut fields)) = serde_json::from_slice::<serde_json::Value>(body) else {
        return CreateLabel::parse(body).map(|_| ());
    };
    if fields.contains_key(KEY_FIELD) {
        return Err(ProblemResponse::new(
            ErrorCode::ValidationFailed,
            format!(
                "this route reads its key from `Repeatability-Request-ID`; remove `{KEY_FIELD}` from the body"
            ),
        ));
    }
    fields.insert(KEY_FIELD.into(), "validation".into());
    CreateLabel::parse(&serde_json::to_vec(&fields).unwrap_or_default()).map(|_| ())
}

/// Between the repeatability layer and the create handler: the label body gets
/// its key from the claim (`Repeatability-Request-ID`), so the handler is the
/// one `POST /labels` runs. The fingerprint was taken from the body as sent.
async fn key_from_claim(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let (parts, body) = req.into_parts();
    let key = parts
        .extensions
        .get::<idemkit_tower::IdempotencyContext>()
        .map(|ctx| ctx.scope.key.as_str().to_owned());
    let bytes = match axum::body::to_bytes(body, 64 * 1024).await {
        Ok(b) => b,
        Err(_) => {
            return ProblemResponse::new(ErrorCode::PayloadTooLarge, "the request body is too large")
                .into_response();
        }
    };
    let bytes = match (key, serde_json::from_slice::<serde_json::Value>(&bytes)) {
        (Some(key), Ok(serde_json::Value::Object(fields))) => {
            let mut with_key = serde_json::Map::new();
            with_key.insert(KEY_FIELD.into(), key.into());
            with_key.extend(fields);
            serde_json::to_vec(&with_key).map_or(bytes, bytes::Bytes::from)
        }
        _ => bytes,
    };
    next.run(axum::extract::Request::from_parts(
        parts,
        axum::body::Body::from(bytes),
    ))
    .await
}

/// The route's validation, run by the layer before it looks the key up: the key
/// field first (missing or `null` is `idempotency_key_missing`, anything but a
/// valid key string `idempotency_key_invalid`), then the rest of the label. A body
/// that is not a JSON object is `validation_failed`. Nothing is claimed or
/// written for any of these.
fn validate_create(body: &[u8]) -> Result<(), ProblemResponse> {
    if let Ok(serde_json::Value::Object(fields)) = serde_json::from_slice::<serde_json::Value>(body) {
        match fields.get(KEY_FIELD) {
            None | Some(serde_json::Value::Null) => {
                let e = KeyError::Missing;
                return Err(ProblemResponse::new(
                    e.code(),
                    format!("{e}: send it in the `{KEY_FIELD}` field"),
                ));
            }
            Some(serde_json::Value::String(key)) => {
                if let Err(e) = IdempotencyKey::parse(key) {
                    return Err(ProblemResponse::new(e.code(), e.to_string()));
                }
            }
            Some(_) => {
                return Err(ProblemResponse::new(
                    ErrorCode::KeyInvalid,
                    format!("`{KEY_FIELD}` must be a string"),
                ));
            }
        }
    }
    CreateLabel::parse(body).map(|_| ())
}

/// The body field that carries the idempotency key (`key_field` in `idemkit.toml`).
const KEY_FIELD: &str = "idempotencyKey";

/// The process's Prometheus recorder, once [`install_metrics`] has run.
static PROMETHEUS: std::sync::Mutex<Option<metrics_exporter_prometheus::PrometheusHandle>> =
    std::sync::Mutex::new(None);

/// Bucket bounds of `idemkit_store_seconds`, 0.5 ms to 5 s.
const STORE_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Installs the process-wide Prometheus recorder that `GET /metrics` renders
/// (idemkit's server metrics, see `docs/metrics.md`, and the courier client's).
/// Once per process: later calls return the same handle. The caller runs
/// [`PrometheusHandle::run_upkeep`](metrics_exporter_prometheus::PrometheusHandle::run_upkeep)
/// every few seconds. Without it, `GET /metrics` answers 404.
pub fn install_metrics() -> anyhow::Result<metrics_exporter_prometheus::PrometheusHandle> {
    let mut slot = PROMETHEUS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(handle) = &*slot {
        return Ok(handle.clone());
    }
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(idemkit_tower::metrics::STORE_SECONDS.into()),
            STORE_BUCKETS,
        )?
        .install_recorder()
        .context("installing the Prometheus recorder")?;
    idemkit_tower::metrics::describe();
    start_at_zero();
    *slot = Some(handle.clone());
    Ok(handle)
}

/// Every `reason` of the courier client's `idemkit_client_gave_up_total`.
const CLIENT_GAVE_UP_REASONS: &[&str] = &[
    "attempts_exhausted",
    "budget_exhausted",
    "deadline_exceeded",
    "retry_after_past_deadline",
    "retry_after_above_cap",
    "not_replayable",
    "not_retryable",
];

/// Registers every counter and gauge the alert rules
/// (`docs/alerts/idemkit-rules.yml`) read at zero: idemkit's server series
/// through [`idemkit_tower::metrics::start_at_zero`] (every request outcome,
/// fenced write, completer result, the reaper counters and the gauges), and the
/// courier client's `idemkit_client_gave_up_total` for every reason. A series
/// that first appears at 1 shows no `increase()`, so without this the first
/// park, the first store outage or the first exhausted budget would never fire
/// an alert.
fn start_at_zero() {
    idemkit_tower::metrics::start_at_zero();
    for reason in CLIENT_GAVE_UP_REASONS {
        metrics::counter!("idemkit_client_gave_up_total", "reason" => *reason).increment(0);
    }
}

/// The Prometheus text exposition of the process's recorder, once
/// [`install_metrics`] has run (`None` before).
pub fn render_metrics() -> Option<String> {
    PROMETHEUS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .as_ref()
        .map(metrics_exporter_prometheus::PrometheusHandle::render)
}

/// `GET /metrics` (and the proxy's `GET /_idemkit/metrics`): the Prometheus
/// text exposition; `404` when metrics are not enabled in this process.
pub async fn metrics_endpoint() -> Response {
    match render_metrics() {
        Some(text) => (
            [(
                http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            text,
        )
            .into_response(),
        None => ProblemResponse::new(ErrorCode::NotFound, "metrics are not enabled in this process")
            .into_response(),
    }
}

/// The running service's parts, for the binary and tests.
pub struct Service {
    /// Every route: REST, and the gRPC service and reflection (multiplexed on
    /// the same listener by path; gRPC needs HTTP/2, which `axum::serve`
    /// speaks without TLS, as gRPC clients' `h2c`).
    pub router: Router,
    /// The gRPC routes alone (`labels.v1.Labels`, reflection v1 and v1alpha),
    /// for a listener of their own (`idemkit serve --grpc-listen`); `None`
    /// with keys in Redis, where only REST is served.
    pub grpc: Option<Router>,
    /// The key store, for the completer and the reaper.
    pub keys: Arc<dyn idemkit_core::KeyStore>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

/// The gRPC routes over `app`: `labels.v1.Labels` behind `idemkit-tonic`'s
/// layer (the same key store and route policy as `POST /labels`; the key in
/// `CreateLabelRequest.idempotency_key`, or `idempotency-key` metadata), and
/// server reflection (v1 and v1alpha).
fn grpc_routes<S: db::LabelsDb>(
    app: App<S>,
    config: &idemkit_tower::config::IdemkitConfig,
) -> anyhow::Result<Router> {
    use tower::{Layer, ServiceExt};
    let route = config
        .route("POST", "/labels")
        .context("the configuration has no `POST /labels` route")?;
    let layer = idemkit_tonic::IdempotencyLayer::lease(app.keys.clone(), app.tokens.clone())
        .policy(route.policy())
        .file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .unary_with_key_field(crate::proto::CREATE_LABEL, crate::proto::KEY_FIELD_NUMBER)
        .unary_with_request_id(
            crate::proto::CREATE_LABEL_WITH_REQUEST_ID,
            crate::proto::REQUEST_ID_FIELD,
        )
        .max_request_message(64 * 1024)
        .build()?;
    let labels = layer
        .layer(crate::proto::labels_server::LabelsServer::new(grpc::LabelsGrpc {
            app,
        }))
        .map_request(|r: http::Request<axum::body::Body>| r.map(tonic::body::Body::new));
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
    };
    Ok(Router::new()
        .route_service(&format!("/{}/{{*method}}", crate::proto::SERVICE), labels)
        .route_service(
            "/grpc.reflection.v1.ServerReflection/{*method}",
            reflection().build_v1()?,
        )
        .route_service(
            "/grpc.reflection.v1alpha.ServerReflection/{*method}",
            reflection().build_v1alpha()?,
        ))
}

/// Opens the database, creates the tables and builds the routes.
pub async fn build(config: LabelsConfig) -> anyhow::Result<Service> {
    let tokens = Tokens(Arc::new(config.tokens.clone()));
    let idem = config.idempotency.clone().with_lease(config.lease)?;
    let contract = crate::contract::contract(&idem);
    let openapi_doc = openapi_json(&idem);
    let courier = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(
            RetryConfig::new().with_deadline(config.courier_deadline),
        ))
        .build();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let common = Router::new()
        .route("/openapi.json", get(|| async move { axum::Json(openapi_doc) }))
        .merge(idemkit_contract::router(&contract))
        .route("/metrics", get(metrics_endpoint))
        .fallback(idemkit_tower::not_found)
        .method_not_allowed_fallback(idemkit_tower::method_not_allowed);
    let schema = config
        .pg_schema
        .clone()
        .or_else(|| std::env::var("IDEMKIT_PG_SCHEMA").ok())
        .unwrap_or_else(|| DEFAULT_PG_SCHEMA.into());
    let rows = idemkit::open_store(&config.database, &OpenOptions::new().with_pg_schema(schema)).await?;
    let separate_keys = match config.keys.as_deref().filter(|k| !k.is_empty()) {
        None => None,
        Some(url) if idemkit::StoreKind::of(url) == idemkit::StoreKind::Redis => {
            let (base, prefix) = redis_prefix(url)?;
            let mut options = OpenOptions::new();
            if let Some(prefix) = prefix {
                options = options.with_redis_prefix(prefix);
            }
            match idemkit::open_store(&base, &options)
                .await
                .context("connecting to the Redis key store")?
            {
                OpenedStore::Redis(keys) => Some(keys as Arc<dyn idemkit_core::KeyStore>),
                other => anyhow::bail!("{url} opened {}, not Redis", other.kind()),
            }
        }
        Some(_) => anyhow::bail!(
            "a separate key store must be Redis (redis://… or redis+cluster://…); with a SQL key \
             store the keys live with the labels rows: leave the key store URL out"
        ),
    };
    let parts = Prepared {
        tokens,
        courier_url: config.courier_url,
        courier,
        http,
        idem,
        common,
    };
    match rows {
        OpenedStore::Postgres(store) => mount(store, separate_keys, parts).await,
        OpenedStore::Sqlite(store) => mount(store, separate_keys, parts).await,
        other => anyhow::bail!(
            "the labels service keeps its labels rows in SQLite or PostgreSQL; {} is not one \
             (to keep the keys in Redis, pass the Redis URL as the key store and a SQL database for the rows)",
            other.kind()
        ),
    }
}

/// What [`build`] prepared for [`mount`].
struct Prepared {
    tokens: Tokens,
    courier_url: String,
    courier: reqwest_middleware::ClientWithMiddleware,
    http: reqwest::Client,
    idem: idemkit_tower::config::IdemkitConfig,
    common: Router,
}

/// The routes over one labels database, with the keys in it (REST and gRPC)
/// or in `separate_keys` (REST only).
async fn mount<S: db::LabelsDb>(
    store: Arc<S>,
    separate_keys: Option<Arc<dyn idemkit_core::KeyStore>>,
    parts: Prepared,
) -> anyhow::Result<Service> {
    store.create_table().await?;
    let in_rows = separate_keys.is_none();
    let keys = separate_keys.unwrap_or_else(|| store.clone() as Arc<dyn idemkit_core::KeyStore>);
    let layer = idempotency(keys.clone(), parts.tokens.clone(), &parts.idem)?;
    let repeatable = repeatable_idempotency(keys.clone(), parts.tokens.clone(), &parts.idem)?;
    let app = App {
        store,
        keys: keys.clone(),
        tokens: parts.tokens,
        courier_url: parts.courier_url,
        courier: parts.courier,
        http: parts.http,
    };
    let create = if in_rows {
        post(create::create::<S>)
    } else {
        post(create::create_keyed::<S>)
    };
    let grpc = if in_rows {
        Some(grpc_routes(app.clone(), &parts.idem)?)
    } else {
        None
    };
    let mut router = Router::new();
    if let Some(repeatable) = repeatable {
        router = router.route(
            REPEATABLE_PATH,
            create
                .clone()
                .layer(axum::middleware::from_fn(key_from_claim))
                .route_layer(repeatable),
        );
    }
    let mut router = router
        // `route_layer`: only POST runs under the layer; other methods get
        // their 405 without it (no key, deadline or account checks first).
        .route("/labels", create.route_layer(layer))
        .route("/labels/{id}", get(read::get::<S>))
        .route("/tracking/{id}", get(read::track::<S>))
        .with_state(app)
        .merge(parts.common);
    if let Some(grpc) = &grpc {
        router = router.merge(grpc.clone());
    }
    Ok(Service { router, grpc, keys })
}

/// A Redis key store URL without its `prefix` query parameter, and the key
/// prefix: that parameter (percent-decoded), else `IDEMKIT_REDIS_PREFIX`, else
/// none (the library's default) — as `idemkit keys` reads them.
fn redis_prefix(url: &str) -> anyhow::Result<(String, Option<String>)> {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut prefix = std::env::var("IDEMKIT_REDIS_PREFIX")
        .ok()
        .filter(|p| !p.is_empty());
    let mut rest = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        match pair.strip_prefix("prefix=") {
            Some(p) => prefix = Some(percent_decode(p).context("the `prefix` of the Redis URL")?),
            None => rest.push(pair),
        }
    }
    let base = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", rest.join("&"))
    };
    Ok((base, prefix))
}

/// `%XX` escapes decoded; the result must be UTF-8.
fn percent_decode(s: &str) -> anyhow::Result<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3).context("a `%` without two hex digits")?;
            out.push(u8::from_str_radix(hex, 16).context("a `%` without two hex digits")?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).context("not UTF-8")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_redis_prefix_comes_from_the_url() {
        let (base, prefix) = super::redis_prefix("redis://127.0.0.1:6379?prefix=t%2D1&db=0").unwrap();
        assert_eq!(base, "redis://127.0.0.1:6379?db=0");
        assert_eq!(prefix.as_deref(), Some("t-1"));
        let (base, _) = super::redis_prefix("redis://h:1").unwrap();
        assert_eq!(base, "redis://h:1");
        assert!(super::redis_prefix("redis://h:1?prefix=%zz").is_err());
    }

    use super::*;

    #[test]
    fn tokens_split_at_the_last_equals_sign() {
        let tokens =
            LabelsConfig::parse_tokens("dG9rZW4==acme, YWJjZA===globex\n# a comment\nplain=initech\n")
                .unwrap();
        assert_eq!(tokens.len(), 3, "{tokens:?}");
        assert_eq!(tokens["dG9rZW4="], "acme", "{tokens:?}");
        assert_eq!(tokens["YWJjZA=="], "globex", "base64 padding stays in the token");
        assert_eq!(tokens["plain"], "initech");
    }

    #[test]
    fn bad_token_lists_are_refused() {
        for bad in [
            "no-equals-sign",
            "=acme",
            "tok=",
            "tok=a,tok=b",
            "",
            " # only a comment\n",
            "t=a,,u",
        ] {
            let parsed = LabelsConfig::parse_tokens(bad);
            assert!(parsed.is_err(), "{bad:?} → {parsed:?}");
        }
    }

    #[test]
    fn errors_do_not_print_whole_tokens() {
        let e = LabelsConfig::parse_tokens("s3cr3t-t0ken")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cr3t-t0ken"), "{e}");
        let e = LabelsConfig::parse_tokens("s3cr3t-t0ken=a,s3cr3t-t0ken=b")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("s3cr3t-t0ken"), "{e}");
    }
}
