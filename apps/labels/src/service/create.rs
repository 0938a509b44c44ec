//! Creating a label: one flow (a label row, then the courier call with the
//! step's downstream key and the caller's remaining time), finished by each
//! protocol: `POST /labels` here, `CreateLabel` in [`super::grpc`].

use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::StatusCode;
use idemkit_client::{CallDeadline, ReqwestRetryError};
use idemkit_core::{ErrorCode, Problem};
use idemkit_tower::{
    CallError, Downstream, IdempotencyContext, Override, PhaseError, Phases, ProblemResponse,
};

use super::db::{LabelsDb, NewLabel};
use super::keyed::KeyedPhases;
use super::{App, CreateLabel, Label, LabelError, Shipment};

/// How the courier call ended, when it did not produce a shipment.
#[derive(Debug)]
pub(super) enum CourierFailure {
    /// The courier refused the label for good (bad address, …).
    Rejected(LabelError),
    /// The courier was unavailable through every retry the deadline allowed.
    Transient(String),
}

/// How a create ends, whatever the protocol and wherever the keys live: the
/// one table the three create paths (`POST /labels` with the keys in the
/// rows' database, `POST /labels` with the keys on Redis, gRPC
/// `CreateLabel`) answer from, so they cannot disagree on what is stored.
///
/// | courier step | label | outcome | REST | gRPC |
/// |---|---|---|---|---|
/// | booked | `created` | final: stored, replayed | `201` | `OK` |
/// | refused for good | `failed` | final: stored, replayed | `502` | `FAILED_PRECONDITION` |
/// | unavailable | `failed` | retryable: not stored, a retry resumes | `502` | `UNAVAILABLE`, RetryInfo 1 s |
///
/// A final outcome is stored whatever the route's `server_errors` policy
/// says: a refusal came after the label row committed, and under `retry` an
/// unmarked `502` would leave the record resumable, so a retry or the
/// completer would call the courier again and book the label the caller was
/// told had failed.
#[derive(Debug, Clone, Copy)]
pub(super) struct Verdict {
    /// What the layer does with the answer.
    pub(super) outcome: Override,
    /// The REST status.
    pub(super) http: StatusCode,
    /// The gRPC status code; `None`: `OK` with the label.
    pub(super) grpc: Option<tonic::Code>,
    /// The retry hint a retryable answer carries.
    pub(super) retry_after: Option<Duration>,
}

/// What the courier step came to.
pub(super) enum Booked {
    /// Booked: the label is created.
    Created(Shipment),
    /// Refused for good: stored and replayed; a corrected request needs a new key.
    Rejected(LabelError),
    /// Unavailable: the label is failed for now and a retry with the same key
    /// re-attempts the courier with the same downstream key.
    Transient(LabelError),
}

impl Booked {
    fn of(booked: Result<Shipment, PhaseError<CourierFailure>>) -> Result<Self, PhaseError<Problem>> {
        match booked {
            Ok(s) => Ok(Self::Created(s)),
            Err(PhaseError::Call(call)) => match call.into_inner() {
                CourierFailure::Rejected(e) => Ok(Self::Rejected(e)),
                CourierFailure::Transient(message) => Ok(Self::Transient(LabelError {
                    code: "courier_unavailable".into(),
                    message,
                    retryable: true,
                })),
            },
            Err(other) => Err(other.map_work(|e| internal(format!("{e:?}")))),
        }
    }

    /// What this outcome is, for every create path: the one table they all
    /// answer from (see [`Verdict`]).
    pub(super) fn verdict(&self) -> Verdict {
        match self {
            Self::Created(_) => Verdict {
                outcome: Override::Final,
                http: StatusCode::CREATED,
                grpc: None,
                retry_after: None,
            },
            Self::Rejected(_) => Verdict {
                outcome: Override::Final,
                http: StatusCode::BAD_GATEWAY,
                grpc: Some(tonic::Code::FailedPrecondition),
                retry_after: None,
            },
            Self::Transient(_) => Verdict {
                outcome: Override::Retryable,
                http: StatusCode::BAD_GATEWAY,
                grpc: Some(tonic::Code::Unavailable),
                retry_after: Some(Duration::from_secs(1)),
            },
        }
    }

    /// The step of the label's final write: one per outcome, and one per
    /// attempt for an unavailable courier (every attempt records its own).
    pub(super) fn final_step(&self, ctx: &IdempotencyContext) -> String {
        match self {
            Self::Created(_) => "created".into(),
            Self::Rejected(_) => "rejected".into(),
            Self::Transient(_) => courier_failed_step(ctx),
        }
    }

    /// The label row's final write in a phase's transaction (keys in the
    /// rows' database).
    pub(super) async fn write<S: LabelsDb>(
        &self,
        tx: &mut S::Tx,
        label_id: &str,
        error_json: &str,
    ) -> Result<(), sqlx::Error> {
        match self {
            Self::Created(s) => S::mark_created(tx, label_id, s).await,
            Self::Rejected(_) | Self::Transient(_) => S::mark_failed(tx, label_id, error_json).await,
        }
    }

    /// The label row's final write on its own (keys on Redis): the same
    /// values on every attempt, and a created label is never turned failed.
    async fn write_keyed<S: LabelsDb>(
        &self,
        db: &S,
        label_id: &str,
        error_json: &str,
    ) -> Result<(), sqlx::Error> {
        match self {
            Self::Created(s) => db.mark_created_keyed(label_id, s).await,
            Self::Rejected(_) | Self::Transient(_) => {
                db.mark_failed_unless_created(label_id, error_json).await
            }
        }
    }

    /// The label as this outcome leaves it.
    pub(super) fn apply(&self, label: &mut Label) {
        match self {
            Self::Created(s) => {
                label.status = "created".into();
                label.courier_order_number = Some(s.order_number.clone());
                label.courier_tracking_number = Some(s.tracking_number.clone());
            }
            Self::Rejected(e) | Self::Transient(e) => {
                label.status = "failed".into();
                label.error = Some(e.clone());
            }
        }
    }
}

/// An internal failure as a problem.
pub(super) fn internal(e: impl std::fmt::Display) -> Problem {
    Problem::new(ErrorCode::Internal, format!("internal failure: {e}"))
}

fn courier_name(req: &CreateLabel) -> String {
    serde_json::to_value(req.courier)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn new_label(id: &str, req: &CreateLabel) -> Label {
    Label {
        id: id.to_owned(),
        status: "pending".into(),
        courier: courier_name(req),
        courier_order_number: None,
        courier_tracking_number: None,
        error: None,
    }
}

/// The step of the label row marked failed for an unavailable courier: one per
/// attempt (its token), so every attempt records its own.
pub(super) fn courier_failed_step(ctx: &IdempotencyContext) -> String {
    format!("courier-failed-{}", ctx.token.0)
}

/// Books the shipment with the courier, with `key` (the step's downstream key)
/// and at most `remaining` (the caller's time left) for the whole call,
/// retries included.
async fn book(
    app: &App<impl Send + Sync>,
    key: &str,
    label_id: &str,
    req: &CreateLabel,
    remaining: Option<Duration>,
) -> Result<Shipment, CallError<CourierFailure>> {
    if remaining == Some(Duration::ZERO) {
        return Err(CallError::NotExecuted(CourierFailure::Transient(
            "the caller's deadline passed before the courier was called".into(),
        )));
    }
    let body = serde_json::json!({
        "reference": label_id, "courier": req.courier, "shipFrom": req.ship_from, "shipTo": req.ship_to, "parcel": req.parcel,
    });
    let mut call = app
        .courier
        .post(format!("{}/shipments", app.courier_url))
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(left) = remaining {
        call = call.with_extension(CallDeadline(left));
    }
    match call.send().await {
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

/// The steps both protocols share, with the keys in the labels rows' database:
/// the label row (phase `label`), then the courier call (external step
/// `courier`, keyed, within the caller's remaining time). The caller finishes
/// with the label's final write.
pub(super) async fn label_and_courier<S: LabelsDb>(
    app: &App<S>,
    ctx: &IdempotencyContext,
    req: &CreateLabel,
    request_json: &str,
) -> Result<(Phases<S>, Label, Booked), PhaseError<Problem>> {
    let account = ctx.scope.account.as_str();
    let courier = courier_name(req);
    let mut phases = Phases::begin(app.store.clone(), ctx).await?;
    let label_id: String = phases
        .phase("label", async |tx| {
            let id = format!("lbl_{}", uuid::Uuid::new_v4().simple());
            let row = NewLabel {
                id: &id,
                account,
                courier: &courier,
                request: request_json,
                created_at: now_ms(),
            };
            S::insert(tx, &row).await.map_err(internal)?;
            Ok(id)
        })
        .await?;
    let booked = phases
        .external_with_deadline("courier", Downstream::HonoursKeys, async |key, left| {
            book(app, key.as_str(), &label_id, req, left).await
        })
        .await;
    let booked = Booked::of(booked)?;
    Ok((phases, new_label(&label_id, req), booked))
}

fn label_response(status: StatusCode, label: &Label) -> Response {
    (status, axum::Json(label)).into_response()
}

fn failed(e: impl std::fmt::Display) -> Response {
    ProblemResponse::from(internal(e)).into_response()
}

fn rest_error(e: PhaseError<Problem>) -> PhaseError<Response> {
    e.map_work(|p| ProblemResponse::from(p).into_response())
}

/// `POST /labels` with the keys in the labels rows' database: every step
/// commits with its recovery point, and the final write commits with the
/// stored answer.
pub(super) async fn create<S: LabelsDb>(
    State(app): State<App<S>>,
    ctx: IdempotencyContext,
    body: Bytes,
) -> Result<Response, PhaseError<Response>> {
    // Validated before the key was looked up; parsing again cannot fail.
    let req = CreateLabel::parse(&body).map_err(|p| PhaseError::Work(p.into_response()))?;
    let (mut phases, mut label, booked) =
        label_and_courier(&app, &ctx, &req, &String::from_utf8_lossy(&body))
            .await
            .map_err(rest_error)?;
    booked.apply(&mut label);
    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
    let verdict = booked.verdict();
    let step = booked.final_step(&ctx);
    if verdict.outcome == Override::Final {
        // The last write and the stored answer commit together.
        return phases
            .finish(&step, async |tx| {
                booked
                    .write::<S>(tx, &label.id, &error_json)
                    .await
                    .map_err(failed)?;
                Ok(label_response(verdict.http, &label))
            })
            .await;
    }
    phases
        .phase(&step, async |tx| {
            booked
                .write::<S>(tx, &label.id, &error_json)
                .await
                .map_err(failed)
        })
        .await?;
    Ok(rest_answer(verdict, &label))
}

/// A REST answer as [`Verdict`] has it, marked for the layer.
fn rest_answer(verdict: Verdict, label: &Label) -> Response {
    (verdict.outcome, label_response(verdict.http, label)).into_response()
}

/// `POST /labels` with the keys in a store that is not the labels rows'
/// database (Redis): the same steps and answers as [`create`], with each SQL
/// write committed on its own, keyed by the step's downstream key (or guarded
/// by the row's status), before its result is recorded with the fenced
/// `KeyStore::advance`; the layer stores the response (see `docs/redis.md`).
pub(super) async fn create_keyed<S: LabelsDb>(
    State(app): State<App<S>>,
    ctx: IdempotencyContext,
    body: Bytes,
) -> Result<Response, PhaseError<Response>> {
    let req = CreateLabel::parse(&body).map_err(|p| PhaseError::Work(p.into_response()))?;
    let account = ctx.scope.account.as_str();
    let courier = courier_name(&req);
    let request = String::from_utf8_lossy(&body);
    let mut phases = KeyedPhases::begin(app.keys.clone(), &ctx).await?;
    let label_id: String = phases
        .phase("label", async |key| {
            let id = format!("lbl_{}", key.as_str());
            let row = NewLabel {
                id: &id,
                account,
                courier: &courier,
                request: &request,
                created_at: now_ms(),
            };
            app.store.insert_keyed(&row).await.map_err(failed)?;
            Ok(id)
        })
        .await?;
    let booked = phases
        .external("courier", async |key| {
            book(&app, key.as_str(), &label_id, &req, ctx.remaining()).await
        })
        .await;
    let booked = Booked::of(booked).map_err(rest_error)?;
    let mut label = new_label(&label_id, &req);
    booked.apply(&mut label);
    let error_json = serde_json::to_string(&label.error).unwrap_or_default();
    let verdict = booked.verdict();
    booked
        .write_keyed(&*app.store, &label.id, &error_json)
        .await
        .map_err(|e| PhaseError::Work(failed(e)))?;
    if matches!(booked, Booked::Created(_)) {
        fail::fail_point!("labels::after_finish_write");
    }
    if verdict.outcome == Override::Retryable {
        // Fenced: a stale attempt learns here that it lost the key.
        phases.mark::<Response>(&booked.final_step(&ctx)).await?;
    }
    // The layer stores a final answer with the attempt's fenced completion.
    Ok(rest_answer(verdict, &label))
}

pub(super) fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
