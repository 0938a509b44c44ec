//! Brooker's optimistic-concurrency simulation ("Exponential Backoff and Jitter",
//! AWS Architecture Blog, 2015), reproduced with virtual time and a seeded generator.
//!
//! N clients start together and each must write one row with optimistic concurrency:
//! a client reads the row's version, then writes conditionally; the write succeeds
//! only when no other write landed since that read. After a failed write the client
//! backs off and starts over with a fresh read. Calls are writes. Network delay each way ~ normal(10 ms, 2 ms); base 5 ms, cap 2 s;
//! each cell is the mean of 100 trials.
//!
//! Full and decorrelated jitter are the crate's own [`Backoff`]; un-jittered and
//! equal-jitter backoff exist only here, for comparison.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Duration;

use idemkit_client::Backoff;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Normal};

const BASE: Duration = Duration::from_millis(5);
const CAP: Duration = Duration::from_secs(2);
const TRIALS: u64 = 100;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Strategy {
    NoJitter,
    EqualJitter,
    FullJitter,
    Decorrelated,
}

impl Strategy {
    const ALL: [Self; 4] = [
        Self::NoJitter,
        Self::EqualJitter,
        Self::FullJitter,
        Self::Decorrelated,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::NoJitter => "no jitter",
            Self::EqualJitter => "equal jitter",
            Self::FullJitter => "full jitter",
            Self::Decorrelated => "decorrelated",
        }
    }

    /// Sleep before retry `n`.
    fn sleep(self, n: u32, previous: Duration, rng: &mut StdRng) -> Duration {
        let exp = BASE
            .saturating_mul(1u32.checked_shl(n).unwrap_or(u32::MAX))
            .min(CAP);
        match self {
            Self::NoJitter => exp,
            Self::EqualJitter => {
                let half = exp / 2;
                half + Duration::from_nanos(rng.random_range(0..=nanos(half)))
            }
            Self::FullJitter => Backoff::full_jitter(BASE, CAP).sample(n, previous, rng),
            Self::Decorrelated => Backoff::decorrelated_jitter(BASE, CAP).sample(n, previous, rng),
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    /// A client's read reaches the server.
    Read(usize),
    /// A client's conditional write (with the version it read) reaches the server.
    Write { client: usize, version: u64 },
    /// The write's answer reaches the client.
    WriteAnswer { client: usize, ok: bool },
}

struct Client {
    attempt: u32,
    previous_sleep: Duration,
}

/// One trial: (write calls made, time of the last event).
///
/// Each attempt is a read followed by a conditional write; a failed write sends the
/// client back to reading after `delay + backoff(attempt)`, with `attempt` counted
/// from 1 as in the original simulator.
fn trial(strategy: Strategy, clients: usize, seed: u64) -> (u64, Duration) {
    let mut rng = StdRng::seed_from_u64(seed);
    let normal = Normal::new(10.0_f64, 2.0).expect("valid normal");
    let net = |rng: &mut StdRng| -> u64 {
        let ms: f64 = normal.sample(rng);
        (ms.abs() * 1e6) as u64
    };
    let mut version = 0u64;
    let mut calls = 0u64;
    let mut state: Vec<Client> = (0..clients)
        .map(|_| Client {
            attempt: 0,
            previous_sleep: BASE,
        })
        .collect();
    // Min-heap of (time in ns, sequence for stable ties, event).
    let mut queue = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |queue: &mut BinaryHeap<_>, at: u64, event: Event| {
        queue.push(Reverse((at, seq, event)));
        seq += 1;
    };
    for client in 0..clients {
        let at = net(&mut rng);
        push(&mut queue, at, Event::Read(client));
    }
    let mut now = 0;
    while let Some(Reverse((at, _, event))) = queue.pop() {
        now = at;
        match event {
            Event::Read(client) => {
                // The read's answer travels back, then the write travels out.
                let at = now + net(&mut rng) + net(&mut rng);
                push(&mut queue, at, Event::Write { client, version });
            }
            Event::Write {
                client,
                version: read,
            } => {
                calls += 1;
                let ok = read == version;
                if ok {
                    version += 1;
                }
                let at = now + net(&mut rng);
                push(&mut queue, at, Event::WriteAnswer { client, ok });
            }
            Event::WriteAnswer { ok: true, .. } => {}
            Event::WriteAnswer { client, ok: false } => {
                let c = &mut state[client];
                c.attempt += 1;
                let sleep = strategy.sleep(c.attempt, c.previous_sleep, &mut rng);
                c.previous_sleep = sleep;
                let at = now + net(&mut rng) + nanos(sleep);
                push(&mut queue, at, Event::Read(client));
            }
        }
    }
    (calls, Duration::from_nanos(now))
}

fn main() {
    // `cargo bench` passes `--bench`; nothing to parse.
    let sizes: Vec<usize> = (1..=10).map(|i| i * 10).collect();
    let mut results = Vec::new();
    for &n in &sizes {
        let row: Vec<(f64, f64)> = Strategy::ALL
            .iter()
            .map(|&s| {
                let (mut calls, mut time) = (0.0, 0.0);
                for t in 0..TRIALS {
                    let (c, d) = trial(s, n, t * 1_000 + n as u64);
                    calls += c as f64;
                    time += d.as_secs_f64() * 1e3;
                }
                (calls / TRIALS as f64, time / TRIALS as f64)
            })
            .collect();
        results.push((n, row));
    }

    println!("Brooker OCC simulation: base 5 ms, cap 2 s, delay ~ N(10 ms, 2 ms), mean of {TRIALS} trials\n");
    let header: Vec<_> = Strategy::ALL.iter().map(|s| s.name()).collect();
    println!("Calls (conditional writes by all clients)\n");
    println!("| clients | {} |", header.join(" | "));
    println!("|---:|{}", "---:|".repeat(header.len()));
    for (n, row) in &results {
        let cells: Vec<_> = row.iter().map(|(c, _)| format!("{c:.0}")).collect();
        println!("| {n} | {} |", cells.join(" | "));
    }
    println!("\nCompletion time (ms until the last client heard its write succeed)\n");
    println!("| clients | {} |", header.join(" | "));
    println!("|---:|{}", "---:|".repeat(header.len()));
    for (n, row) in &results {
        let cells: Vec<_> = row.iter().map(|(_, t)| format!("{t:.0}")).collect();
        println!("| {n} | {} |", cells.join(" | "));
    }
    let (_, last) = results.last().expect("at least one size");
    let ratio = last[2].0 / last[0].0;
    println!(
        "\nAt 100 clients full jitter makes {ratio:.2}x the calls of un-jittered backoff and finishes in {:.0} ms vs {:.0} ms; decorrelated: {:.0} calls, {:.0} ms.",
        last[2].1, last[0].1, last[3].0, last[3].1
    );
}
