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
//! use idemkit_client::wire::IDEMPOTENCY_KEY;
//! use idemkit_client::{RetryConfig, RetryLayer};
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
//! Start with the guide's client page (`docs/client.md` in the repository's book):
//! results, settings, examples. In short:
//!
//! - **Results**: `Ok(response)` for a success *and* for an answer that is never
//!   retried (400, 401, 404, 500 unless opted in, `409 idempotency_key_reused`, …);
//!   `Err` ([`RetryError`]) when a retryable failure was not retried any further. It
//!   carries the last answer ([`RetryError::status`], [`RetryError::headers`],
//!   [`RetryError::into_response`]) and why retrying stopped ([`RetryError::stop_reason`]).
//! - **Classification** ([`Classifier`]) is separate from **policy** ([`RetryPolicy`],
//!   [`Call`]). Each attempt ends as *not sent*, *maybe executed* or *answered*
//!   ([`Outcome`]). Retried: not-sent failures, 429, 502, 503, 504 and
//!   `409 idempotency_request_in_progress`; 500 only when opted in. Never: other 4xx,
//!   auth, `409 idempotency_key_reused`. A *maybe executed* failure — a timeout or reset
//!   after sending, or a gateway's 502/504 — is retried only when the request is
//!   *protected*: its method is idempotent, it carries the caller's key, or it carries
//!   the automatic key and the route is known to honour it. Extend the allowlist with
//!   a hook that can delegate to it ([`RetryPolicy::with_classifier_hook`]).
//! - **Keys**: a POST, PATCH, PUT or DELETE without a key gets a UUID v4 once per
//!   logical call, reused on every attempt ([`AutoKey`]). Against a server that ignores
//!   keys that key protects nothing, so by default it makes a lost answer retryable only
//!   on routes the server's published `x-idempotency` policy names
//!   ([`RetryPolicy::with_published_policy`]); [`IdempotencyKey::derived`] builds
//!   event-derived keys.
//! - **Backoff**: full jitter (default) or decorrelated jitter ([`Backoff`]).
//!   `Retry-After` is a floor with the jittered backoff added above it, honoured up to
//!   60 s ([`RetryConfig::with_retry_after_cap`]); a longer one, or one ending past the
//!   deadline, stops at once with a [`RetryError`] carrying the server's answer and hint.
//! - **Caps**: 3 attempts in total (attempts, not retries:
//!   [`RetryConfig::with_max_retries`] counts retries) and one 30 s deadline per call
//!   ([`RetryConfig::with_deadline`]); each attempt's timeout is
//!   `min(attempt timeout, remaining)` ([`RetryConfig::with_attempt_timeout`], or
//!   [`RetryConfig::with_adaptive_attempt_timeout`]).
//! - **Budget**: a [`TokenBucket`] shared by all calls of a client, replaceable through
//!   the [`Budget`] trait; [`RetryPolicy::budget_remaining`] reads it.
//! - **Observability**: each retry is a `tracing` event (attempt, outcome, next delay);
//!   counters `idemkit_client_attempts_total{outcome, verdict}`,
//!   `idemkit_client_retries_total{kind, reason}` and
//!   `idemkit_client_gave_up_total{reason}` (`budget_exhausted` among the reasons) and
//!   the gauge `idemkit_client_budget_tokens{client}` go through `metrics`.
//!
//! Keys buy *effectively once* within the key scope and replay window of a server that
//! honours them — not a guarantee against every duplicate.
//!
//! # Features
//!
#![doc = document_features::document_features!()]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod backoff;
mod budget;
mod classify;
mod error;
mod key;
mod policy;
mod policy_doc;
#[cfg(any(feature = "reqwest", feature = "tower", feature = "tonic"))]
mod replay;
mod timeout;

#[cfg(feature = "tonic")]
mod grpc;
#[cfg(feature = "reqwest")]
mod reqwest;
#[cfg(feature = "tower")]
mod tower;

pub use backoff::{Backoff, BackoffIter, Jitter};
pub use budget::{Budget, TokenBucket, Unlimited, Withdrawal};
pub use classify::{
    Answer, AttemptInfo, CODE_IN_PROGRESS, CODE_KEY_REUSED, Classifier, ClassifyHook, FatalReason, Outcome,
    PROBLEM_CONTENT_TYPE, RetryKind, Verdict, classify_error, needs_problem_code, problem_code, retry_after,
};
pub use error::{Last, RetryError};
pub use idemkit_core::wire;
pub use key::{AutoKey, IdempotencyKey, InvalidKey};
pub use policy::{
    AttemptPlan, Call, CallDeadline, RetryConfig, RetryDecision, RetryPolicy, Stop, gets_auto_key,
    is_idempotent,
};
pub use policy_doc::{KeyLocation, PolicyDocError, PublishedAnswer, PublishedOperation, PublishedPolicy};
pub use timeout::{AdaptiveTimeout, AttemptTimeout};

#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub use crate::grpc::{
    GrpcResponseFuture, GrpcRetryError, GrpcRetryLayer, GrpcRetryService, grpc_timeout_value,
    parse_grpc_timeout,
};
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub use crate::reqwest::{ReqwestRetryError, RetryErrorExt, RetryMiddleware};
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub use crate::tower::{ReplayBody, ResponseFuture, RetryBody, RetryLayer, RetryService, TowerRetryError};
