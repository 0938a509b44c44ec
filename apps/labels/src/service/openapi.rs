//! `GET /openapi.json`: the published contract as OpenAPI 3.1 (utoipa).

#![allow(dead_code)] // the functions below exist only to carry `#[utoipa::path]` docs

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::model::{Address, CourierName, CreateLabel, Label, LabelError, Parcel, Tracking, TrackingEvent};

/// An RFC 9457 problem document (`application/problem+json`).
#[derive(utoipa::ToSchema)]
struct Problem {
    /// Problem type URI (`urn:idemkit:problem:<code>`).
    r#type: String,
    /// Short summary.
    title: String,
    /// HTTP status.
    status: u16,
    /// What went wrong.
    detail: String,
    /// Stable machine code: `validation_failed`, `unauthorized`, `not_found`,
    /// `idempotency_key_missing`, `idempotency_key_invalid`, `idempotency_key_reused`,
    /// `idempotency_request_in_progress`, `idempotency_request_parked`,
    /// `idempotency_store_unavailable`, `idempotency_lease_lost`,
    /// `idempotency_response_too_large`, `deadline_exceeded`, `payload_too_large`,
    /// `unsupported_media_type`, `internal_error`.
    code: String,
    /// Whether the same request may be retried with the same key.
    retryable: bool,
}

/// Create a label.
///
/// The body carries the idempotency key (`idempotencyKey`), scoped to your account.
/// The body is validated before the key is looked up, and nothing is stored for a
/// refused body: no `idempotencyKey` (or `null`) is `400 idempotency_key_missing`,
/// a key that is not 1–255 visible ASCII characters `400 idempotency_key_invalid`,
/// and any other invalid body `400 validation_failed` whatever state its key is in
/// (the key stays usable for the corrected body).
/// The first request creates the label and books the courier (`201`). The same key
/// and body again answer `200` with the identical label and `Idempotent-Replayed:
/// true`; any other stored answer (a `502` rejection) replays with its own status.
/// The same key with a different body is `409 idempotency_key_reused`; while the
/// first request runs, `409 idempotency_request_in_progress` with `Retry-After`.
/// A courier outage is `502` with the label (status `failed`, `error.retryable:
/// true`): retry with the same key and body. A courier rejection is `502` with
/// `error.retryable: false`: correct the request and use a new key.
/// With `Request-Timeout` (the milliseconds left of your deadline) already spent,
/// nothing runs and the key is not claimed: `504 deadline_exceeded`.
#[utoipa::path(
    post,
    path = "/labels",
    request_body = CreateLabel,
    params(
        ("Request-Timeout" = Option<u64>, Header, nullable = false, minimum = 0, maximum = 9_999_999_999_u64,
            description = "The time left of your deadline, in whole milliseconds (1 to 10 digits, no unit; round down), counted from when the request arrives; send what is left on every retry. `0` (already spent) is `504 deadline_exceeded`: nothing runs and the key is not claimed. Otherwise the request runs to its end and the handler passes the remaining time on to the courier. A malformed value is ignored."),
    ),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Label created", body = Label),
        (status = 200, description = "Replay of the label created earlier with this key", body = Label,
            headers(("Idempotent-Replayed" = String, description = "`true` on replays"))),
        (status = 400, description = "Validation failed, or the key is missing or invalid", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No or unknown bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Key reused with a different body, request in progress, or parked for review", body = Problem, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds, on `idempotency_request_in_progress`"))),
        (status = 413, description = "Body too large", body = Problem, content_type = "application/problem+json"),
        (status = 415, description = "Body is not JSON", body = Problem, content_type = "application/problem+json"),
        (status = 500, description = "Internal failure; retry with the same key", body = Problem, content_type = "application/problem+json"),
        (status = 502, description = "The courier failed (`error.retryable` says whether to retry with the same key)", body = Label),
        (status = 503, description = "Key store unavailable; retry with the same key", body = Problem, content_type = "application/problem+json"),
        (status = 504, description = "`deadline_exceeded`: the `Request-Timeout` budget was already spent; nothing ran and the key was not claimed (a later call with a fresh budget may use it)", body = Problem, content_type = "application/problem+json"),
    )
)]
fn create_label() {}

/// Create a label, speaking OASIS Repeatable Requests 1.0.
///
/// The same label creation as `POST /labels`, for clients that speak the OASIS
/// Repeatable Requests headers (as Azure APIs do): the key is the
/// `Repeatability-Request-ID` header and the body carries no `idempotencyKey`.
/// `Repeatability-First-Sent` (the HTTP-date of the first attempt, the same on
/// every retry) is required; one older than the replay window (24 h) or more
/// than 60 s ahead is `412 repeatability_first_sent_out_of_window` and nothing
/// runs. Answers carry `Repeatability-Result: accepted` (created, or replayed
/// with `Idempotent-Replayed: true` and `200`) or `rejected` (refused because of
/// the repeatability headers: missing or malformed `400`, reused with another
/// body or still in progress `409`, out of window `412`).
#[utoipa::path(
    post,
    path = "/repeatable/labels",
    request_body(content = CreateLabel, description = "A label without `idempotencyKey`."),
    params(
        ("Repeatability-Request-ID" = String, Header, description = "The key: 1–255 visible ASCII characters (a UUID), the same on every retry."),
        ("Repeatability-First-Sent" = String, Header, description = "HTTP-date (IMF-fixdate) of the first attempt, the same on every retry."),
    ),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "Label created", body = Label,
            headers(("Repeatability-Result" = String, description = "`accepted`"))),
        (status = 200, description = "Replay of the label created earlier with this request id", body = Label,
            headers(("Idempotent-Replayed" = String, description = "`true` on replays"), ("Repeatability-Result" = String, description = "`accepted`"))),
        (status = 400, description = "Validation failed, or a repeatability header is missing or invalid", body = Problem, content_type = "application/problem+json"),
        (status = 401, description = "No or unknown bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 409, description = "Request id reused with a different body, or in progress", body = Problem, content_type = "application/problem+json"),
        (status = 412, description = "`repeatability_first_sent_out_of_window`", body = Problem, content_type = "application/problem+json",
            headers(("Repeatability-Result" = String, description = "`rejected`"))),
        (status = 502, description = "The courier failed (`error.retryable` says whether to retry with the same request id)", body = Label),
        (status = 503, description = "Key store unavailable; retry with the same request id", body = Problem, content_type = "application/problem+json"),
    )
)]
fn create_label_repeatable() {}

/// Get a label of your account.
#[utoipa::path(
    get,
    path = "/labels/{id}",
    params(("id" = String, Path, description = "Label id")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "The label", body = Label),
        (status = 401, description = "No or unknown bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such label in your account", body = Problem, content_type = "application/problem+json"),
    )
)]
fn get_label() {}

/// Tracking events of a label, by label id or tracking number.
#[utoipa::path(
    get,
    path = "/tracking/{id}",
    params(("id" = String, Path, description = "Label id or tracking number")),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "Tracking events", body = Tracking),
        (status = 401, description = "No or unknown bearer token", body = Problem, content_type = "application/problem+json"),
        (status = 404, description = "No such label or shipment in your account", body = Problem, content_type = "application/problem+json"),
        (status = 503, description = "The courier's tracking is unavailable", body = Problem, content_type = "application/problem+json"),
    )
)]
fn get_tracking() {}

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[derive(OpenApi)]
#[openapi(
    info(title = "idemkit labels", description = "Shipping labels: effectively once within the key scope and replay window (24 h)."),
    paths(create_label, create_label_repeatable, get_label, get_tracking),
    components(schemas(CreateLabel, Label, LabelError, Address, Parcel, CourierName, Tracking, TrackingEvent, Problem)),
    modifiers(&Bearer)
)]
struct ApiDoc;

/// The OpenAPI 3.1 document, without the policy extension (see [`openapi_json`]).
pub fn openapi() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The OpenAPI 3.1 document served at `GET /openapi.json`: [`openapi`] with each
/// configured route's `x-idempotency` (`docs/x-idempotency.md`) on its operation,
/// generated from the configuration the service runs with.
pub fn openapi_json(config: &idemkit_tower::config::IdemkitConfig) -> serde_json::Value {
    let mut doc = serde_json::to_value(openapi()).unwrap_or_default();
    for route in &config.routes {
        let pointer = format!(
            "/paths/{}/{}",
            route.path.replace('~', "~0").replace('/', "~1"),
            route.method.to_ascii_lowercase()
        );
        if let Some(serde_json::Value::Object(op)) = doc.pointer_mut(&pointer) {
            op.insert("x-idempotency".into(), route.x_idempotency());
        }
    }
    doc
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    #[test]
    fn post_labels_declares_the_deadline_header_and_its_504() {
        let doc = openapi_json(&crate::contract::default_config());
        let op = &doc["paths"]["/labels"]["post"];
        let params = op["parameters"].as_array().expect("POST /labels has parameters");
        let deadline: Vec<&Value> = params
            .iter()
            .filter(|p| {
                p["in"] == "header"
                    && p["name"]
                        .as_str()
                        .is_some_and(|n| n.eq_ignore_ascii_case(idemkit_core::wire::REQUEST_TIMEOUT))
            })
            .collect();
        assert_eq!(deadline.len(), 1, "{params:?}");
        let p = deadline[0];
        assert_eq!(p["name"], idemkit_contract::DEADLINE_HEADER_DISPLAY);
        assert_ne!(p["required"], json!(true), "the header is optional");
        let schema = &p["schema"];
        assert_eq!(schema["type"], "integer", "a header is never null: {schema}");
        // 1 to DEADLINE_HEADER_MAX_DIGITS digits.
        let digits = u32::try_from(idemkit_core::DEADLINE_HEADER_MAX_DIGITS).unwrap();
        assert_eq!(schema["minimum"], json!(0));
        assert_eq!(schema["maximum"], json!(10_u64.pow(digits) - 1));
        assert!(p["description"].as_str().unwrap().contains("deadline_exceeded"));

        let gateway_timeout = &op["responses"]["504"];
        assert_eq!(
            gateway_timeout["content"]["application/problem+json"]["schema"]["$ref"],
            "#/components/schemas/Problem"
        );
        assert!(
            gateway_timeout["description"]
                .as_str()
                .unwrap()
                .contains("deadline_exceeded")
        );
        assert!(
            op.get("x-idempotency").is_some(),
            "the policy extension is still there"
        );
        // Only the create route takes a deadline.
        assert!(
            doc["paths"]["/labels/{id}"]["get"]["parameters"]
                .as_array()
                .unwrap()
                .iter()
                .all(|p| p["in"] != "header")
        );
    }
}
