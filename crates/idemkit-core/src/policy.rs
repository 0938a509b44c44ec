//! Per-route idempotency policy and its validation (the behaviour contract, `docs/spec.md` §3, §5 and §6).

use std::time::Duration;

/// What a request finds when its key is held by a live lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum InFlightBehavior {
    /// Answer `409 idempotency_request_in_progress` with `Retry-After` at once (default).
    Reject,
    /// Wait up to the given time for the holder to finish, then replay its response;
    /// if it has not finished by then, answer 409 as [`InFlightBehavior::Reject`] does.
    Wait(Duration),
    /// For long work: answer `202 Accepted` with a `Location` the layer serves,
    /// where `GET` answers "in progress" until the request completes and then the
    /// stored response.
    Accepted,
}

/// What happens to a 5xx answer of the handler.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerErrorPolicy {
    /// Do not store it: release the key (or keep it resumable when a phase committed),
    /// so the client's retry runs again. The default.
    #[default]
    Retry,
    /// Store it and replay it, as Stripe's API v1 does.
    Replay,
}

/// The status a fingerprint mismatch answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum MismatchStatus {
    /// `409 Conflict` (default).
    #[default]
    Conflict,
    /// `422 Unprocessable Content`, as the expired IETF draft suggested.
    UnprocessableContent,
}

impl MismatchStatus {
    /// The numeric status.
    pub const fn as_u16(self) -> u16 {
        match self {
            Self::Conflict => 409,
            Self::UnprocessableContent => 422,
        }
    }
}

/// Default response headers stored and replayed besides any configured ones.
/// `content-encoding` is among them because a stored body's bytes mean nothing
/// without it: a compressed answer is stored with its coding and replayed only
/// to a caller whose `Accept-Encoding` accepts that coding (the behaviour contract, `docs/spec.md` §5).
pub const DEFAULT_REPLAYED_HEADERS: &[&str] =
    &["content-type", "location", "content-language", "content-encoding"];

/// Headers that are never stored or replayed, whatever the allowlist says:
/// cookies are per-session, hop-by-hop headers describe one connection, and `date`
/// must describe the replay, not the original.
pub const NEVER_REPLAYED_HEADERS: &[&str] = &[
    "set-cookie",
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "date",
    "content-length",
    "idempotent-replayed",
];

/// The idempotency policy of one route. Build with [`Policy::new`] and the `with_*`
/// setters, then [`Policy::validate`] (the layer validates on construction).
///
/// ```
/// use std::time::Duration;
/// use idemkit_core::{Policy, PolicyError};
/// let p = Policy::new().with_longest_retry_chain(Duration::from_secs(3600));
/// assert!(p.validate().is_ok());
/// let bad = Policy::new().with_replay_window(Duration::from_secs(60))
///     .with_longest_retry_chain(Duration::from_secs(3600));
/// assert!(matches!(bad.validate(), Err(PolicyError::WindowShorterThanRetryChain { .. })));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Policy {
    /// How long a completed key replays (default 24 h).
    pub replay_window: Duration,
    /// How long records are kept for humans before the reaper deletes them (default 72 h).
    pub reap_threshold: Duration,
    /// How long a claim is held without a heartbeat (default 30 s).
    pub lease: Duration,
    /// What a request finds when the key is held by a live lease.
    pub in_flight: InFlightBehavior,
    /// What happens to 5xx answers.
    pub on_server_error: ServerErrorPolicy,
    /// The status replays answer with instead of the stored one (e.g. 200 for a stored 201).
    pub replay_status: Option<u16>,
    /// Extra response headers to store and replay, lower-case.
    pub replayed_headers: Vec<String>,
    /// Largest response body stored for replay (default 1 MiB). Larger responses are
    /// refused, never truncated.
    pub max_stored_body: usize,
    /// Status of a fingerprint mismatch.
    pub mismatch_status: MismatchStatus,
    /// The longest retry chain clients are told to use on this route; the replay
    /// window must cover it.
    pub longest_retry_chain: Option<Duration>,
    /// How many runs in a row of one request may panic after it recorded
    /// progress (a phase, an external call's intent) before it is parked for
    /// review instead of being resumed again (default 3: the first run and two
    /// resumes). A panic before any progress releases the key instead, and is
    /// not counted. Values below 1 count as 1.
    pub panic_limit: u32,
}

impl Default for Policy {
    fn default() -> Self {
        Self::new()
    }
}

/// A policy that would break the contract.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The replay window ends before clients stop retrying.
    #[error(
        "replay window {window:?} is shorter than the declared longest retry chain {chain:?}: a late retry would execute twice"
    )]
    WindowShorterThanRetryChain {
        /// The replay window.
        window: Duration,
        /// The declared longest retry chain.
        chain: Duration,
    },
    /// The lease is not shorter than the replay window.
    #[error("lease {lease:?} must be shorter than the replay window {window:?}")]
    LeaseNotShorterThanWindow {
        /// The lease.
        lease: Duration,
        /// The replay window.
        window: Duration,
    },
    /// Records would be reaped while they still replay.
    #[error("reap threshold {reap:?} must be at least the replay window {window:?}")]
    ReapBeforeWindowEnds {
        /// The reap threshold.
        reap: Duration,
        /// The replay window.
        window: Duration,
    },
    /// A zero duration where a positive one is required.
    #[error("{0} must be positive")]
    Zero(&'static str),
    /// A replay status outside 100–599.
    #[error("replay status {0} is not an HTTP status")]
    BadReplayStatus(u16),
    /// A header the contract forbids replaying was allowlisted.
    #[error(
        "header `{0}` can never be replayed: cookies belong to one session, hop-by-hop headers to one connection, and `date`, `content-length` and the replay marker describe the replay itself"
    )]
    ForbiddenHeader(String),
}

impl Policy {
    /// The defaults of the behaviour contract's §6 (`docs/spec.md`): 24 h window, 72 h reap, 30 s lease, reject in-flight
    /// duplicates, retry 5xx, 1 MiB stored-body cap, 409 on mismatch.
    pub const fn new() -> Self {
        Self {
            replay_window: Duration::from_secs(24 * 3600),
            reap_threshold: Duration::from_secs(72 * 3600),
            lease: Duration::from_secs(30),
            in_flight: InFlightBehavior::Reject,
            on_server_error: ServerErrorPolicy::Retry,
            replay_status: None,
            replayed_headers: Vec::new(),
            max_stored_body: 1024 * 1024,
            mismatch_status: MismatchStatus::Conflict,
            longest_retry_chain: None,
            panic_limit: 3,
        }
    }

    /// Sets the replay window.
    pub fn with_replay_window(mut self, d: Duration) -> Self {
        self.replay_window = d;
        self
    }
    /// Sets the reap threshold.
    pub fn with_reap_threshold(mut self, d: Duration) -> Self {
        self.reap_threshold = d;
        self
    }
    /// Sets the lease.
    pub fn with_lease(mut self, d: Duration) -> Self {
        self.lease = d;
        self
    }
    /// Sets the in-flight behaviour.
    pub fn with_in_flight(mut self, b: InFlightBehavior) -> Self {
        self.in_flight = b;
        self
    }
    /// Sets the 5xx policy.
    pub fn with_server_error_policy(mut self, p: ServerErrorPolicy) -> Self {
        self.on_server_error = p;
        self
    }
    /// Replays answer with `status` instead of the stored status when the stored one
    /// is `original` (e.g. `201 → 200`).
    pub fn with_replay_status(mut self, status: u16) -> Self {
        self.replay_status = Some(status);
        self
    }
    /// Stores and replays one more response header.
    pub fn with_replayed_header(mut self, name: impl Into<String>) -> Self {
        self.replayed_headers.push(name.into().to_ascii_lowercase());
        self
    }
    /// Sets the stored-body cap.
    pub fn with_max_stored_body(mut self, bytes: usize) -> Self {
        self.max_stored_body = bytes;
        self
    }
    /// Sets how many runs in a row may panic after recording progress before
    /// the request is parked for review (see [`Policy::panic_limit`]).
    pub fn with_panic_limit(mut self, runs: u32) -> Self {
        self.panic_limit = runs;
        self
    }
    /// Sets the mismatch status.
    pub fn with_mismatch_status(mut self, s: MismatchStatus) -> Self {
        self.mismatch_status = s;
        self
    }
    /// Declares the longest retry chain clients use on this route.
    pub fn with_longest_retry_chain(mut self, d: Duration) -> Self {
        self.longest_retry_chain = Some(d);
        self
    }

    /// How often a lease holder extends its lease: a third of the lease, so two
    /// heartbeats can be missed before another attempt may take over.
    pub fn heartbeat_interval(&self) -> Duration {
        self.lease / 3
    }

    /// The `Retry-After` hint of an in-progress answer: the expected wait, not
    /// the holder's whole lease. A live holder heartbeats every
    /// [`Policy::heartbeat_interval`], so by then it has either finished or
    /// proved it is still working; the hint is the lease left, capped at that
    /// interval, and at least one second (the header's unit). A client whose
    /// deadline is shorter than the lease can still wait for the answer.
    pub fn in_progress_hint(&self, lease_left: Duration) -> Duration {
        lease_left
            .min(self.heartbeat_interval())
            .max(Duration::from_secs(1))
    }

    /// Whether a response header is stored and replayed under this policy.
    pub fn replays_header(&self, name: &str) -> bool {
        let is = |n: &&str| n.eq_ignore_ascii_case(name);
        !NEVER_REPLAYED_HEADERS.iter().any(is)
            && (DEFAULT_REPLAYED_HEADERS.iter().any(is)
                || self.replayed_headers.iter().any(|n| n.eq_ignore_ascii_case(name)))
    }

    /// Checks the invariants of the behaviour contract's §6 (`docs/spec.md`).
    pub fn validate(&self) -> Result<(), PolicyError> {
        for (name, d) in [
            ("replay window", self.replay_window),
            ("reap threshold", self.reap_threshold),
            ("lease", self.lease),
        ] {
            if d.is_zero() {
                return Err(PolicyError::Zero(name));
            }
        }
        if let Some(chain) = self.longest_retry_chain
            && self.replay_window < chain
        {
            return Err(PolicyError::WindowShorterThanRetryChain {
                window: self.replay_window,
                chain,
            });
        }
        if self.lease >= self.replay_window {
            return Err(PolicyError::LeaseNotShorterThanWindow {
                lease: self.lease,
                window: self.replay_window,
            });
        }
        if self.reap_threshold < self.replay_window {
            return Err(PolicyError::ReapBeforeWindowEnds {
                reap: self.reap_threshold,
                window: self.replay_window,
            });
        }
        if let Some(s) = self.replay_status
            && !(100..=599).contains(&s)
        {
            return Err(PolicyError::BadReplayStatus(s));
        }
        if let Some(h) = self
            .replayed_headers
            .iter()
            .find(|h| NEVER_REPLAYED_HEADERS.iter().any(|n| n.eq_ignore_ascii_case(h)))
        {
            return Err(PolicyError::ForbiddenHeader(h.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        let p = Policy::new();
        assert!(p.validate().is_ok());
        assert_eq!(p.replay_window, Duration::from_secs(86_400));
        assert_eq!(p.reap_threshold, Duration::from_secs(259_200));
        assert_eq!(p.lease, Duration::from_secs(30));
        assert_eq!(p.max_stored_body, 1 << 20);
        assert_eq!(p.heartbeat_interval(), Duration::from_secs(10));
    }

    #[test]
    fn invalid_combinations_are_rejected() {
        let h = Duration::from_secs(3600);
        assert!(matches!(
            Policy::new().with_lease(Duration::from_secs(86_400)).validate(),
            Err(PolicyError::LeaseNotShorterThanWindow { .. })
        ));
        assert!(matches!(
            Policy::new().with_reap_threshold(h).validate(),
            Err(PolicyError::ReapBeforeWindowEnds { .. })
        ));
        assert!(matches!(
            Policy::new()
                .with_replay_window(h)
                .with_longest_retry_chain(2 * h)
                .validate(),
            Err(PolicyError::WindowShorterThanRetryChain { .. })
        ));
        assert_eq!(
            Policy::new().with_lease(Duration::ZERO).validate(),
            Err(PolicyError::Zero("lease"))
        );
        assert_eq!(
            Policy::new().with_replay_status(42).validate(),
            Err(PolicyError::BadReplayStatus(42))
        );
        assert!(matches!(
            Policy::new().with_replayed_header("Set-Cookie").validate(),
            Err(PolicyError::ForbiddenHeader(_))
        ));
    }

    #[test]
    fn header_allowlist() {
        let p = Policy::new().with_replayed_header("X-Request-Cost");
        assert!(p.replays_header("Content-Type"));
        assert!(p.replays_header("location"));
        assert!(p.replays_header("x-request-cost"));
        assert!(!p.replays_header("set-cookie"));
        assert!(!p.replays_header("date"));
        assert!(!p.replays_header("x-other"));
    }
}
