//! How a handler overrides the route's storage policy for one response (the behaviour contract, `docs/spec.md` §5).

use axum::response::{IntoResponseParts, ResponseParts};

pub use crate::engine::Override;

/// Attach an [`Override`] to a response to override the route policy for it.
///
/// ```
/// use axum::response::IntoResponse;
/// use http::StatusCode;
/// use idemkit_tower::Override;
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
