//! `labels.v1.Labels` over gRPC: the same flow, store, accounts, courier and
//! recovery points as the REST routes, behind `idemkit-tonic`'s layer.
//!
//! `CreateLabel` answers (ErrorInfo `domain` = [`LABELS_DOMAIN`] for the
//! label's own outcomes, `idemkit` for the layer's refusals), from the one
//! table every create path shares (`create::Verdict`):
//!
//! | outcome | REST | gRPC | stored |
//! |---|---|---|---|
//! | created | `201` label | `OK` label | yes |
//! | courier refused the label | `502` failed label | `FAILED_PRECONDITION`, ErrorInfo reason = the courier's code | yes (`final`) |
//! | courier unavailable | `502` failed label, retryable | `UNAVAILABLE`, reason `courier_unavailable`, RetryInfo | no (`retryable`: a retry resumes) |
//! | invalid label | `400 validation_failed` | `INVALID_ARGUMENT`, reason `validation_failed` | no |

use std::time::Duration;

use idemkit_core::{Account, Problem};
use idemkit_tonic::{status_for, with_outcome};
use idemkit_tower::AccountResolver;
use idemkit_tower::Override;
use idemkit_tower::{IdempotencyContext, PhaseError};
use tonic::{Code, Request, Response, Status};
use tonic_types::{ErrorDetails, StatusExt};

use super::create::{internal, label_and_courier};
use super::db::LabelsDb;
use super::{App, CreateLabel, Label, Tokens, read};
use crate::proto;

/// The ErrorInfo domain of the label's own outcomes (a courier's refusal or
/// outage), as opposed to the idempotency layer's (`idemkit`).
pub const LABELS_DOMAIN: &str = "labels.v1";

/// The gRPC service over one labels database.
pub(super) struct LabelsGrpc<S> {
    pub(super) app: App<S>,
}

/// The caller's account for the read methods the layer does not wrap: the same
/// resolver as the layer's, over the call's metadata.
fn account_of<T>(tokens: &Tokens, request: &Request<T>) -> Result<Account, Status> {
    let mut parts = http::Request::new(()).into_parts().0;
    parts.headers = request.metadata().clone().into_headers();
    tokens
        .resolve(&parts)
        .map_err(|refused| status_for(&refused.problem, refused.retry_after))
}

fn status(p: &Problem) -> Status {
    status_for(p, None)
}

/// A phase error as the call's status: the layer's mapping for its own
/// refusals (parked, lease lost, store), marked so the layer leaves a record
/// the phases already settled as it is.
fn phase_status(e: PhaseError<Problem>) -> Status {
    match e {
        PhaseError::Work(p) => status(&p),
        PhaseError::Call(call) => status(call.inner()),
        PhaseError::Parked(reason) => with_outcome(
            status(&Problem::new(idemkit_core::ErrorCode::RequestParked, reason)),
            Override::Settled,
        ),
        PhaseError::Store(idemkit_core::StoreError::Fenced) => with_outcome(
            status_for(
                &Problem::new(
                    idemkit_core::ErrorCode::LeaseLost,
                    "this attempt's lease was taken over by a later attempt; retry to get its result",
                ),
                Some(Duration::from_secs(1)),
            ),
            Override::Settled,
        ),
        PhaseError::Store(e @ idemkit_core::StoreError::Unavailable(_)) => status_for(
            &Problem::new(idemkit_core::ErrorCode::StoreUnavailable, e.to_string()),
            Some(Duration::from_secs(1)),
        ),
        PhaseError::Store(e) => status(&Problem::new(idemkit_core::ErrorCode::Internal, e.to_string())),
        other => status(&internal(format!("{other:?}"))),
    }
}

/// A failed label as a status: ErrorInfo with the label's error code and id.
fn failed_label(code: Code, label: &Label, retry_after: Option<Duration>) -> Status {
    let error = label.error.clone().unwrap_or_else(|| super::LabelError {
        code: "failed".into(),
        message: "the label failed".into(),
        retryable: false,
    });
    let mut details = ErrorDetails::with_error_info(
        error.code.clone(),
        LABELS_DOMAIN,
        [
            ("label_id".to_owned(), label.id.clone()),
            ("retryable".to_owned(), error.retryable.to_string()),
        ],
    );
    if let Some(d) = retry_after {
        details.set_retry_info(Some(d));
    }
    Status::with_error_details(code, error.message, details)
}

/// The label as its message.
fn to_message(label: &Label) -> proto::Label {
    proto::Label {
        id: label.id.clone(),
        status: label.status.clone(),
        courier: label.courier.clone(),
        courier_order_number: label.courier_order_number.clone(),
        courier_tracking_number: label.courier_tracking_number.clone(),
        error: label.error.as_ref().map(|e| proto::LabelError {
            code: e.code.clone(),
            message: e.message.clone(),
            retryable: e.retryable,
        }),
    }
}

#[tonic::async_trait]
impl<S: LabelsDb> proto::labels_server::Labels for LabelsGrpc<S> {
    async fn create_label_with_request_id(
        &self,
        request: Request<proto::CreateLabelWithRequestIdRequest>,
    ) -> Result<Response<proto::Label>, Status> {
        // The same label creation: the request id is the key (the layer read
        // it, or the metadata key when the field is empty).
        let (metadata, extensions, m) = request.into_parts();
        let message = proto::CreateLabelRequest {
            idempotency_key: m.request_id,
            courier: m.courier,
            ship_from: m.ship_from,
            ship_to: m.ship_to,
            parcel: m.parcel,
        };
        self.create_label(Request::from_parts(metadata, extensions, message))
            .await
    }

    async fn create_label(
        &self,
        request: Request<proto::CreateLabelRequest>,
    ) -> Result<Response<proto::Label>, Status> {
        let ctx = request
            .extensions()
            .get::<IdempotencyContext>()
            .cloned()
            .ok_or_else(|| Status::internal("CreateLabel runs behind the idempotency layer"))?;
        // The REST body is this message's JSON mapping: one validation for both.
        // A key sent as metadata goes into the field, as the layer read it.
        let mut message = request.into_inner();
        if message.idempotency_key.is_empty() {
            message.idempotency_key = ctx.scope.key.as_str().to_owned();
        }
        let json = proto::to_json(&message);
        let req = CreateLabel::parse(json.as_bytes()).map_err(|p| status(&p.problem))?;
        let (mut phases, mut label, booked) = label_and_courier(&self.app, &ctx, &req, &json)
            .await
            .map_err(phase_status)?;
        booked.apply(&mut label);
        let error_json = serde_json::to_string(&label.error).unwrap_or_default();
        // The final write is a phase of its own; the layer stores the answer
        // (a crash between the two resumes with every step saved), as the one
        // table of outcomes (`Verdict`) has it.
        let verdict = booked.verdict();
        phases
            .phase(&booked.final_step(&ctx), async |tx| {
                booked
                    .write::<S>(tx, &label.id, &error_json)
                    .await
                    .map_err(internal)
            })
            .await
            .map_err(phase_status)?;
        match verdict.grpc {
            None => {
                let mut answer = Response::new(to_message(&label));
                answer.extensions_mut().insert(verdict.outcome);
                Ok(answer)
            }
            Some(code) => Err(with_outcome(
                failed_label(code, &label, verdict.retry_after),
                verdict.outcome,
            )),
        }
    }

    async fn get_label(
        &self,
        request: Request<proto::GetLabelRequest>,
    ) -> Result<Response<proto::Label>, Status> {
        let account = account_of(&self.app.tokens, &request)?;
        read::label(&self.app, account.as_str(), &request.get_ref().id)
            .await
            .map(|l| Response::new(to_message(&l)))
            .map_err(|p| status(&p))
    }

    async fn get_tracking(
        &self,
        request: Request<proto::GetTrackingRequest>,
    ) -> Result<Response<proto::Tracking>, Status> {
        let account = account_of(&self.app.tokens, &request)?;
        let t = read::tracking(&self.app, account.as_str(), &request.get_ref().id)
            .await
            .map_err(|p| status(&p))?;
        Ok(Response::new(proto::Tracking {
            tracking_number: t.tracking_number,
            events: t
                .events
                .into_iter()
                .map(|e| proto::TrackingEvent {
                    at: e.at,
                    status: e.status,
                    description: e.description,
                })
                .collect(),
        }))
    }
}
