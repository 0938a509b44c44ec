//! The clients: every request is sent through the real `idemkit-client`
//! retry policy ([`RetryService`]), whose transport is one in-process attempt
//! at a live instance. The policy decides what is retried (its allowlist: not
//! sent, maybe executed with the caller's key, 429, 502, 503, 504, `409 in
//! progress`; 500 only where opted in), how long it backs off (full jitter
//! with `Retry-After` as a floor, on the scheduler's virtual clock), when it
//! stops (attempts, deadline, budget), and sends each attempt's
//! `Request-Timeout`, which the engine enforces.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use futures::FutureExt;
use http::{Request, Response};
use http_body_util::Full;
use idemkit_client::{Backoff, Classifier, RetryConfig, RetryPolicy, RetryService};
use tower::ServiceExt;

use super::{Spec, World};
use crate::check::Answer;

/// Records a hang-up when an attempt's future is dropped (its timeout fired,
/// or the call's deadline) before its answer was read whole.
struct HangUp<'a> {
    world: &'a World,
    spec: usize,
    answered: bool,
}

impl Drop for HangUp<'_> {
    fn drop(&mut self) {
        if !self.answered {
            self.world.record(Answer::hung_up(self.spec, false));
        }
    }
}

impl World {
    /// A client's retry policy (the REST and the gRPC ones alike): 5 attempts
    /// within 45 s, a random attempt timeout (the client hangs up and
    /// retries), full jitter from 100 ms to 3 s, its randomness seeded by the
    /// schedule; `adjust` adds what one kind of client sets on top.
    pub(super) fn retry_policy(&self, adjust: impl FnOnce(RetryConfig) -> RetryConfig) -> RetryPolicy {
        let (attempt_timeout, seed) = self.sched.with_rng(|r| (r.millis(300, 9000), r.next_u64()));
        let config = RetryConfig::new()
            .with_max_attempts(5)
            .with_deadline(Duration::from_secs(45))
            .with_attempt_timeout(attempt_timeout)
            .with_backoff(Backoff::full_jitter(
                Duration::from_millis(100),
                Duration::from_secs(3),
            ));
        RetryPolicy::new(adjust(config)).with_seed(seed)
    }

    /// One client's call: `spec` through the real retry policy
    /// ([`World::retry_policy`]; 500 retried for half of the clients).
    pub(super) async fn client(self: Arc<Self>, spec: Spec) {
        if spec.grpc() {
            return self.grpc_client(spec).await;
        }
        let retry_500 = self.sched.with_rng(|r| r.chance(0.5));
        let policy =
            self.retry_policy(|config| config.with_classifier(Classifier::new().with_retry_500(retry_500)));
        let world = self.clone();
        let id = spec.id;
        let transport = tower::service_fn(move |req: Request<Full<Bytes>>| {
            let world = world.clone();
            async move { world.attempt(id, req).await }
        });
        let outcome = RetryService::new(transport, policy)
            .oneshot(spec.request().map(Full::new))
            .await;
        self.sched.note(|| match &outcome {
            Ok(res) => format!("client {id}: done with {}", res.status()),
            Err(e) => format!("client {id}: gave up: {e}"),
        });
    }

    /// One attempt: the request through a live instance's router, its answer
    /// read whole and recorded. An instance that crashes under it resets the
    /// connection (an error after sending: maybe executed).
    async fn attempt(&self, spec: usize, req: Request<Full<Bytes>>) -> io::Result<Response<Full<Bytes>>> {
        let mut guard = HangUp {
            world: self,
            spec,
            answered: false,
        };
        let inst = self.live();
        let call = async {
            let res = inst
                .app
                .clone()
                .oneshot(req.map(Body::new))
                .await
                .expect("infallible router");
            let (parts, body) = res.into_parts();
            let body = axum::body::to_bytes(body, usize::MAX).await.unwrap_or_default();
            (parts, body)
        };
        match std::panic::AssertUnwindSafe(call).catch_unwind().await {
            Ok((parts, body)) => {
                guard.answered = true;
                self.record(Answer::new(spec, parts.status.as_u16(), body.to_vec(), false));
                Ok(Response::from_parts(parts, Full::new(body)))
            }
            Err(_) => {
                guard.answered = true;
                self.record(Answer::hung_up(spec, false));
                Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the instance crashed",
                ))
            }
        }
    }
}
