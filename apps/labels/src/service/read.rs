//! Reading labels and tracking, for both protocols.

use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use http::request::Parts;
use idemkit_core::{ErrorCode, Problem};
use idemkit_tower::{AccountResolver, ProblemResponse};

use super::create::internal;
use super::db::{LabelsDb, Row};
use super::{App, Label, Tracking, TrackingEvent};

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

/// The account's label `id`.
pub(super) async fn label<S: LabelsDb>(app: &App<S>, account: &str, id: &str) -> Result<Label, Problem> {
    match app.store.find(account, id).await {
        Ok(Some(row)) if row.0 == id => Ok(label_of(row).0),
        Ok(_) => Err(Problem::new(ErrorCode::NotFound, "no label with this id")),
        Err(e) => Err(internal(e)),
    }
}

/// The courier's tracking of the account's label with this id or tracking number.
pub(super) async fn tracking<S: LabelsDb>(
    app: &App<S>,
    account: &str,
    id: &str,
) -> Result<Tracking, Problem> {
    let (label, shipment) = match app.store.find(account, id).await {
        Ok(Some(row)) => label_of(row),
        Ok(None) => {
            return Err(Problem::new(
                ErrorCode::NotFound,
                "no label with this id or tracking number",
            ));
        }
        Err(e) => return Err(internal(e)),
    };
    let (Some(tracking), Some(n)) = (label.courier_tracking_number, shipment) else {
        return Err(Problem::new(
            ErrorCode::NotFound,
            "this label has no shipment yet",
        ));
    };
    let unavailable = || {
        Problem::new(
            ErrorCode::StoreUnavailable,
            "the courier's tracking is unavailable; retry",
        )
    };
    let res = app
        .http
        .get(format!("{}/shipments/{n}/events", app.courier_url))
        .send()
        .await
        .ok()
        .filter(|r| r.status().is_success())
        .ok_or_else(unavailable)?;
    let events: serde_json::Value = res.json().await.map_err(internal)?;
    let events: Vec<TrackingEvent> = serde_json::from_value(events["events"].clone()).unwrap_or_default();
    Ok(Tracking {
        tracking_number: tracking,
        events,
    })
}

/// `200` with the document, or the problem.
fn answer<T: serde::Serialize>(result: Result<T, Problem>) -> Response {
    match result {
        Ok(doc) => (StatusCode::OK, axum::Json(doc)).into_response(),
        Err(p) => ProblemResponse::from(p).into_response(),
    }
}

/// `GET /labels/{id}`.
pub(super) async fn get<S: LabelsDb>(
    State(app): State<App<S>>,
    parts: Parts,
    Path(id): Path<String>,
) -> Response {
    match app.tokens.resolve(&parts) {
        Ok(account) => answer(label(&app, account.as_str(), &id).await),
        Err(p) => p.into_response(),
    }
}

/// `GET /tracking/{id}`.
pub(super) async fn track<S: LabelsDb>(
    State(app): State<App<S>>,
    parts: Parts,
    Path(id): Path<String>,
) -> Response {
    match app.tokens.resolve(&parts) {
        Ok(account) => answer(tracking(&app, account.as_str(), &id).await),
        Err(p) => p.into_response(),
    }
}
