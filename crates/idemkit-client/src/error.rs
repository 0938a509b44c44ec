//! The error a retried call ends with.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use crate::classify::Outcome;
use crate::policy::Stop;

/// The last attempt's result, kept so the caller can inspect it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Last<R, E> {
    /// The server answered (e.g. the third 503, or a 429 whose `Retry-After` ends past
    /// the deadline). Read its headers and body from here.
    Response(R),
    /// The transport failed.
    Error(E),
    /// The attempt's timeout elapsed.
    TimedOut(Duration),
}

/// A call that ended on a failure the retry layer would not or could not retry further:
/// retries exhausted, budget empty, deadline reached, a `Retry-After` too long, or a
/// *maybe executed* request without protection.
///
/// Answers that are never retried (400, 401, 404, 500 unless opted in,
/// `409 idempotency_key_reused`, …) are **not** errors: they come back as `Ok(response)`.
///
/// Everything about the last answer is one call away: [`status`](Self::status),
/// [`headers`](Self::headers) and [`last_response`](Self::last_response) borrow it,
/// [`into_response`](Self::into_response) hands it over (to read its body);
/// [`stop_reason`](Self::stop_reason) says why retrying stopped and
/// [`retry_after`](Self::retry_after) carries the server's hint. With reqwest, get the
/// error out of a `reqwest_middleware::Error` with
/// [`RetryErrorExt::into_retry_error`](crate::RetryErrorExt::into_retry_error).
///
/// ```
/// # use std::time::Duration;
/// # use idemkit_client::{RetryError, Stop};
/// fn wait_hint<R, E>(err: &RetryError<R, E>) -> Option<Duration> {
///     match err.stop_reason() {
///         Stop::RetryAfterPastDeadline { retry_after } | Stop::RetryAfterAboveCap { retry_after } => {
///             Some(retry_after)
///         }
///         _ => err.retry_after(),
///     }
/// }
/// ```
#[non_exhaustive]
pub struct RetryError<R, E> {
    stop: Stop,
    attempts: u32,
    outcome: Outcome,
    last: Last<R, E>,
}

impl<R, E> RetryError<R, E> {
    /// Builds an error (for integrations driving a [`Call`](crate::Call) themselves).
    #[must_use]
    pub fn new(stop: Stop, attempts: u32, outcome: Outcome, last: Last<R, E>) -> Self {
        Self {
            stop,
            attempts,
            outcome,
            last,
        }
    }

    /// Why retrying stopped.
    #[must_use]
    pub fn stop_reason(&self) -> Stop {
        self.stop
    }

    /// Why retrying stopped (same as [`stop_reason`](Self::stop_reason)).
    #[must_use]
    pub fn stop(&self) -> Stop {
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

    /// The server's `Retry-After` on the last answer, if any.
    #[must_use]
    pub fn retry_after(&self) -> Option<Duration> {
        self.outcome.retry_after()
    }

    /// The last attempt's result.
    #[must_use]
    pub fn last(&self) -> &Last<R, E> {
        &self.last
    }

    /// The last response, when the server answered (e.g. the third 503).
    #[must_use]
    pub fn last_response(&self) -> Option<&R> {
        match &self.last {
            Last::Response(r) => Some(r),
            _ => None,
        }
    }

    /// The last response, by value (to read its body), when the server answered.
    #[must_use]
    pub fn into_response(self) -> Option<R> {
        match self.last {
            Last::Response(r) => Some(r),
            _ => None,
        }
    }

    /// The last attempt's result, by value.
    #[must_use]
    pub fn into_last(self) -> Last<R, E> {
        self.last
    }
}

#[cfg(feature = "reqwest")]
impl<E> RetryError<reqwest::Response, E> {
    /// Status of the last answer; `None` when the last attempt got no answer (timeout,
    /// transport error).
    #[must_use]
    pub fn status(&self) -> Option<http::StatusCode> {
        self.last_response().map(reqwest::Response::status)
    }

    /// Headers of the last answer; `None` when the last attempt got no answer.
    #[must_use]
    pub fn headers(&self) -> Option<&http::HeaderMap> {
        self.last_response().map(reqwest::Response::headers)
    }
}

impl<B, E> RetryError<http::Response<B>, E> {
    /// Status of the last answer; `None` when the last attempt got no answer (timeout,
    /// transport error).
    #[must_use]
    pub fn status(&self) -> Option<http::StatusCode> {
        self.last_response().map(http::Response::status)
    }

    /// Headers of the last answer; `None` when the last attempt got no answer.
    #[must_use]
    pub fn headers(&self) -> Option<&http::HeaderMap> {
        self.last_response().map(http::Response::headers)
    }
}

impl<R, E> fmt::Debug for RetryError<R, E>
where
    E: fmt::Debug,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("RetryError");
        d.field("stop", &self.stop)
            .field("attempts", &self.attempts)
            .field("outcome", &self.outcome);
        if let Last::Error(e) = &self.last {
            d.field("error", e);
        }
        d.finish_non_exhaustive()
    }
}

impl<R, E> fmt::Display for RetryError<R, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "request failed after {} attempt(s): {}; last outcome: {}",
            self.attempts, self.stop, self.outcome
        )
    }
}

impl<R, E> StdError for RetryError<R, E>
where
    E: StdError + 'static,
{
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        match &self.last {
            Last::Error(e) => Some(e),
            _ => None,
        }
    }
}
