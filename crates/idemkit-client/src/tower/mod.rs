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
use std::time::Duration;

use tokio::time::Instant;
use tower::{Service, ServiceExt};

use crate::classify::{
    Answer, AttemptInfo, FatalReason, Outcome, classify_error, needs_problem_code, problem_code,
};
use crate::error::{Last, RetryError};
use crate::policy::callers_deadline;
use crate::policy::{RetryDecision, RetryPolicy, Stop};
use crate::replay::{Peek, read_start};

/// Largest `409` body read to find the problem `code`.
const PROBLEM_LIMIT: usize = 64 * 1024;

/// The least time an attempt is sent with: less rounds down to `Request-Timeout: 0`.
const MIN_ATTEMPT_BUDGET: Duration = Duration::from_millis(1);

/// The error of a [`RetryService`] wrapping `S` with response body `B`.
pub type TowerRetryError<B, E> = RetryError<Response<RetryBody<B>>, E>;

/// What an attempt left for the caller: the response, the error or the timeout.
type AttemptResult<B, E> = Last<Response<RetryBody<B>>, E>;

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
    ResB::Error: Into<Box<dyn StdError + Send + Sync>> + Send,
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
    let url = req.uri().to_string();
    let mut call = policy.start(req.method(), &url, req.headers(), replayable);
    // The caller's own deadline (its `Request-Timeout`, or a `CallDeadline`) bounds
    // the call when it is the sooner one; it is never sent on raised.
    if let Some(deadline) = callers_deadline(req.headers(), req.extensions()) {
        call.limit_deadline(deadline);
    }
    let mut original = Some(req);
    // The previous attempt's outcome and result, kept for a give-up while waiting.
    let mut previous: Option<(Outcome, AttemptResult<ResB, S::Error>)> = None;
    loop {
        if let Some((outcome, last)) = previous.take() {
            // A retry: the inner service (a rate limiter, a bulkhead) is waited for
            // within the deadline, leaving the time the attempt needs.
            let ready = match call.wait_budget(start.elapsed()) {
                Some(budget) => tokio::time::timeout(budget, service.ready()).await,
                None => Ok(service.ready().await),
            };
            match ready {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => {
                    return Err(RetryError::new(
                        Stop::NotRetryable(FatalReason::ServiceNotReady),
                        call.attempts(),
                        Outcome::NotSent,
                        Last::Error(err),
                    ));
                }
                Err(_) => {
                    return Err(RetryError::new(
                        Stop::DeadlineExceeded,
                        call.attempts(),
                        outcome,
                        last,
                    ));
                }
            }
        }
        if call
            .remaining(start.elapsed())
            .is_some_and(|r| r < MIN_ATTEMPT_BUDGET)
        {
            // Nothing left to send an attempt with (a caller's `Request-Timeout: 0`):
            // the server would refuse it unread.
            return Err(RetryError::new(
                Stop::DeadlineExceeded,
                call.attempts(),
                Outcome::NotSent,
                Last::TimedOut(Duration::ZERO),
            ));
        }
        let plan = call.before_attempt(start.elapsed());
        let mut attempt = match original.as_ref().and_then(try_clone_request) {
            Some(clone) => clone,
            None => original.take().expect("an unclonable request is sent once"),
        };
        plan.apply(attempt.headers_mut());
        // The attempt timeout covers the response headers and, for a `409` read to
        // classify it, its body: a stalled body cannot hold the call past its deadline.
        let sent = async {
            match service.call(attempt).await {
                Err(err) => (classify_error(&err), Last::Error(err)),
                Ok(response) => {
                    let (response, outcome) = inspect(response).await;
                    (outcome, Last::Response(response))
                }
            }
        };
        let (outcome, last) = match tokio::time::timeout(plan.timeout(), sent).await {
            Err(_) => (
                Outcome::MaybeExecuted { timed_out: true },
                Last::TimedOut(plan.timeout()),
            ),
            Ok(done) => done,
        };
        let info = AttemptInfo::new(&outcome);
        let info = match &last {
            Last::Response(response) => info.with_headers(response.headers()),
            Last::Error(err) => info.with_error(err),
            Last::TimedOut(_) => info,
        };
        match call.after_attempt_with(start.elapsed(), info) {
            RetryDecision::Retry(delay) => {
                tokio::time::sleep(delay).await;
                previous = Some((outcome, last));
            }
            RetryDecision::Stop(stop) => {
                return Err(RetryError::new(stop, call.attempts(), outcome, last));
            }
            RetryDecision::Return => {
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

/// Classifies a response; reads the body of a JSON/problem `409` (up to
/// [`PROBLEM_LIMIT`]) to find its `code`. The body is handed on whole whatever the
/// read found: a body too large to classify is not a retry signal and goes on as it
/// is (the bytes read, then the rest); a body whose read failed makes the attempt a
/// failure after sending (*maybe executed*), and the response kept for the caller
/// replays what arrived, then that failure.
async fn inspect<B>(response: Response<B>) -> (Response<RetryBody<B>>, Outcome)
where
    B: http_body::Body<Data = Bytes>,
{
    let answer = Answer::from_parts(response.status(), response.headers());
    if !needs_problem_code(response.status(), response.headers()) {
        return (response.map(RetryBody::streaming), Outcome::Answered(answer));
    }
    let (parts, body) = response.into_parts();
    let (body, peek) = read_start(body, PROBLEM_LIMIT).await;
    let outcome = match peek {
        Peek::Whole(bytes) => Outcome::Answered(answer.with_problem_code(problem_code(&bytes))),
        Peek::TooLarge => Outcome::Answered(answer),
        Peek::Failed => Outcome::MaybeExecuted { timed_out: false },
    };
    (Response::from_parts(parts, RetryBody::replayed(body)), outcome)
}
