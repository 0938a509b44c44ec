//! Problem responses (RFC 9457) for what axum rejects: [`Json`] and the
//! router fallbacks.

use axum::body::Body;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idemkit_core::ErrorCode;
use idemkit_engine::ProblemResponse;

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
