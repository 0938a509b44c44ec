//! tonic integration: [`GrpcRetryLayer`] / [`GrpcRetryService`], retrying gRPC calls
//! by gRPC status code with the same [`RetryPolicy`] as the HTTP integrations.
//!
//! What is buffered and retried, and what passes through: see [`GrpcRetryLayer`].

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use tower::{Layer, Service, ServiceExt};

use crate::classify::{Answer, AttemptInfo, CODE_IN_PROGRESS, FatalReason, Outcome, classify_error};
use crate::policy::{RetryDecision, RetryPolicy, Stop};
use crate::replay::Replayed;

/// The gRPC deadline header, set on every attempt to its remaining budget (`1234m`).
pub(crate) const GRPC_TIMEOUT: HeaderName = HeaderName::from_static(idemkit_core::wire::GRPC_TIMEOUT);

/// gRFC A6 server pushback: a delay in milliseconds before retrying, or (negative or
/// malformed) a request not to retry.
pub(crate) const GRPC_RETRY_PUSHBACK_MS: HeaderName =
    HeaderName::from_static(idemkit_core::wire::GRPC_RETRY_PUSHBACK_MS);

const GRPC_STATUS: &str = "grpc-status";
const GRPC_STATUS_DETAILS: &str = "grpc-status-details-bin";

type BoxError = Box<dyn StdError + Send + Sync>;

/// The future of a [`GrpcRetryService`].
pub type GrpcResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Body>, GrpcRetryError>> + Send>>;

/// A tower [`Layer`] for tonic client channels: wraps a
/// `Service<http::Request<tonic::body::Body>>` (e.g. `tonic::transport::Channel`) in a
/// [`GrpcRetryService`].
///
/// A tonic request body is a stream and cannot be cloned, so tower's `Retry` cannot
/// wrap a channel. This layer never guesses a method's kind:
///
/// - **Request**: a call is retryable only when its body is one complete gRPC message
///   followed by the end of the stream, both there at once (what tonic sends for a
///   unary or server-streaming call). That message is buffered once and a copy goes
///   out on every attempt. Anything else (a client stream or a bidirectional stream:
///   a second message, or an end not yet there) is passed through as it arrives, sent
///   once, neither buffered whole nor retried.
/// - **Response** (gRFC A6's commit rule): a trailers-only answer (a status without
///   messages) is judged and may be retried. A response with headers commits the call:
///   its messages are passed through as they arrive, never cut by the attempt timeout
///   nor re-opened. Methods registered with [`with_unary_method`](Self::with_unary_method) are
///   known to answer with one message: their response is read to its trailers within
///   the attempt timeout, so a status in the trailers is judged too.
/// - **Deadline**: the call's deadline is the sooner of the policy's and the caller's
///   own (its `grpc-timeout`, or a [`CallDeadline`](crate::CallDeadline) extension);
///   sleeps, pushback and waiting for the inner service to be ready all fit in it, and
///   no attempt goes out with no time left. When the caller's deadline is what leaves
///   no room for another attempt, the call ends with `DEADLINE_EXCEEDED` (naming the
///   last attempt's status, keeping its metadata); when the policy's does, with the
///   last attempt's own status.
///
/// ```
/// use idemkit_client::{GrpcRetryLayer, RetryConfig};
///
/// let layer = GrpcRetryLayer::new(RetryConfig::new())
///     .with_unary_method("/labels.v1.Labels/CreateLabel")
///     .with_streaming_method("/labels.v1.Labels/WatchTracking");
/// # let _ = layer;
/// ```
#[derive(Debug, Clone, Default)]
pub struct GrpcRetryLayer {
    policy: RetryPolicy,
    methods: Arc<Methods>,
}

/// What the layer was told about methods.
#[derive(Debug, Clone, Default)]
struct Methods {
    streaming: Vec<&'static str>,
    unary: Vec<&'static str>,
    /// Unary methods whose key is a `string` field of the request (AIP-155
    /// `request_id`), by field number.
    key_fields: Vec<(&'static str, u32)>,
}

impl Methods {
    fn is_streaming(&self, path: &str) -> bool {
        self.streaming.contains(&path)
    }

    fn is_unary(&self, path: &str) -> bool {
        self.unary.contains(&path) || self.key_field(path).is_some()
    }

    fn key_field(&self, path: &str) -> Option<u32> {
        self.key_fields.iter().find(|(p, _)| *p == path).map(|(_, n)| *n)
    }
}

/// gRFC A6: how many attempts of this call were sent before this one, on every
/// retry (absent on the first attempt).
pub(crate) use idemkit_core::wire::GRPC_PREVIOUS_RPC_ATTEMPTS;

impl GrpcRetryLayer {
    /// A layer using `policy`. No method is assumed unary or streaming: see the
    /// [`GrpcRetryLayer`] for what is retried.
    pub fn new(policy: impl Into<RetryPolicy>) -> Self {
        Self {
            policy: policy.into(),
            methods: Arc::default(),
        }
    }

    /// Passes calls to `path` (`/package.Service/Method`, a streaming method) through
    /// untouched: sent once, neither buffered nor retried.
    #[must_use]
    pub fn with_streaming_method(mut self, path: &'static str) -> Self {
        Arc::make_mut(&mut self.methods).streaming.push(path);
        self
    }

    /// Declares `path` (`/package.Service/Method`) a unary method: its response is
    /// read to its trailers within the attempt timeout, so that a status sent in the
    /// trailers is judged (and retried when allowlisted), and each attempt's
    /// `grpc-timeout` is the attempt's own budget. Unregistered calls are committed
    /// at the response headers. Registering a streaming method here cuts its
    /// responses at the attempt timeout: register only unary methods.
    #[must_use]
    pub fn with_unary_method(mut self, path: &'static str) -> Self {
        Arc::make_mut(&mut self.methods).unary.push(path);
        self
    }

    /// Declares `path` a unary method (as [`with_unary_method`](Self::with_unary_method))
    /// whose key is the top-level `string` field `number` of its request message
    /// (AIP-155 `request_id`). When the caller left the field empty, the client
    /// fills it with the call's automatic key, a UUID4 generated once per logical
    /// call, and sends the same message on every attempt (AIP-4235); the key
    /// metadata carries the same value, so the two never disagree. A caller's own
    /// value is kept (and sent as the key metadata too).
    #[must_use]
    pub fn with_request_id_field(mut self, path: &'static str, number: u32) -> Self {
        Arc::make_mut(&mut self.methods).key_fields.push((path, number));
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
            methods: Arc::clone(&self.methods),
        }
    }
}

/// A tower service that retries gRPC calls with a [`RetryPolicy`] (which calls:
/// see [`GrpcRetryLayer`]).
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
    methods: Arc<Methods>,
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
        let ready = std::mem::replace(&mut self.inner, clone);
        let path = req.uri().path();
        if self.methods.is_streaming(path) {
            return Box::pin(pass_through(ready, req));
        }
        let unary = self.methods.is_unary(path);
        let key_field = self.methods.key_field(path);
        Box::pin(run(ready, self.policy.clone(), req, unary, key_field))
    }
}

/// Sends `req` once, as it is, and hands the response on as it arrives.
async fn pass_through<S, ResB>(mut service: S, req: Request<Body>) -> Result<Response<Body>, GrpcRetryError>
where
    S: Service<Request<Body>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    match service.call(req).await {
        Ok(response) => Ok(response.map(|b| Body::new(b.map_err(Into::into)))),
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

/// The least time an attempt is sent with: less would go out as `grpc-timeout: 0m`.
const MIN_ATTEMPT_BUDGET: Duration = Duration::from_millis(1);

async fn run<S, ResB>(
    mut service: S,
    policy: RetryPolicy,
    req: Request<Body>,
    unary: bool,
    key_field: Option<u32>,
) -> Result<Response<Body>, GrpcRetryError>
where
    S: Service<Request<Body>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
    ResB: http_body::Body<Data = Bytes> + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let start = Instant::now();
    let (parts, body) = req.into_parts();
    // The one message, buffered once (each attempt sends a copy); anything else goes
    // on as it is, once.
    let message = match take_message(body).await {
        Taken::One(message) => message,
        Taken::Stream(body) => return pass_through(service, Request::from_parts(parts, body)).await,
        Taken::Failed(err) => {
            return Err(GrpcRetryError::new(
                Stop::NotRetryable(FatalReason::NotAllowlisted),
                0,
                Outcome::NotSent,
                err,
            ));
        }
    };
    let mut parts = parts;
    if let Some(number) = key_field {
        // A key the caller put in the message is the caller's key: sent as the key
        // metadata, and counted as such by the policy.
        adopt_field_key(&message, number, &mut parts.headers, policy.config().key_header());
    }
    let mut call = policy.start(&Method::POST, parts.uri.path(), &parts.headers, true);
    let message = match key_field {
        Some(number) => fill_key_field(
            message,
            number,
            &mut parts.headers,
            &call,
            policy.config().key_header(),
        ),
        None => message,
    };
    // The caller's own deadline (its `grpc-timeout`, or a `CallDeadline`) bounds the
    // whole call, sleeps and pushback included, when it is the sooner one.
    let callers = callers_grpc_deadline(&parts.headers, &parts.extensions);
    let callers_bound = callers.is_some_and(|d| policy.config().deadline().is_none_or(|c| d <= c));
    if let Some(deadline) = callers {
        call.limit_deadline(deadline);
    }
    let give_up = |stop: Stop, attempts: u32, outcome: Outcome, status: Status| {
        GrpcRetryError::new(
            stop,
            attempts,
            outcome,
            deadline_status(stop, status, callers_bound),
        )
    };
    let mut previous: Option<(Outcome, Status)> = None;
    loop {
        if let Some((outcome, status)) = previous.take() {
            // A retry: the inner service (a rate limiter, a bulkhead) is waited for
            // within the deadline, leaving the time the attempt needs.
            let ready = match call.wait_budget(start.elapsed()) {
                Some(budget) => tokio::time::timeout(budget, service.ready()).await,
                None => Ok(service.ready().await),
            };
            match ready {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => return Err(not_ready(err.into())),
                Err(_) => return Err(give_up(Stop::DeadlineExceeded, call.attempts(), outcome, status)),
            }
        }
        let remaining = call.remaining(start.elapsed());
        if remaining.is_some_and(|r| r < MIN_ATTEMPT_BUDGET) {
            let status = Status::deadline_exceeded("no time left before the deadline for an attempt");
            return Err(give_up(
                Stop::DeadlineExceeded,
                call.attempts(),
                Outcome::NotSent,
                status,
            ));
        }
        let plan = call.before_attempt(start.elapsed());
        let timeout = plan.timeout();
        let mut attempt = Request::from_parts(parts.clone(), Body::new(Full::new(message.clone())));
        plan.apply_metadata(attempt.headers_mut());
        if plan.number() > 1 {
            attempt.headers_mut().insert(
                http::HeaderName::from_static(GRPC_PREVIOUS_RPC_ATTEMPTS),
                HeaderValue::from(plan.number() - 1),
            );
        }
        // The server is told how long the client waits: a unary attempt's own budget;
        // for a call that may be a stream, only the caller's deadline (an attempt
        // budget there would cut a long stream on the server).
        let budget = if unary {
            Some(timeout)
        } else {
            callers.and(remaining)
        };
        match budget {
            Some(budget) => {
                attempt
                    .headers_mut()
                    .insert(GRPC_TIMEOUT, grpc_timeout_value(budget));
            }
            None => {
                attempt.headers_mut().remove(GRPC_TIMEOUT);
            }
        }
        let sent = async {
            let response = match service.call(attempt).await {
                Ok(response) => response,
                Err(err) => {
                    let err = err.into();
                    return Attempt::Failed(classify_error(&*err), Status::from_error(err));
                }
            };
            read_response(response, unary).await
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
        let info = AttemptInfo::new(&outcome);
        let info = match &response {
            Some(response) => info.with_headers(response.headers()),
            None => info.with_error(&status),
        };
        match call.after_attempt_with(start.elapsed(), info) {
            RetryDecision::Retry(delay) => {
                tokio::time::sleep(delay).await;
                previous = Some((outcome, status));
            }
            RetryDecision::Stop(stop) => return Err(give_up(stop, call.attempts(), outcome, status)),
            RetryDecision::Return => {
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

/// The caller's deadline on a gRPC request: the sooner of its `grpc-timeout` and its
/// [`CallDeadline`](crate::CallDeadline) extension.
fn callers_grpc_deadline(headers: &HeaderMap, extensions: &http::Extensions) -> Option<Duration> {
    let header = headers.get(GRPC_TIMEOUT).and_then(parse_grpc_timeout);
    let extension = extensions.get::<crate::CallDeadline>().map(|d| d.0);
    match (header, extension) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The status a give-up hands the caller. When the caller's own deadline is what
/// left no room for another attempt, it is `DEADLINE_EXCEEDED` (what that deadline
/// means in gRPC), naming the last attempt's status and keeping its metadata;
/// otherwise the last attempt's own status.
fn deadline_status(stop: Stop, status: Status, callers_bound: bool) -> Status {
    let deadline = matches!(stop, Stop::DeadlineExceeded | Stop::RetryAfterPastDeadline { .. });
    if !callers_bound || !deadline || status.code() == Code::DeadlineExceeded {
        return status;
    }
    let message = format!(
        "the caller's deadline left no time for another attempt (last attempt: {:?}: {})",
        status.code(),
        status.message()
    );
    Status::with_metadata(Code::DeadlineExceeded, message, status.metadata().clone())
}

/// A request body, seen whole or not.
enum Taken {
    /// One complete message, and the end of the stream.
    One(Bytes),
    /// Anything else, to be sent on as it is (what was read, then the rest).
    Stream(Body),
    /// The body failed before anything could be sent.
    Failed(Status),
}

/// Reads what the request body has ready now: a unary (or server-streaming) request
/// from tonic has its one message and its end ready at once; a client or
/// bidirectional stream has a second message, or an end that is not there yet. Only
/// the first is buffered; waiting for more would deadlock a bidirectional call whose
/// client waits for an answer before it sends again.
/// AIP-4235: the request's key field (`number`), filled once per logical call.
/// A field the caller set is kept and copied to the key metadata; an empty one
/// gets the call's automatic key (so every attempt sends the same message). A
/// compressed or malformed message is sent as it is.
/// Sends a key the caller set in the message's key field as the key metadata too
/// (unless that is set already).
fn adopt_field_key(frame: &Bytes, number: u32, headers: &mut HeaderMap, key_header: http::HeaderName) {
    if frame.len() < 5 || frame[0] != 0 || headers.contains_key(&key_header) {
        return;
    }
    if let Some(Some(value)) = wire::last_string_field(&frame[5..], number)
        && !value.is_empty()
        && let Ok(v) = HeaderValue::from_bytes(value)
    {
        headers.insert(key_header, v);
    }
}

fn fill_key_field(
    frame: Bytes,
    number: u32,
    headers: &mut HeaderMap,
    call: &crate::Call,
    key_header: http::HeaderName,
) -> Bytes {
    if frame.len() < 5 || frame[0] != 0 {
        return frame;
    }
    let Some(existing) = wire::last_string_field(&frame[5..], number) else {
        return frame;
    };
    if let Some(value) = existing.filter(|v| !v.is_empty()) {
        if !headers.contains_key(&key_header)
            && let Ok(v) = HeaderValue::from_bytes(value)
        {
            headers.insert(key_header, v);
        }
        return frame;
    }
    let Some(key) = call.idempotency_key() else {
        // The caller's own key metadata is the key; the field stays empty.
        return frame;
    };
    let mut message = BytesMut::from(&frame[5..]);
    // A later occurrence of a scalar field wins (protobuf merge rules), so an
    // empty one already present is overridden.
    wire::put_varint(&mut message, (u64::from(number) << 3) | 2);
    wire::put_varint(&mut message, key.as_str().len() as u64);
    message.extend_from_slice(key.as_str().as_bytes());
    let mut out = BytesMut::with_capacity(message.len() + 5);
    out.extend_from_slice(&[0]);
    out.extend_from_slice(&u32::try_from(message.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(&message);
    out.freeze()
}

/// Just enough of the protobuf wire format to find and add a string field.
mod wire {
    use bytes::{BufMut, BytesMut};

    fn varint(buf: &mut &[u8]) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = buf.split_first()?;
            *buf = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }

    /// The last value of the length-delimited field `number`: `Some(None)` when
    /// absent, `None` when the message is not well-formed.
    pub(super) fn last_string_field(mut msg: &[u8], number: u32) -> Option<Option<&[u8]>> {
        let mut found = None;
        while !msg.is_empty() {
            let tag = varint(&mut msg)?;
            let len = match tag & 7 {
                0 => {
                    varint(&mut msg)?;
                    continue;
                }
                1 => 8,
                2 => usize::try_from(varint(&mut msg)?).ok()?,
                5 => 4,
                _ => return None,
            };
            if msg.len() < len {
                return None;
            }
            let (value, rest) = msg.split_at(len);
            if tag >> 3 == u64::from(number) {
                if tag & 7 != 2 {
                    return None;
                }
                found = Some(value);
            }
            msg = rest;
        }
        Some(found)
    }

    pub(super) fn put_varint(buf: &mut BytesMut, mut v: u64) {
        while v >= 0x80 {
            buf.put_u8((v as u8) | 0x80);
            v >>= 7;
        }
        buf.put_u8(v as u8);
    }
}

async fn take_message(body: Body) -> Taken {
    let mut body = Box::pin(body);
    let mut buffered = BytesMut::new();
    let ended = std::future::poll_fn(|cx| {
        loop {
            match http_body::Body::poll_frame(body.as_mut(), cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame: http_body::Frame<Bytes> = frame;
                    if let Ok(data) = frame.into_data() {
                        buffered.extend_from_slice(&data);
                    }
                    if message_len(&buffered).is_some_and(|len| buffered.len() > len) {
                        return Poll::Ready(Ok(false));
                    }
                }
                Poll::Ready(Some(Err(err))) => return Poll::Ready(Err(err)),
                Poll::Ready(None) => return Poll::Ready(Ok(true)),
                Poll::Pending => return Poll::Ready(Ok(false)),
            }
        }
    })
    .await;
    let buffered = buffered.freeze();
    match ended {
        Ok(true) if message_len(&buffered) == Some(buffered.len()) => Taken::One(buffered),
        Ok(_) => Taken::Stream(Body::new(Replayed::prefixed(buffered, body))),
        Err(status) => Taken::Failed(status),
    }
}

/// The length of the first gRPC message in `buf` (5-byte prefix included), once its
/// prefix is there.
fn message_len(buf: &[u8]) -> Option<usize> {
    let prefix: [u8; 4] = buf.get(1..5)?.try_into().ok()?;
    usize::try_from(u32::from_be_bytes(prefix)).ok()?.checked_add(5)
}

/// Reads a response as far as the decision needs: the status in the headers of a
/// trailers-only answer; for a method known to be unary, the (buffered) message and
/// the status in its trailers; otherwise nothing more: the response headers commit
/// the call (gRFC A6) and the messages are handed on as they arrive.
async fn read_response<B>(response: Response<B>, unary: bool) -> Attempt
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
    if !unary {
        let status = Status::ok("");
        let answer = judge_status(&status, None);
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

    fn frame(message: &[u8]) -> Bytes {
        let mut out = vec![0];
        out.extend_from_slice(&u32::try_from(message.len()).unwrap().to_be_bytes());
        out.extend_from_slice(message);
        Bytes::from(out)
    }

    #[test]
    fn an_empty_request_id_is_filled_once_and_a_set_one_kept() {
        let policy = RetryPolicy::default().with_seed(1);
        let call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
        let key = call.idempotency_key().unwrap().as_str().to_owned();
        let header = http::HeaderName::from_static("idempotency-key");
        // `request_id = 1` absent, `n = 2` (varint 5) present.
        let mut headers = HeaderMap::new();
        let filled = fill_key_field(frame(&[0x10, 5]), 1, &mut headers, &call, header.clone());
        assert_eq!(
            wire::last_string_field(&filled[5..], 1),
            Some(Some(key.as_bytes())),
            "filled with the call's key"
        );
        assert_eq!(
            u32::from_be_bytes(filled[1..5].try_into().unwrap()) as usize,
            filled.len() - 5
        );
        let again = fill_key_field(frame(&[0x10, 5]), 1, &mut HeaderMap::new(), &call, header.clone());
        assert_eq!(again, filled, "the same message on every attempt");
        // An empty occurrence is overridden by the appended one.
        let empty = fill_key_field(
            frame(&[0x0a, 0, 0x10, 5]),
            1,
            &mut HeaderMap::new(),
            &call,
            header.clone(),
        );
        assert_eq!(
            wire::last_string_field(&empty[5..], 1),
            Some(Some(key.as_bytes()))
        );
        // A caller's own value is kept, and sent as the key metadata.
        let own = frame(&[0x0a, 3, b'a', b'b', b'c']);
        let mut headers = HeaderMap::new();
        assert_eq!(
            fill_key_field(own.clone(), 1, &mut headers, &call, header.clone()),
            own
        );
        assert_eq!(headers[&header], "abc");
        // Compressed messages are left alone.
        let mut compressed = own.to_vec();
        compressed[0] = 1;
        let compressed = Bytes::from(compressed);
        assert_eq!(
            fill_key_field(compressed.clone(), 1, &mut HeaderMap::new(), &call, header),
            compressed
        );
    }

    #[test]
    fn a_key_the_caller_put_in_the_message_is_the_callers_key() {
        let policy = RetryPolicy::default();
        let header = http::HeaderName::from_static("idempotency-key");
        let mut headers = HeaderMap::new();
        adopt_field_key(
            &frame(&[0x0a, 3, b'a', b'b', b'c']),
            1,
            &mut headers,
            header.clone(),
        );
        assert_eq!(headers[&header], "abc");
        let call = policy.start(&Method::POST, "/p.S/M", &headers, true);
        assert!(call.idempotency_key().is_none() && call.is_protected());
        // An empty field is no key: the call generates one (not trusted by default).
        let mut headers = HeaderMap::new();
        adopt_field_key(&frame(&[0x0a, 0]), 1, &mut headers, header);
        assert!(headers.is_empty());
        let call = policy.start(&Method::POST, "/p.S/M", &headers, true);
        assert!(call.idempotency_key().is_some() && !call.is_protected());
    }

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
