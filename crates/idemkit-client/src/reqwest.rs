//! [`reqwest-middleware`](reqwest_middleware) integration.

use http::Extensions;
use std::time::Duration;

use reqwest::{Request, Response, ResponseBuilderExt};
use reqwest_middleware::{Middleware, Next};
use tokio::time::Instant;

use crate::classify::{Answer, AttemptInfo, Outcome, classify_error, needs_problem_code, problem_code};
use crate::error::{Last, RetryError};
use crate::policy::{RetryDecision, RetryPolicy, Stop, callers_deadline};
use crate::replay::{Peek, read_start};

/// Largest `409` body read to find the problem `code`.
const PROBLEM_LIMIT: usize = 64 * 1024;

/// The least time an attempt is sent with: less rounds down to `Request-Timeout: 0`.
const MIN_ATTEMPT_BUDGET: Duration = Duration::from_millis(1);

/// The error a retried reqwest call ends with, inside
/// [`reqwest_middleware::Error::Middleware`]. Get it back with
/// [`RetryErrorExt::into_retry_error`] (by value, to read the last body) or
/// [`RetryErrorExt::retry_error`] (by reference).
pub type ReqwestRetryError = RetryError<Response, reqwest_middleware::Error>;

/// Gets the [`ReqwestRetryError`] out of a `reqwest_middleware::Error`.
///
/// reqwest's own helpers (`status()`, `is_status()`, …) know nothing about it: after
/// retries are exhausted on 503s they answer `None`/`false`. Ask the retry error
/// instead.
///
/// ```no_run
/// use idemkit_client::{RetryErrorExt, RetryMiddleware};
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::default())
///     .build();
/// match client.get("http://inventory.internal/items/7").send().await {
///     Ok(response) => println!("answered {}", response.status()),
///     Err(err) => match err.into_retry_error() {
///         Ok(gave_up) => {
///             println!("gave up: {} (status {:?})", gave_up.stop_reason(), gave_up.status());
///             if let Some(last) = gave_up.into_response() {
///                 println!("last body: {}", last.text().await?);
///             }
///         }
///         Err(other) => return Err(other), // e.g. an invalid URL: never attempted
///     },
/// }
/// # Ok(())
/// # }
/// ```
pub trait RetryErrorExt: Sized + sealed::Sealed {
    /// The retry error, by reference, when this error is one.
    fn retry_error(&self) -> Option<&ReqwestRetryError>;

    /// The retry error, by value, when this error is one; the error itself otherwise.
    ///
    /// # Errors
    ///
    /// `Err(self)` when the error did not come from [`RetryMiddleware`].
    fn into_retry_error(self) -> Result<ReqwestRetryError, Self>;

    /// reqwest-retry's convention in one call: the last response when the retries
    /// ended on an answer (the third 503, a 429 whose `Retry-After` was too long),
    /// as `Ok`; the error itself otherwise (a transport failure, a timeout, an
    /// error that did not come from [`RetryMiddleware`]).
    ///
    /// ```no_run
    /// use idemkit_client::{RetryErrorExt, RetryMiddleware};
    ///
    /// # async fn run() -> Result<(), reqwest_middleware::Error> {
    /// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
    ///     .with(RetryMiddleware::default())
    ///     .build();
    /// // `Ok(503)` after the last retry, as with reqwest-retry.
    /// let response = client
    ///     .get("http://inventory.internal/items/7")
    ///     .send()
    ///     .await
    ///     .or_else(RetryErrorExt::into_last_response)?;
    /// println!("{}", response.status());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// `Err(self)` when there is no last response.
    fn into_last_response(self) -> Result<Response, Self>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for reqwest_middleware::Error {}
}

impl RetryErrorExt for reqwest_middleware::Error {
    fn retry_error(&self) -> Option<&ReqwestRetryError> {
        match self {
            Self::Middleware(e) => e.downcast_ref::<ReqwestRetryError>(),
            Self::Reqwest(_) => None,
        }
    }

    fn into_retry_error(self) -> Result<ReqwestRetryError, Self> {
        match self {
            Self::Middleware(e) => e.downcast::<ReqwestRetryError>().map_err(Self::Middleware),
            other @ Self::Reqwest(_) => Err(other),
        }
    }

    fn into_last_response(self) -> Result<Response, Self> {
        if self.retry_error().is_none_or(|e| e.last_response().is_none()) {
            return Err(self);
        }
        let retry = self.into_retry_error()?;
        Ok(retry.into_response().expect("checked above"))
    }
}

/// A `reqwest-middleware` middleware that retries with a [`RetryPolicy`].
///
/// Returns `Ok(response)` for successes and for answers that are never retried (400,
/// 401, `409 idempotency_key_reused`, …). When a retryable failure is not retried any
/// further it returns [`reqwest_middleware::Error::Middleware`] holding a
/// [`ReqwestRetryError`] (get it with [`RetryErrorExt::into_retry_error`]), which keeps
/// the last response or transport error and says why it stopped.
///
/// Requests whose body cannot be cloned (streams) are sent once. The attempt timeout
/// covers the time to the response headers (and, for a JSON/problem `409`, to its
/// body, read to classify it); reading the body afterwards is the caller's. A
/// caller's own `Request-Timeout` header, or a [`CallDeadline`](crate::CallDeadline)
/// extension, shortens the call's deadline.
///
/// ```no_run
/// use idemkit_client::wire::IDEMPOTENCY_KEY;
/// use idemkit_client::{IdempotencyKey, RetryMiddleware};
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::default())
///     .build();
/// let response = client
///     .post("http://127.0.0.1:8080/orders/42/confirm")
///     .header(IDEMPOTENCY_KEY, IdempotencyKey::derived("order-confirm", 42).as_str())
///     .send()
///     .await?;
/// # let _ = response;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct RetryMiddleware {
    policy: RetryPolicy,
}

impl RetryMiddleware {
    /// A middleware using `policy` (and its shared budget).
    #[must_use]
    pub fn new(policy: impl Into<RetryPolicy>) -> Self {
        Self {
            policy: policy.into(),
        }
    }

    /// The policy.
    #[must_use]
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let start = Instant::now();
        let replayable = req.try_clone().is_some();
        let mut call = self
            .policy
            .start(req.method(), req.url().as_str(), req.headers(), replayable);
        // The caller's own deadline (its `Request-Timeout`, or a `CallDeadline`)
        // bounds the call when it is the sooner one; it is never sent on raised.
        if let Some(deadline) = callers_deadline(req.headers(), extensions) {
            call.limit_deadline(deadline);
        }
        let mut original = Some(req);
        loop {
            if call
                .remaining(start.elapsed())
                .is_some_and(|r| r < MIN_ATTEMPT_BUDGET)
            {
                // Nothing left to send an attempt with (a caller's `Request-Timeout: 0`).
                let err = RetryError::<Response, reqwest_middleware::Error>::new(
                    Stop::DeadlineExceeded,
                    call.attempts(),
                    Outcome::NotSent,
                    Last::TimedOut(Duration::ZERO),
                );
                return Err(reqwest_middleware::Error::middleware(err));
            }
            let plan = call.before_attempt(start.elapsed());
            // A clone goes out and the original stays for later attempts; an unclonable
            // request is sent itself, once (the policy never retries it).
            let mut attempt = match original.as_ref().and_then(Request::try_clone) {
                Some(clone) => clone,
                None => original.take().expect("an unclonable request is sent once"),
            };
            plan.apply(attempt.headers_mut());
            let mut attempt_extensions = extensions.clone();
            // The attempt timeout covers the response headers and, for a `409` read
            // to classify it, its body: a stalled body cannot hold the call past its
            // deadline.
            let sent = async {
                match next.clone().run(attempt, &mut attempt_extensions).await {
                    Err(err) => (transport_outcome(&err), Last::Error(err)),
                    Ok(response) => inspect(response).await,
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
            let decision = call.after_attempt_with(start.elapsed(), info);
            if !matches!(decision, RetryDecision::Retry(_)) {
                // The extensions of the attempt whose result the caller gets.
                *extensions = attempt_extensions;
            }
            match decision {
                RetryDecision::Retry(delay) => tokio::time::sleep(delay).await,
                RetryDecision::Stop(stop) => {
                    let err = RetryError::new(stop, call.attempts(), outcome, last);
                    return Err(reqwest_middleware::Error::middleware(err));
                }
                RetryDecision::Return => {
                    return match last {
                        Last::Response(response) => Ok(response),
                        Last::Error(err) => Err(err),
                        Last::TimedOut(_) => unreachable!("the policy returns answers only"),
                    };
                }
            }
        }
    }
}

fn transport_outcome(err: &reqwest_middleware::Error) -> Outcome {
    match err {
        reqwest_middleware::Error::Reqwest(e) if e.is_connect() => Outcome::NotSent,
        reqwest_middleware::Error::Reqwest(e) if e.is_timeout() => Outcome::MaybeExecuted { timed_out: true },
        reqwest_middleware::Error::Reqwest(e) => classify_error(e),
        reqwest_middleware::Error::Middleware(e) => classify_error(e.as_ref()),
    }
}

/// Classifies a response; reads the body of a JSON/problem `409` (up to
/// [`PROBLEM_LIMIT`]) to find its `code`, then rebuilds an equivalent response for
/// the caller. The body is handed on whole whatever the read found: a body too large
/// to classify is not a retry signal and goes on as it is (the bytes read, then the
/// rest); a body whose read failed is that transport error (*maybe executed*), never
/// an empty `409`.
async fn inspect(response: Response) -> (Outcome, Last<Response, reqwest_middleware::Error>) {
    let status = response.status();
    let answer = Answer::from_parts(status, response.headers());
    if !needs_problem_code(status, response.headers()) {
        return (Outcome::Answered(answer), Last::Response(response));
    }
    let url = response.url().clone();
    let http_response: http::Response<reqwest::Body> = response.into();
    let (parts, body) = http_response.into_parts();
    let (mut body, peek) = read_start(body, PROBLEM_LIMIT).await;
    let answer = match peek {
        Peek::Whole(bytes) => answer.with_problem_code(problem_code(&bytes)),
        Peek::TooLarge => answer,
        Peek::Failed => {
            let err = body.take_error().expect("a failed read keeps its error");
            return (
                Outcome::MaybeExecuted { timed_out: false },
                Last::Error(reqwest_middleware::Error::Reqwest(err)),
            );
        }
    };
    let mut builder = http::Response::builder()
        .status(parts.status)
        .version(parts.version);
    if let Some(headers) = builder.headers_mut() {
        *headers = parts.headers;
    }
    // Every extension of the original response (its connection info, what inner
    // middleware attached), then its URL, which reqwest keeps outside the extensions:
    // set before them, it would be overwritten and read back as a placeholder.
    *builder.extensions_mut().expect("a fresh builder") = parts.extensions;
    let rebuilt = builder
        .url(url)
        .body(reqwest::Body::wrap(body))
        .expect("parts of a valid response");
    (Outcome::Answered(answer), Last::Response(Response::from(rebuilt)))
}
