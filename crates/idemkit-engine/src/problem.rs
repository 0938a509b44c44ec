//! Problem answers (RFC 9457) as the adapters send them.

use std::time::Duration;

use idemkit_core::{ErrorCode, Problem, StoreError};

/// A [`Problem`] as an HTTP response, optionally with `Retry-After`: what the
/// layer answers with, and what a handler returns for its own errors (a store
/// error converts with `?`, keeping the layer's codes).
///
/// ```
/// use std::time::Duration;
/// use axum::response::IntoResponse;
/// use idemkit_core::ErrorCode;
/// use idemkit_engine::ProblemResponse;
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

    /// A problem with an optional `Retry-After` (how the engine's refusals
    /// carry them).
    pub fn from_parts(problem: Problem, retry_after: Option<Duration>) -> Self {
        Self { problem, retry_after }
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
pub fn retry_after_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0).max(u64::from(d.as_secs() == 0))
}

/// A handler's store failure answered as the layer answers its own: a stale
/// lease is `503 idempotency_lease_lost` and an unreachable store `503
/// idempotency_store_unavailable` (both with `Retry-After: 1`), a configuration
/// that cannot work `500 idempotency_misconfigured`, anything else `500
/// internal_error`. So `?` on a store call in a handler keeps the contract.
impl From<StoreError> for ProblemResponse {
    fn from(e: StoreError) -> Self {
        Self::from(&e)
    }
}

impl From<&StoreError> for ProblemResponse {
    fn from(e: &StoreError) -> Self {
        let (problem, retry_after) = crate::store_problem(e);
        Self { problem, retry_after }
    }
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
