//! Policy: attempt cap, overall deadline, backoff, budget and keys, applied to the
//! verdicts of the [`Classifier`](crate::Classifier).
//!
//! The policy is sans-IO: a [`Call`] is told what happened and when, and answers what
//! to do next. The reqwest and tower integrations drive it with tokio's clock; the
//! benchmarks drive the very same code with a virtual clock.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::backoff::{Backoff, Jitter};
use crate::budget::{Budget, TokenBucket, Withdrawal};
use crate::classify::{Classifier, FatalReason, Outcome, RetryKind, Verdict};
use crate::key::{AutoKey, IDEMPOTENCY_KEY_STR, IdempotencyKey};
use crate::timeout::AdaptiveTimeout;
use crate::timeout::{AttemptTimeout, LatencyWindow};

/// Header carrying the 1-based attempt number, when enabled with
/// [`RetryConfig::with_attempt_header`]: `Idemkit-Attempt: 2`.
pub const ATTEMPT_HEADER: HeaderName = HeaderName::from_static("idemkit-attempt");

/// Header carrying how long the client will wait for this attempt, in whole
/// milliseconds (`min(attempt timeout, remaining deadline)`), when enabled with
/// [`RetryConfig::with_timeout_header`]: `Idemkit-Timeout-Ms: 1834`. A server can drop
/// work the client will no longer wait for.
pub const TIMEOUT_HEADER: HeaderName = HeaderName::from_static("idemkit-timeout-ms");

/// Header carrying each attempt's remaining budget in whole milliseconds (rounded
/// down; 1 to 10 digits), sent on every attempt by the HTTP integrations:
/// `Request-Timeout: 1834`, idemkit's REST deadline convention (the same name as the
/// server's `idemkit_core::DEADLINE_HEADER`, checked by a test). An idemkit server
/// refuses a request whose budget is spent before claiming its key and hands the rest
/// to the handler.
pub const DEADLINE_HEADER: HeaderName = HeaderName::from_static("request-timeout");

/// The largest [`DEADLINE_HEADER`] value (10 digits).
const DEADLINE_HEADER_MAX_MS: u128 = 9_999_999_999;

/// Whether `method` is idempotent by RFC 9110 (GET, HEAD, OPTIONS, TRACE, PUT, DELETE).
#[must_use]
pub fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Whether [`AutoKey::Generate`] gives a request with `method` a key when it has none:
/// every method except the safe ones (GET, HEAD, OPTIONS, TRACE). That covers POST,
/// PATCH, PUT and DELETE, the methods an idemkit server guards by default, so a
/// keyless PUT or DELETE is not refused with `400 idempotency_key_missing`.
#[must_use]
pub fn gets_auto_key(method: &Method) -> bool {
    !matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE
    )
}

/// Retry settings: a plain `Copy` value, buildable in a `const`. Every default is
/// listed in `docs/client.md` (the [guide](crate::guide)) and argued in
/// `docs/client-decisions.md`.
///
/// ```
/// use std::time::Duration;
/// use idemkit_client::{Jitter, RetryConfig, RetryPolicy};
///
/// const CONFIG: RetryConfig = RetryConfig::new()
///     .with_max_attempts(4)
///     .with_deadline(Duration::from_secs(5))
///     .with_attempt_timeout(Duration::from_secs(2))
///     .with_jitter(Jitter::Decorrelated);
/// assert_eq!(CONFIG.max_attempts(), 4);
///
/// // `Copy`: one value configures several policies (each with its own budget).
/// let config = CONFIG.with_retry_after_cap(Duration::from_secs(10));
/// let orders = RetryPolicy::new(config);
/// let payments = RetryPolicy::new(config);
/// # let _ = (orders, payments);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryConfig {
    max_attempts: u32,
    deadline: Option<Duration>,
    attempt_timeout: AttemptTimeout,
    min_attempt_time: Duration,
    retry_after_cap: Duration,
    backoff: Backoff,
    throttling_backoff: Backoff,
    classifier: Classifier,
    auto_key: AutoKey,
    key_header: &'static str,
    attempt_header: bool,
    timeout_header: bool,
    name: &'static str,
}

impl RetryConfig {
    /// Default attempt cap (attempts in total, not retries).
    pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;
    /// Default overall deadline of one logical call.
    pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(30);
    /// Default timeout of one attempt.
    pub const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
    /// Default shortest time an attempt is assumed to need.
    pub const DEFAULT_MIN_ATTEMPT_TIME: Duration = Duration::from_millis(50);
    /// Default longest `Retry-After` the client waits for.
    pub const DEFAULT_RETRY_AFTER_CAP: Duration = Duration::from_secs(60);
    /// Default value of the `client` label on the budget gauge.
    pub const DEFAULT_NAME: &'static str = "default";

    /// The defaults.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            max_attempts: Self::DEFAULT_MAX_ATTEMPTS,
            deadline: Some(Self::DEFAULT_DEADLINE),
            attempt_timeout: AttemptTimeout::DEFAULT,
            min_attempt_time: Self::DEFAULT_MIN_ATTEMPT_TIME,
            retry_after_cap: Self::DEFAULT_RETRY_AFTER_CAP,
            backoff: Backoff::TRANSIENT,
            throttling_backoff: Backoff::THROTTLING,
            classifier: Classifier::new(),
            auto_key: AutoKey::Generate,
            key_header: IDEMPOTENCY_KEY_STR,
            attempt_header: false,
            timeout_header: false,
            name: Self::DEFAULT_NAME,
        }
    }

    /// Attempts in total, first one included (minimum 1). `1` disables retries.
    #[must_use]
    pub const fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// The overall deadline of one logical call (default 30 s), set once when it
    /// starts: every attempt and every sleep between attempts fit inside it.
    #[must_use]
    pub const fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// No overall deadline: the attempt cap, the attempt timeout and the
    /// `Retry-After` cap still bound a call.
    #[must_use]
    pub const fn without_deadline(mut self) -> Self {
        self.deadline = None;
        self
    }

    /// How long one attempt may take (default 10 s). Each attempt gets
    /// `min(this, time left before the deadline)`.
    #[must_use]
    pub const fn with_attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = AttemptTimeout::Fixed(timeout);
        self
    }

    /// Derives the attempt timeout from measured latency instead of a fixed value
    /// (`multiplier × p99` of recent successful attempts, within bounds): see
    /// [`AdaptiveTimeout`].
    #[must_use]
    pub const fn with_adaptive_attempt_timeout(mut self, adaptive: AdaptiveTimeout) -> Self {
        self.attempt_timeout = AttemptTimeout::Adaptive(adaptive);
        self
    }

    /// The shortest time any attempt is assumed to need. A retry is not started when,
    /// after its sleep, less than `max(this, the previous attempt's duration)` would
    /// remain before the deadline.
    #[must_use]
    pub const fn with_min_attempt_time(mut self, min: Duration) -> Self {
        self.min_attempt_time = min;
        self
    }

    /// The longest `Retry-After` the client honours (default 60 s). A server asking for
    /// more ends the retries at once: the call returns a [`RetryError`](crate::RetryError)
    /// with [`Stop::RetryAfterAboveCap`], the server's answer and its hint.
    #[must_use]
    pub const fn with_retry_after_cap(mut self, cap: Duration) -> Self {
        self.retry_after_cap = cap;
        self
    }

    /// Backoff after transient failures.
    #[must_use]
    pub const fn with_backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Backoff after throttling (429, `409 idempotency_request_in_progress`).
    #[must_use]
    pub const fn with_throttling_backoff(mut self, backoff: Backoff) -> Self {
        self.throttling_backoff = backoff;
        self
    }

    /// Sets the jitter formula of both backoffs.
    #[must_use]
    pub const fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.backoff = self.backoff.with_jitter(jitter);
        self.throttling_backoff = self.throttling_backoff.with_jitter(jitter);
        self
    }

    /// Replaces the classifier (e.g. `Classifier::new().with_retry_500(true)`).
    #[must_use]
    pub const fn with_classifier(mut self, classifier: Classifier) -> Self {
        self.classifier = classifier;
        self
    }

    /// Whether requests without a key get one automatically (default
    /// [`AutoKey::Generate`]: POST, PATCH, PUT, DELETE and other unsafe methods).
    #[must_use]
    pub const fn with_auto_key(mut self, auto_key: AutoKey) -> Self {
        self.auto_key = auto_key;
        self
    }

    /// The header carrying the key (default `idempotency-key`), as a lowercase header
    /// name.
    ///
    /// # Panics
    ///
    /// When `header` is not a valid lowercase header name (at compile time in a
    /// `const`).
    #[must_use]
    pub const fn with_key_header(mut self, header: &'static str) -> Self {
        // Validates the name (panics on an invalid or uppercase one).
        std::mem::forget(HeaderName::from_static(header));
        self.key_header = header;
        self
    }

    /// Sends [`ATTEMPT_HEADER`] on every attempt.
    #[must_use]
    pub const fn with_attempt_header(mut self, send: bool) -> Self {
        self.attempt_header = send;
        self
    }

    /// Sends [`TIMEOUT_HEADER`] on every attempt.
    #[must_use]
    pub const fn with_timeout_header(mut self, send: bool) -> Self {
        self.timeout_header = send;
        self
    }

    /// Names the client in metrics: the `client` label of the
    /// `idemkit_client_budget_tokens` gauge (default `"default"`). Give each policy
    /// with its own budget its own name.
    #[must_use]
    pub const fn with_name(mut self, name: &'static str) -> Self {
        self.name = name;
        self
    }

    /// Attempt cap.
    #[must_use]
    pub const fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Overall deadline, `None` when there is none.
    #[must_use]
    pub const fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Attempt timeout setting (fixed or adaptive).
    #[must_use]
    pub const fn attempt_timeout(&self) -> AttemptTimeout {
        self.attempt_timeout
    }

    /// The shortest time an attempt is assumed to need.
    #[must_use]
    pub const fn min_attempt_time(&self) -> Duration {
        self.min_attempt_time
    }

    /// The longest `Retry-After` honoured.
    #[must_use]
    pub const fn retry_after_cap(&self) -> Duration {
        self.retry_after_cap
    }

    /// Backoff after transient failures.
    #[must_use]
    pub const fn backoff(&self) -> Backoff {
        self.backoff
    }

    /// Backoff after throttling.
    #[must_use]
    pub const fn throttling_backoff(&self) -> Backoff {
        self.throttling_backoff
    }

    /// The classifier.
    #[must_use]
    pub const fn classifier(&self) -> Classifier {
        self.classifier
    }

    /// The auto-key setting.
    #[must_use]
    pub const fn auto_key(&self) -> AutoKey {
        self.auto_key
    }

    /// The key header.
    #[must_use]
    pub fn key_header(&self) -> HeaderName {
        HeaderName::from_static(self.key_header)
    }

    /// The name used as the `client` metric label.
    #[must_use]
    pub const fn name(&self) -> &'static str {
        self.name
    }
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self::new()
    }
}

struct Inner {
    config: RetryConfig,
    budget: Arc<dyn Budget>,
    latency: LatencyWindow,
    seeder: Option<Mutex<StdRng>>,
}

/// A retry policy and the state shared by every call made with it: the retry budget
/// and the latency window of the adaptive timeout. Cheap to clone; clones share that
/// state, so build one per client (per downstream service), not one per call.
///
/// ```
/// use std::sync::Arc;
/// use idemkit_client::{RetryConfig, RetryPolicy, TokenBucket};
///
/// let policy = RetryPolicy::new(RetryConfig::new().with_max_attempts(5))
///     .with_budget(Arc::new(TokenBucket::new().with_capacity(100)));
/// assert_eq!(policy.config().max_attempts(), 5);
/// ```
#[derive(Clone)]
pub struct RetryPolicy {
    inner: Arc<Inner>,
}

impl fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("config", &self.inner.config)
            .field("budget", &self.inner.budget)
            .finish_non_exhaustive()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::new(RetryConfig::new())
    }
}

impl From<RetryConfig> for RetryPolicy {
    fn from(config: RetryConfig) -> Self {
        Self::new(config)
    }
}

impl RetryPolicy {
    /// A policy with the default budget ([`TokenBucket::new`]).
    #[must_use]
    pub fn new(config: RetryConfig) -> Self {
        Self::build(config, Arc::new(TokenBucket::new()), None)
    }

    fn build(config: RetryConfig, budget: Arc<dyn Budget>, seed: Option<u64>) -> Self {
        let policy = Self {
            inner: Arc::new(Inner {
                config,
                budget,
                latency: LatencyWindow::default(),
                seeder: seed.map(|s| Mutex::new(StdRng::seed_from_u64(s))),
            }),
        };
        policy.report_budget();
        policy
    }

    /// Publishes the budget's tokens on the `idemkit_client_budget_tokens{client}` gauge.
    fn report_budget(&self) {
        if let Some(tokens) = self.inner.budget.remaining() {
            metrics::gauge!("idemkit_client_budget_tokens", "client" => self.inner.config.name)
                .set(f64::from(tokens));
        }
    }

    /// A new policy with the same settings and `budget` (e.g. [`Unlimited`](crate::Unlimited)
    /// or a bucket shared with other clients). The result does not share state with
    /// `self`.
    #[must_use]
    pub fn with_budget(self, budget: Arc<dyn Budget>) -> Self {
        let seed = self.seed_hint();
        Self::build(self.inner.config, budget, seed)
    }

    /// A new policy whose jitter comes from a generator seeded with `seed`
    /// (deterministic runs, tests). The result does not share state with `self`.
    #[must_use]
    pub fn with_seed(self, seed: u64) -> Self {
        Self::build(self.inner.config, Arc::clone(&self.inner.budget), Some(seed))
    }

    fn seed_hint(&self) -> Option<u64> {
        use rand::Rng;
        self.inner
            .seeder
            .as_ref()
            .map(|m| m.lock().unwrap_or_else(|p| p.into_inner()).random())
    }

    /// The settings.
    #[must_use]
    pub fn config(&self) -> &RetryConfig {
        &self.inner.config
    }

    /// The shared retry budget.
    #[must_use]
    pub fn budget(&self) -> &Arc<dyn Budget> {
        &self.inner.budget
    }

    /// Tokens left in the shared retry budget (`None` for a budget without tokens, such
    /// as [`Unlimited`](crate::Unlimited)). The same number is published as the gauge
    /// `idemkit_client_budget_tokens{client}` through `metrics`.
    ///
    /// ```
    /// use idemkit_client::{RetryConfig, RetryPolicy};
    ///
    /// let policy = RetryPolicy::new(RetryConfig::new());
    /// assert_eq!(policy.budget_remaining(), Some(500));
    /// ```
    #[must_use]
    pub fn budget_remaining(&self) -> Option<u32> {
        self.inner.budget.remaining()
    }

    /// The attempt timeout the policy would use now (adaptive timeouts move with the
    /// measured latency).
    #[must_use]
    pub fn current_attempt_timeout(&self) -> Duration {
        self.inner.latency.timeout(&self.inner.config.attempt_timeout)
    }

    /// Starts one logical call.
    ///
    /// `headers` are the request's headers (to find a caller-set key); `replayable`
    /// says whether the request can be sent again (its body can be cloned). A POST,
    /// PATCH, PUT or DELETE without a key gets its automatic key here, once.
    #[must_use]
    pub fn start(&self, method: &Method, headers: &HeaderMap, replayable: bool) -> Call {
        let config = &self.inner.config;
        let has_key = headers.contains_key(config.key_header);
        let idempotent = is_idempotent(method);
        let auto_key = (!has_key && gets_auto_key(method) && config.auto_key == AutoKey::Generate)
            .then(IdempotencyKey::random);
        let rng = match &self.inner.seeder {
            Some(seeder) => StdRng::from_rng(&mut *seeder.lock().unwrap_or_else(|p| p.into_inner())),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Call {
            policy: self.clone(),
            rng,
            protected: has_key || idempotent || auto_key.is_some(),
            replayable,
            auto_key,
            attempts: 0,
            attempt_started: None,
            last_attempt: Duration::ZERO,
            previous_sleep: Duration::ZERO,
            withdrawal: None,
            deadline: config.deadline,
        }
    }
}

/// One logical call: every attempt of one request, under one deadline and one key.
///
/// Drive it as: [`before_attempt`](Self::before_attempt) → send →
/// [`after_attempt`](Self::after_attempt) → sleep on [`Decision::Retry`] → repeat.
/// Times are "elapsed since the call started" on whatever clock the caller uses.
///
/// ```
/// use std::time::Duration;
/// use http::{HeaderMap, Method, StatusCode};
/// use idemkit_client::{Decision, Outcome, RetryPolicy, Stop};
///
/// let policy = RetryPolicy::default().with_seed(1);
/// let mut call = policy.start(&Method::POST, &HeaderMap::new(), true);
/// assert!(call.idempotency_key().is_some(), "POST without a key gets one");
/// let mut now = Duration::ZERO;
/// loop {
///     let plan = call.before_attempt(now);
///     now += Duration::from_millis(20); // the "server" always answers 503
///     match call.after_attempt(now, &Outcome::status(StatusCode::SERVICE_UNAVAILABLE)) {
///         Decision::Retry(delay) => now += delay,
///         Decision::Stop(stop) => {
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
    attempts: u32,
    attempt_started: Option<Duration>,
    last_attempt: Duration,
    previous_sleep: Duration,
    withdrawal: Option<Withdrawal>,
    /// The overall deadline: the config's, or less (see [`Call::limit_deadline`]).
    deadline: Option<Duration>,
}

impl Call {
    /// The key generated for this call, if one was (the same on every attempt).
    #[must_use]
    pub fn idempotency_key(&self) -> Option<&IdempotencyKey> {
        self.auto_key.as_ref()
    }

    /// Whether a *maybe executed* failure may be retried (key or idempotent method).
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
    /// let mut call = policy.start(&Method::POST, &HeaderMap::new(), true);
    /// call.limit_deadline(Duration::from_millis(1500));
    /// assert_eq!(call.before_attempt(Duration::ZERO).remaining(), Some(Duration::from_millis(1500)));
    /// ```
    pub fn limit_deadline(&mut self, deadline: Duration) {
        self.deadline = Some(self.deadline.map_or(deadline, |d| d.min(deadline)));
    }

    /// Plans the next attempt at `elapsed` since the call started.
    pub fn before_attempt(&mut self, elapsed: Duration) -> AttemptPlan {
        let config = &self.policy.inner.config;
        self.attempts += 1;
        self.attempt_started = Some(elapsed);
        let remaining = self.deadline.map(|d| d.saturating_sub(elapsed));
        let mut timeout = self.policy.current_attempt_timeout();
        if let Some(remaining) = remaining {
            timeout = timeout.min(remaining);
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
            attempt_header: config.attempt_header,
            timeout_header: config.timeout_header,
        }
    }

    /// Records the attempt's outcome at `elapsed` and decides what comes next.
    pub fn after_attempt(&mut self, elapsed: Duration, outcome: &Outcome) -> Decision {
        let started = self.attempt_started.take().unwrap_or(elapsed);
        self.last_attempt = elapsed.saturating_sub(started);
        let inner = Arc::clone(&self.policy.inner);
        let config = &inner.config;
        let verdict = config.classifier.classify(outcome, self.protected);
        metrics::counter!(
            "idemkit_client_attempts_total",
            "outcome" => outcome.label(),
            "verdict" => verdict_label(verdict),
        )
        .increment(1);
        match verdict {
            Verdict::Success => {
                inner.budget.deposit(self.withdrawal.take());
                self.policy.report_budget();
                inner.latency.record(self.last_attempt);
                Decision::Return
            }
            Verdict::Fatal(FatalReason::NotAllowlisted) => Decision::Return,
            Verdict::Fatal(reason) => self.give_up(Stop::NotRetryable(reason), outcome),
            Verdict::Transient(kind) => self.plan_retry(kind, elapsed, outcome),
        }
    }

    fn plan_retry(&mut self, kind: RetryKind, elapsed: Duration, outcome: &Outcome) -> Decision {
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
        self.withdrawal = Some(withdrawal);
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
        Decision::Retry(delay)
    }

    fn give_up(&mut self, stop: Stop, outcome: &Outcome) -> Decision {
        metrics::counter!("idemkit_client_gave_up_total", "reason" => stop.label()).increment(1);
        tracing::warn!(
            attempt = self.attempts,
            outcome = %outcome,
            reason = %stop,
            "not retrying request"
        );
        Decision::Stop(stop)
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
pub enum Decision {
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
    fn label(self) -> &'static str {
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
    /// as [`DEADLINE_HEADER`] (`Request-Timeout: <ms>`, this attempt's
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
        if self.attempt_header {
            headers.insert(ATTEMPT_HEADER, HeaderValue::from(self.number));
        }
        if self.timeout_header {
            let ms = u64::try_from(self.timeout.as_millis()).unwrap_or(u64::MAX);
            headers.insert(TIMEOUT_HEADER, HeaderValue::from(ms));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::Unlimited;
    use crate::classify::Answer;
    use crate::key::IDEMPOTENCY_KEY;
    use http::StatusCode;

    const MS: Duration = Duration::from_millis(1);

    fn status(s: u16) -> Outcome {
        Outcome::status(StatusCode::from_u16(s).unwrap())
    }

    #[test]
    fn auto_key_only_for_unprotected_methods() {
        let p = RetryPolicy::default();
        assert!(
            p.start(&Method::POST, &HeaderMap::new(), true)
                .idempotency_key()
                .is_some()
        );
        assert!(
            p.start(&Method::PATCH, &HeaderMap::new(), true)
                .idempotency_key()
                .is_some()
        );
        for method in [Method::PUT, Method::DELETE] {
            assert!(
                p.start(&method, &HeaderMap::new(), true)
                    .idempotency_key()
                    .is_some(),
                "{method} is guarded by the server: it gets a key"
            );
        }
        for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
            assert!(
                p.start(&method, &HeaderMap::new(), true)
                    .idempotency_key()
                    .is_none(),
                "{method}"
            );
        }
        let mut h = HeaderMap::new();
        h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("mine"));
        let call = p.start(&Method::POST, &h, true);
        assert!(call.idempotency_key().is_none() && call.is_protected());
        let caller_only = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::CallerOnly));
        let call = caller_only.start(&Method::POST, &HeaderMap::new(), true);
        assert!(call.idempotency_key().is_none() && !call.is_protected());
    }

    #[test]
    fn plan_applies_same_key_every_attempt() {
        let p = RetryPolicy::new(
            RetryConfig::new()
                .with_attempt_header(true)
                .with_timeout_header(true)
                .with_deadline(Duration::from_secs(2)),
        );
        let mut call = p.start(&Method::POST, &HeaderMap::new(), true);
        let mut keys = Vec::new();
        let mut now = Duration::ZERO;
        for n in 1..=3 {
            let plan = call.before_attempt(now);
            let mut h = HeaderMap::new();
            plan.apply(&mut h);
            assert_eq!(h[ATTEMPT_HEADER], n.to_string().as_str());
            assert!(h[TIMEOUT_HEADER].to_str().unwrap().parse::<u64>().unwrap() <= 2000);
            keys.push(h[IDEMPOTENCY_KEY].clone());
            if let Decision::Retry(d) = call.after_attempt(now + MS, &status(503)) {
                now += MS + d;
            }
        }
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
    }

    #[test]
    fn retry_after_is_a_floor_and_never_crosses_the_deadline() {
        let p = RetryPolicy::new(RetryConfig::new().with_deadline(Duration::from_secs(10))).with_seed(3);
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        let answer =
            Answer::new(StatusCode::TOO_MANY_REQUESTS).with_retry_after(Some(Duration::from_secs(4)));
        let d = call.after_attempt(MS, &Outcome::Answered(answer.clone()));
        assert!(matches!(d, Decision::Retry(delay) if delay >= Duration::from_secs(4)));
        call.before_attempt(Duration::from_secs(5));
        let answer = answer.with_retry_after(Some(Duration::from_secs(6)));
        assert_eq!(
            call.after_attempt(Duration::from_secs(5), &Outcome::Answered(answer)),
            Decision::Stop(Stop::RetryAfterPastDeadline {
                retry_after: Duration::from_secs(6)
            })
        );
    }

    #[test]
    fn maybe_executed_needs_protection_and_bodies_must_be_replayable() {
        let p = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::CallerOnly));
        let timeout = Outcome::MaybeExecuted { timed_out: true };
        let mut call = p.start(&Method::POST, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert_eq!(
            call.after_attempt(MS, &timeout),
            Decision::Stop(Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected))
        );
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert!(matches!(call.after_attempt(MS, &timeout), Decision::Retry(_)));
        let mut call = p.start(&Method::GET, &HeaderMap::new(), false);
        call.before_attempt(Duration::ZERO);
        assert_eq!(
            call.after_attempt(MS, &timeout),
            Decision::Stop(Stop::NotReplayable)
        );
    }

    #[test]
    fn budget_refunds_and_empties() {
        let bucket = Arc::new(TokenBucket::new().with_capacity(30));
        let p = RetryPolicy::default().with_budget(bucket.clone());
        // A failed call that retried spends 14 per retry.
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert!(matches!(call.after_attempt(MS, &status(503)), Decision::Retry(_)));
        assert_eq!(bucket.available(), 16);
        // The retry succeeds: its cost comes back.
        call.before_attempt(Duration::from_secs(1));
        assert_eq!(
            call.after_attempt(Duration::from_secs(1), &status(200)),
            Decision::Return
        );
        assert_eq!(bucket.available(), 30);
        // Drain it.
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert!(matches!(call.after_attempt(MS, &status(503)), Decision::Retry(_)));
        call.before_attempt(Duration::from_secs(1));
        assert!(matches!(
            call.after_attempt(Duration::from_secs(1), &status(503)),
            Decision::Retry(_)
        ));
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert_eq!(
            call.after_attempt(MS, &status(503)),
            Decision::Stop(Stop::BudgetExhausted)
        );
    }

    #[test]
    fn unlimited_budget_stops_at_the_cap() {
        let p = RetryPolicy::default().with_budget(Arc::new(Unlimited));
        let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
        let mut now = Duration::ZERO;
        let mut decisions = Vec::new();
        loop {
            call.before_attempt(now);
            match call.after_attempt(now, &status(502)) {
                Decision::Retry(d) => now += d,
                other => {
                    decisions.push(other);
                    break;
                }
            }
        }
        assert_eq!(call.attempts(), 3);
        assert_eq!(decisions, [Decision::Stop(Stop::AttemptsExhausted)]);
    }
    /// First-retry delays of `n` calls answered 429 with `Retry-After: ra` at `elapsed`.
    fn first_delays(config: RetryConfig, ra: Duration, elapsed: Duration, n: usize) -> Vec<Duration> {
        let p = RetryPolicy::new(config)
            .with_budget(Arc::new(Unlimited))
            .with_seed(11);
        let answer = Answer::new(StatusCode::TOO_MANY_REQUESTS).with_retry_after(Some(ra));
        (0..n)
            .map(|_| {
                let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
                // A 1 ms attempt ending at `elapsed`.
                call.before_attempt(elapsed.saturating_sub(MS));
                match call.after_attempt(elapsed, &Outcome::Answered(answer.clone())) {
                    Decision::Retry(d) => d,
                    other => panic!("{other:?}"),
                }
            })
            .collect()
    }

    /// Counts of `delays` in `bins` equal bins over `[low, high]`.
    fn histogram(delays: &[Duration], low: Duration, high: Duration, bins: usize) -> Vec<usize> {
        let width = (high - low).as_secs_f64() / bins as f64;
        let mut counts = vec![0; bins];
        for d in delays {
            assert!(*d >= low && *d <= high, "{d:?} outside [{low:?}, {high:?}]");
            let i = ((*d - low).as_secs_f64() / width) as usize;
            counts[i.min(bins - 1)] += 1;
        }
        counts
    }

    #[test]
    fn jitter_is_spread_uniformly_above_the_retry_after_floor() {
        // Throttling backoff: full jitter, base 1 s, so the first retry sleeps
        // Retry-After + uniform(0, 1 s).
        const N: usize = 20_000;
        let ra = Duration::from_secs(2);
        let delays = first_delays(RetryConfig::new(), ra, MS, N);
        let at_floor = delays.iter().filter(|d| **d == ra).count();
        assert!(
            at_floor <= 2,
            "{at_floor} clients would retry at the same instant"
        );
        let counts = histogram(&delays, ra, ra + Duration::from_secs(1), 10);
        for c in &counts {
            // Expected 2000 per bin, sd about 42: 10 % is ~5 sd.
            assert!((1_800..=2_200).contains(c), "not uniform: {counts:?}");
        }
    }

    #[test]
    fn near_the_deadline_the_jitter_above_the_floor_is_drawn_from_what_is_left() {
        // Deadline 10 s, at 6.5 s with Retry-After 3 s: 0.5 s of room above the floor
        // minus the 50 ms an attempt needs -> sleep in [3 s, 3.45 s], still spread.
        const N: usize = 10_000;
        let config = RetryConfig::new().with_deadline(Duration::from_secs(10));
        let ra = Duration::from_secs(3);
        let delays = first_delays(config, ra, Duration::from_millis(6_500), N);
        let high = Duration::from_millis(3_450);
        let counts = histogram(&delays, ra, high, 9);
        for c in &counts {
            assert!((N / 9 * 8 / 10..=N / 9 * 12 / 10).contains(c), "{counts:?}");
        }
        // With no room above the floor at all it still waits at least the floor.
        let exact = first_delays(config, ra, Duration::from_millis(10_000 - 3_000 - 50 - 1), 100);
        assert!(exact.iter().all(|d| *d >= ra && *d <= ra + MS), "{exact:?}");
    }

    #[test]
    fn retry_after_above_the_cap_stops_even_without_a_deadline() {
        let p = RetryPolicy::new(
            RetryConfig::new()
                .without_deadline()
                .with_retry_after_cap(Duration::from_secs(5)),
        );
        for (ra, retried) in [(5, true), (6, false), (999_999_999, false)] {
            let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
            call.before_attempt(Duration::ZERO);
            let answer =
                Answer::new(StatusCode::SERVICE_UNAVAILABLE).with_retry_after(Some(Duration::from_secs(ra)));
            let decision = call.after_attempt(MS, &Outcome::Answered(answer));
            if retried {
                assert!(matches!(decision, Decision::Retry(d) if d >= Duration::from_secs(ra)));
            } else {
                assert_eq!(
                    decision,
                    Decision::Stop(Stop::RetryAfterAboveCap {
                        retry_after: Duration::from_secs(ra)
                    })
                );
            }
        }
        assert_eq!(
            RetryConfig::new().retry_after_cap(),
            Duration::from_secs(60),
            "default cap"
        );
    }

    #[test]
    fn budget_remaining_is_readable_and_published_as_a_gauge() {
        use metrics_util::debugging::{DebugValue, DebuggingRecorder};

        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        let gauge = || {
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .find_map(|(key, _, _, value)| {
                    let key = key.key();
                    let labelled = key.labels().any(|l| l.key() == "client" && l.value() == "orders");
                    match value {
                        DebugValue::Gauge(v) if key.name() == "idemkit_client_budget_tokens" && labelled => {
                            Some(v.into_inner())
                        }
                        _ => None,
                    }
                })
        };
        metrics::with_local_recorder(&recorder, || {
            let p = RetryPolicy::new(RetryConfig::new().with_name("orders"))
                .with_budget(Arc::new(TokenBucket::new().with_capacity(30)));
            assert_eq!(p.budget_remaining(), Some(30));
            assert_eq!(gauge(), Some(30.0), "published when the policy is built");
            let mut call = p.start(&Method::GET, &HeaderMap::new(), true);
            call.before_attempt(Duration::ZERO);
            assert!(matches!(call.after_attempt(MS, &status(503)), Decision::Retry(_)));
            assert_eq!(p.budget_remaining(), Some(16));
            assert_eq!(gauge(), Some(16.0));
            call.before_attempt(Duration::from_secs(1));
            assert_eq!(
                call.after_attempt(Duration::from_secs(1), &status(200)),
                Decision::Return
            );
            assert_eq!(p.budget_remaining(), Some(30));
            assert_eq!(gauge(), Some(30.0), "refund published");
        });
        let unlimited = RetryPolicy::default().with_budget(Arc::new(Unlimited));
        assert_eq!(unlimited.budget_remaining(), None);
    }

    #[test]
    fn config_is_copy_and_const() {
        const BASE: RetryConfig = RetryConfig::new()
            .with_deadline(Duration::from_secs(5))
            .with_attempt_timeout(Duration::from_secs(1))
            .with_key_header("x-request-key");
        let config = BASE;
        let (a, b) = (RetryPolicy::new(config), RetryPolicy::new(config));
        assert_eq!(a.config(), b.config());
        assert_eq!(config.deadline(), Some(Duration::from_secs(5)));
        assert_eq!(config.without_deadline().deadline(), None);
        assert_eq!(
            config.attempt_timeout(),
            AttemptTimeout::Fixed(Duration::from_secs(1))
        );
        assert!(matches!(
            config
                .with_adaptive_attempt_timeout(AdaptiveTimeout::new())
                .attempt_timeout(),
            AttemptTimeout::Adaptive(_)
        ));
        let mut call = a.start(&Method::POST, &HeaderMap::new(), true);
        let mut h = HeaderMap::new();
        call.before_attempt(Duration::ZERO).apply(&mut h);
        assert!(h.contains_key("x-request-key") && !h.contains_key(IDEMPOTENCY_KEY));
    }
}
