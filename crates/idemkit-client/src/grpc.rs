//! tonic integration: [`GrpcRetryLayer`] / [`GrpcRetryService`], retrying unary gRPC
//! calls by gRPC status code with the same [`RetryPolicy`] as the HTTP integrations.
//!
//! A tonic request body is a stream and cannot be cloned, so tower's `Retry` cannot
//! wrap a channel. This layer buffers the unary request message once and sends a copy
//! on every attempt; the unary response is buffered too, so that its status (in the
//! headers of a trailers-only answer, or in the trailers) can be read before deciding.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use tower::{Layer, Service, ServiceExt};

use crate::classify::{Answer, CODE_IN_PROGRESS, FatalReason, Outcome, classify_error};
use crate::policy::{Decision, RetryPolicy, Stop};

/// The gRPC deadline header, set on every attempt to its remaining budget (`1234m`).
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// gRFC A6 server pushback: a delay in milliseconds before retrying, or (negative or
/// malformed) a request not to retry.
pub const GRPC_RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

const GRPC_STATUS: &str = "grpc-status";
const GRPC_STATUS_DETAILS: &str = "grpc-status-details-bin";

type BoxError = Box<dyn StdError + Send + Sync>;

/// The future of a [`GrpcRetryService`].
pub type GrpcResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, GrpcRetryError>> + Send>>;

/// A tower [`Layer`] for tonic client channels: wraps a
/// `Service<http::Request<tonic::body::Body>>` (e.g. `tonic::transport::Channel`) in a
/// [`GrpcRetryService`].
///
/// ```
/// use idemkit_client::{GrpcRetryLayer, RetryConfig};
///
/// let layer = GrpcRetryLayer::new(RetryConfig::new())
///     .with_streaming_method("/labels.v1.Labels/WatchTracking");
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Default)]
pub struct GrpcRetryLayer {
    policy: RetryPolicy,
    streaming: Arc<Vec<&'static str>>,
}

impl GrpcRetryLayer {
    /// A layer using `policy`; every method is treated as unary.
    pub fn new(policy: impl Into<RetryPolicy>) -> Self {
        Self {
            policy: policy.into(),
            streaming: Arc::default(),
        }
    }

    /// Passes calls to `path` (`/package.Service/Method`, a streaming method) through
    /// untouched: sent once, neither buffered nor retried.
    #[must_use]
    pub fn with_streaming_method(mut self, path: &'static str) -> Self {
        Arc::make_mut(&mut self.streaming).push(path);
        self
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

impl<S> Layer<S> for GrpcRetryLayer {
    type Service = GrpcRetryService<S>;

    fn layer(&self, inner: S) -> GrpcRetryService<S> {
        GrpcRetryService {
            inner,
            policy: self.policy.clone(),
            streaming: Arc::clone(&self.streaming),
        }
    }
}

/// A tower service that retries unary gRPC calls with a [`RetryPolicy`].
///
/// Retried: `UNAVAILABLE`, `RESOURCE_EXHAUSTED` (as throttling) and `ABORTED` whose
/// `google.rpc.ErrorInfo` reason is `idempotency_request_in_progress` (throttling);
/// `DEADLINE_EXCEEDED`, an attempt timeout and a reset after sending are *maybe
/// executed*, retried only when the call carries an idempotency key. Every other code
/// is returned as is (`Ok`, so tonic hands the caller the server's own status). Each
/// attempt carries its remaining budget as `grpc-timeout`; `grpc-retry-pushback-ms`
/// and `RetryInfo.retry_delay` are floors like `Retry-After`.
#[derive(Debug, Clone)]
pub struct GrpcRetryService<S> {
    inner: S,
    policy: RetryPolicy,
    streaming: Arc<Vec<&'static str>>,
}

impl<S> GrpcRetryService<S> {
    /// Wraps `inner`.
    pub fn new(inner: S, policy: impl Into<RetryPolicy>) -> Self {
        GrpcRetryLayer::new(policy).layer(inner)
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

impl<S, ResB> Service<Request<Body>> for GrpcRetryService<S>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = GrpcRetryError;
    type Future = GrpcResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(|e| not_ready(e.into()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        if self.streaming.iter().any(|p| *p == req.uri().path()) {
            return Box::pin(async move {
                match ready.call(req).await {
                    Ok(response) => Ok(response.map(Body::new)),
                    Err(err) => {
                        let err = err.into();
                        let outcome = classify_error(&*err);
                        Err(GrpcRetryError::new(
                            Stop::NotReplayable,
                            1,
                            outcome,
                            Status::from_error(err),
                        ))
                    }
                }
            });
        }
        Box::pin(run(ready, self.policy.clone(), req))
    }
}

fn not_ready(err: BoxError) -> GrpcRetryError {
    GrpcRetryError::new(
        Stop::NotRetryable(FatalReason::ServiceNotReady),
        0,
        Outcome::NotSent,
        Status::from_error(err),
    )
}

/// What one attempt ended with.
enum Attempt {
    /// The server answered: the rebuilt response, its classification and its status.
    Answered(Response<Body>, Answer, Status),
    /// The transport failed, or the response stream broke.
    Failed(Outcome, Status),
}

async fn run<S, ResB>(
    mut service: S,
    policy: RetryPolicy,
    req: Request<Body>,
) -> Result<Response<Body>, GrpcRetryError>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let start = Instant::now();
    let (parts, body) = req.into_parts();
    // The unary message, buffered once: each attempt sends a copy.
    let message = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => {
            return Err(GrpcRetryError::new(
                Stop::NotRetryable(FatalReason::NotAllowlisted),
                0,
                Outcome::NotSent,
                err,
            ));
        }
    };
    // A caller's own `grpc-timeout` still bounds the whole call.
    let caller_budget = parts.headers.get(GRPC_TIMEOUT).and_then(parse_grpc_timeout);
    let mut call = policy.start(&Method::POST, &parts.headers, true);
    let mut first = true;
    loop {
        let plan = call.before_attempt(start.elapsed());
        let mut timeout = plan.timeout();
        if let Some(budget) = caller_budget {
            timeout = timeout.min(budget.saturating_sub(start.elapsed()));
        }
        let mut attempt = Request::from_parts(parts.clone(), Body::new(Full::new(message.clone())));
        plan.apply_metadata(attempt.headers_mut());
        attempt
            .headers_mut()
            .insert(GRPC_TIMEOUT, grpc_timeout_value(timeout));
        if !first {
            service.ready().await.map_err(|e| not_ready(e.into()))?;
        }
        first = false;
        let sent = async {
            let response = match service.call(attempt).await {
                Ok(response) => response,
                Err(err) => {
                    let err = err.into();
                    return Attempt::Failed(classify_error(&*err), Status::from_error(err));
                }
            };
            read_response(response).await
        };
        let (outcome, response, status) = match tokio::time::timeout(timeout, sent).await {
            Err(_) => (
                Outcome::MaybeExecuted { timed_out: true },
                None,
                Status::deadline_exceeded(format!("attempt timed out after {} ms", timeout.as_millis())),
            ),
            Ok(Attempt::Failed(outcome, status)) => (outcome, None, status),
            Ok(Attempt::Answered(response, answer, status)) => {
                (Outcome::Answered(answer), Some(response), status)
            }
        };
        match call.after_attempt(start.elapsed(), &outcome) {
            Decision::Retry(delay) => tokio::time::sleep(delay).await,
            Decision::Stop(stop) => {
                return Err(GrpcRetryError::new(stop, call.attempts(), outcome, status));
            }
            Decision::Return => {
                return match response {
                    Some(response) => Ok(response),
                    None => Err(GrpcRetryError::new(
                        Stop::NotRetryable(FatalReason::NotAllowlisted),
                        call.attempts(),
                        outcome,
                        status,
                    )),
                };
            }
        }
    }
}

/// Reads a unary response to its status: from the headers of a trailers-only answer,
/// else from the trailers after the (buffered) message.
async fn read_response<B>(response: Response<B>) -> Attempt
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    if parts.headers.contains_key(GRPC_STATUS) {
        let (answer, status) = judge(&parts.headers);
        let body = Body::new(body.map_err(Into::into));
        return Attempt::Answered(Response::from_parts(parts, body), answer, status);
    }
    if parts.status != StatusCode::OK {
        // Not a gRPC answer (a proxy's): judged by its HTTP status.
        let answer = Answer::from_parts(parts.status, &parts.headers);
        let status = Status::new(code_of_http(parts.status), format!("HTTP {}", parts.status));
        let body = Body::new(body.map_err(Into::into));
        return Attempt::Answered(Response::from_parts(parts, body), answer, status);
    }
    let collected = match body.collect().await {
        Ok(collected) => collected,
        // The stream broke after the request was sent: maybe executed.
        Err(err) => {
            return Attempt::Failed(
                Outcome::MaybeExecuted { timed_out: false },
                Status::from_error(err.into()),
            );
        }
    };
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let data = collected.to_bytes();
    let (answer, status) = if trailers.contains_key(GRPC_STATUS) {
        judge(&trailers)
    } else {
        let status = Status::internal("the response ended without a grpc-status");
        (judge_status(&status, None), status)
    };
    let body = Full::new(data).with_trailers(async move { Some(Ok(trailers)) });
    Attempt::Answered(Response::from_parts(parts, Body::new(body)), answer, status)
}

/// The status in `map` (trailers, or the headers of a trailers-only answer) and how
/// the policy judges it.
fn judge(map: &HeaderMap) -> (Answer, Status) {
    let status = status_from_map(map);
    let pushback = map.get(GRPC_RETRY_PUSHBACK_MS).map(parse_pushback);
    (judge_status(&status, pushback), status)
}

/// Maps a gRPC status onto the HTTP answer the [`Classifier`](crate::Classifier)
/// judges: `UNAVAILABLE` → 503, `RESOURCE_EXHAUSTED` → 429, `ABORTED` in progress → the
/// in-progress 409, `DEADLINE_EXCEEDED` → 504 (maybe executed), `OK` → 200, anything
/// else → 400 (never retried).
fn judge_status(status: &Status, pushback: Option<Option<Duration>>) -> Answer {
    let details = status.get_error_details();
    let reason = details.error_info().map(|info| info.reason.clone());
    let http = match status.code() {
        Code::Ok => StatusCode::OK,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Aborted if reason.as_deref() == Some(CODE_IN_PROGRESS) => StatusCode::CONFLICT,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::BAD_REQUEST,
    };
    let retry_info = details.retry_info().and_then(|info| info.retry_delay);
    let (retry_after, refused) = match pushback {
        Some(Some(delay)) => (Some(delay), false),
        Some(None) => (None, true),
        None => (retry_info, false),
    };
    Answer::new(http)
        .with_retry_after(retry_after)
        .with_problem_code(reason)
        .with_retry_refused(refused)
        .with_grpc_code(Some(status.code() as i32))
}

/// The status in `map`. tonic's own `Status::from_header_map` panics on malformed
/// `grpc-status-details-bin`; such details are dropped here first.
fn status_from_map(map: &HeaderMap) -> Status {
    let engine = base64::engine::GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        base64::engine::GeneralPurposeConfig::new()
            .with_encode_padding(false)
            .with_decode_padding_mode(base64::engine::DecodePaddingMode::Indifferent),
    );
    let bad_details = map
        .get(GRPC_STATUS_DETAILS)
        .is_some_and(|v| engine.decode(v.as_bytes()).is_err());
    let status = if bad_details {
        let mut map = map.clone();
        map.remove(GRPC_STATUS_DETAILS);
        Status::from_header_map(&map)
    } else {
        Status::from_header_map(map)
    };
    status.unwrap_or_else(|| Status::internal("missing grpc-status"))
}

/// gRFC A6: `Some(delay)` for a non-negative integer, `None` (do not retry) for a
/// negative or malformed value.
fn parse_pushback(value: &HeaderValue) -> Option<Duration> {
    let ms: i64 = value.to_str().ok()?.trim().parse().ok()?;
    u64::try_from(ms).ok().map(Duration::from_millis)
}

/// The gRPC HTTP-to-code mapping for answers without a `grpc-status`.
fn code_of_http(status: StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502..=504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// `timeout` in the gRPC wire format: at most 8 digits and a unit, in milliseconds
/// while that fits (`1234m`), else seconds, else hours.
#[must_use]
pub fn grpc_timeout_value(timeout: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let ms = timeout.as_millis();
    let text = if ms <= MAX {
        format!("{ms}m")
    } else if u128::from(timeout.as_secs()) <= MAX {
        format!("{}S", timeout.as_secs())
    } else {
        format!("{}H", (timeout.as_secs() / 3600).min(99_999_999))
    };
    HeaderValue::from_str(&text).expect("digits and a unit are a valid header value")
}

/// Parses a `grpc-timeout` value (`100m`, `5S`, …).
#[must_use]
pub fn parse_grpc_timeout(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?;
    let (digits, unit) = text.split_at_checked(text.len().checked_sub(1)?)?;
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A gRPC call that ended on a failure the layer would not or could not retry
/// further.
///
/// Its [`source`](StdError::source) is the last attempt's [`Status`] (the server's own,
/// with its message, details and metadata, or one built from a transport failure or a
/// timeout), so a tonic client built on the layer hands the caller that status.
pub struct GrpcRetryError {
    stop: Stop,
    attempts: u32,
    outcome: Outcome,
    status: Status,
}

impl GrpcRetryError {
    /// Builds an error.
    #[must_use]
    pub fn new(stop: Stop, attempts: u32, outcome: Outcome, status: Status) -> Self {
        Self {
            stop,
            attempts,
            outcome,
            status,
        }
    }

    /// Why retrying stopped.
    #[must_use]
    pub fn stop_reason(&self) -> Stop {
        self.stop
    }

    /// Attempts made.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The classified outcome of the last attempt.
    #[must_use]
    pub fn outcome(&self) -> &Outcome {
        &self.outcome
    }

    /// The server's pushback or `RetryInfo` delay on the last answer, if any.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.outcome.retry_after()
    }

    /// The last attempt's status.
    #[must_use]
    pub fn status(&self) -> &Status {
        &self.status
    }

    /// The last attempt's status, by value.
    #[must_use]
    pub fn into_status(self) -> Status {
        self.status
    }
}

impl fmt::Debug for GrpcRetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GrpcRetryError")
            .field("stop", &self.stop)
            .field("attempts", &self.attempts)
            .field("outcome", &self.outcome)
            .field("status", &self.status)
            .finish()
    }
}

impl fmt::Display for GrpcRetryError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gRPC call failed after {} attempt(s): {}; last outcome: {}",
            self.attempts, self.stop, self.outcome
        )
    }
}

impl StdError for GrpcRetryError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.status)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::classify::Classifier;
    use crate::classify::{RetryKind, Verdict};

    #[test]
    fn timeouts_round_trip() {
        assert_eq!(grpc_timeout_value(Duration::from_millis(1234)), "1234m");
        assert_eq!(grpc_timeout_value(Duration::from_secs(200_000)), "200000S");
        let v = grpc_timeout_value(Duration::from_secs(u64::MAX / 2));
        assert!(v.to_str().unwrap().ends_with('H') && v.len() <= 9);
        for v in ["1234m", "5S", "2H", "3M", "7u", "9n"] {
            assert!(parse_grpc_timeout(&HeaderValue::from_static(v)).is_some(), "{v}");
        }
        assert_eq!(
            parse_grpc_timeout(&HeaderValue::from_static("250m")),
            Some(Duration::from_millis(250))
        );
        for v in ["", "m", "123456789m", "12x", "-1m"] {
            assert_eq!(parse_grpc_timeout(&HeaderValue::from_static(v)), None, "{v}");
        }
    }

    #[test]
    fn pushback_values() {
        let p = |s: &'static str| parse_pushback(&HeaderValue::from_static(s));
        assert_eq!(p("250"), Some(Duration::from_millis(250)));
        assert_eq!(p("0"), Some(Duration::ZERO));
        assert_eq!(p("-1"), None);
        assert_eq!(p("soon"), None);
        assert_eq!(p("1.5"), None);
    }

    #[test]
    fn codes_map_onto_the_allowlist() {
        let c = Classifier::new();
        let verdict = |status: Status| c.classify(&Outcome::Answered(judge_status(&status, None)), false);
        assert_eq!(verdict(Status::ok("")), Verdict::Success);
        assert_eq!(
            verdict(Status::unavailable("down")),
            Verdict::Transient(RetryKind::Transient)
        );
        assert_eq!(
            verdict(Status::resource_exhausted("slow down")),
            Verdict::Transient(RetryKind::Throttling)
        );
        assert_eq!(
            verdict(Status::deadline_exceeded("late")),
            Verdict::Fatal(FatalReason::MaybeExecutedUnprotected)
        );
        for status in [
            Status::aborted("plain abort"),
            Status::invalid_argument("bad"),
            Status::internal("boom"),
            Status::failed_precondition("key reused"),
            Status::unauthenticated("who"),
        ] {
            assert_eq!(verdict(status), Verdict::Fatal(FatalReason::NotAllowlisted));
        }
        let mut in_progress = tonic_types::ErrorDetails::with_error_info(
            CODE_IN_PROGRESS,
            "idemkit",
            std::collections::HashMap::new(),
        );
        in_progress.set_retry_info(Some(Duration::from_millis(700)));
        let status = Status::with_error_details(Code::Aborted, "in progress", in_progress);
        let answer = judge_status(&status, None);
        assert_eq!(answer.retry_after, Some(Duration::from_millis(700)));
        assert_eq!(
            c.classify(&Outcome::Answered(answer.clone()), false),
            Verdict::Transient(RetryKind::Throttling)
        );
        assert_eq!(
            answer.to_string(),
            "gRPC ABORTED idempotency_request_in_progress (Retry-After 0.7s)"
        );
        // Pushback overrides RetryInfo; a refusal clears the delay.
        let pushed = judge_status(&status, Some(Some(Duration::from_millis(50))));
        assert_eq!(pushed.retry_after, Some(Duration::from_millis(50)));
        let refused = judge_status(&status, Some(None));
        assert!(refused.retry_refused && refused.retry_after.is_none());
    }

    #[test]
    fn malformed_details_do_not_panic() {
        let mut map = HeaderMap::new();
        map.insert(GRPC_STATUS, HeaderValue::from_static("14"));
        map.insert(GRPC_STATUS_DETAILS, HeaderValue::from_static("!!not base64!!"));
        map.insert(GRPC_RETRY_PUSHBACK_MS, HeaderValue::from_static("-5"));
        let (answer, status) = judge(&map);
        assert_eq!(status.code(), Code::Unavailable);
        assert!(answer.retry_refused);
    }
}
