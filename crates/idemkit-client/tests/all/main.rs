//! Integration tests: the reqwest middleware and the tower layer against a real
//! fault-injecting axum server on loopback, deadline behaviour under paused time, and
//! properties of the retry arithmetic.

mod conventions;
mod deadline;
#[cfg(feature = "tonic")]
mod grpc;
#[cfg(feature = "tonic")]
mod grpc_hardening;
mod hardening;
mod key_trust;
mod properties;
mod reqwest_faults;
mod safety;
mod server;
mod tower_layer;

use std::time::Duration;

use idemkit_client::{Backoff, ReqwestRetryError, RetryConfig, RetryMiddleware, RetryPolicy};
use reqwest_middleware::ClientWithMiddleware;

/// Defaults, with short backoffs so the suite stays fast.
pub(crate) fn fast() -> RetryConfig {
    let quick = Backoff::full_jitter(Duration::from_millis(5), Duration::from_millis(50));
    RetryConfig::new()
        .with_backoff(quick)
        .with_throttling_backoff(quick)
}

pub(crate) fn client(config: RetryConfig) -> ClientWithMiddleware {
    client_with(RetryPolicy::new(config).with_seed(7))
}

pub(crate) fn client_with(policy: RetryPolicy) -> ClientWithMiddleware {
    reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy))
        .build()
}

/// The retry error inside a middleware error.
pub(crate) fn retry_error(err: reqwest_middleware::Error) -> ReqwestRetryError {
    match err {
        reqwest_middleware::Error::Middleware(e) => e
            .downcast::<ReqwestRetryError>()
            .expect("a RetryError from the middleware"),
        other => panic!("expected a retry error, got {other:?}"),
    }
}

/// All values equal and present.
pub(crate) fn same_key(keys: &[Option<String>]) -> bool {
    keys.iter().all(Option::is_some) && keys.windows(2).all(|w| w[0] == w[1])
}
