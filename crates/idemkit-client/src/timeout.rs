//! Attempt timeouts: a fixed default, or derived from measured latency.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

/// How long one attempt may take before it is abandoned (and counted as
/// *maybe executed*). Each attempt's effective timeout is
/// `min(this, remaining overall deadline)`.
///
/// ```
/// use std::time::Duration;
/// use idemkit_client::{AdaptiveTimeout, AttemptTimeout};
///
/// let fixed = AttemptTimeout::Fixed(Duration::from_secs(2));
/// let adaptive = AttemptTimeout::Adaptive(
///     AdaptiveTimeout::new().with_multiplier(3).with_ceiling(Duration::from_secs(5)),
/// );
/// # let _ = (fixed, adaptive);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum AttemptTimeout {
    /// The same timeout for every attempt.
    Fixed(Duration),
    /// `multiplier × p99` of recent successful attempts, bounded by a floor and a
    /// ceiling; the fallback until enough samples exist. An attempt it cuts short
    /// doubles it (up to the ceiling) until the p99 catches up, so a rise in latency
    /// above it is recovered from.
    Adaptive(AdaptiveTimeout),
}

impl AttemptTimeout {
    /// The default: a fixed 10 s (see `docs/client-decisions.md`).
    pub const DEFAULT: Self = Self::Fixed(Duration::from_secs(10));
}

impl Default for AttemptTimeout {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Settings of [`AttemptTimeout::Adaptive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdaptiveTimeout {
    multiplier: u32,
    floor: Duration,
    ceiling: Duration,
    fallback: Duration,
    min_samples: usize,
}

impl AdaptiveTimeout {
    /// Samples kept (the most recent successful attempts).
    pub const WINDOW: usize = 256;

    /// Defaults: 3 × p99, floor 100 ms, ceiling 10 s, fallback 10 s until 20 samples.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            multiplier: 3,
            floor: Duration::from_millis(100),
            ceiling: Duration::from_secs(10),
            fallback: Duration::from_secs(10),
            min_samples: 20,
        }
    }

    /// Sets the multiplier applied to the p99.
    #[must_use]
    pub const fn with_multiplier(mut self, multiplier: u32) -> Self {
        self.multiplier = multiplier;
        self
    }

    /// Sets the smallest timeout it may choose.
    #[must_use]
    pub const fn with_floor(mut self, floor: Duration) -> Self {
        self.floor = floor;
        self
    }

    /// Sets the largest timeout it may choose.
    #[must_use]
    pub const fn with_ceiling(mut self, ceiling: Duration) -> Self {
        self.ceiling = ceiling;
        self
    }

    /// Sets the timeout used until enough samples exist.
    #[must_use]
    pub const fn with_fallback(mut self, fallback: Duration) -> Self {
        self.fallback = fallback;
        self
    }

    /// Sets how many samples are needed before the p99 is trusted (at most
    /// [`WINDOW`](Self::WINDOW)).
    #[must_use]
    pub const fn with_min_samples(mut self, min_samples: usize) -> Self {
        self.min_samples = min_samples;
        self
    }

    fn choose(&self, p99: Option<Duration>) -> Duration {
        match p99 {
            Some(p99) => p99
                .saturating_mul(self.multiplier)
                .clamp(self.floor, self.ceiling.max(self.floor)),
            None => self.fallback,
        }
    }
}

impl Default for AdaptiveTimeout {
    fn default() -> Self {
        Self::new()
    }
}

/// Latencies of recent successful attempts, shared by all calls of a client, and
/// what the adaptive timeout learned from the attempts it cut short.
#[derive(Debug, Default)]
pub(crate) struct LatencyWindow {
    state: Mutex<Window>,
}

#[derive(Debug, Default)]
struct Window {
    samples: VecDeque<Duration>,
    /// A timeout raised above the learned one after attempts timed out: doubled on
    /// each timeout (up to the ceiling), decayed by successes toward
    /// `multiplier × their latency`, dropped once the p99 has caught up with it.
    raised: Option<Duration>,
}

impl Window {
    /// The p99 (nearest rank) when at least `min_samples` exist.
    fn p99(&self, min_samples: usize) -> Option<Duration> {
        if self.samples.is_empty() || self.samples.len() < min_samples {
            return None;
        }
        let mut sorted: Vec<Duration> = self.samples.iter().copied().collect();
        sorted.sort_unstable();
        let rank = (sorted.len() * 99).div_ceil(100).max(1);
        Some(sorted[rank - 1])
    }

    fn learned(&self, adaptive: &AdaptiveTimeout) -> Duration {
        adaptive.choose(self.p99(adaptive.min_samples))
    }

    fn timeout(&self, adaptive: &AdaptiveTimeout) -> Duration {
        let learned = self.learned(adaptive);
        self.raised.map_or(learned, |raised| learned.max(raised))
    }
}

impl LatencyWindow {
    /// Records a successful attempt that took `latency`.
    pub(crate) fn record(&self, latency: Duration, setting: &AttemptTimeout) {
        let mut window = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if window.samples.len() == AdaptiveTimeout::WINDOW {
            window.samples.pop_front();
        }
        window.samples.push_back(latency);
        if let (AttemptTimeout::Adaptive(adaptive), Some(raised)) = (setting, window.raised) {
            // Decay slowly, never below what this success says an attempt needs, so
            // that the p99 has the samples to catch up before the raise is gone.
            let decayed = raised
                .saturating_sub(raised / 16)
                .max(latency.saturating_mul(adaptive.multiplier))
                .min(adaptive.ceiling.max(adaptive.floor));
            let learned = window.learned(adaptive);
            window.raised = (decayed > learned).then_some(decayed);
        }
    }

    /// Records an attempt cut short by its timeout after `took`: the adaptive timeout
    /// doubles it (up to its ceiling) when that is above what it would choose now.
    /// Without this, once latency rose above the learned timeout every attempt failed
    /// and no sample could ever raise it.
    pub(crate) fn record_timeout(&self, took: Duration, setting: &AttemptTimeout) {
        let AttemptTimeout::Adaptive(adaptive) = setting else {
            return;
        };
        let mut window = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let doubled = took.saturating_mul(2).min(adaptive.ceiling.max(adaptive.floor));
        if doubled > window.timeout(adaptive) {
            window.raised = Some(doubled);
        }
    }

    /// The p99 (nearest rank) when at least `min_samples` exist.
    #[cfg(test)]
    pub(crate) fn p99(&self, min_samples: usize) -> Option<Duration> {
        self.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .p99(min_samples)
    }

    pub(crate) fn timeout(&self, setting: &AttemptTimeout) -> Duration {
        match setting {
            AttemptTimeout::Fixed(d) => *d,
            AttemptTimeout::Adaptive(a) => self.state.lock().unwrap_or_else(|p| p.into_inner()).timeout(a),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn adaptive_follows_p99_within_bounds() {
        let w = LatencyWindow::default();
        let a = AttemptTimeout::Adaptive(AdaptiveTimeout::new().with_min_samples(100));
        assert_eq!(w.timeout(&a), Duration::from_secs(10), "fallback before samples");
        for i in 0..100 {
            w.record(if i == 0 { 900 * MS } else { 50 * MS }, &a);
        }
        // p99 of 100 samples (nearest rank 99) is 50 ms: one outlier does not count.
        assert_eq!(w.p99(100), Some(50 * MS));
        assert_eq!(w.timeout(&a), 150 * MS);
        for _ in 0..5 {
            w.record(5 * Duration::from_secs(1), &a);
        }
        assert_eq!(w.timeout(&a), Duration::from_secs(10), "ceiling");
        let tiny = LatencyWindow::default();
        for _ in 0..100 {
            tiny.record(MS, &a);
        }
        assert_eq!(tiny.timeout(&a), 100 * MS, "floor");
    }

    #[test]
    fn timeouts_raise_the_adaptive_timeout_and_successes_settle_it() {
        let w = LatencyWindow::default();
        let a = AttemptTimeout::Adaptive(AdaptiveTimeout::new().with_min_samples(20));
        for _ in 0..256 {
            w.record(30 * MS, &a);
        }
        assert_eq!(w.timeout(&a), 100 * MS);
        // Latency is now 400 ms: each timeout doubles the timeout, up to the ceiling.
        w.record_timeout(100 * MS, &a);
        assert_eq!(w.timeout(&a), 200 * MS);
        w.record_timeout(200 * MS, &a);
        assert_eq!(w.timeout(&a), 400 * MS);
        w.record_timeout(400 * MS, &a);
        assert_eq!(w.timeout(&a), 800 * MS);
        // A timeout cut short by the deadline (shorter than today's timeout) says nothing.
        w.record_timeout(50 * MS, &a);
        assert_eq!(w.timeout(&a), 800 * MS);
        // Successes at 400 ms keep it at 3 x 400 ms until the p99 has caught up.
        for _ in 0..3 {
            w.record(400 * MS, &a);
            assert!(w.timeout(&a) >= 1200 * MS, "{:?}", w.timeout(&a));
        }
        for _ in 0..10 {
            w.record(400 * MS, &a);
        }
        assert_eq!(w.timeout(&a), 1200 * MS);
        // Never above the ceiling; a fixed timeout never moves.
        for _ in 0..20 {
            w.record_timeout(Duration::from_secs(9), &a);
        }
        assert_eq!(w.timeout(&a), Duration::from_secs(10));
        let fixed = AttemptTimeout::Fixed(100 * MS);
        w.record_timeout(100 * MS, &fixed);
        assert_eq!(w.timeout(&fixed), 100 * MS);
    }
}
