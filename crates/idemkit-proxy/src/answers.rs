//! What the proxy answers: its own problems, the upstream's answer once
//! stored, and what the engine answers instead (a replay, a refusal).

use super::*;

/// The `outcome` a refused key counts as.
pub(super) fn key_outcome(e: &idemkit_core::KeyError) -> &'static str {
    match e.code() {
        ErrorCode::KeyMissing => outcome::KEY_MISSING,
        ErrorCode::KeyInvalid => outcome::KEY_INVALID,
        _ => outcome::REJECTED,
    }
}

/// The caller's `Accept-Encoding` headers: what its answer, first or
/// replayed, is negotiated and compressed by.
pub(super) fn accept_encoding(headers: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::new();
    for v in headers.get_all(header::ACCEPT_ENCODING) {
        out.append(header::ACCEPT_ENCODING, v.clone());
    }
    out
}

pub(super) fn problem(code: ErrorCode, detail: impl Into<String>) -> Response {
    ProblemResponse::new(code, detail).into_response()
}

pub(super) fn bad_gateway(e: &UpstreamError) -> Response {
    tracing::warn!(error = %e, "proxy: upstream failed");
    ProblemResponse::new(
        ErrorCode::Internal,
        format!("the upstream could not be reached: {e}"),
    )
    .with_status(502)
    .into_response()
}

/// The answer for a request the engine did not let through. A replay is
/// negotiated for the caller (`caller`: its `Accept-Encoding`) by the engine's
/// rule (`replay_response_to`): a stored answer in a coding the caller does
/// not accept is answered `406 idempotency_replay_not_acceptable`.
pub(super) fn refusal_response(refusal: Refusal, policy: &Policy, caller: &HeaderMap) -> Response {
    match refusal {
        Refusal::Replay(stored) => replay_response_to(stored, policy, caller),
        Refusal::Problem { problem, retry_after } => {
            let mut res = ProblemResponse::from(problem);
            res.retry_after = retry_after;
            res.into_response()
        }
        // `accepted` has no status URL behind a proxy: answered as in progress.
        Refusal::Accepted { retry_after } => ProblemResponse::new(
            ErrorCode::RequestInProgress,
            "a request with this idempotency key is in progress; retry later",
        )
        .retry_after(retry_after)
        .into_response(),
    }
}
