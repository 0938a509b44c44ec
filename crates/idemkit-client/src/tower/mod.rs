//! tower integration: [`RetryLayer`] / [`RetryService`], for any
//! `Service<http::Request<B>>` — a hyper client, a tonic channel, a tower stack.

mod body;
mod layer;

pub use body::{ReplayBody, RetryBody};
pub use layer::RetryLayer;

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use tokio::time::Instant;
use tower::{Service, ServiceExt};

use crate::classify::{Answer, FatalReason, Outcome, classify_error, needs_problem_code, problem_code};
use crate::error::{Last, RetryError};
use crate::policy::{Decision, RetryPolicy, Stop};

/// Largest `409` body read to find the problem `code`.
const PROBLEM_LIMIT: usize = 64 * 1024;

/// The error of a [`RetryService`] wrapping `S` with response body `B`.
pub type TowerRetryError<B, E> = RetryError<Response<RetryBody<B>>, E>;

/// The future of a [`RetryService`].
pub type ResponseFuture<B, E> =
    Pin<Box<dyn Future<Output = Result<Response<RetryBody<B>>, TowerRetryError<B, E>>> + Send>>;

/// A tower service that retries HTTP requests with a [`RetryPolicy`].
///
/// Same contract as [`RetryMiddleware`](crate::RetryMiddleware): `Ok` for successes
/// and never-retried answers, [`RetryError`] when a retryable failure was not retried
/// further. The request body must implement [`ReplayBody`]; a body that returns `None`
/// from it is sent once. The inner service is cloned for retries (tower convention).
#[derive(Debug, Clone)]
pub struct RetryService<S> {
    inner: S,
    policy: RetryPolicy,
}

impl<S> RetryService<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, policy: impl Into<RetryPolicy>) -> Self {
        Self {
            inner,
            policy: policy.into(),
        }
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, ReqB, ResB> Service<Request<ReqB>> for RetryService<S>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: StdError + Send + Sync + 'static,
    ReqB: ReplayBody + Send + 'static,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    type Response = Response<RetryBody<ResB>>;
    type Error = TowerRetryError<ResB, S::Error>;
    type Future = ResponseFuture<ResB, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(not_ready)
    }

    fn call(&mut self, req: Request<ReqB>) -> Self::Future {
        // The ready service serves the first attempt; a clone replaces it (tower convention).
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        let policy = self.policy.clone();
        Box::pin(run(ready, policy, req))
    }
}

fn not_ready<R, E>(err: E) -> RetryError<R, E> {
    RetryError::new(
        Stop::NotRetryable(FatalReason::ServiceNotReady),
        0,
        Outcome::NotSent,
        Last::Error(err),
    )
}

async fn run<S, ReqB, ResB>(
    mut service: S,
    policy: RetryPolicy,
    req: Request<ReqB>,
) -> Result<Response<RetryBody<ResB>>, TowerRetryError<ResB, S::Error>>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    S::Error: StdError + 'static,
    ReqB: ReplayBody,
    ResB: http_body::Body<Data = Bytes>,
    ResB::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let start = Instant::now();
    let replayable = try_clone_request(&req).is_some();
    let mut call = policy.start(req.method(), req.headers(), replayable);
    let mut original = Some(req);
    let mut first = true;
    loop {
        let plan = call.before_attempt(start.elapsed());
        let mut attempt = match original.as_ref().and_then(try_clone_request) {
            Some(clone) => clone,
            None => original.take().expect("an unclonable request is sent once"),
        };
        plan.apply(attempt.headers_mut());
        if !first {
            service.ready().await.map_err(not_ready)?;
        }
        first = false;
        let (outcome, last) = match tokio::time::timeout(plan.timeout(), service.call(attempt)).await {
            Err(_) => (
                Outcome::MaybeExecuted { timed_out: true },
                Last::TimedOut(plan.timeout()),
            ),
            Ok(Err(err)) => (classify_error(&err), Last::Error(err)),
            Ok(Ok(response)) => {
                let (response, answer) = inspect(response).await;
                (Outcome::Answered(answer), Last::Response(response))
            }
        };
        match call.after_attempt(start.elapsed(), &outcome) {
            Decision::Retry(delay) => tokio::time::sleep(delay).await,
            Decision::Stop(stop) => {
                return Err(RetryError::new(stop, call.attempts(), outcome, last));
            }
            Decision::Return => {
                return match last {
                    Last::Response(response) => Ok(response),
                    other => Err(RetryError::new(
                        Stop::NotRetryable(FatalReason::NotAllowlisted),
                        call.attempts(),
                        outcome,
                        other,
                    )),
                };
            }
        }
    }
}

fn try_clone_request<B: ReplayBody>(req: &Request<B>) -> Option<Request<B>> {
    let body = req.body().try_clone_body()?;
    let mut clone = Request::new(body);
    *clone.method_mut() = req.method().clone();
    *clone.uri_mut() = req.uri().clone();
    *clone.version_mut() = req.version();
    *clone.headers_mut() = req.headers().clone();
    *clone.extensions_mut() = req.extensions().clone();
    Some(clone)
}

async fn inspect<B>(response: Response<B>) -> (Response<RetryBody<B>>, Answer)
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let answer = Answer::from_parts(response.status(), response.headers());
    if !needs_problem_code(response.status(), response.headers()) {
        return (response.map(RetryBody::streaming), answer);
    }
    let (parts, body) = response.into_parts();
    let bytes = match Limited::new(body, PROBLEM_LIMIT).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let answer = answer.with_problem_code(problem_code(&bytes));
    (Response::from_parts(parts, RetryBody::buffered(bytes)), answer)
}
