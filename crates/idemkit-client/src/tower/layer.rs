use tower::Layer;

use super::RetryService;
use crate::policy::RetryPolicy;

/// A tower [`Layer`] that wraps services in a [`RetryService`].
///
/// All services it produces share the policy's retry budget and latency window.
/// Place it outermost when combined with other resilience layers: Retry →
/// CircuitBreaker → RateLimiter → Bulkhead → transport.
///
/// ```
/// use idemkit_client::{RetryConfig, RetryLayer};
/// use tower::ServiceBuilder;
///
/// # fn wrap<S>(transport: S) {
/// let service = ServiceBuilder::new()
///     .layer(RetryLayer::new(RetryConfig::new().with_max_attempts(2)))
///     .service(transport);
/// # let _ = service;
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct RetryLayer {
    policy: RetryPolicy,
}

impl RetryLayer {
    /// A layer using `policy`.
    pub fn new(policy: impl Into<RetryPolicy>) -> Self {
        Self {
            policy: policy.into(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

impl<S> Layer<S> for RetryLayer {
    type Service = RetryService<S>;

    fn layer(&self, inner: S) -> RetryService<S> {
        RetryService::new(inner, self.policy.clone())
    }
}
