//! HTTP renderings of the engine's answers: replays, problems, `202` with a
//! status URL.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode, header};
use idemkit_core::{ErrorCode, Policy, Scope, StoreError, StoredHeader, StoredResponse};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};

use crate::ProblemResponse;
use crate::engine::{Refusal, replay_status};
use crate::problem::retry_after_secs;
use crate::shared::{IDEMPOTENT_REPLAYED, Shared};

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
        Refusal::Replay(stored) => replay_response_to(stored, &shared.engine.policy, request),
        Refusal::Accepted { retry_after } => accepted(shared, scope, retry_after),
        Refusal::Problem { problem, retry_after } => ProblemResponse { problem, retry_after }.into_response(),
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
        Refusal::Problem { problem, retry_after } => ProblemResponse { problem, retry_after }.into_response(),
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
    let (problem, retry_after) = crate::engine::store_problem(e);
    ProblemResponse { problem, retry_after }
}

/// A handler's store failure answered as the layer answers its own: a stale
/// lease is `503 idempotency_lease_lost` and an unreachable store `503
/// idempotency_store_unavailable` (both with `Retry-After: 1`), a configuration
/// that cannot work `500 idempotency_misconfigured`, anything else `500
/// internal_error`. So `?` on a store call in a handler keeps the contract.
impl From<StoreError> for ProblemResponse {
    fn from(e: StoreError) -> Self {
        store_problem(&e)
    }
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
/// accept (see [`crate::accepts_encoding`]) is not replayed to it (its bytes
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

/// The request headers an HTTP adapter keeps with the record (for the
/// completer and an operator's review): content negotiation only, never
/// credentials. The layer and `idemkit proxy` keep these.
pub const STORED_REQUEST_HEADERS: &[&str] = &["content-type", "accept", "content-language"];

/// The headers of `headers` named in `names`, as the record keeps them (the
/// first value of each, in `names`' order).
pub fn stored_request_headers(headers: &http::HeaderMap, names: &[&str]) -> Vec<StoredHeader> {
    names
        .iter()
        .filter_map(|name| {
            headers.get(*name).map(|v| StoredHeader {
                name: (*name).to_owned(),
                value: v.as_bytes().to_vec(),
            })
        })
        .collect()
}

/// What is kept of an HTTP answer to replay it: the status, the headers the
/// route policy replays (never `Set-Cookie` or hop-by-hop ones) and the body.
/// What the layer stores, and what `idemkit proxy` stores of an upstream's answer.
pub fn stored_response(parts: &http::response::Parts, body: &[u8], policy: &Policy) -> StoredResponse {
    StoredResponse {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| policy.replays_header(name.as_str()))
            .map(|(name, value)| StoredHeader {
                name: name.as_str().to_owned(),
                value: value.as_bytes().to_vec(),
            })
            .collect(),
        body: body.to_vec(),
    }
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
