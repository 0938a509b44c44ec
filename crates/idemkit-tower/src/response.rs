//! HTTP renderings of the engine's answers: replays, problems, `202` with a
//! status URL.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode, header};
use idemkit_core::{ErrorCode, Policy, Scope, StoreError, StoredResponse};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::ProblemResponse;
use crate::shared::{IDEMPOTENT_REPLAYED, Shared};
use idemkit_engine::retry_after_secs;
use idemkit_engine::{Refusal, replay_status};

/// Percent-encodes everything but unreserved characters in a path segment.
const SEGMENT: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');

/// The HTTP answer for a request the engine refused to run.
pub(crate) fn refusal_response(
    shared: &Shared,
    scope: &Scope,
    refusal: Refusal,
    request: &http::HeaderMap,
) -> Response {
    match refusal {
        Refusal::Replay(stored) => replay_response_to(stored, shared.engine.policy(), request),
        Refusal::Accepted { retry_after } => accepted(shared, scope, retry_after),
        Refusal::Problem { problem, retry_after } => {
            ProblemResponse::from_parts(problem, retry_after).into_response()
        }
    }
}

/// A refusal after the handler ran (its answer could not be stored): replays
/// carry no accepted-mode status URL, so this needs no route state.
pub(crate) fn refused_response(refusal: Refusal) -> Response {
    match refusal {
        Refusal::Replay(stored) => {
            let mut res = Response::new(Body::from(stored.body.clone()));
            *res.status_mut() =
                StatusCode::from_u16(stored.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            for h in stored.headers {
                if let (Ok(name), Ok(value)) = (
                    HeaderName::from_bytes(h.name.as_bytes()),
                    HeaderValue::from_bytes(&h.value),
                ) {
                    res.headers_mut().append(name, value);
                }
            }
            res.headers_mut().insert(
                HeaderName::from_static(IDEMPOTENT_REPLAYED),
                HeaderValue::from_static("true"),
            );
            res
        }
        Refusal::Problem { problem, retry_after } => {
            ProblemResponse::from_parts(problem, retry_after).into_response()
        }
        Refusal::Accepted { .. } => ProblemResponse::new(
            ErrorCode::RequestInProgress,
            "a concurrent request with this idempotency key changed its state; retry",
        )
        .retry_after(Duration::from_secs(1))
        .into_response(),
    }
}

/// The problem answer for a store failure.
pub(crate) fn store_problem(e: &StoreError) -> ProblemResponse {
    ProblemResponse::from(e)
}

/// Rebuilds a stored response: same status (or the route's replay status for a
/// stored 2xx), allowlisted headers, byte-identical body, plus the replay
/// marker. What the layer replays, and what `idemkit proxy` replays.
pub fn replay_response(stored: StoredResponse, policy: &Policy) -> Response {
    let status = replay_status(&stored, policy);
    let mut res = refused_response(Refusal::Replay(stored));
    *res.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    res
}

/// [`replay_response`] for a caller with these request headers: a stored
/// answer whose `Content-Encoding` the caller's `Accept-Encoding` does not
/// accept (see [`accepts_encoding`](crate::render::accepts_encoding)) is not replayed to it (its bytes
/// would not decode) but answered `406 idempotency_replay_not_acceptable`,
/// naming the coding to accept. The request is not run again.
pub fn replay_response_to(stored: StoredResponse, policy: &Policy, request: &http::HeaderMap) -> Response {
    if let Some(coding) = crate::conventions::stored_coding(&stored)
        && !crate::conventions::accepts_encoding(request, &coding)
    {
        let mut res = ProblemResponse::new(
            ErrorCode::ReplayNotAcceptable,
            format!(
                "the stored answer of this request is `{coding}`-encoded and this request does not accept `{coding}`; repeat it with `Accept-Encoding: {coding}` to get the stored answer (it is not run again)"
            ),
        )
        .into_response();
        res.headers_mut()
            .insert(header::VARY, HeaderValue::from_static("accept-encoding"));
        return res;
    }
    replay_response(stored, policy)
}

pub(crate) fn in_progress(location: Option<String>, retry_after: Duration) -> Response {
    let mut body = serde_json::json!({ "status": "in_progress" });
    if let Some(l) = &location {
        body["statusUrl"] = l.clone().into();
    }
    let mut res = (StatusCode::ACCEPTED, axum::Json(body)).into_response();
    res.headers_mut().insert(
        header::RETRY_AFTER,
        HeaderValue::from(retry_after_secs(retry_after)),
    );
    if let Some(l) = location.and_then(|l| HeaderValue::from_str(&l).ok()) {
        res.headers_mut().insert(header::LOCATION, l);
    }
    res
}

/// The `202 Accepted` answer for a duplicate of a request still in flight.
pub(crate) fn accepted(shared: &Shared, scope: &Scope, retry_after: Duration) -> Response {
    let location = format!(
        "{}/{}",
        shared.status_path.trim_end_matches('/'),
        utf8_percent_encode(scope.key.as_str(), SEGMENT)
    );
    in_progress(Some(location), retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_status_override_applies_to_success_only() {
        let p = Policy::new().with_replay_status(200);
        let ok = replay_response(
            StoredResponse {
                status: 201,
                headers: vec![],
                body: b"x".to_vec(),
            },
            &p,
        );
        assert_eq!(ok.status(), 200);
        assert_eq!(ok.headers()[IDEMPOTENT_REPLAYED], "true");
        let failed = replay_response(
            StoredResponse {
                status: 502,
                headers: vec![],
                body: vec![],
            },
            &p,
        );
        assert_eq!(failed.status(), 502);
    }
}
