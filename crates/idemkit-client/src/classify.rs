//! Classification: what happened on one attempt, and whether that is worth retrying.
//!
//! This module only describes and judges an attempt; whether a retry actually happens
//! (attempt cap, deadline, budget, replayable body) is the policy's business
//! ([`crate::Call`]).

use std::error::Error as StdError;
use std::fmt;
use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};

/// Problem `code` of a `409` meaning "the first request with this key is still running".
pub const CODE_IN_PROGRESS: &str = "idempotency_request_in_progress";
/// Problem `code` of a `409` meaning "this key was used for a different request".
pub const CODE_KEY_REUSED: &str = "idempotency_key_reused";
/// Content type of RFC 9457 problem documents.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// What happened on one attempt, as far as the client can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Outcome {
    /// The request never reached the server: the connection was refused or failed
    /// before the request was written. Always safe to retry.
    NotSent,
    /// The request may have been executed: a timeout or a reset after it was sent.
    /// Safe to retry only with an idempotency key or an idempotent method. (A `502` or
    /// `504` answer is judged the same way: see [`Classifier`].)
    MaybeExecuted {
        /// Whether the attempt ended because its timeout elapsed.
        timed_out: bool,
    },
    /// The server answered.
    Answered(Answer),
}

impl Outcome {
    /// An answered outcome with just a status.
    #[must_use]
    pub fn status(status: StatusCode) -> Self {
        Self::Answered(Answer::new(status))
    }

    /// The server's `Retry-After`, when it answered with one.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Answered(answer) => answer.retry_after,
            _ => None,
        }
    }

    pub(crate) fn label(&self) -> &'static str {
        match self {
            Self::NotSent => "not_sent",
            Self::MaybeExecuted { timed_out: true } => "timeout",
            Self::MaybeExecuted { timed_out: false } => "maybe_executed",
            Self::Answered(_) => "answered",
        }
    }

    /// Why a retry was planned, as a bounded metric label: the transport
    /// failure, or what the server answered.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Self::NotSent => "not_sent",
            Self::MaybeExecuted { timed_out: true } => "timeout",
            Self::MaybeExecuted { timed_out: false } => "maybe_executed",
            Self::Answered(a) if a.problem_code.as_deref() == Some(CODE_IN_PROGRESS) => "in_progress",
            Self::Answered(a) => match a.status.as_u16() {
                429 => "throttled",
                502 => "bad_gateway",
                503 => "unavailable",
                504 => "gateway_timeout",
                500..=599 => "server_error",
                _ => "other",
            },
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotSent => f.write_str("not sent (connection failed before the request was written)"),
            Self::MaybeExecuted { timed_out: true } => {
                f.write_str("attempt timed out after sending (maybe executed)")
            }
            Self::MaybeExecuted { timed_out: false } => {
                f.write_str("connection failed after sending (maybe executed)")
            }
            Self::Answered(answer) => answer.fmt(f),
        }
    }
}

/// The parts of a server's answer that classification needs.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Answer {
    /// Response status.
    pub status: StatusCode,
    /// `Retry-After`, converted to a delay from now.
    pub retry_after: Option<Duration>,
    /// The problem document's `code`, when the body was one (for gRPC: the
    /// `google.rpc.ErrorInfo` reason).
    pub problem_code: Option<String>,
    /// The server asked the client not to retry (a negative or malformed gRPC
    /// `grpc-retry-pushback-ms`, gRFC A6): a retryable failure then stops with
    /// [`Stop::RetryRefused`](crate::Stop::RetryRefused).
    pub retry_refused: bool,
    /// The gRPC status code (`grpc-status`), when the answer was a gRPC one; `status`
    /// is then the HTTP status the code is judged as (see the guide's client page,
    /// `docs/client.md`).
    pub grpc_code: Option<i32>,
}

impl Answer {
    /// An answer with a status only.
    #[must_use]
    pub const fn new(status: StatusCode) -> Self {
        Self {
            status,
            retry_after: None,
            problem_code: None,
            retry_refused: false,
            grpc_code: None,
        }
    }

    /// Reads `Retry-After` from response headers.
    #[must_use]
    pub fn from_parts(status: StatusCode, headers: &HeaderMap) -> Self {
        Self {
            status,
            retry_after: retry_after(headers, SystemTime::now()),
            problem_code: None,
            retry_refused: false,
            grpc_code: None,
        }
    }

    /// Sets the `Retry-After` delay.
    #[must_use]
    pub const fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Sets the problem `code`.
    #[must_use]
    pub fn with_problem_code(mut self, code: Option<String>) -> Self {
        self.problem_code = code;
        self
    }

    /// Marks the answer as one the server asked not to retry.
    #[must_use]
    pub const fn with_retry_refused(mut self, refused: bool) -> Self {
        self.retry_refused = refused;
        self
    }

    /// Sets the gRPC status code.
    #[must_use]
    pub const fn with_grpc_code(mut self, code: Option<i32>) -> Self {
        self.grpc_code = code;
        self
    }
}

impl fmt::Display for Answer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.grpc_code {
            Some(code) => write!(f, "gRPC {}", grpc_code_name(code))?,
            None => write!(f, "{}", self.status)?,
        }
        if let Some(code) = &self.problem_code {
            write!(f, " {code}")?;
        }
        if let Some(delay) = self.retry_after {
            write!(f, " (Retry-After {}s)", delay.as_secs_f64())?;
        }
        Ok(())
    }
}

/// The canonical name of a gRPC status code (`UNAVAILABLE`), or its number.
fn grpc_code_name(code: i32) -> String {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|i| NAMES.get(i))
        .map_or_else(|| code.to_string(), |name| (*name).to_owned())
}

/// Parses `Retry-After` (delta-seconds or an HTTP date) into a delay from `now`.
///
/// A date in the past is a zero delay; a number too large for a `u64` is the longest
/// delay; an unparseable value is ignored.
///
/// ```
/// use std::time::{Duration, SystemTime};
/// use http::{HeaderMap, HeaderValue, header::RETRY_AFTER};
///
/// let mut headers = HeaderMap::new();
/// headers.insert(RETRY_AFTER, HeaderValue::from_static("3"));
/// assert_eq!(
///     idemkit_client::retry_after(&headers, SystemTime::now()),
///     Some(Duration::from_secs(3))
/// );
/// ```
#[must_use]
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let value = headers.get(header::RETRY_AFTER)?.to_str().ok()?.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time", not "no hint".
        return Some(Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(value).ok()?;
    Some(date.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Whether a response is worth reading for a problem `code`: only `409`s decide
/// anything by their code.
#[must_use]
pub fn needs_problem_code(status: StatusCode, headers: &HeaderMap) -> bool {
    status == StatusCode::CONFLICT
        && headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| {
                let ct = ct.trim().to_ascii_lowercase();
                ct.starts_with(PROBLEM_CONTENT_TYPE) || ct.starts_with("application/json")
            })
}

/// Extracts the `code` member of a problem document.
#[must_use]
pub fn problem_code(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Problem {
        code: Option<String>,
    }
    serde_json::from_slice::<Problem>(body).ok()?.code
}

/// Classifies a transport error by where in the exchange it happened.
///
/// [`Outcome::NotSent`] only when the source chain holds an error its client marks as
/// a failure to *connect*: reqwest's (`reqwest::Error::is_connect`), hyper-util's
/// (`hyper_util::client::legacy::Error::is_connect`) or tonic's
/// (`tonic::ConnectError`). Everything else is [`Outcome::MaybeExecuted`], because
/// once a connection is up the client cannot prove the request was not processed;
/// that includes an "unreachable" or "refused" reported by an established connection
/// after the request went out, so the kind of an `io::Error` alone decides nothing.
#[must_use]
pub fn classify_error(error: &(dyn StdError + 'static)) -> Outcome {
    let mut current = Some(error);
    while let Some(err) = current {
        if is_connect_error(err) {
            return Outcome::NotSent;
        }
        current = err.source();
    }
    Outcome::MaybeExecuted { timed_out: false }
}

/// Whether `err` is a client's own "could not connect" error.
fn is_connect_error(err: &(dyn StdError + 'static)) -> bool {
    #[cfg(feature = "reqwest")]
    if err
        .downcast_ref::<reqwest::Error>()
        .is_some_and(reqwest::Error::is_connect)
    {
        return true;
    }
    #[cfg(any(feature = "tower", feature = "tonic"))]
    if err
        .downcast_ref::<hyper_util::client::legacy::Error>()
        .is_some_and(hyper_util::client::legacy::Error::is_connect)
    {
        return true;
    }
    #[cfg(feature = "tonic")]
    if err.is::<tonic::ConnectError>() {
        return true;
    }
    let _ = err;
    false
}

/// How a retryable failure is charged and backed off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RetryKind {
    /// A transient failure: not sent, maybe executed (incl. timeouts), 502/503/504, and
    /// 500 when opted in.
    Transient,
    /// The server asked to slow down or wait: 429 and `409 idempotency_request_in_progress`.
    Throttling,
}

impl RetryKind {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Throttling => "throttling",
        }
    }
}

/// Why an outcome is final.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FatalReason {
    /// Answered with a status outside the retry allowlist (4xx, auth, 500 without
    /// opt-in, `409 idempotency_key_reused`, …).
    NotAllowlisted,
    /// The request may have been executed and carries no idempotency key, and its method
    /// is not idempotent: retrying could duplicate the write.
    MaybeExecutedUnprotected,
    /// The transport (a tower service) failed before it could take the request.
    ServiceNotReady,
    /// The request may have been executed, its method is not idempotent and its only
    /// protection is the key the client generated ([`AutoKey::Generate`](crate::AutoKey::Generate)),
    /// which this route is not known to honour: no published `x-idempotency` policy
    /// ([`RetryPolicy::with_published_policy`](crate::RetryPolicy::with_published_policy))
    /// names the key for it, and the server has not recognised the key during this
    /// call. A server that ignores keys would perform the write again.
    AutoKeyUnconfirmed,
}

impl fmt::Display for FatalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::NotAllowlisted => "status is not on the retry allowlist",
            Self::MaybeExecutedUnprotected => {
                "the request may have been executed and has neither an idempotency key nor an idempotent method"
            }
            Self::ServiceNotReady => "the transport failed before taking the request",
            Self::AutoKeyUnconfirmed => {
                "the request may have been executed and its only protection is an automatic idempotency key \
                 this route is not known to honour (no published x-idempotency policy names it): \
                 a server that ignores keys would perform it again"
            }
        })
    }
}

/// The classifier's judgement on one outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// A 1xx/2xx/3xx answer.
    Success,
    /// Worth retrying, policy permitting.
    Transient(RetryKind),
    /// Never retried.
    Fatal(FatalReason),
}

/// The retry allowlist, separate from any policy (the same table is in the
/// guide's client page, `docs/client.md`).
///
/// A request is *protected* when it carries an idempotency key or its method is
/// idempotent (GET, HEAD, OPTIONS, TRACE, PUT, DELETE).
///
/// | outcome | verdict |
/// |---|---|
/// | not sent | transient |
/// | maybe executed (timeout or reset after sending), protected | transient |
/// | maybe executed, unprotected | fatal |
/// | 429, `409 idempotency_request_in_progress` | throttling |
/// | 503 | transient |
/// | 502, 504 (a gateway answered; the origin may still be running), protected | transient |
/// | 502, 504, unprotected | fatal (*maybe executed*) |
/// | 500 | transient only with [`Classifier::with_retry_500`] |
/// | any other 4xx/5xx, incl. 401/403 and `409 idempotency_key_reused` | fatal |
///
/// ```
/// use http::StatusCode;
/// use idemkit_client::{Classifier, FatalReason, Outcome, RetryKind, Verdict};
///
/// let c = Classifier::new();
/// assert_eq!(c.classify(&Outcome::status(StatusCode::SERVICE_UNAVAILABLE), false),
///            Verdict::Transient(RetryKind::Transient));
/// assert!(matches!(c.classify(&Outcome::status(StatusCode::BAD_REQUEST), true), Verdict::Fatal(_)));
/// // A gateway's 502 to a keyless POST: the write may have happened.
/// assert_eq!(c.classify(&Outcome::status(StatusCode::BAD_GATEWAY), false),
///            Verdict::Fatal(FatalReason::MaybeExecutedUnprotected));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classifier {
    retry_500: bool,
}

impl Classifier {
    /// The default allowlist: 500 is not retried.
    #[must_use]
    pub const fn new() -> Self {
        Self { retry_500: false }
    }

    /// Also retries `500 Internal Server Error` (as a transient failure).
    #[must_use]
    pub const fn with_retry_500(mut self, retry: bool) -> Self {
        self.retry_500 = retry;
        self
    }

    /// Whether 500 is retried.
    #[must_use]
    pub const fn retries_500(&self) -> bool {
        self.retry_500
    }

    /// Judges `outcome`. `protected` says whether the request carries an idempotency
    /// key or has an idempotent method.
    #[must_use]
    pub fn classify(&self, outcome: &Outcome, protected: bool) -> Verdict {
        match outcome {
            Outcome::NotSent => Verdict::Transient(RetryKind::Transient),
            Outcome::MaybeExecuted { .. } if protected => Verdict::Transient(RetryKind::Transient),
            Outcome::MaybeExecuted { .. } => Verdict::Fatal(FatalReason::MaybeExecutedUnprotected),
            Outcome::Answered(answer) => self.classify_answer(answer, protected),
        }
    }

    fn classify_answer(&self, answer: &Answer, protected: bool) -> Verdict {
        let status = answer.status;
        if status.is_informational() || status.is_success() || status.is_redirection() {
            return Verdict::Success;
        }
        match status {
            StatusCode::TOO_MANY_REQUESTS => Verdict::Transient(RetryKind::Throttling),
            StatusCode::CONFLICT if answer.problem_code.as_deref() == Some(CODE_IN_PROGRESS) => {
                Verdict::Transient(RetryKind::Throttling)
            }
            StatusCode::SERVICE_UNAVAILABLE => Verdict::Transient(RetryKind::Transient),
            // A gateway answered; the origin may have run (or still be running) the
            // request: "maybe executed".
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT if protected => {
                Verdict::Transient(RetryKind::Transient)
            }
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => {
                Verdict::Fatal(FatalReason::MaybeExecutedUnprotected)
            }
            StatusCode::INTERNAL_SERVER_ERROR if self.retry_500 => Verdict::Transient(RetryKind::Transient),
            _ => Verdict::Fatal(FatalReason::NotAllowlisted),
        }
    }
}

impl Default for Classifier {
    fn default() -> Self {
        Self::new()
    }
}

/// One attempt as a [`ClassifyHook`] sees it: the classified [`Outcome`], the
/// response's headers when the server answered, the transport error when it did
/// not, and whether the request counts as protected (see [`Classifier`]).
#[derive(Debug, Clone, Copy)]
pub struct AttemptInfo<'a> {
    outcome: &'a Outcome,
    headers: Option<&'a HeaderMap>,
    error: Option<&'a (dyn StdError + 'static)>,
    protected: bool,
}

impl<'a> AttemptInfo<'a> {
    /// An attempt known only by its outcome (what [`Call::after_attempt`](crate::Call::after_attempt)
    /// shows a hook).
    #[must_use]
    pub const fn new(outcome: &'a Outcome) -> Self {
        Self {
            outcome,
            headers: None,
            error: None,
            protected: false,
        }
    }

    /// Adds the response's headers.
    #[must_use]
    pub const fn with_headers(mut self, headers: &'a HeaderMap) -> Self {
        self.headers = Some(headers);
        self
    }

    /// Adds the transport error.
    #[must_use]
    pub const fn with_error(mut self, error: &'a (dyn StdError + 'static)) -> Self {
        self.error = Some(error);
        self
    }

    pub(crate) const fn with_protected(mut self, protected: bool) -> Self {
        self.protected = protected;
        self
    }

    /// What happened.
    #[must_use]
    pub const fn outcome(&self) -> &'a Outcome {
        self.outcome
    }

    /// The response's status, when the server answered.
    #[must_use]
    pub fn status(&self) -> Option<StatusCode> {
        match self.outcome {
            Outcome::Answered(answer) => Some(answer.status),
            _ => None,
        }
    }

    /// The response's headers, when the server answered (and the integration passed
    /// them: every integration of this crate does).
    #[must_use]
    pub const fn headers(&self) -> Option<&'a HeaderMap> {
        self.headers
    }

    /// The transport error, when the attempt failed without an answer (`None` for a
    /// timeout: the attempt was cut by the client).
    #[must_use]
    pub const fn error(&self) -> Option<&'a (dyn StdError + 'static)> {
        self.error
    }

    /// Whether the request carries an idempotency key the route honours, or has an
    /// idempotent method: a *maybe executed* failure of a protected request is safe
    /// to retry.
    #[must_use]
    pub const fn protected(&self) -> bool {
        self.protected
    }
}

/// Extends classification: called after the built-in [`Classifier`] on every attempt,
/// with the attempt and the classifier's verdict, it returns the verdict the policy
/// applies. Return `default` to keep the built-in judgement; any closure
/// `Fn(&AttemptInfo<'_>, Verdict) -> Verdict + Send + Sync + 'static` is a hook.
/// Install one with [`RetryPolicy::with_classifier_hook`](crate::RetryPolicy::with_classifier_hook).
///
/// The policy still applies its own limits to a retry the hook asks for (attempt
/// cap, deadline, budget, a body that cannot be cloned). A hook that turns a *maybe
/// executed* failure of an unprotected request into a retry takes the duplicate risk
/// on itself. A `Success` or `Fatal(NotAllowlisted)` verdict on an attempt that got
/// no answer ends the call with [`Stop::NotRetryable`](crate::Stop::NotRetryable):
/// there is no response to hand back.
///
/// ```
/// use http::StatusCode;
/// use idemkit_client::{AttemptInfo, RetryConfig, RetryKind, RetryPolicy, Verdict};
///
/// // A server that marks transient 500s with `x-transient: true`; everything else as
/// // the default says.
/// let policy = RetryPolicy::new(RetryConfig::new()).with_classifier_hook(
///     |attempt: &AttemptInfo<'_>, default: Verdict| {
///         let marked = attempt
///             .headers()
///             .and_then(|h| h.get("x-transient"))
///             .is_some_and(|v| v == "true");
///         if attempt.status() == Some(StatusCode::INTERNAL_SERVER_ERROR) && marked {
///             Verdict::Transient(RetryKind::Transient)
///         } else {
///             default
///         }
///     },
/// );
/// # let _ = policy;
/// ```
pub trait ClassifyHook: Send + Sync + 'static {
    /// The verdict for `attempt`; `default` is the built-in classifier's.
    fn classify(&self, attempt: &AttemptInfo<'_>, default: Verdict) -> Verdict;
}

impl<F> ClassifyHook for F
where
    F: Fn(&AttemptInfo<'_>, Verdict) -> Verdict + Send + Sync + 'static,
{
    fn classify(&self, attempt: &AttemptInfo<'_>, default: Verdict) -> Verdict {
        self(attempt, default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;
    use std::io;

    fn answered(status: u16, code: Option<&str>) -> Outcome {
        Outcome::Answered(
            Answer::new(StatusCode::from_u16(status).unwrap()).with_problem_code(code.map(str::to_owned)),
        )
    }

    #[test]
    fn retry_reasons_are_a_small_fixed_set() {
        assert_eq!(Outcome::NotSent.reason(), "not_sent");
        assert_eq!(Outcome::MaybeExecuted { timed_out: true }.reason(), "timeout");
        assert_eq!(answered(409, Some(CODE_IN_PROGRESS)).reason(), "in_progress");
        assert_eq!(answered(429, None).reason(), "throttled");
        assert_eq!(answered(503, None).reason(), "unavailable");
        assert_eq!(answered(500, None).reason(), "server_error");
        assert_eq!(answered(418, None).reason(), "other");
    }

    #[test]
    fn allowlist() {
        let c = Classifier::new();
        let t = Verdict::Transient(RetryKind::Transient);
        let th = Verdict::Transient(RetryKind::Throttling);
        let fatal = Verdict::Fatal(FatalReason::NotAllowlisted);
        assert_eq!(c.classify(&answered(200, None), false), Verdict::Success);
        assert_eq!(c.classify(&answered(201, None), false), Verdict::Success);
        assert_eq!(c.classify(&answered(429, None), false), th);
        assert_eq!(c.classify(&answered(409, Some(CODE_IN_PROGRESS)), false), th);
        assert_eq!(c.classify(&answered(409, Some(CODE_KEY_REUSED)), true), fatal);
        assert_eq!(c.classify(&answered(409, None), true), fatal);
        for s in [502, 503, 504] {
            assert_eq!(c.classify(&answered(s, None), true), t);
        }
        assert_eq!(c.classify(&answered(503, None), false), t);
        for s in [502, 504] {
            assert_eq!(
                c.classify(&answered(s, None), false),
                Verdict::Fatal(FatalReason::MaybeExecutedUnprotected),
                "{s} to an unprotected request is maybe executed"
            );
        }
        for s in [400, 401, 403, 404, 422, 500, 501] {
            assert_eq!(c.classify(&answered(s, None), true), fatal, "{s}");
        }
        assert_eq!(c.with_retry_500(true).classify(&answered(500, None), false), t);
        assert_eq!(c.classify(&Outcome::NotSent, false), t);
        assert_eq!(c.classify(&Outcome::MaybeExecuted { timed_out: true }, true), t);
        assert_eq!(
            c.classify(&Outcome::MaybeExecuted { timed_out: true }, false),
            Verdict::Fatal(FatalReason::MaybeExecutedUnprotected)
        );
    }

    #[test]
    fn retry_after_forms() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut h = HeaderMap::new();
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("7"));
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(7)));
        let date = httpdate::fmt_http_date(now + Duration::from_secs(4));
        h.insert(header::RETRY_AFTER, HeaderValue::from_str(&date).unwrap());
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(4)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(4));
        h.insert(header::RETRY_AFTER, HeaderValue::from_str(&past).unwrap());
        assert_eq!(retry_after(&h, now), Some(Duration::ZERO));
        h.insert(
            header::RETRY_AFTER,
            HeaderValue::from_static("99999999999999999999999"),
        );
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(u64::MAX)));
        h.insert(header::RETRY_AFTER, HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&h, now), None);
    }

    #[test]
    fn problem_codes() {
        let body = br#"{"type":"about:blank","title":"t","status":409,"code":"idempotency_request_in_progress","retryable":true}"#;
        assert_eq!(problem_code(body).as_deref(), Some(CODE_IN_PROGRESS));
        assert_eq!(problem_code(b"not json"), None);
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        assert!(needs_problem_code(StatusCode::CONFLICT, &h));
        assert!(!needs_problem_code(StatusCode::BAD_REQUEST, &h));
    }

    #[test]
    fn error_chain() {
        #[derive(Debug)]
        struct Wrap(io::Error);
        impl fmt::Display for Wrap {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("wrapped")
            }
        }
        impl StdError for Wrap {
            fn source(&self) -> Option<&(dyn StdError + 'static)> {
                Some(&self.0)
            }
        }
        // An io kind alone does not say the request was never written: an established
        // connection reports "refused" or "unreachable" too.
        for kind in [
            io::ErrorKind::ConnectionRefused,
            io::ErrorKind::HostUnreachable,
            io::ErrorKind::NetworkUnreachable,
        ] {
            let err = Wrap(io::Error::from(kind));
            assert_eq!(classify_error(&err), Outcome::MaybeExecuted { timed_out: false });
        }
        #[cfg(feature = "tonic")]
        {
            let refused = tonic::ConnectError(Box::new(io::Error::from(io::ErrorKind::ConnectionRefused)));
            assert_eq!(classify_error(&refused), Outcome::NotSent);
        }
        let reset = Wrap(io::Error::from(io::ErrorKind::ConnectionReset));
        assert_eq!(
            classify_error(&reset),
            Outcome::MaybeExecuted { timed_out: false }
        );
    }
}
