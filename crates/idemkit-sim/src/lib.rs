//! # idemkit-sim
//!
//! A deterministic simulator of the shipped code. Each schedule runs, on one
//! tokio current-thread runtime with paused (virtual) time:
//!
//! - two instances (each its own [`idemkit_tower::IdempotencyLayer`] and
//!   engine over its own store handle, SQLite handles with skewed clocks)
//!   sharing one store, restarted after a crash;
//! - clients sending HTTP requests through the real layer in front of an axum
//!   router (tower `oneshot`, no sockets), retrying on retryable answers and
//!   hanging up at random (a request timeout drops the request future);
//! - a lease-mode handler written with the real [`idemkit_tower::Phases`]
//!   calling a downstream that ignores keys and one that honours them, both
//!   counting their effects (and sometimes acting and then losing their
//!   answer), and on SQLite a single-step handler whose business write is a
//!   row in the store's own database;
//! - the real [`idemkit_tower::Completer`] and [`idemkit_tower::Reaper`]
//!   passes, and the operator's commands (`idemkit keys release` with and
//!   without `--downstream-did-nothing`, `idemkit keys complete`; see
//!   [`operator`]).
//!
//! Every store call goes through [`store::Instrumented`], which parks the
//! task at the [`sched::Sched`] before the call and after the store answered;
//! the scheduler releases one parked task at a time (uniform random or PCT)
//! and draws faults there: a reply lost after the write applied, an outage,
//! an instance crash. Handlers draw panics; downstreams draw lost answers.
//! [`check`] then judges safety and liveness, and [`mutants`] plants defects
//! the checker must catch.
//!
//! ## Determinism
//!
//! Only one task runs at a time, and time moves only when every task waits
//! on a timer, so a seed fixes the schedule on the memory store. On SQLite the
//! store's I/O runs on sqlx's worker threads: the scheduler waits for a
//! running call to return (spinning, so paused time never auto-advances
//! during I/O), and treats a call that has not returned after 25 ms of real
//! time as blocked on a lock a parked task holds. That makes SQLite and
//! PostgreSQL schedules reproducible unless an I/O takes longer than that (a
//! loaded machine): best effort. PostgreSQL runs in a fresh schema with every
//! handle's database clock replaced by the virtual clock (`with_test_clock`),
//! so its timeouts never race a jump of paused time: the scheduler spins
//! (never idles) while a store call is on the wire. Redis runs the same way
//! under a key prefix of its own (deleted afterwards), its server clock
//! replaced by the virtual clock, lease mode with phases through
//! [`store::MemTx`].

pub mod adapter;
pub mod check;
pub mod mutants;
pub mod operator;
pub mod sched;
pub mod store;
pub mod world;

pub use check::{Kind, Violation};
pub use mutants::Mutation;
pub use sched::{Faults, Strategy};
pub use world::{Config, Outcome, StoreKind, run};

/// The strategy of schedule number `n` of a run: alternately uniform random
/// and PCT of depth 2 and 3.
pub fn strategy_for(n: u64) -> Strategy {
    match n % 3 {
        0 => Strategy::Random,
        1 => Strategy::Pct { depth: 2 },
        _ => Strategy::Pct { depth: 3 },
    }
}

/// The seed of schedule `n` of a run whose seed is `run_seed`.
pub fn seed_for(run_seed: u64, n: u64) -> u64 {
    let mut r = sched::Rng::new(run_seed ^ n.wrapping_mul(0x2545_f491_4f6c_dd1d));
    r.next_u64()
}

/// The configuration of schedule `n` of a run.
pub fn config_for(store: StoreKind, run_seed: u64, n: u64, mutation: Option<Mutation>) -> Config {
    Config {
        store,
        seed: seed_for(run_seed, n),
        strategy: strategy_for(n),
        faults: Faults::DEFAULT,
        mutation,
        instances: 2,
        always_panic: false,
        small: false,
        prefix: Vec::new(),
    }
}

/// A run of the exhaustive strategy on the memory store: the small scenario,
/// no faults, one fixed seed, following `prefix` ([`sched::next_prefix`]).
pub fn exhaustive_config(preemptions: usize, prefix: Vec<usize>, mutation: Option<Mutation>) -> Config {
    Config {
        store: StoreKind::Memory,
        seed: 1,
        strategy: Strategy::Exhaustive { preemptions },
        faults: Faults::NONE,
        mutation,
        instances: 2,
        always_panic: false,
        small: true,
        prefix,
    }
}
