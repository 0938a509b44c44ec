//! Properties of the retry arithmetic, driven through the sans-IO `Call` with a
//! virtual clock.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use idemkit_client::{
    Answer, Backoff, CODE_IN_PROGRESS, Decision, Jitter, Outcome, RetryConfig, RetryPolicy, Unlimited,
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
        let mut call = policy.start(&Method::POST, &HeaderMap::new(), true);
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
                Decision::Retry(delay) => {
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
                Decision::Return | Decision::Stop(_) => break,
                _ => unreachable!(),
            }
            prop_assert!(call.attempts() <= max_attempts);
        }
        prop_assert!(now <= deadline);
    }
}
