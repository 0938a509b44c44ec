//! One logical call ([`Call`]): its decisions ([`RetryDecision`], [`Stop`]) and
//! each attempt's plan ([`AttemptPlan`]).

use super::*;

impl RetryPolicy {
    /// Starts one logical call.
    ///
    /// `url` is the request's target (absolute, or its path): with a
    /// [published policy](Self::with_published_policy) it decides whether a generated
    /// key protects the request. `headers` are the request's headers (to find a
    /// caller-set key); `replayable` says whether the request can be sent again (its
    /// body can be cloned). A POST, PATCH, PUT or DELETE without a key gets its
    /// automatic key here, once.
    #[must_use]
    pub fn start(&self, method: &Method, url: &str, headers: &HeaderMap, replayable: bool) -> Call {
        let config = &self.inner.config;
        let has_key = headers.contains_key(config.key_header);
        let idempotent = is_idempotent(method);
        let auto_key = (!has_key && gets_auto_key(method) && config.auto_key != AutoKey::CallerOnly)
            .then(IdempotencyKey::random);
        // A generated key protects only where the server is known to honour it.
        let key_honoured = auto_key.is_some() && self.auto_key_honoured(method, url);
        // One first-sent time per logical call, the same on every attempt
        // (OASIS Repeatable Requests): the server judges the whole chain by it.
        let first_sent = (config.repeatability
            && (has_key || auto_key.is_some())
            && !headers.contains_key(REPEATABILITY_FIRST_SENT))
        .then(|| {
            HeaderValue::from_str(&httpdate::fmt_http_date(std::time::SystemTime::now()))
                .expect("an HTTP-date is a valid header value")
        });
        let rng = match &self.inner.seeder {
            Some(seeder) => StdRng::from_rng(&mut *seeder.lock().unwrap_or_else(|p| p.into_inner())),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Call {
            policy: self.clone(),
            rng,
            protected: has_key || idempotent || key_honoured,
            replayable,
            auto_key,
            first_sent,
            attempts: 0,
            attempt_started: None,
            last_attempt: Duration::ZERO,
            previous_sleep: Duration::ZERO,
            withdrawal: None,
            retry_pending: false,
            cut_by_deadline: false,
            deadline: config.deadline,
        }
    }
}

/// One logical call: every attempt of one request, under one deadline and one key.
///
/// Drive it as: [`before_attempt`](Self::before_attempt) → send →
/// [`after_attempt`](Self::after_attempt) → sleep on [`RetryDecision::Retry`] → repeat.
/// Times are "elapsed since the call started" on whatever clock the caller uses.
/// A retry's budget tokens are taken when [`RetryDecision::Retry`] is returned; dropping
/// the call before the next [`before_attempt`](Self::before_attempt) (the caller
/// cancelled during the sleep, or gave up waiting) gives them back through
/// [`Budget::refund`](crate::Budget::refund).
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderMap, Method, StatusCode};
/// use idemkit_client::{RetryDecision, Outcome, RetryPolicy, Stop};
///
/// let policy = RetryPolicy::default().with_seed(1);
/// let mut call = policy.start(&Method::POST, "/orders", &HeaderMap::new(), true);
/// assert!(call.idempotency_key().is_some(), "POST without a key gets one");
/// let mut now = Duration::ZERO;
/// loop {
///     let plan = call.before_attempt(now);
///     now += Duration::from_millis(20); // the "server" always answers 503
///     match call.after_attempt(now, &Outcome::status(StatusCode::SERVICE_UNAVAILABLE)) {
///         RetryDecision::Retry(delay) => now += delay,
///         RetryDecision::Stop(stop) => {
///             assert_eq!(stop, Stop::AttemptsExhausted);
///             assert_eq!(plan.number(), 3);
///             break;
///         }
///         other => unreachable!("{other:?}"),
///     }
/// }
/// ```
#[derive(Debug)]
pub struct Call {
    policy: RetryPolicy,
    rng: StdRng,
    protected: bool,
    replayable: bool,
    auto_key: Option<IdempotencyKey>,
    /// `Repeatability-First-Sent` of every attempt, when the client speaks OASIS
    /// Repeatable Requests.
    first_sent: Option<HeaderValue>,
    attempts: u32,
    attempt_started: Option<Duration>,
    last_attempt: Duration,
    previous_sleep: Duration,
    withdrawal: Option<Withdrawal>,
    /// A retry was decided (and paid for) but not started yet: if the call ends
    /// before [`Call::before_attempt`] (the caller cancelled during the backoff, or
    /// the deadline came first), its tokens go back to the budget.
    retry_pending: bool,
    /// The attempt under way was given less than the attempt timeout because the
    /// deadline was nearer: its timing out says nothing about the attempt timeout.
    cut_by_deadline: bool,
    /// The overall deadline: the config's, or less (see [`Call::limit_deadline`]).
    deadline: Option<Duration>,
}

impl Drop for Call {
    fn drop(&mut self) {
        if self.retry_pending
            && let Some(withdrawal) = self.withdrawal.take()
        {
            self.policy.inner.budget.refund(withdrawal);
            self.policy.report_budget();
        }
    }
}

impl Call {
    /// The key generated for this call, if one was (the same on every attempt).
    #[must_use]
    pub fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.auto_key.as_ref()
    }

    /// Whether a *maybe executed* failure may be retried: the request has an
    /// idempotent method, a caller-set key, or a generated key the route is known to
    /// honour (see [`AutoKey`]).
    #[must_use]
    pub fn is_protected(&self) -> bool {
        self.protected
    }

    /// Attempts started so far.
    #[must_use]
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Shortens this call's overall deadline to `deadline` (from the call's
    /// start) when that is sooner than the configured one: a server hands its
    /// caller's remaining time to a downstream call this way, so every attempt
    /// (and its `Request-Timeout`) fits in what the caller will still wait for.
    ///
    /// ```
    /// use std::time::Duration;
    /// use http::{HeaderMap, Method};
    /// use idemkit_client::RetryPolicy;
    ///
    /// let policy = RetryPolicy::default();
    /// let mut call = policy.start(&Method::POST, "/orders", &HeaderMap::new(), true);
    /// call.limit_deadline(Duration::from_millis(1500));
    /// assert_eq!(call.before_attempt(Duration::ZERO).remaining(), Some(Duration::from_millis(1500)));
    /// ```
    pub fn limit_deadline(&mut self, deadline: Duration) {
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
    }

    /// Time left before the overall deadline at `elapsed`, if there is one.
    #[cfg(any(feature = "reqwest", feature = "tower", feature = "tonic"))]
    pub(crate) fn remaining(&self, elapsed: Duration) -> Option<Duration> {
        self.deadline.map(|d| d.saturating_sub(elapsed))
    }

    /// How long a retry may wait (for the inner service to be ready) at `elapsed`
    /// and still leave the time an attempt needs before the deadline (the rule
    /// [`Call::after_attempt`] applies before sleeping).
    #[cfg(any(feature = "tower", feature = "tonic"))]
    pub(crate) fn wait_budget(&self, elapsed: Duration) -> Option<Duration> {
        let needed = self.policy.inner.config.min_attempt_time.max(self.last_attempt);
        self.remaining(elapsed).map(|r| r.saturating_sub(needed))
    }

    /// Plans the next attempt at `elapsed` since the call started.
    pub fn before_attempt(&mut self, elapsed: Duration) -> AttemptPlan {
        let config = &self.policy.inner.config;
        // The retry is being sent: its tokens are spent for good.
        self.retry_pending = false;
        self.attempts += 1;
        self.attempt_started = Some(elapsed);
        let remaining = self.deadline.map(|d| d.saturating_sub(elapsed));
        let mut timeout = self.policy.current_attempt_timeout();
        self.cut_by_deadline = false;
        if let Some(remaining) = remaining
            && remaining < timeout
        {
            timeout = remaining;
            self.cut_by_deadline = true;
        }
        AttemptPlan {
            number: self.attempts,
            max_attempts: config.max_attempts,
            timeout,
            remaining,
            key: self
                .auto_key
                .as_ref()
                .map(|k| (config.key_header(), k.header_value())),
            first_sent: self.first_sent.clone(),
            attempt_header: config.attempt_header,
            timeout_header: config.timeout_header,
        }
    }

    /// Records the attempt's outcome at `elapsed` and decides what comes next.
    pub fn after_attempt(&mut self, elapsed: Duration, outcome: &Outcome) -> RetryDecision {
        self.after_attempt_with(elapsed, AttemptInfo::new(outcome))
    }

    /// [`after_attempt`](Self::after_attempt) with what else the attempt left (the
    /// response's headers, the transport error) for a
    /// [classifier hook](RetryPolicy::with_classifier_hook) to judge by.
    pub fn after_attempt_with(&mut self, elapsed: Duration, attempt: AttemptInfo<'_>) -> RetryDecision {
        let outcome = attempt.outcome();
        let started = self.attempt_started.take().unwrap_or(elapsed);
        self.last_attempt = elapsed.saturating_sub(started);
        let inner = Arc::clone(&self.policy.inner);
        let config = &inner.config;
        if let Outcome::Answered(answer) = outcome
            && self.auto_key.is_some()
            && answer.problem_code.as_deref() == Some(crate::classify::CODE_IN_PROGRESS)
        {
            // The server answered this very key "a request with this key is in
            // progress": it de-duplicates by the key on this route.
            self.protected = true;
        }
        let default = config.classifier.classify(outcome, self.protected);
        let verdict = match &inner.extras.hook {
            Some(hook) => hook.classify(&attempt.with_protected(self.protected), default),
            None => default,
        };
        metrics::counter!(
            "idemkit_client_attempts_total",
            "outcome" => outcome.label(),
            "verdict" => verdict_label(verdict),
        )
        .increment(1);
        if matches!(outcome, Outcome::MaybeExecuted { timed_out: true }) && !self.cut_by_deadline {
            // The adaptive timeout learns from attempts it cut short too, or a rise in
            // latency above it would fail every call and never be measured. Not from
            // an attempt the deadline cut shorter than the attempt timeout: that one
            // only says latency exceeded what the caller had left, and doubling that
            // could raise the timeout above anything an attempt ever needed.
            inner
                .latency
                .record_timeout(self.last_attempt, &config.attempt_timeout);
        }
        match verdict {
            // A hook's `Success` or never-retried verdict on an attempt without an
            // answer: there is no response to hand back.
            Verdict::Success | Verdict::Fatal(FatalReason::NotAllowlisted)
                if !matches!(outcome, Outcome::Answered(_)) =>
            {
                self.give_up(Stop::NotRetryable(FatalReason::NotAllowlisted), outcome)
            }
            Verdict::Success => {
                inner.budget.deposit(self.withdrawal.take());
                self.policy.report_budget();
                inner.latency.record(self.last_attempt, &config.attempt_timeout);
                RetryDecision::Return
            }
            Verdict::Fatal(FatalReason::NotAllowlisted) => RetryDecision::Return,
            // Unprotected only because the generated key is not known to be honoured.
            Verdict::Fatal(FatalReason::MaybeExecutedUnprotected) if self.auto_key.is_some() => {
                self.give_up(Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed), outcome)
            }
            Verdict::Fatal(reason) => self.give_up(Stop::NotRetryable(reason), outcome),
            Verdict::Transient(kind) => self.plan_retry(kind, elapsed, outcome),
        }
    }

    fn plan_retry(&mut self, kind: RetryKind, elapsed: Duration, outcome: &Outcome) -> RetryDecision {
        let inner = Arc::clone(&self.policy.inner);
        let config = &inner.config;
        if !self.replayable {
            return self.give_up(Stop::NotReplayable, outcome);
        }
        if matches!(outcome, Outcome::Answered(answer) if answer.retry_refused) {
            return self.give_up(Stop::RetryRefused, outcome);
        }
        if self.attempts >= config.max_attempts {
            return self.give_up(Stop::AttemptsExhausted, outcome);
        }
        let backoff = match kind {
            RetryKind::Throttling => config.throttling_backoff,
            RetryKind::Transient => config.backoff,
        };
        let computed = backoff.sample(self.attempts - 1, self.previous_sleep, &mut self.rng);
        let retry_after = outcome.retry_after();
        if let Some(ra) = retry_after
            && ra > config.retry_after_cap
        {
            return self.give_up(Stop::RetryAfterAboveCap { retry_after: ra }, outcome);
        }
        // `Retry-After` is a floor; the jittered backoff is added above it so that
        // clients told the same value do not come back at the same instant.
        let floor = retry_after.unwrap_or(Duration::ZERO);
        let mut delay = floor.saturating_add(computed);
        if let Some(deadline) = self.deadline {
            // Never sleep into an attempt that could not finish before the deadline.
            let remaining = deadline.saturating_sub(elapsed);
            let needed = config.min_attempt_time.max(self.last_attempt);
            let room = remaining.saturating_sub(needed);
            if needed > remaining || delay > room {
                let least = backoff.floor(self.attempts - 1, self.previous_sleep);
                match retry_after {
                    Some(ra) if needed > remaining || ra > room => {
                        return self.give_up(Stop::RetryAfterPastDeadline { retry_after: ra }, outcome);
                    }
                    // The floor fits but floor + jitter does not: draw the jitter from
                    // what is left, so waiting clients still spread out.
                    Some(ra) if ra.saturating_add(least) <= room => {
                        delay = ra + jitter_between(least, room - ra, &mut self.rng);
                    }
                    _ => return self.give_up(Stop::DeadlineExceeded, outcome),
                }
            }
        }
        let Some(withdrawal) = inner.budget.withdraw(kind) else {
            self.policy.report_budget();
            return self.give_up(Stop::BudgetExhausted, outcome);
        };
        self.policy.report_budget();
        // Taken now, so that concurrent calls cannot all plan on the same tokens; given
        // back on drop if the retry is never sent (see `retry_pending`).
        self.withdrawal = Some(withdrawal);
        self.retry_pending = true;
        self.previous_sleep = computed;
        metrics::counter!(
            "idemkit_client_retries_total",
            "kind" => kind.label(),
            "reason" => outcome.reason(),
        )
        .increment(1);
        tracing::info!(
            attempt = self.attempts,
            max_attempts = config.max_attempts,
            outcome = %outcome,
            kind = kind.label(),
            next_delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            retry_after_ms = retry_after.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            auto_key = self.auto_key.is_some(),
            "retrying request"
        );
        RetryDecision::Retry(delay)
    }

    fn give_up(&mut self, stop: Stop, outcome: &Outcome) -> RetryDecision {
        metrics::counter!("idemkit_client_gave_up_total", "reason" => stop.label()).increment(1);
        tracing::warn!(
            attempt = self.attempts,
            outcome = %outcome,
            reason = %stop,
            "not retrying request"
        );
        RetryDecision::Stop(stop)
    }
}

/// A uniform draw from `[low, high]` (`low <= high`).
fn jitter_between(low: Duration, high: Duration, rng: &mut StdRng) -> Duration {
    use rand::Rng;
    let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
    let (low, high) = (nanos(low), nanos(high));
    Duration::from_nanos(if high <= low {
        low
    } else {
        rng.random_range(low..=high)
    })
}

fn verdict_label(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Success => "success",
        Verdict::Transient(kind) => kind.label(),
        Verdict::Fatal(_) => "fatal",
    }
}

/// What [`Call::after_attempt`] decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryDecision {
    /// Hand the attempt's result to the caller as it is: a success, or an answer that
    /// is never retried (e.g. 400, `409 idempotency_key_reused`).
    Return,
    /// Sleep this long, then make another attempt.
    Retry(Duration),
    /// The outcome was a failure and no further attempt will be made.
    Stop(Stop),
}

/// Why retrying stopped on a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Stop {
    /// The attempt cap was reached.
    AttemptsExhausted,
    /// The client's shared retry budget is empty (too many recent failures).
    BudgetExhausted,
    /// The next attempt could not finish before the overall deadline.
    DeadlineExceeded,
    /// The server's `Retry-After` ends past the overall deadline.
    RetryAfterPastDeadline {
        /// The server's requested wait.
        retry_after: Duration,
    },
    /// The server's `Retry-After` is longer than the client waits for
    /// ([`RetryConfig::with_retry_after_cap`], default 60 s).
    RetryAfterAboveCap {
        /// The server's requested wait.
        retry_after: Duration,
    },
    /// The request body cannot be cloned, so the request was sent once.
    NotReplayable,
    /// The server asked not to retry (a negative or malformed gRPC
    /// `grpc-retry-pushback-ms`, gRFC A6).
    RetryRefused,
    /// The failure is never retried.
    NotRetryable(FatalReason),
}

impl Stop {
    /// The `reason` label of `idemkit_client_gave_up_total` (and of the WARN
    /// event) for this stop: `attempts_exhausted`, `budget_exhausted`, …
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::AttemptsExhausted => "attempts_exhausted",
            Self::BudgetExhausted => "budget_exhausted",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::RetryAfterPastDeadline { .. } => "retry_after_past_deadline",
            Self::RetryAfterAboveCap { .. } => "retry_after_above_cap",
            Self::NotReplayable => "not_replayable",
            Self::RetryRefused => "retry_refused",
            Self::NotRetryable(_) => "not_retryable",
        }
    }
}

impl fmt::Display for Stop {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AttemptsExhausted => f.write_str("attempt cap reached"),
            Self::BudgetExhausted => {
                f.write_str("retry budget exhausted (too many recent failures on this client)")
            }
            Self::DeadlineExceeded => f.write_str("no time left before the deadline for another attempt"),
            Self::RetryAfterPastDeadline { retry_after } => write!(
                f,
                "server asked to retry after {}s, past the deadline",
                retry_after.as_secs_f64()
            ),
            Self::RetryAfterAboveCap { retry_after } => write!(
                f,
                "server asked to retry after {}s, longer than the client waits",
                retry_after.as_secs_f64()
            ),
            Self::NotReplayable => f.write_str("request body cannot be cloned; sent once"),
            Self::RetryRefused => f.write_str("the server asked not to retry (grpc-retry-pushback-ms)"),
            Self::NotRetryable(reason) => write!(f, "not retryable: {reason}"),
        }
    }
}

/// What one attempt should carry and how long it may take.
#[derive(Debug, Clone)]
pub struct AttemptPlan {
    number: u32,
    max_attempts: u32,
    timeout: Duration,
    remaining: Option<Duration>,
    key: Option<(HeaderName, HeaderValue)>,
    first_sent: Option<HeaderValue>,
    attempt_header: bool,
    timeout_header: bool,
}

impl AttemptPlan {
    /// 1-based attempt number.
    #[must_use]
    pub fn number(&self) -> u32 {
        self.number
    }

    /// The attempt cap.
    #[must_use]
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// This attempt's timeout: `min(attempt timeout, remaining deadline)`.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Time left before the overall deadline, if there is one.
    #[must_use]
    pub fn remaining(&self) -> Option<Duration> {
        self.remaining
    }

    /// Adds the automatic key (unless a key is already there), the attempt's budget
    /// as [`wire::REQUEST_TIMEOUT`](idemkit_core::wire::REQUEST_TIMEOUT) (`Request-Timeout: <ms>`, this attempt's
    /// [`timeout`](Self::timeout) rounded down; it replaces one already there) and the
    /// enabled attempt/timeout headers.
    pub fn apply(&self, headers: &mut HeaderMap) {
        self.apply_metadata(headers);
        let ms = self.timeout.as_millis().min(DEADLINE_HEADER_MAX_MS);
        let ms = u64::try_from(ms).expect("at most 10 digits");
        headers.insert(DEADLINE_HEADER, HeaderValue::from(ms));
    }

    /// [`apply`](Self::apply) without the REST deadline header (gRPC carries its
    /// budget in `grpc-timeout`).
    pub(crate) fn apply_metadata(&self, headers: &mut HeaderMap) {
        if let Some((name, value)) = &self.key
            && !headers.contains_key(name)
        {
            headers.insert(name.clone(), value.clone());
        }
        if let Some(first_sent) = &self.first_sent
            && !headers.contains_key(REPEATABILITY_FIRST_SENT)
        {
            headers.insert(REPEATABILITY_FIRST_SENT, first_sent.clone());
        }
        if self.attempt_header {
            headers.insert(ATTEMPT_HEADER, HeaderValue::from(self.number));
        }
        if self.timeout_header {
            let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
            headers.insert(TIMEOUT_HEADER, HeaderValue::from(ms));
        }
    }
}
