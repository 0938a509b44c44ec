//! Problem responses (RFC 9457) for everything the layer and the framework reject.

use std::time::Duration;

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode, header};
use idemkit_core::{ErrorCode, PROBLEM_CONTENT_TYPE, Problem};

/// A [`Problem`] as an HTTP response, optionally with `Retry-After`: what the
/// layer answers with, and what a handler returns for its own errors (a store
/// error converts with `?`, keeping the layer's codes).
///
/// ```
/// use std::time::Duration;
/// use axum::response::IntoResponse;
/// use idemkit_core::ErrorCode;
/// use idemkit_tower::ProblemResponse;
///
/// let busy = ProblemResponse::new(ErrorCode::StoreUnavailable, "the ledger is down")
///     .retry_after(Duration::from_secs(2))
///     .into_response();
/// assert_eq!(busy.status(), 503);
/// assert_eq!(busy.headers()["retry-after"], "2");
/// assert_eq!(busy.headers()["content-type"], "application/problem+json");
///
/// // `?` on a store call answers as the layer would: a lost lease is a 503.
/// let lost: ProblemResponse = idemkit_core::StoreError::Fenced.into();
/// assert_eq!(lost.problem.status, 503);
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ProblemResponse {
    /// The document.
    pub problem: Problem,
    /// Sent as `Retry-After` (whole seconds, rounded up, at least 1).
    pub retry_after: Option<Duration>,
}

impl ProblemResponse {
    /// A problem with the code's defaults.
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self {
            problem: Problem::new(code, detail),
            retry_after: None,
        }
    }

    /// Sets `Retry-After`.
    pub fn retry_after(mut self, d: Duration) -> Self {
        self.retry_after = Some(d);
        self
    }

    /// Overrides the status.
    pub fn with_status(mut self, status: u16) -> Self {
        self.problem = self.problem.with_status(status);
        self
    }
}

impl From<Problem> for ProblemResponse {
    fn from(problem: Problem) -> Self {
        Self {
            problem,
            retry_after: None,
        }
    }
}

/// Whole seconds for `Retry-After`: rounded up, never 0 (0 invites a hot loop).
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0).max(u64::from(d.as_secs() == 0))
}

impl IntoResponse for ProblemResponse {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.problem.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut res = Response::new(Body::from(self.problem.to_json()));
        *res.status_mut() = status;
        res.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(PROBLEM_CONTENT_TYPE),
        );
        if let Some(d) = self.retry_after {
            res.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs(d)));
        }
        res
    }
}

/// axum's `Json` extractor with problem+json rejections: syntax and shape errors
/// are `400 validation_failed` (not axum's text/plain 422), a missing JSON content
/// type is `415`, an oversized body `413`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Json<T>(pub T);

impl<T, S> axum::extract::FromRequest<S> for Json<T>
where
    T: serde::de::DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ProblemResponse;

    async fn from_request(req: http::Request<Body>, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Self(v)),
            Err(rejection) => Err(json_rejection(&rejection)),
        }
    }
}

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

fn json_rejection(rejection: &JsonRejection) -> ProblemResponse {
    let code = match rejection {
        JsonRejection::MissingJsonContentType(_) => ErrorCode::UnsupportedMediaType,
        JsonRejection::BytesRejection(r) if r.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            ErrorCode::PayloadTooLarge
        }
        _ => ErrorCode::ValidationFailed,
    };
    ProblemResponse::new(code, rejection.body_text())
}

/// A router fallback answering `404` as a problem document.
pub async fn not_found() -> ProblemResponse {
    ProblemResponse::new(ErrorCode::NotFound, "no route matches this path")
}

/// A fallback for `405 Method Not Allowed` as a problem document.
pub async fn method_not_allowed() -> ProblemResponse {
    let mut p = ProblemResponse::new(
        ErrorCode::ValidationFailed,
        "this method is not allowed on this route",
    );
    p.problem.status = 405;
    p.problem.title = "Method not allowed".into();
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_and_is_never_zero() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1000)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::from_secs(29)), 29);
    }
}
