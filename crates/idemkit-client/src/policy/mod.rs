//! Policy: attempt cap, overall deadline, backoff, budget and keys, applied to the
//! verdicts of the [`Classifier`](crate::Classifier).
//!
//! The policy is sans-IO: a [`Call`] is told what happened and when, and answers what
//! to do next. The reqwest and tower integrations drive it with tokio's clock; the
//! benchmarks drive the very same code with a virtual clock.
//!
//! Layout: this module holds the configuration ([`RetryConfig`]) and the shared
//! policy ([`RetryPolicy`]); `call` holds one logical call ([`Call`], started by
//! [`RetryPolicy::start`]), its decisions and each attempt's plan.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use rand::SeedableRng;
use rand::rngs::StdRng;

use crate::backoff::{Backoff, Jitter};
use crate::budget::{Budget, TokenBucket, Withdrawal};
use crate::classify::{AttemptInfo, Classifier, ClassifyHook, FatalReason, Outcome, RetryKind, Verdict};
use crate::key::{AutoKey, IDEMPOTENCY_KEY_STR, IdempotencyKey};
use crate::policy_doc::{KeyLocation, PublishedPolicy};

use crate::timeout::AdaptiveTimeout;
use crate::timeout::{AttemptTimeout, LatencyWindow};
pub(crate) use idemkit_core::wire::{REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID};

mod call;
#[cfg(test)]
mod tests;

pub use call::{AttemptPlan, Call, RetryDecision, Stop};

/// Header carrying the 1-based attempt number, when enabled with
/// [`RetryConfig::with_attempt_header`]: `Idemkit-Attempt: 2`.
pub(crate) const ATTEMPT_HEADER: HeaderName = HeaderName::from_static(idemkit_core::wire::IDEMKIT_ATTEMPT);

/// Header carrying how long the client will wait for this attempt, in whole
/// milliseconds (`min(attempt timeout, remaining deadline)`), when enabled with
/// [`RetryConfig::with_timeout_header`]: `Idemkit-Timeout-Ms: 1834`. A server can drop
/// work the client will no longer wait for.
pub(crate) const TIMEOUT_HEADER: HeaderName = HeaderName::from_static(idemkit_core::wire::IDEMKIT_TIMEOUT_MS);

/// Header carrying each attempt's remaining budget in whole milliseconds (rounded
/// down; 1 to 10 digits), sent on every attempt by the HTTP integrations:
/// `Request-Timeout: 1834`, idemkit's REST deadline convention (the same name as the
/// server's `idemkit_core::wire::REQUEST_TIMEOUT`, checked by a test). An idemkit server
/// refuses a request whose budget is spent before claiming its key and hands the rest
/// to the handler.
pub(crate) const DEADLINE_HEADER: HeaderName = HeaderName::from_static(idemkit_core::wire::REQUEST_TIMEOUT);

/// The largest [`DEADLINE_HEADER`] value (10 digits).
const DEADLINE_HEADER_MAX_MS: u128 = 9_999_999_999;

/// A shorter overall deadline for one call: the time the caller's own caller still
/// waits (a server passing its remaining budget downstream). Every integration reads
/// it from the request's extensions: with reqwest attach it with
/// `reqwest_middleware::RequestBuilder::with_extension`; with the tower and gRPC
/// layers insert it into the `http::Request`'s (or `tonic::Request`'s) extensions.
/// The call's deadline becomes the sooner of this, the caller's own deadline header
/// (`Request-Timeout`, or `grpc-timeout`) and the policy's, and every attempt's
/// budget fits in it.
///
/// ```no_run
/// # async fn run(client: reqwest_middleware::ClientWithMiddleware) -> reqwest_middleware::Result<()> {
/// use std::time::Duration;
/// use idemkit_client::CallDeadline;
///
/// let left = Duration::from_millis(1800); // e.g. `IdempotencyContext::remaining()`
/// client
///     .post("http://127.0.0.1:8081/shipments")
///     .with_extension(CallDeadline(left))
///     .send()
///     .await?;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallDeadline(pub Duration);

/// The deadline a caller set on this request: the sooner of its [`CallDeadline`]
/// extension and its own [`DEADLINE_HEADER`] (whole milliseconds, 1 to 10 digits; any
/// other value is not a deadline and is replaced like an absent one).
#[cfg(any(feature = "reqwest", feature = "tower"))]
pub(crate) fn callers_deadline(headers: &HeaderMap, extensions: &http::Extensions) -> Option<Duration> {
    let header = headers
        .get(&DEADLINE_HEADER)
        .and_then(|v| v.to_str().ok())
        .filter(|v| (1..=10).contains(&v.len()) && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis);
    let extension = extensions.get::<CallDeadline>().map(|d| d.0);
    match (header, extension) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

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
/// listed in the guide's client page (`docs/client.md`) and argued in
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
    repeatability: bool,
    attempt_header: bool,
    timeout_header: bool,
    name: &'static str,
}

impl RetryConfig {
    /// Default attempt cap: **3 attempts in total**, the first one included, so at
    /// most 2 retries (reqwest-retry and tokio-retry count retries; gRPC's
    /// `maxAttempts` and the AWS SDKs count attempts, as this crate does).
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
            repeatability: false,
            attempt_header: false,
            timeout_header: false,
            name: Self::DEFAULT_NAME,
        }
    }

    /// **Attempts in total, the first one included** (minimum 1), not retries:
    /// `with_max_attempts(3)` sends a request at most 3 times, i.e. 2 retries. `1`
    /// disables retries. To count retries as reqwest-retry's
    /// `build_with_max_retries(n)` does, use [`with_max_retries`](Self::with_max_retries).
    #[must_use]
    pub const fn with_max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = if attempts == 0 { 1 } else { attempts };
        self
    }

    /// **Retries after the first attempt**: `with_max_retries(n)` is
    /// `with_max_attempts(n + 1)` (reqwest-retry's `build_with_max_retries(n)`
    /// means the same). `0` disables retries.
    ///
    /// ```
    /// use idemkit_client::RetryConfig;
    ///
    /// const CONFIG: RetryConfig = RetryConfig::new().with_max_retries(3);
    /// assert_eq!(CONFIG.max_attempts(), 4);
    /// assert_eq!(CONFIG.max_retries(), 3);
    /// ```
    #[must_use]
    pub const fn with_max_retries(self, retries: u32) -> Self {
        self.with_max_attempts(retries.saturating_add(1))
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

    /// Whether requests without a key get one automatically, and whether it counts as
    /// protection (default [`AutoKey::Generate`]: POST, PATCH, PUT, DELETE and other
    /// unsafe methods get one; it makes a *maybe executed* write retryable only on
    /// routes a published policy says honour it).
    #[must_use]
    pub const fn with_auto_key(mut self, auto_key: AutoKey) -> Self {
        self.auto_key = auto_key;
        self
    }

    /// Speaks OASIS Repeatable Requests 1.0 (what a server publishes with
    /// `key.convention = "oasis-repeatable-requests-1.0"`): the automatic key goes
    /// in `Repeatability-Request-ID`, and every attempt of one logical call carries
    /// the same `Repeatability-First-Sent`, the HTTP-date the call started (a
    /// caller-set one is kept).
    #[must_use]
    pub const fn with_repeatability(mut self) -> Self {
        self.key_header = REPEATABILITY_REQUEST_ID;
        self.repeatability = true;
        self
    }

    /// Whether the client speaks OASIS Repeatable Requests (see
    /// [`with_repeatability`](Self::with_repeatability)).
    #[must_use]
    pub const fn repeatability(&self) -> bool {
        self.repeatability
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

    /// Sends [`wire::IDEMKIT_ATTEMPT`](idemkit_core::wire::IDEMKIT_ATTEMPT) on every attempt.
    #[must_use]
    pub const fn with_attempt_header(mut self, send: bool) -> Self {
        self.attempt_header = send;
        self
    }

    /// Sends [`wire::IDEMKIT_TIMEOUT_MS`](idemkit_core::wire::IDEMKIT_TIMEOUT_MS) on every attempt.
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

    /// Attempt cap: attempts in total, the first one included.
    #[must_use]
    pub const fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// Retries after the first attempt (`max_attempts() - 1`).
    #[must_use]
    pub const fn max_retries(&self) -> u32 {
        self.max_attempts - 1
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
    extras: Extras,
}

/// The settings that are not `Copy` (so not in [`RetryConfig`]).
#[derive(Clone, Default)]
struct Extras {
    published: Option<Arc<PublishedPolicy>>,
    hook: Option<Arc<dyn ClassifyHook>>,
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
            .field("published_policy", &self.inner.extras.published.is_some())
            .field("classifier_hook", &self.inner.extras.hook.is_some())
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
        Self::build(config, Arc::new(TokenBucket::new()), None, Extras::default())
    }

    fn build(config: RetryConfig, budget: Arc<dyn Budget>, seed: Option<u64>, extras: Extras) -> Self {
        let policy = Self {
            inner: Arc::new(Inner {
                config,
                budget,
                latency: LatencyWindow::default(),
                seeder: seed.map(|s| Mutex::new(StdRng::seed_from_u64(s))),
                extras,
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
        Self::build(self.inner.config, budget, seed, self.inner.extras.clone())
    }

    /// A new policy whose jitter comes from a generator seeded with `seed`
    /// (deterministic runs, tests). The result does not share state with `self`.
    #[must_use]
    pub fn with_seed(self, seed: u64) -> Self {
        Self::build(
            self.inner.config,
            Arc::clone(&self.inner.budget),
            Some(seed),
            self.inner.extras.clone(),
        )
    }

    /// A new policy that follows the server's published `x-idempotency` policy
    /// ([`PublishedPolicy`]): a generated key ([`AutoKey::Generate`]) makes a *maybe
    /// executed* write retryable on the routes whose published operation takes a key
    /// in the header the client sends it in ([`RetryConfig::key_header`], or OASIS
    /// Repeatable Requests with [`RetryConfig::with_repeatability`]) and is not
    /// `retrySafe: false`. A route the policy describes as taking no key (or a key in
    /// the body) is not protected by a generated key even under
    /// [`AutoKey::GenerateTrusted`]. The result shares the budget, not the latency
    /// window.
    ///
    /// ```
    /// use http::{HeaderMap, Method};
    /// use idemkit_client::{PublishedPolicy, RetryPolicy};
    ///
    /// let doc = serde_json::json!({"operations": [{"method": "POST", "path": "/orders",
    ///     "x-idempotency": {"key": {"in": "header", "name": "Idempotency-Key"}}}]});
    /// let published = PublishedPolicy::from_document("https://api.example.com", &doc).unwrap();
    /// let policy = RetryPolicy::default().with_published_policy(published);
    /// let orders = policy.start(&Method::POST, "https://api.example.com/orders", &HeaderMap::new(), true);
    /// assert!(orders.is_protected(), "the published policy says /orders honours the key");
    /// let refunds = policy.start(&Method::POST, "https://api.example.com/refunds", &HeaderMap::new(), true);
    /// assert!(refunds.idempotency_key().is_some(), "a key is still sent");
    /// assert!(!refunds.is_protected(), "but it does not make a lost answer retryable");
    /// ```
    #[must_use]
    pub fn with_published_policy(self, published: impl Into<Arc<PublishedPolicy>>) -> Self {
        let extras = Extras {
            published: Some(published.into()),
            ..self.inner.extras.clone()
        };
        let seed = self.seed_hint();
        Self::build(self.inner.config, Arc::clone(&self.inner.budget), seed, extras)
    }

    /// The published policy this policy follows, if any.
    #[must_use]
    pub fn published_policy(&self) -> Option<&PublishedPolicy> {
        self.inner.extras.published.as_deref()
    }

    /// A new policy whose verdicts go through `hook` after the built-in
    /// [`Classifier`] (see [`ClassifyHook`]). The result shares the budget, not the
    /// latency window.
    #[must_use]
    pub fn with_classifier_hook(self, hook: impl ClassifyHook) -> Self {
        let extras = Extras {
            hook: Some(Arc::new(hook)),
            ..self.inner.extras.clone()
        };
        let seed = self.seed_hint();
        Self::build(self.inner.config, Arc::clone(&self.inner.budget), seed, extras)
    }

    /// Whether a generated key protects a request with `method` to `url` (see
    /// [`AutoKey`]).
    fn auto_key_honoured(&self, method: &Method, url: &str) -> bool {
        let config = &self.inner.config;
        let described = self
            .inner
            .extras
            .published
            .as_ref()
            .and_then(|p| p.operation(method, url).map(|_| p.key_for(method, url)));
        match described {
            // The published policy describes this route: it decides.
            Some(key) => match key {
                Some(KeyLocation::Header(name)) => *name == config.key_header(),
                Some(KeyLocation::Repeatability) => config.repeatability,
                Some(KeyLocation::Body(_)) | None => false,
            },
            None => config.auto_key == AutoKey::GenerateTrusted,
        }
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
}
