//! Outage amplification: attempts per logical call when the server fails a fraction
//! of attempts, over 10,000 sequential calls through one client.
//!
//! Drives the crate's real policy (`RetryPolicy` / `Call`: classification, attempt
//! cap, deadline, budget) with virtual time and a seeded generator: each attempt takes
//! 10 ms and independently fails with `503` at the given rate.

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, StatusCode};
use idemkit_client::{Budget, Outcome, RetryConfig, RetryDecision, RetryPolicy, TokenBucket, Unlimited};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const CALLS: u32 = 10_000;
const LATENCY: Duration = Duration::from_millis(10);
const RATES: [f64; 5] = [0.0, 0.1, 0.5, 0.9, 1.0];

struct Run {
    attempts_per_call: f64,
    success_rate: f64,
}

fn run(budget: Arc<dyn Budget>, failure_rate: f64, seed: u64) -> Run {
    let policy = RetryPolicy::new(RetryConfig::new())
        .with_budget(budget)
        .with_seed(seed);
    let mut server = StdRng::seed_from_u64(seed ^ 0x5eed);
    let (mut attempts, mut successes) = (0u64, 0u64);
    for _ in 0..CALLS {
        let mut call = policy.start(&Method::GET, "/", &HeaderMap::new(), true);
        let mut now = Duration::ZERO;
        loop {
            let _plan = call.before_attempt(now);
            attempts += 1;
            now += LATENCY;
            let failed = server.random_bool(failure_rate);
            let status = if failed {
                StatusCode::SERVICE_UNAVAILABLE
            } else {
                StatusCode::OK
            };
            match call.after_attempt(now, &Outcome::status(status)) {
                RetryDecision::Retry(delay) => now += delay,
                RetryDecision::Return => {
                    successes += 1;
                    break;
                }
                _ => break,
            }
        }
    }
    Run {
        attempts_per_call: attempts as f64 / f64::from(CALLS),
        success_rate: successes as f64 / f64::from(CALLS),
    }
}

fn main() {
    println!(
        "Outage amplification: {CALLS} calls through one client, default policy (3 attempts, 30 s deadline)\n"
    );
    println!(
        "| failure rate | attempts/call, cap only | attempts/call, default budget | success, cap only | success, default budget |"
    );
    println!("|---:|---:|---:|---:|---:|");
    for (i, rate) in RATES.into_iter().enumerate() {
        let seed = 42 + i as u64;
        let cap_only = run(Arc::new(Unlimited), rate, seed);
        let budgeted = run(Arc::new(TokenBucket::new()), rate, seed);
        println!(
            "| {rate:.1} | {:.3} | {:.3} | {:.2}% | {:.2}% |",
            cap_only.attempts_per_call,
            budgeted.attempts_per_call,
            cap_only.success_rate * 100.0,
            budgeted.success_rate * 100.0,
        );
    }
}
