//! The policy's unit tests: decisions and plans, driven with a virtual clock.

use super::*;
use crate::budget::Unlimited;
use crate::classify::Answer;
use http::StatusCode;
use idemkit_core::wire::IDEMPOTENCY_KEY;

const MS: Duration = Duration::from_millis(1);

fn status(s: u16) -> Outcome {
    Outcome::status(StatusCode::from_u16(s).unwrap())
}

#[test]
fn auto_key_only_for_unprotected_methods() {
    let p = RetryPolicy::default();
    assert!(
        p.start(&Method::POST, "/", &HeaderMap::new(), true)
            .idempotency_key()
            .is_some()
    );
    assert!(
        p.start(&Method::PATCH, "/", &HeaderMap::new(), true)
            .idempotency_key()
            .is_some()
    );
    for method in [Method::PUT, Method::DELETE] {
        assert!(
            p.start(&method, "/", &HeaderMap::new(), true)
                .idempotency_key()
                .is_some(),
            "{method} is guarded by the server: it gets a key"
        );
    }
    for method in [Method::GET, Method::HEAD, Method::OPTIONS, Method::TRACE] {
        assert!(
            p.start(&method, "/", &HeaderMap::new(), true)
                .idempotency_key()
                .is_none(),
            "{method}"
        );
    }
    let mut h = HeaderMap::new();
    h.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("mine"));
    let call = p.start(&Method::POST, "/", &h, true);
    assert!(call.idempotency_key().is_none() && call.is_protected());
    let caller_only = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::CallerOnly));
    let call = caller_only.start(&Method::POST, "/", &HeaderMap::new(), true);
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
    let mut call = p.start(&Method::POST, "/", &HeaderMap::new(), true);
    let mut keys = Vec::new();
    let mut now = Duration::ZERO;
    for n in 1..=3 {
        let plan = call.before_attempt(now);
        let mut h = HeaderMap::new();
        plan.apply(&mut h);
        assert_eq!(h[ATTEMPT_HEADER], n.to_string().as_str());
        assert!(h[TIMEOUT_HEADER].to_str().unwrap().parse::<u64>().unwrap() <= 2000);
        keys.push(h[IDEMPOTENCY_KEY].clone());
        if let RetryDecision::Retry(d) = call.after_attempt(now + MS, &status(503)) {
            now += MS + d;
        }
    }
    assert!(keys.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn retry_after_is_a_floor_and_never_crosses_the_deadline() {
    let p = RetryPolicy::new(RetryConfig::new().with_deadline(Duration::from_secs(10))).with_seed(3);
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    let answer = Answer::new(StatusCode::TOO_MANY_REQUESTS).with_retry_after(Some(Duration::from_secs(4)));
    let d = call.after_attempt(MS, &Outcome::Answered(answer.clone()));
    assert!(matches!(d, RetryDecision::Retry(delay) if delay >= Duration::from_secs(4)));
    call.before_attempt(Duration::from_secs(5));
    let answer = answer.with_retry_after(Some(Duration::from_secs(6)));
    assert_eq!(
        call.after_attempt(Duration::from_secs(5), &Outcome::Answered(answer)),
        RetryDecision::Stop(Stop::RetryAfterPastDeadline {
            retry_after: Duration::from_secs(6)
        })
    );
}

#[test]
fn maybe_executed_needs_protection_and_bodies_must_be_replayable() {
    let p = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::CallerOnly));
    let timeout = Outcome::MaybeExecuted { timed_out: true };
    let mut call = p.start(&Method::POST, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert_eq!(
        call.after_attempt(MS, &timeout),
        RetryDecision::Stop(Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected))
    );
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert!(matches!(
        call.after_attempt(MS, &timeout),
        RetryDecision::Retry(_)
    ));
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), false);
    call.before_attempt(Duration::ZERO);
    assert_eq!(
        call.after_attempt(MS, &timeout),
        RetryDecision::Stop(Stop::NotReplayable)
    );
}

#[test]
fn budget_refunds_and_empties() {
    let bucket = Arc::new(TokenBucket::new().with_capacity(30));
    let p = RetryPolicy::default().with_budget(bucket.clone());
    // A failed call that retried spends 14 per retry.
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert!(matches!(
        call.after_attempt(MS, &status(503)),
        RetryDecision::Retry(_)
    ));
    assert_eq!(bucket.available(), 16);
    // The retry succeeds: its cost comes back.
    call.before_attempt(Duration::from_secs(1));
    assert_eq!(
        call.after_attempt(Duration::from_secs(1), &status(200)),
        RetryDecision::Return
    );
    assert_eq!(bucket.available(), 30);
    // Drain it.
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert!(matches!(
        call.after_attempt(MS, &status(503)),
        RetryDecision::Retry(_)
    ));
    call.before_attempt(Duration::from_secs(1));
    assert!(matches!(
        call.after_attempt(Duration::from_secs(1), &status(503)),
        RetryDecision::Retry(_)
    ));
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert_eq!(
        call.after_attempt(MS, &status(503)),
        RetryDecision::Stop(Stop::BudgetExhausted)
    );
}

#[test]
fn unlimited_budget_stops_at_the_cap() {
    let p = RetryPolicy::default().with_budget(Arc::new(Unlimited));
    let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
    let mut now = Duration::ZERO;
    let mut decisions = Vec::new();
    loop {
        call.before_attempt(now);
        match call.after_attempt(now, &status(502)) {
            RetryDecision::Retry(d) => now += d,
            other => {
                decisions.push(other);
                break;
            }
        }
    }
    assert_eq!(call.attempts(), 3);
    assert_eq!(decisions, [RetryDecision::Stop(Stop::AttemptsExhausted)]);
}
/// First-retry delays of `n` calls answered 429 with `Retry-After: ra` at `elapsed`.
fn first_delays(config: RetryConfig, ra: Duration, elapsed: Duration, n: usize) -> Vec<Duration> {
    let p = RetryPolicy::new(config)
        .with_budget(Arc::new(Unlimited))
        .with_seed(11);
    let answer = Answer::new(StatusCode::TOO_MANY_REQUESTS).with_retry_after(Some(ra));
    (0..n)
        .map(|_| {
            let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
            // A 1 ms attempt ending at `elapsed`.
            call.before_attempt(elapsed.saturating_sub(MS));
            match call.after_attempt(elapsed, &Outcome::Answered(answer.clone())) {
                RetryDecision::Retry(d) => d,
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
        let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        let answer =
            Answer::new(StatusCode::SERVICE_UNAVAILABLE).with_retry_after(Some(Duration::from_secs(ra)));
        let decision = call.after_attempt(MS, &Outcome::Answered(answer));
        if retried {
            assert!(matches!(decision, RetryDecision::Retry(d) if d >= Duration::from_secs(ra)));
        } else {
            assert_eq!(
                decision,
                RetryDecision::Stop(Stop::RetryAfterAboveCap {
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
        let mut call = p.start(&Method::GET, "/", &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        assert!(matches!(
            call.after_attempt(MS, &status(503)),
            RetryDecision::Retry(_)
        ));
        assert_eq!(p.budget_remaining(), Some(16));
        assert_eq!(gauge(), Some(16.0));
        call.before_attempt(Duration::from_secs(1));
        assert_eq!(
            call.after_attempt(Duration::from_secs(1), &status(200)),
            RetryDecision::Return
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
    let mut call = a.start(&Method::POST, "/", &HeaderMap::new(), true);
    let mut h = HeaderMap::new();
    call.before_attempt(Duration::ZERO).apply(&mut h);
    assert!(h.contains_key("x-request-key") && !h.contains_key(IDEMPOTENCY_KEY));
}

#[test]
fn a_retry_never_sent_gives_its_tokens_back() {
    let bucket = Arc::new(TokenBucket::new());
    let policy = RetryPolicy::default().with_budget(bucket.clone()).with_seed(1);
    // Decided, paid for, then dropped before it is sent (the caller cancelled in the
    // backoff, or the deadline came first): refunded.
    let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert!(matches!(
        call.after_attempt(10 * MS, &status(503)),
        RetryDecision::Retry(_)
    ));
    assert_eq!(bucket.available(), 486, "taken when the retry is decided");
    drop(call);
    assert_eq!(bucket.available(), 500);
    // Sent: spent for good, even if the call then ends without an answer.
    let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert!(matches!(
        call.after_attempt(10 * MS, &status(503)),
        RetryDecision::Retry(_)
    ));
    call.before_attempt(100 * MS);
    drop(call);
    assert_eq!(bucket.available(), 486);
}

/// Review: an attempt cut short by the call's
/// deadline, not by the adaptive timeout, says only that latency exceeded what
/// was left of the deadline; it must not raise the adaptive timeout (doubling
/// what was left would raise it above what any attempt ever needed).
#[test]
fn an_attempt_cut_by_the_deadline_does_not_raise_the_adaptive_timeout() {
    let config =
        RetryConfig::new().with_adaptive_attempt_timeout(AdaptiveTimeout::new().with_min_samples(20));
    let policy = RetryPolicy::new(config);
    for _ in 0..50 {
        let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
        call.before_attempt(Duration::ZERO);
        call.after_attempt(30 * MS, &status(201));
    }
    let learned = policy.current_attempt_timeout();
    assert_eq!(learned, 100 * MS, "the floor, from 30 ms successes");

    // A caller with 70 ms left: the attempt's budget is 70 ms, and it times out.
    let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
    call.limit_deadline(70 * MS);
    let plan = call.before_attempt(Duration::ZERO);
    assert_eq!(plan.timeout(), 70 * MS);
    call.after_attempt(70 * MS, &Outcome::MaybeExecuted { timed_out: true });
    assert_eq!(
        policy.current_attempt_timeout(),
        learned,
        "an attempt the deadline cut short raised the adaptive timeout"
    );

    // An attempt the adaptive timeout itself cut short still raises it.
    let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    call.after_attempt(100 * MS, &Outcome::MaybeExecuted { timed_out: true });
    assert_eq!(policy.current_attempt_timeout(), 200 * MS);
}

#[test]
fn a_generated_key_protects_only_where_it_is_known_to_be_honoured() {
    let post = |p: &RetryPolicy, url: &str| p.start(&Method::POST, url, &HeaderMap::new(), true);
    // Default: sent, not trusted.
    let p = RetryPolicy::default();
    let call = post(&p, "/orders");
    assert!(call.idempotency_key().is_some() && !call.is_protected());
    // The caller's word for every route.
    let trusted = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::GenerateTrusted));
    assert!(post(&trusted, "/orders").is_protected());

    let doc = serde_json::json!({"operations": [
        {"method": "POST", "path": "/h", "x-idempotency": {"key": {"in": "header", "name": "Idempotency-Key"}}},
        {"method": "POST", "path": "/other", "x-idempotency": {"key": {"in": "header", "name": "X-Request-Key"}}},
        {"method": "POST", "path": "/body", "x-idempotency": {"key": {"in": "body", "name": "/key"}}},
        {"method": "POST", "path": "/none", "x-idempotency": {"version": 1}},
        {"method": "POST", "path": "/r", "x-idempotency": {"key": {"in": "header",
            "name": "Repeatability-Request-ID", "convention": "oasis-repeatable-requests-1.0"}}},
    ]});
    let published = crate::PublishedPolicy::from_document("https://api.example.com", &doc).unwrap();
    let p = RetryPolicy::default().with_published_policy(published.clone());
    assert!(post(&p, "https://api.example.com/h").is_protected());
    assert!(post(&p, "/h?x=1").is_protected(), "a path, with a query");
    assert!(p.published_policy().is_some());
    for url in ["/other", "/body", "/r", "/unpublished"] {
        assert!(!post(&p, url).is_protected(), "{url}");
    }
    // `/none` takes no key by the published word: not even the caller's trust helps.
    let trusted = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::GenerateTrusted))
        .with_published_policy(published.clone());
    assert!(!post(&trusted, "/none").is_protected());
    assert!(post(&trusted, "/unpublished").is_protected());
    // OASIS Repeatable Requests, when the client speaks it.
    let oasis = RetryPolicy::new(RetryConfig::new().with_repeatability()).with_published_policy(published);
    assert!(post(&oasis, "/r").is_protected());
    assert!(
        !post(&oasis, "/h").is_protected(),
        "the key goes in another header"
    );
    // The published policy survives the other builders.
    let rebuilt = p.with_seed(3).with_budget(Arc::new(Unlimited));
    assert!(post(&rebuilt, "/h").is_protected());
}

#[test]
fn a_generated_key_not_known_to_be_honoured_says_so_when_it_stops() {
    let p = RetryPolicy::default().with_seed(1);
    let mut call = p.start(&Method::POST, "/orders", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert_eq!(
        call.after_attempt(10 * MS, &Outcome::MaybeExecuted { timed_out: true }),
        RetryDecision::Stop(Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed))
    );
    // Without any key: the plain reason.
    let p = RetryPolicy::new(RetryConfig::new().with_auto_key(AutoKey::CallerOnly));
    let mut call = p.start(&Method::POST, "/orders", &HeaderMap::new(), true);
    call.before_attempt(Duration::ZERO);
    assert_eq!(
        call.after_attempt(10 * MS, &status(502)),
        RetryDecision::Stop(Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected))
    );
}
