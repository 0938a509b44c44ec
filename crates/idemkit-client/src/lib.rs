//! Client retries with defaults that make retried writes safe.
//!
//! ```
//! use std::convert::Infallible;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//!
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use idemkit_client::{IDEMPOTENCY_KEY, RetryConfig, RetryLayer};
//! use tower::{ServiceBuilder, ServiceExt};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! // A transport that is unavailable once, then succeeds; it records the keys it sees.
//! let calls = Arc::new(AtomicU32::new(0));
//! let keys = Arc::new(std::sync::Mutex::new(Vec::new()));
//! let transport = {
//!     let (calls, keys) = (calls.clone(), keys.clone());
//!     tower::service_fn(move |req: Request<Full<Bytes>>| {
//!         let n = calls.fetch_add(1, Ordering::SeqCst);
//!         keys.lock().unwrap().push(req.headers()[IDEMPOTENCY_KEY].clone());
//!         let status = if n == 0 { StatusCode::SERVICE_UNAVAILABLE } else { StatusCode::CREATED };
//!         async move { Ok::<_, std::io::Error>(Response::builder().status(status).body(Full::new(Bytes::new())).unwrap()) }
//!     })
//! };
//! let client = ServiceBuilder::new()
//!     .layer(RetryLayer::new(RetryConfig::new()))
//!     .service(transport);
//!
//! let request = Request::post("http://orders.internal/orders").body(Full::new(Bytes::from("{}"))).unwrap();
//! let response = client.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::CREATED);
//! assert_eq!(calls.load(Ordering::SeqCst), 2);
//! // The POST got one generated key, sent on both attempts.
//! let keys = keys.lock().unwrap();
//! assert_eq!(keys[0], keys[1]);
//! # }
//! ```
//!
//! What the defaults do (SPEC §8; the guide is [`guide`]):
//!
//! - **Classification** ([`Classifier`]) is separate from **policy** ([`RetryPolicy`],
//!   [`Call`]). Each attempt ends as *not sent*, *maybe executed* or *answered*
//!   ([`Outcome`]). Retried: not-sent failures, 429, 502, 503, 504 and
//!   `409 idempotency_request_in_progress`; 500 only when opted in. Never: other 4xx,
//!   auth, `409 idempotency_key_reused`. A *maybe executed* failure is retried only
//!   when the request carries an idempotency key or its method is idempotent.
//! - **Keys**: a non-idempotent request without a key gets a UUID v4 once per logical
//!   call, reused on every attempt ([`AutoKey`]); [`IdempotencyKey::derived`] builds
//!   event-derived keys.
//! - **Backoff**: full jitter (default) or decorrelated jitter ([`Backoff`]);
//!   `Retry-After` is a floor; a wait that would end past the deadline stops at once
//!   with a [`RetryError`] carrying the server's `Retry-After`.
//! - **Caps**: 3 attempts in total and one 30 s deadline per call; each attempt's
//!   timeout is `min(attempt timeout, remaining)` ([`AttemptTimeout`], optionally
//!   adaptive).
//! - **Budget**: a [`TokenBucket`] shared by all calls of a client, replaceable through
//!   the [`Budget`] trait.
//! - **Observability**: each retry is a `tracing` event (attempt, outcome, next delay);
//!   counters `idemkit_client_attempts_total{outcome, verdict}`,
//!   `idemkit_client_retries_total{kind, reason}` and
//!   `idemkit_client_gave_up_total{reason}` (`budget_exhausted` among the reasons) go
//!   through `metrics`.
//!
//! Keys buy *effectively once* within the key scope and replay window of a server that
//! honours them — not a guarantee against every duplicate.
//!
//! # Features
//!
//! | feature | default | enables |
//! |---|---|---|
//! | `reqwest` | yes | [`RetryMiddleware`] for `reqwest-middleware` |
//! | `tower` | yes | [`RetryLayer`] / [`RetryService`] for hyper, tonic and tower stacks |
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backoff;
mod budget;
mod classify;
mod error;
mod key;
mod policy;
mod timeout;

#[cfg(feature = "reqwest")]
mod reqwest;
#[cfg(feature = "tower")]
mod tower;

pub use backoff::{Backoff, BackoffIter, Jitter};
pub use budget::{Budget, TokenBucket, Unlimited, Withdrawal};
pub use classify::{
    Answer, CODE_IN_PROGRESS, CODE_KEY_REUSED, Classifier, FatalReason, Outcome, PROBLEM_CONTENT_TYPE,
    RetryKind, Verdict, classify_error, needs_problem_code, problem_code, retry_after,
};
pub use error::{Last, RetryError};
pub use key::{AutoKey, IDEMPOTENCY_KEY, IdempotencyKey, InvalidKey};
pub use policy::{
    ATTEMPT_HEADER, AttemptPlan, Call, Decision, RetryConfig, RetryPolicy, Stop, TIMEOUT_HEADER,
    is_idempotent,
};
pub use timeout::{AdaptiveTimeout, AttemptTimeout};

#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use crate::reqwest::{ReqwestRetryError, RetryMiddleware};
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub use crate::tower::{ReplayBody, ResponseFuture, RetryBody, RetryLayer, RetryService, TowerRetryError};

#[doc = include_str!("../../../docs/client.md")]
pub mod guide {}
