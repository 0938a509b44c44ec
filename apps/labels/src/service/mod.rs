//! The shipping-label service: `POST /labels` creates a label and books it with a
//! courier; retries with the same `idempotencyKey` never create a second label or
//! shipment. Built on idemkit's lease mode with phases (the courier call cannot be
//! rolled back), and idemkit's client for the courier call.

mod keyed;
mod model;
mod openapi;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::StatusCode;
use http::request::Parts;
use idemkit::{OpenOptions, OpenedStore};
use idemkit_client::{ReqwestRetryError, RetryConfig, RetryMiddleware};
use idemkit_core::{Account, ErrorCode, IdempotencyKey, KeyError};
use idemkit_postgres::PgStore;
use idemkit_sqlite::SqliteStore;
use idemkit_tower::{
    AccountResolver, CallError, Downstream, IdempotencyContext, IdempotencyLayer, Outcome, PhaseError,
    Phases, ProblemResponse, bearer_token,
};

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

#[derive(Clone)]
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

/// How the courier call ended, when it did not produce a shipment.
#[derive(Debug)]
enum CourierFailure {
    /// The courier refused the label for good (bad address, …).
    Rejected(LabelError),
    /// The courier was unavailable through every retry the deadline allowed.
    Transient(String),
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Shipment {
    order_number: String,
    tracking_number: String,
    shipment: i64,
}

async fn book(
    app: &App<impl Send + Sync>,
    key: &str,
    label_id: &str,
    req: &CreateLabel,
) -> Result<Shipment, CallError<CourierFailure>> {
    let body = serde_json::json!({
        "reference": label_id, "courier": req.courier, "shipFrom": req.ship_from, "shipTo": req.ship_to, "parcel": req.parcel,
    });
    let sent = app
        .courier
        .post(format!("{}/shipments", app.courier_url))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string())
        .send()
        .await;
    match sent {
        Ok(res) if res.status().is_success() => res
            .json()
            .await
            .map_err(|e| CallError::Unknown(CourierFailure::Transient(format!("courier answer: {e}")))),
        Ok(res) if res.status().is_client_error() => {
            let status = res.status();
            let problem: serde_json::Value = res.json().await.unwrap_or_default();
            Err(CallError::NotExecuted(CourierFailure::Rejected(LabelError {
                code: problem["code"].as_str().unwrap_or("courier_rejected").to_owned(),
                message: format!(
                    "the courier rejected the label ({status}): {}; correct the request and send it with a new idempotency key",
                    problem["detail"].as_str().unwrap_or("no detail")
                ),
                retryable: false,
            })))
        }
        Ok(res) => Err(CallError::NotExecuted(CourierFailure::Transient(format!(
            "courier answered {}",
            res.status()
        )))),
        Err(reqwest_middleware::Error::Middleware(e)) => {
            let message = format!("courier unavailable: {e}");
            match e.downcast_ref::<ReqwestRetryError>().map(|r| r.outcome()) {
                // It answered (503 …): nothing was created.
                Some(idemkit_client::Outcome::Answered(_)) | Some(idemkit_client::Outcome::NotSent) => {
                    Err(CallError::NotExecuted(CourierFailure::Transient(message)))
                }
                _ => Err(CallError::Unknown(CourierFailure::Transient(message))),
            }
        }
        Err(e) => Err(CallError::Unknown(CourierFailure::Transient(format!(
            "courier unreachable: {e}"
        )))),
    }
}

fn label_response(status: StatusCode, label: &Label) -> Response {
    (status, axum::Json(label)).into_response()
}

fn failed(e: impl std::fmt::Display) -> Response {
    ProblemResponse::new(ErrorCode::Internal, format!("internal failure: {e}")).into_response()
}

/// The SQL both databases run (placeholders in order of first use, so SQLite's
/// `$n` names bind like PostgreSQL's positions).
mod sql {
    pub(super) const INSERT: &str = "INSERT INTO labels (id, account, courier, status, request, created_at) \
         VALUES ($1, $2, $3, 'pending', $4, $5)";
    pub(super) const CREATED: &str = "UPDATE labels SET status = 'created', courier_order = $1, courier_tracking = $2, \
         courier_shipment = $3, error = NULL WHERE id = $4";
    pub(super) const FAILED: &str = "UPDATE labels SET status = 'failed', error = $1 WHERE id = $2";
    /// With keys on Redis: the label row's id is derived from the request's
    /// downstream key, so a re-run of the phase (a takeover after a crash
    /// before its result was recorded) writes nothing.
    pub(super) const INSERT_KEYED: &str = "INSERT INTO labels (id, account, courier, status, request, created_at) \
         VALUES ($1, $2, $3, 'pending', $4, $5) ON CONFLICT (id) DO NOTHING";
    /// With keys on Redis the write is not fenced by a transaction: a stale
    /// holder may never turn a created label back into a failed one.
    pub(super) const FAILED_UNLESS_CREATED: &str =
        "UPDATE labels SET status = 'failed', error = $1 WHERE id = $2 AND status <> 'created'";
    pub(super) const SELECT: &str = "SELECT id, courier, status, courier_order, courier_tracking, error, courier_shipment \
         FROM labels WHERE account = $1 AND (id = $2 OR courier_tracking = $2)";
    pub(super) const TABLE_SQLITE: &str = "CREATE TABLE IF NOT EXISTS labels (id TEXT PRIMARY KEY, account TEXT NOT NULL, \
         courier TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, courier_order TEXT, courier_tracking TEXT, \
         courier_shipment INTEGER, error TEXT, created_at INTEGER NOT NULL)";
    pub(super) const TABLE_PG: &str = "CREATE TABLE IF NOT EXISTS labels (id TEXT PRIMARY KEY, account TEXT NOT NULL, \
         courier TEXT NOT NULL, status TEXT NOT NULL, request TEXT NOT NULL, courier_order TEXT, courier_tracking TEXT, \
         courier_shipment BIGINT, error TEXT, created_at BIGINT NOT NULL)";
}

type Row = (
    String,
    String,
    String,
    Option<String>,
    Option<String>,
    Option<String>,
    Option<i64>,
);

fn label_of(row: Row) -> (Label, Option<i64>) {
    let (id, courier, status, order, tracking, error, shipment) = row;
    let error = error.and_then(|e| serde_json::from_str(&e).ok());
    (
        Label {
            id,
            status,
            courier,
            courier_order_number: order,
            courier_tracking_number: tracking,
            error,
        },
        shipment,
    )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// The handlers, once per database type.
macro_rules! handlers {
    ($create:ident, $get:ident, $track:ident, $store:ty) => {
        async fn $create(
            State(app): State<App<$store>>,
            ctx: IdempotencyContext,
            body: bytes::Bytes,
        ) -> Result<Response, PhaseError<Response>> {
            // Validated before the key was looked up; parsing again cannot fail.
            let req = CreateLabel::parse(&body).map_err(|p| PhaseError::Work(p.into_response()))?;
            let account = ctx.scope.account.as_str().to_owned();
            let courier = serde_json::to_value(req.courier)
                .unwrap_or_default()
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let mut phases = Phases::begin(app.store.clone(), &ctx).await?;
            let label_id: String = phases
                .phase("label", async |tx| {
                    let id = format!("lbl_{}", uuid::Uuid::new_v4().simple());
                    sqlx::query(sql::INSERT)
                        .bind(&id)
                        .bind(&account)
                        .bind(&courier)
                        .bind(String::from_utf8_lossy(&body).into_owned())
                        .bind(now_ms())
                        .execute(&mut **tx)
                        .await
                        .map_err(failed)?;
                    Ok(id)
                })
                .await?;
            let booked = phases
                .external("courier", Downstream::HonoursKeys, async |key| {
                    book(&app, key.as_str(), &label_id, &req).await
                })
                .await;
            let mut label = Label {
                id: label_id.clone(),
                status: "created".into(),
                courier: courier.clone(),
                courier_order_number: None,
                courier_tracking_number: None,
                error: None,
            };
            match booked {
                Ok(s) => {
                    label.courier_order_number = Some(s.order_number.clone());
                    label.courier_tracking_number = Some(s.tracking_number.clone());
                    phases
                        .finish("created", async |tx| {
                            sqlx::query(sql::CREATED)
                                .bind(&s.order_number)
                                .bind(&s.tracking_number)
                                .bind(s.shipment)
                                .bind(&label_id)
                                .execute(&mut **tx)
                                .await
                                .map_err(failed)?;
                            Ok(label_response(StatusCode::CREATED, &label))
                        })
                        .await
                }
                Err(PhaseError::Call(CourierFailure::Rejected(error))) => {
                    // Permanent: stored and replayed; a corrected request needs a new key.
                    label.status = "failed".into();
                    label.error = Some(error);
                    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
                    phases
                        .finish("rejected", async |tx| {
                            sqlx::query(sql::FAILED)
                                .bind(&error_json)
                                .bind(&label_id)
                                .execute(&mut **tx)
                                .await
                                .map_err(failed)?;
                            Ok(label_response(StatusCode::BAD_GATEWAY, &label))
                        })
                        .await
                }
                Err(PhaseError::Call(CourierFailure::Transient(message))) => {
                    // Retryable: the label is stored failed and the lease ends at once;
                    // a retry re-attempts the courier with the same downstream key.
                    label.status = "failed".into();
                    label.error = Some(LabelError {
                        code: "courier_unavailable".into(),
                        message,
                        retryable: true,
                    });
                    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
                    let step = format!("courier-failed-{}", ctx.token.0);
                    phases
                        .phase(&step, async |tx| {
                            sqlx::query(sql::FAILED)
                                .bind(&error_json)
                                .bind(&label_id)
                                .execute(&mut **tx)
                                .await
                                .map_err(failed)
                                .map(|_| ())
                        })
                        .await?;
                    Ok((
                        Outcome::Retryable,
                        label_response(StatusCode::BAD_GATEWAY, &label),
                    )
                        .into_response())
                }
                Err(other) => Err(other.map_work(|e| failed(format!("{e:?}")))),
            }
        }

        async fn $get(State(app): State<App<$store>>, parts: Parts, Path(id): Path<String>) -> Response {
            let account = match app.tokens.resolve(&parts) {
                Ok(a) => a,
                Err(p) => return p.into_response(),
            };
            let row: Result<Option<Row>, _> = sqlx::query_as(sql::SELECT)
                .bind(account.as_str())
                .bind(&id)
                .fetch_optional(app.store.pool())
                .await;
            match row {
                Ok(Some(row)) if row.0 == id => label_response(StatusCode::OK, &label_of(row).0),
                Ok(_) => ProblemResponse::new(ErrorCode::NotFound, "no label with this id").into_response(),
                Err(e) => failed(e),
            }
        }

        async fn $track(State(app): State<App<$store>>, parts: Parts, Path(id): Path<String>) -> Response {
            let account = match app.tokens.resolve(&parts) {
                Ok(a) => a,
                Err(p) => return p.into_response(),
            };
            let row: Result<Option<Row>, _> = sqlx::query_as(sql::SELECT)
                .bind(account.as_str())
                .bind(&id)
                .fetch_optional(app.store.pool())
                .await;
            let (label, shipment) = match row {
                Ok(Some(row)) => label_of(row),
                Ok(None) => {
                    return ProblemResponse::new(
                        ErrorCode::NotFound,
                        "no label with this id or tracking number",
                    )
                    .into_response()
                }
                Err(e) => return failed(e),
            };
            let (Some(tracking), Some(n)) = (label.courier_tracking_number, shipment) else {
                return ProblemResponse::new(ErrorCode::NotFound, "this label has no shipment yet")
                    .into_response();
            };
            let events = app
                .http
                .get(format!("{}/shipments/{n}/events", app.courier_url))
                .send()
                .await;
            let events: Vec<TrackingEvent> = match events {
                Ok(res) if res.status().is_success() => match res.json::<serde_json::Value>().await {
                    Ok(v) => serde_json::from_value(v["events"].clone()).unwrap_or_default(),
                    Err(e) => return failed(e),
                },
                _ => {
                    return ProblemResponse::new(
                        ErrorCode::StoreUnavailable,
                        "the courier's tracking is unavailable; retry",
                    )
                    .into_response()
                }
            };
            (
                StatusCode::OK,
                axum::Json(Tracking {
                    tracking_number: tracking,
                    events,
                }),
            )
                .into_response()
        }
    };
}

handlers!(create_sqlite, get_sqlite, track_sqlite, SqliteStore);
handlers!(create_pg, get_pg, track_pg, PgStore);

/// `POST /labels` with the keys in a store that is not the labels rows'
/// database (Redis): the same steps and answers as the transactional handler,
/// with each SQL write committed on its own, keyed by the step's downstream key
/// (or guarded by the row's status), before its result is recorded with the
/// fenced `KeyStore::advance`; the layer stores the response (see
/// `docs/redis.md`).
macro_rules! keyed_handler {
    ($create:ident, $store:ty) => {
        async fn $create(
            State(app): State<App<$store>>,
            ctx: IdempotencyContext,
            body: bytes::Bytes,
        ) -> Result<Response, PhaseError<Response>> {
            let req = CreateLabel::parse(&body).map_err(|p| PhaseError::Work(p.into_response()))?;
            let account = ctx.scope.account.as_str().to_owned();
            let courier = serde_json::to_value(req.courier)
                .unwrap_or_default()
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let pool = app.store.pool();
            let mut phases = keyed::KeyedPhases::begin(app.keys.clone(), &ctx).await?;
            let label_id: String = phases
                .phase("label", async |key| {
                    let id = format!("lbl_{}", key.as_str());
                    sqlx::query(sql::INSERT_KEYED)
                        .bind(&id)
                        .bind(&account)
                        .bind(&courier)
                        .bind(String::from_utf8_lossy(&body).into_owned())
                        .bind(now_ms())
                        .execute(pool)
                        .await
                        .map_err(failed)?;
                    Ok(id)
                })
                .await?;
            let booked = phases
                .external("courier", async |key| {
                    book(&app, key.as_str(), &label_id, &req).await
                })
                .await;
            let mut label = Label {
                id: label_id.clone(),
                status: "created".into(),
                courier: courier.clone(),
                courier_order_number: None,
                courier_tracking_number: None,
                error: None,
            };
            match booked {
                Ok(s) => {
                    // The same values on every attempt (the courier replays the
                    // shipment for the same key): idempotent as it stands.
                    label.courier_order_number = Some(s.order_number.clone());
                    label.courier_tracking_number = Some(s.tracking_number.clone());
                    sqlx::query(sql::CREATED)
                        .bind(&s.order_number)
                        .bind(&s.tracking_number)
                        .bind(s.shipment)
                        .bind(&label_id)
                        .execute(pool)
                        .await
                        .map_err(|e| PhaseError::Work(failed(e)))?;
                    fail::fail_point!("labels::after_finish_write");
                    Ok(label_response(StatusCode::CREATED, &label))
                }
                Err(PhaseError::Call(CourierFailure::Rejected(error))) => {
                    label.status = "failed".into();
                    label.error = Some(error);
                    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
                    sqlx::query(sql::FAILED_UNLESS_CREATED)
                        .bind(&error_json)
                        .bind(&label_id)
                        .execute(pool)
                        .await
                        .map_err(|e| PhaseError::Work(failed(e)))?;
                    Ok(label_response(StatusCode::BAD_GATEWAY, &label))
                }
                Err(PhaseError::Call(CourierFailure::Transient(message))) => {
                    label.status = "failed".into();
                    label.error = Some(LabelError {
                        code: "courier_unavailable".into(),
                        message,
                        retryable: true,
                    });
                    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
                    sqlx::query(sql::FAILED_UNLESS_CREATED)
                        .bind(&error_json)
                        .bind(&label_id)
                        .execute(pool)
                        .await
                        .map_err(|e| PhaseError::Work(failed(e)))?;
                    // Fenced: a stale attempt learns here that it lost the key.
                    phases
                        .mark::<Response>(&format!("courier-failed-{}", ctx.token.0))
                        .await?;
                    Ok((
                        Outcome::Retryable,
                        label_response(StatusCode::BAD_GATEWAY, &label),
                    )
                        .into_response())
                }
                Err(other) => Err(other.map_work(|e| failed(format!("{e:?}")))),
            }
        }
    };
}

keyed_handler!(create_keyed_sqlite, SqliteStore);
keyed_handler!(create_keyed_pg, PgStore);

fn idempotency(
    store: Arc<impl idemkit_core::KeyStore>,
    tokens: Tokens,
    config: &idemkit_tower::config::IdemkitConfig,
) -> anyhow::Result<IdempotencyLayer> {
    let route = config
        .route("POST", "/labels")
        .context("the configuration has no `POST /labels` route")?;
    Ok(route
        .configure(IdempotencyLayer::builder(store))?
        .resolver(tokens)
        .validate_body(|_, body| validate_create(body))
        .max_request_body(64 * 1024)
        .build()?)
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

/// `GET /metrics`: the Prometheus text exposition.
async fn metrics_endpoint() -> Response {
    let handle = PROMETHEUS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    match handle {
        Some(handle) => (
            [(
                http::header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            handle.render(),
        )
            .into_response(),
        None => ProblemResponse::new(ErrorCode::NotFound, "metrics are not enabled in this process")
            .into_response(),
    }
}

/// The running service's parts, for the binary and tests.
pub struct Service {
    /// The HTTP routes.
    pub router: Router,
    /// The key store, for the completer and the reaper.
    pub keys: Arc<dyn idemkit_core::KeyStore>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").finish_non_exhaustive()
    }
}

/// Opens the database, creates the tables and builds the routes.
pub async fn build(config: LabelsConfig) -> anyhow::Result<Service> {
    let tokens = Tokens(Arc::new(config.tokens.clone()));
    let idem = config.idempotency.clone().with_lease(config.lease)?;
    let contract = crate::docs::render(&idem, &RetryConfig::new(), crate::docs::Format::Html);
    let openapi_doc = openapi_json(&idem);
    let policy_doc = idem.policy_document();
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
        .route(
            "/docs/idempotency.json",
            get(|| async move { axum::Json(policy_doc) }),
        )
        .route("/metrics", get(metrics_endpoint))
        .route(
            "/docs/idempotency",
            get(move || async move { axum::response::Html(contract) }),
        )
        .fallback(idemkit_tower::not_found)
        .method_not_allowed_fallback(idemkit_tower::method_not_allowed);
    // The same routes over either store; only the handler instances differ.
    macro_rules! mount {
        ($store:expr, $keys:expr, $table:expr, $create:ident, $get:ident, $track:ident) => {{
            let store = $store;
            let keys = $keys;
            sqlx::query($table).execute(store.pool()).await?;
            let layer = idempotency(keys.clone(), tokens.clone(), &idem)?;
            let keys: Arc<dyn idemkit_core::KeyStore> = keys;
            let app = App {
                store: store.clone(),
                keys: keys.clone(),
                tokens,
                courier_url: config.courier_url,
                courier,
                http,
            };
            let router = Router::new()
                .route("/labels", post($create).layer(layer))
                .route("/labels/{id}", get($get))
                .route("/tracking/{id}", get($track))
                .with_state(app)
                .merge(common);
            Ok(Service { router, keys })
        }};
    }
    let schema = config
        .pg_schema
        .clone()
        .or_else(|| std::env::var("IDEMKIT_PG_SCHEMA").ok())
        .unwrap_or_else(|| DEFAULT_PG_SCHEMA.into());
    let rows = idemkit::open_store(&config.database, &OpenOptions::new().with_pg_schema(schema)).await?;
    let keys = match config.keys.as_deref().filter(|k| !k.is_empty()) {
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
                OpenedStore::Redis(keys) => Some(keys),
                other => anyhow::bail!("{url} opened {}, not Redis", other.kind()),
            }
        }
        Some(_) => anyhow::bail!(
            "a separate key store must be Redis (redis://… or redis+cluster://…); with a SQL key \
             store the keys live with the labels rows: leave the key store URL out"
        ),
    };
    match (rows, keys) {
        (OpenedStore::Postgres(store), None) => {
            mount!(store.clone(), store, sql::TABLE_PG, create_pg, get_pg, track_pg)
        }
        (OpenedStore::Sqlite(store), None) => {
            mount!(
                store.clone(),
                store,
                sql::TABLE_SQLITE,
                create_sqlite,
                get_sqlite,
                track_sqlite
            )
        }
        (OpenedStore::Postgres(store), Some(keys)) => {
            mount!(store, keys, sql::TABLE_PG, create_keyed_pg, get_pg, track_pg)
        }
        (OpenedStore::Sqlite(store), Some(keys)) => {
            mount!(
                store,
                keys,
                sql::TABLE_SQLITE,
                create_keyed_sqlite,
                get_sqlite,
                track_sqlite
            )
        }
        (other, _) => anyhow::bail!(
            "the labels service keeps its labels rows in SQLite or PostgreSQL; {} is not one \
             (to keep the keys in Redis, pass the Redis URL as the key store and a SQL database for the rows)",
            other.kind()
        ),
    }
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
