//! The axum side of the engine's types (feature `axum`): what `idemkit-tower`
//! answers and extracts with them.

use axum::body::Body;
use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, IntoResponseParts, Response, ResponseParts};
use http::request::Parts;
use http::{HeaderValue, StatusCode, header};
use idemkit_core::{ErrorCode, PROBLEM_CONTENT_TYPE};

use crate::{IdempotencyContext, Override, ProblemResponse, retry_after_secs};

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

/// Attach an [`Override`] to a response to override the route policy for it.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idemkit_engine::Override;
///
/// // The courier refused the address: permanent, store and replay it.
/// let permanent = (StatusCode::BAD_GATEWAY, Override::Final, "address rejected").into_response();
/// // The courier timed out: do not store; the next attempt resumes at once.
/// let transient = (StatusCode::BAD_GATEWAY, Override::Retryable, "courier timed out").into_response();
/// # let _ = (permanent, transient);
/// ```
impl IntoResponseParts for Override {
    type Error = std::convert::Infallible;

    fn into_response_parts(self, mut res: ResponseParts) -> Result<ResponseParts, Self::Error> {
        res.extensions_mut().insert(self);
        Ok(res)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = ProblemResponse;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or_else(|| {
            ProblemResponse::new(
                ErrorCode::Internal,
                "the idempotency layer is not applied to this route",
            )
        })
    }
}
