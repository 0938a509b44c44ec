//! The courier's routes, the fault gate in front of `POST /shipments`, and its
//! problem documents.

use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, StatusCode, header};
use idemkit_core::wire::IDEMPOTENT_REPLAYED;
use idemkit_core::{Account, ErrorCode, InFlightBehavior, PROBLEM_CONTENT_TYPE, Policy};
use idemkit_postgres::PgTx;
use idemkit_sqlite::SqliteTx;
use idemkit_tower::{
    IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, ProblemResponse, Tx, method_not_allowed,
    not_found,
};
use serde::Serialize;
use serde_json::Value;

use super::conn::KillSwitch;
use super::db::{self, Db, NewShipment};
use super::faults::{FaultUpdate, Gate};
use super::{COURIER_ACCOUNT, Courier, ShipmentCreated, TrackingEvent, TrackingEvents, clock};

/// Builds the router: `POST /shipments` under the idempotency layer (single-step,
/// one fixed account), wrapped by the fault gate; the rest plain.
pub(crate) fn router(courier: &Courier, wait: Duration) -> anyhow::Result<Router> {
    let configure = |builder: IdempotencyLayerBuilder| {
        builder
            .policy(Policy::new().with_in_flight(InFlightBehavior::Wait(wait)))
            .build()
    };
    let create = match &courier.inner.db {
        Db::Sqlite(store) => post(create_sqlite).layer(configure(IdempotencyLayer::single_step(
            store.clone(),
            courier_account,
        ))?),
        Db::Postgres(store) => post(create_pg).layer(configure(IdempotencyLayer::single_step(
            store.clone(),
            courier_account,
        ))?),
    }
    .layer(middleware::from_fn_with_state(courier.clone(), gate));
    Ok(Router::new()
        .route("/shipments", create)
        .route("/shipments/{n}/events", get(events))
        .route("/_faults", get(faults).post(set_faults))
        .route("/_stats", get(stats))
        .route("/_deadline", get(deadline))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(courier.clone()))
}

/// The courier has no accounts: every caller shares one key space, on purpose
/// (single-tenant). A fixed account rather than `.unscoped()`: the unscoped
/// account's identifier starts with a NUL byte, which PostgreSQL `TEXT` refuses.
fn courier_account(_: &Parts) -> Result<Account, ProblemResponse> {
    Ok(Account::new(COURIER_ACCOUNT))
}

/// Every `POST /shipments` passes here: it is counted, injected failures and
/// rejections answer before the key is looked at, replays are counted on the
/// way out, and a successful answer may be dropped after its commit.
async fn gate(State(courier): State<Courier>, req: Request, next: Next) -> Response {
    let inner = &courier.inner;
    inner.calls.fetch_add(1, Ordering::Relaxed);
    let budget = req
        .headers()
        .get(idemkit_core::wire::REQUEST_TIMEOUT)
        .and_then(|v| v.to_str().ok())
        .and_then(idemkit_core::parse_deadline_header)
        .map_or(u64::MAX, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX - 1));
    inner.last_request_timeout.store(budget, Ordering::Relaxed);
    match courier.lock_faults().gate() {
        Gate::Fail(status) => return injected_failure(status),
        Gate::Reject => return rejected(),
        Gate::Proceed => {}
    }
    let kill = req.extensions().get::<KillSwitch>().cloned();
    // The call runs to its commit even when the client gives up waiting, as a real
    // courier's would: that is what makes a client timeout "maybe executed".
    let res = match tokio::spawn(next.run(req)).await {
        Ok(res) => res,
        Err(e) => {
            tracing::error!(error = %e, "courier: the shipment handler failed");
            ProblemResponse::new(ErrorCode::Internal, "the shipment handler failed").into_response()
        }
    };
    if res.headers().contains_key(IDEMPOTENT_REPLAYED) {
        inner.duplicates.fetch_add(1, Ordering::Relaxed);
    }
    if res.status().is_success()
        && let Some(kill) = kill
        && courier.lock_faults().take_drop()
    {
        tracing::debug!("courier: dropping the response after its commit (fault)");
        kill.pull();
        // The connection task drops this future with the connection.
        std::future::pending::<()>().await;
    }
    res
}

/// The body of `POST /shipments`: any JSON object. `reference` is kept when it is
/// a string; everything else (`shipTo`, `shipFrom`, `parcel`, …) passes through.
struct ShipmentRequest {
    reference: Option<String>,
    compact: String,
}

impl ShipmentRequest {
    fn parse(body: &[u8]) -> Result<Self, ProblemResponse> {
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            ProblemResponse::new(
                ErrorCode::ValidationFailed,
                format!("the shipment request is not JSON: {e}"),
            )
        })?;
        let Value::Object(object) = &value else {
            return Err(ProblemResponse::new(
                ErrorCode::ValidationFailed,
                "the shipment request must be a JSON object",
            ));
        };
        Ok(Self {
            reference: object.get("reference").and_then(Value::as_str).map(str::to_owned),
            compact: value.to_string(),
        })
    }

    fn row<'a>(&'a self, ctx: &'a IdempotencyContext) -> NewShipment<'a> {
        NewShipment {
            key: ctx.scope.key.as_str(),
            reference: self.reference.as_deref(),
            request: &self.compact,
            created_at: clock::now_ms(),
        }
    }
}

/// The shipment row commits in the claim's own transaction, with the key's
/// stored answer, or not at all.
async fn create_sqlite(
    State(courier): State<Courier>,
    ctx: IdempotencyContext,
    mut tx: Tx<SqliteTx>,
    body: Bytes,
) -> Result<Response, ProblemResponse> {
    let req = ShipmentRequest::parse(&body)?;
    courier.spend_latency().await;
    let n = db::insert_sqlite(&mut tx, &req.row(&ctx))
        .await
        .map_err(database)?;
    Ok(created(n))
}

/// [`create_sqlite`] on PostgreSQL.
async fn create_pg(
    State(courier): State<Courier>,
    ctx: IdempotencyContext,
    mut tx: Tx<PgTx>,
    body: Bytes,
) -> Result<Response, ProblemResponse> {
    let req = ShipmentRequest::parse(&body)?;
    courier.spend_latency().await;
    let n = db::insert_pg(&mut tx, &req.row(&ctx)).await.map_err(database)?;
    Ok(created(n))
}

fn created(n: i64) -> Response {
    (StatusCode::CREATED, axum::Json(ShipmentCreated::new(n))).into_response()
}

/// How long after its creation each tracking event appears (the simulator
/// compresses a courier's day into a minute).
const TIMELINE: &[(i64, &str, &str)] = &[
    (
        0,
        "label_created",
        "Shipping label created; the parcel awaits pickup",
    ),
    (10_000, "picked_up", "Parcel picked up by the courier"),
    (60_000, "in_transit", "Parcel in transit to the destination depot"),
];

async fn events(State(courier): State<Courier>, Path(n): Path<String>) -> Result<Response, ProblemResponse> {
    let unknown = || ProblemResponse::new(ErrorCode::NotFound, format!("no shipment {n}"));
    let Some(id) = n.parse::<i64>().ok().filter(|id| *id > 0) else {
        return Err(unknown());
    };
    let created_at = courier
        .inner
        .db
        .created_at(id)
        .await
        .map_err(database)?
        .ok_or_else(unknown)?;
    let now = clock::now_ms();
    let events = TIMELINE
        .iter()
        .filter(|(after, _, _)| *after == 0 || created_at + after <= now)
        .map(|(after, status, description)| TrackingEvent {
            at: clock::rfc3339(created_at + after),
            status: (*status).to_owned(),
            description: (*description).to_owned(),
        })
        .collect();
    Ok(axum::Json(TrackingEvents {
        shipment: id,
        tracking_number: super::tracking_number(id),
        events,
    })
    .into_response())
}

async fn faults(State(courier): State<Courier>) -> Response {
    axum::Json(courier.faults()).into_response()
}

async fn set_faults(State(courier): State<Courier>, body: Bytes) -> Result<Response, ProblemResponse> {
    let update: FaultUpdate = if body.iter().all(u8::is_ascii_whitespace) {
        FaultUpdate::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ProblemResponse::new(
                ErrorCode::ValidationFailed,
                format!(
                    "expected any of {{\"failNext\":N,\"status\":S,\"latencyMs\":M,\"dropResponseAfterCommit\":N,\"rejectNext\":N,\"reset\":true}}: {e}"
                ),
            )
        })?
    };
    let faults = courier
        .set_faults(&update)
        .map_err(|detail| ProblemResponse::new(ErrorCode::ValidationFailed, detail))?;
    Ok(axum::Json(faults).into_response())
}

async fn stats(State(courier): State<Courier>) -> Result<Response, ProblemResponse> {
    let stats = courier.stats().await.map_err(database)?;
    Ok(axum::Json(stats).into_response())
}

/// `GET /_deadline`: `{"lastRequestTimeoutMs": n}` (`null` when the last
/// `POST /shipments` sent no `Request-Timeout`, or there was none).
async fn deadline(State(courier): State<Courier>) -> Response {
    let ms = courier.last_request_timeout().map(|d| d.as_millis() as u64);
    axum::Json(serde_json::json!({ "lastRequestTimeoutMs": ms })).into_response()
}

fn database(e: sqlx::Error) -> ProblemResponse {
    match e {
        // Nothing was committed: the same call with the same key may be retried.
        sqlx::Error::Io(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::Protocol(_) => {
            ProblemResponse::new(ErrorCode::StoreUnavailable, format!("database unavailable: {e}"))
                .retry_after(Duration::from_secs(1))
        }
        e => ProblemResponse::new(ErrorCode::Internal, format!("database error: {e}")),
    }
}

/// An RFC 9457 document in idemkit's shape, for the courier's own codes.
#[derive(Serialize)]
struct CourierProblem<'a> {
    #[serde(rename = "type")]
    type_uri: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    code: &'a str,
    retryable: bool,
}

fn problem(status: u16, code: &str, title: &str, detail: &str, retryable: bool) -> Response {
    let body = CourierProblem {
        type_uri: format!("urn:idemkit:problem:{code}"),
        title,
        status,
        detail,
        code,
        retryable,
    };
    let mut res = Response::new(axum::body::Body::from(
        serde_json::to_vec(&body).unwrap_or_default(),
    ));
    *res.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
    );
    res
}

/// `failNext`: nothing was created; the same call may be retried.
fn injected_failure(status: u16) -> Response {
    problem(
        status,
        "courier_unavailable",
        "Courier temporarily unavailable",
        "injected failure (failNext): nothing was created; retry with the same idempotency key",
        true,
    )
}

/// `rejectNext`: permanent; nothing was created.
fn rejected() -> Response {
    problem(
        422,
        "address_rejected",
        "Address rejected",
        "the courier cannot deliver to this address (injected by rejectNext); nothing was created; do not retry",
        false,
    )
}
