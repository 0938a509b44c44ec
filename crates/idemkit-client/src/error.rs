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

/// A call that ended on a failure the retry layer would not or could not retry further.
///
/// Carries why it stopped ([`Stop`]), how many attempts were made, the last outcome
/// and the last response or transport error.
///
/// ```
/// # use std::time::Duration;
/// # use idemkit_client::{RetryError, Stop};
/// fn wait_hint<R, E>(err: &RetryError<R, E>) -> Option<Duration> {
///     match err.stop() {
///         Stop::RetryAfterPastDeadline { retry_after } => Some(retry_after),
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

    /// The last response, when the server answered.
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
