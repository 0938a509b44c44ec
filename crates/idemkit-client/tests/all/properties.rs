//! Properties of the retry arithmetic, driven through the sans-IO `Call` with a
//! virtual clock.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use idemkit_client::{
    Answer, Backoff, CODE_IN_PROGRESS, Jitter, Outcome, RetryConfig, RetryDecision, RetryPolicy, Unlimited,
};
use proptest::prelude::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[derive(Debug, Clone)]
enum Step {
    Unavailable(u64),
    Throttled { latency: u64, retry_after: Option<u64> },
    InProgress(u64),
    Hang,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u64..800).prop_map(Step::Unavailable),
        (0u64..800, proptest::option::of(0u64..4))
            .prop_map(|(latency, retry_after)| { Step::Throttled { latency, retry_after } }),
        (0u64..800).prop_map(Step::InProgress),
        Just(Step::Hang),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn sleeps_respect_their_formula_and_the_total_respects_the_deadline(
        seed: u64,
        deadline_ms in 1u64..10_000,
        timeout_ms in 1u64..5_000,
        max_attempts in 1u32..30,
        base_ms in 1u64..2_000,
        cap_ms in 1u64..30_000,
        decorrelated: bool,
        steps in proptest::collection::vec(step(), 1..10),
    ) {
        let jitter = if decorrelated { Jitter::Decorrelated } else { Jitter::Full };
        let backoff = Backoff::full_jitter(ms(base_ms), ms(cap_ms)).with_jitter(jitter);
        let throttling = Backoff::full_jitter(ms(base_ms * 2), ms(cap_ms)).with_jitter(jitter);
        let deadline = ms(deadline_ms);
        let config = RetryConfig::new()
            .with_deadline(deadline)
            .with_attempt_timeout(ms(timeout_ms))
            .with_max_attempts(max_attempts)
            .with_backoff(backoff)
            .with_throttling_backoff(throttling);
        let policy = RetryPolicy::new(config).with_budget(Arc::new(Unlimited)).with_seed(seed);
        let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
        let mut now = Duration::ZERO;
        let mut previous = [backoff.base(), throttling.base()];
        for step in steps.iter().cycle() {
            let plan = call.before_attempt(now);
            prop_assert!(plan.timeout() <= ms(timeout_ms));
            prop_assert!(now + plan.timeout() <= deadline, "attempt timeout carved from what remains");
            let (latency, outcome, throttled) = match step {
                Step::Unavailable(l) => (*l, Outcome::status(StatusCode::SERVICE_UNAVAILABLE), false),
                Step::Throttled { latency, retry_after } => (
                    *latency,
                    Outcome::Answered(Answer::new(StatusCode::TOO_MANY_REQUESTS)
                        .with_retry_after(retry_after.map(Duration::from_secs))),
                    true,
                ),
                Step::InProgress(l) => (
                    *l,
                    Outcome::Answered(Answer::new(StatusCode::CONFLICT)
                        .with_problem_code(Some(CODE_IN_PROGRESS.into()))),
                    true,
                ),
                Step::Hang => (u64::MAX / 4, Outcome::status(StatusCode::OK), false),
            };
            let (took, outcome) = if ms(latency) > plan.timeout() {
                (plan.timeout(), Outcome::MaybeExecuted { timed_out: true })
            } else {
                (ms(latency), outcome)
            };
            now += took;
            prop_assert!(now <= deadline);
            match call.after_attempt(now, &outcome) {
                RetryDecision::Retry(delay) => {
                    let n = call.attempts() - 1;
                    let throttled = throttled && !matches!(outcome, Outcome::MaybeExecuted { .. });
                    let b = if throttled { throttling } else { backoff };
                    let prev = &mut previous[usize::from(throttled)];
                    let floor = outcome.retry_after().unwrap_or(Duration::ZERO);
                    prop_assert!(delay >= floor, "Retry-After is a floor");
                    if floor == Duration::ZERO {
                        prop_assert!(delay >= b.floor(n, *prev));
                    }
                    // Jitter is added above the floor, never more than the formula allows.
                    match jitter {
                        Jitter::Full => prop_assert!(delay <= floor + b.ceiling(n, Duration::ZERO)),
                        _ => prop_assert!(delay <= floor + b.cap()),
                    }
                    *prev = delay;
                    now += delay;
                    prop_assert!(now <= deadline, "slept past the deadline");
                }
                RetryDecision::Return | RetryDecision::Stop(_) => break,
                _ => unreachable!(),
            }
            prop_assert!(call.attempts() <= max_attempts);
        }
        prop_assert!(now <= deadline);
    }
}

/// Samples are spread as the formula says, not merely inside its bounds (a
/// `sample()` returning the floor, or the ceiling, passes every bound check):
/// the mean is within 3 % of the interval's middle and a chi-square test over
/// ten equal buckets accepts uniformity (critical value 27.88: df 9, p 0.001).
/// Seeds are fixed, so the check is deterministic.
fn assert_uniform(samples: &[Duration], low: Duration, high: Duration, what: &str) {
    let (low, high) = (low.as_secs_f64(), high.as_secs_f64());
    let width = high - low;
    assert!(width > 0.0, "{what}: empty interval");
    let n = samples.len() as f64;
    let mean = samples.iter().map(Duration::as_secs_f64).sum::<f64>() / n;
    let middle = (low + high) / 2.0;
    assert!(
        (mean - middle).abs() <= 0.03 * width,
        "{what}: mean {mean:.4}s, expected {middle:.4}s ± {:.4}s",
        0.03 * width
    );
    const BUCKETS: usize = 10;
    let mut counts = [0u32; BUCKETS];
    for s in samples {
        let x = (s.as_secs_f64() - low) / width;
        assert!((0.0..=1.0).contains(&x), "{what}: {s:?} outside [{low}, {high}]");
        counts[((x * BUCKETS as f64) as usize).min(BUCKETS - 1)] += 1;
    }
    let expected = n / BUCKETS as f64;
    let chi2: f64 = counts
        .iter()
        .map(|&c| (f64::from(c) - expected).powi(2) / expected)
        .sum();
    assert!(
        chi2 < 27.88,
        "{what}: chi-square {chi2:.1} over buckets {counts:?}"
    );
}

#[test]
fn full_jitter_is_uniform_between_zero_and_its_ceiling() {
    use rand::SeedableRng;
    let backoff = Backoff::full_jitter(ms(100), ms(5_000));
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    for n in [0, 2, 5, 9] {
        let ceiling = backoff.ceiling(n, Duration::ZERO);
        let samples: Vec<Duration> = (0..10_000)
            .map(|_| backoff.sample(n, Duration::ZERO, &mut rng))
            .collect();
        assert_uniform(
            &samples,
            Duration::ZERO,
            ceiling,
            &format!("full jitter, n = {n}"),
        );
    }
}

#[test]
fn decorrelated_jitter_is_uniform_between_base_and_three_times_the_previous_sleep() {
    use rand::SeedableRng;
    let backoff = Backoff::decorrelated_jitter(ms(100), ms(5_000));
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    for previous in [ms(100), ms(700), ms(4_000)] {
        let samples: Vec<Duration> = (0..10_000)
            .map(|_| backoff.sample(3, previous, &mut rng))
            .collect();
        let high = (previous * 3).min(backoff.cap());
        assert_uniform(
            &samples,
            backoff.base(),
            high,
            &format!("decorrelated after {previous:?}"),
        );
    }
}

/// The sleeps a retry loop actually takes are spread too: the first retry of
/// a 503 over many seeds is uniform on `[0, base]`, the third on `[0, 4·base]`.
#[test]
fn retry_sleeps_are_spread_across_clients() {
    let backoff = Backoff::full_jitter(ms(200), ms(20_000));
    let config = RetryConfig::new()
        .with_deadline(Duration::from_secs(600))
        .with_attempt_timeout(Duration::from_secs(10))
        .with_max_attempts(10)
        .with_backoff(backoff);
    let mut first = Vec::new();
    let mut third = Vec::new();
    for seed in 0..5_000u64 {
        let policy = RetryPolicy::new(config)
            .with_budget(Arc::new(Unlimited))
            .with_seed(seed);
        let mut call = policy.start(&Method::POST, "/", &HeaderMap::new(), true);
        let mut now = Duration::ZERO;
        for retry in 0..3 {
            call.before_attempt(now);
            now += ms(1);
            match call.after_attempt(now, &Outcome::status(StatusCode::SERVICE_UNAVAILABLE)) {
                RetryDecision::Retry(delay) => {
                    match retry {
                        0 => first.push(delay),
                        2 => third.push(delay),
                        _ => {}
                    }
                    now += delay;
                }
                other => panic!("a 503 is retried: {other:?}"),
            }
        }
    }
    assert_uniform(
        &first,
        Duration::ZERO,
        backoff.ceiling(0, Duration::ZERO),
        "first retry",
    );
    assert_uniform(
        &third,
        Duration::ZERO,
        backoff.ceiling(2, Duration::ZERO),
        "third retry",
    );
}
