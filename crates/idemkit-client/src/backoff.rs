//! Backoff: how long to sleep before retry number `n`.
//!
//! Two strategies only, both jittered, because un-jittered and equal-jitter backoff
//! keep contending clients synchronised (see `docs/client-decisions.md` and the
//! `brooker` benchmark, which is the only place those two exist).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The jitter formula.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Jitter {
    /// `sleep = random(0, min(cap, base · 2^n))` — the default.
    Full,
    /// `sleep = min(cap, random(base, 3 · previous_sleep))`, starting from `base`.
    Decorrelated,
}

/// A jittered exponential backoff; an [`Iterator`] of sleeps via [`IntoIterator`] or
/// [`Backoff::iter_seeded`].
///
/// `n` counts retries from 0: the sleep before the first retry uses `n = 0`.
///
/// ```
/// use std::time::Duration;
/// use idemkit_client::Backoff;
///
/// let backoff = Backoff::full_jitter(Duration::from_millis(100), Duration::from_secs(5));
/// for (n, sleep) in backoff.iter_seeded(7).take(10).enumerate() {
///     assert!(sleep <= backoff.ceiling(n as u32, Duration::ZERO));
/// }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    jitter: Jitter,
    base: Duration,
    cap: Duration,
}

impl Backoff {
    /// Default backoff for transient failures: full jitter, base 50 ms, cap 20 s.
    pub const TRANSIENT: Self = Self::full_jitter(Duration::from_millis(50), Duration::from_secs(20));
    /// Default backoff for throttling (429, `409 in progress`): full jitter, base 1 s, cap 20 s.
    pub const THROTTLING: Self = Self::full_jitter(Duration::from_secs(1), Duration::from_secs(20));

    /// Full jitter with the given base and cap.
    #[must_use]
    pub const fn full_jitter(base: Duration, cap: Duration) -> Self {
        Self {
            jitter: Jitter::Full,
            base,
            cap,
        }
    }

    /// Decorrelated jitter with the given base and cap.
    #[must_use]
    pub const fn decorrelated_jitter(base: Duration, cap: Duration) -> Self {
        Self {
            jitter: Jitter::Decorrelated,
            base,
            cap,
        }
    }

    /// Replaces the base.
    #[must_use]
    pub const fn with_base(mut self, base: Duration) -> Self {
        self.base = base;
        self
    }

    /// Replaces the cap.
    #[must_use]
    pub const fn with_cap(mut self, cap: Duration) -> Self {
        self.cap = cap;
        self
    }

    /// Replaces the jitter formula.
    #[must_use]
    pub const fn with_jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// The jitter formula.
    #[must_use]
    pub const fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The base.
    #[must_use]
    pub const fn base(&self) -> Duration {
        self.base
    }

    /// The cap.
    #[must_use]
    pub const fn cap(&self) -> Duration {
        self.cap
    }

    /// The smallest sleep the formula can produce for retry `n` (`previous` is the
    /// previous sleep, used by decorrelated jitter).
    #[must_use]
    pub fn floor(&self, _n: u32, _previous: Duration) -> Duration {
        match self.jitter {
            Jitter::Full => Duration::ZERO,
            Jitter::Decorrelated => self.base.min(self.cap),
        }
    }

    /// The largest sleep the formula can produce for retry `n`.
    #[must_use]
    pub fn ceiling(&self, n: u32, previous: Duration) -> Duration {
        match self.jitter {
            Jitter::Full => {
                let growth = 1u32.checked_shl(n).unwrap_or(u32::MAX);
                self.base.saturating_mul(growth).min(self.cap)
            }
            Jitter::Decorrelated => {
                let previous = previous.max(self.base);
                previous.saturating_mul(3).max(self.base).min(self.cap)
            }
        }
    }

    /// Draws the sleep before retry `n`, uniformly between [`floor`](Self::floor) and
    /// [`ceiling`](Self::ceiling).
    pub fn sample<R: Rng + ?Sized>(&self, n: u32, previous: Duration, rng: &mut R) -> Duration {
        let low = nanos(self.floor(n, previous));
        let high = nanos(self.ceiling(n, previous));
        if high <= low {
            return Duration::from_nanos(low);
        }
        Duration::from_nanos(rng.random_range(low..=high))
    }

    /// An endless iterator of sleeps from a seeded generator (deterministic).
    #[must_use]
    pub fn iter_seeded(&self, seed: u64) -> BackoffIter {
        BackoffIter::new(*self, StdRng::seed_from_u64(seed))
    }
}

impl Default for Backoff {
    fn default() -> Self {
        Self::TRANSIENT
    }
}

impl IntoIterator for Backoff {
    type Item = Duration;
    type IntoIter = BackoffIter;

    fn into_iter(self) -> BackoffIter {
        BackoffIter::new(self, StdRng::from_rng(&mut rand::rng()))
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Endless iterator of sleeps drawn from a [`Backoff`].
#[derive(Debug, Clone)]
pub struct BackoffIter {
    backoff: Backoff,
    n: u32,
    previous: Duration,
    rng: StdRng,
}

impl BackoffIter {
    fn new(backoff: Backoff, rng: StdRng) -> Self {
        Self {
            backoff,
            n: 0,
            previous: backoff.base,
            rng,
        }
    }
}

impl Iterator for BackoffIter {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        let sleep = self.backoff.sample(self.n, self.previous, &mut self.rng);
        self.n = self.n.saturating_add(1);
        self.previous = sleep;
        Some(sleep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MS: Duration = Duration::from_millis(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn full_jitter_ceiling_doubles_then_caps() {
        let b = Backoff::full_jitter(100 * MS, 1000 * MS);
        let ceilings: Vec<_> = (0..6).map(|n| b.ceiling(n, Duration::ZERO)).collect();
        assert_eq!(
            ceilings,
            [100 * MS, 200 * MS, 400 * MS, 800 * MS, 1000 * MS, 1000 * MS]
        );
        assert_eq!(b.ceiling(200, Duration::ZERO), 1000 * MS);
    }

    #[test]
    fn seeded_iterators_repeat() {
        let b = Backoff::TRANSIENT;
        let a: Vec<_> = b.iter_seeded(1).take(5).collect();
        let c: Vec<_> = b.iter_seeded(1).take(5).collect();
        assert_eq!(a, c);
    }

    proptest! {
        #[test]
        fn every_sleep_is_within_its_formula(
            base_ms in 1u64..5_000,
            cap_ms in 1u64..60_000,
            seed: u64,
            decorrelated: bool,
        ) {
            let b = if decorrelated {
                Backoff::decorrelated_jitter(ms(base_ms), ms(cap_ms))
            } else {
                Backoff::full_jitter(ms(base_ms), ms(cap_ms))
            };
            let mut previous = b.base();
            for (n, sleep) in b.iter_seeded(seed).take(40).enumerate() {
                let n = n as u32;
                prop_assert!(sleep >= b.floor(n, previous));
                prop_assert!(sleep <= b.ceiling(n, previous));
                prop_assert!(sleep <= b.cap());
                match b.jitter() {
                    Jitter::Full => {
                        let formula = (b.base().as_nanos() << n.min(64)).min(b.cap().as_nanos());
                        prop_assert!(sleep.as_nanos() <= formula);
                    }
                    Jitter::Decorrelated => {
                        prop_assert!(sleep >= b.base().min(b.cap()));
                        prop_assert!(sleep <= (previous * 3).max(b.base()).min(b.cap()));
                    }
                }
                previous = sleep;
            }
        }
    }
}
