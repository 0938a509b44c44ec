use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use idemkit_core::{Clock, Millis};

/// A clock that only moves when a test moves it.
#[derive(Debug)]
pub struct ManualClock(AtomicI64);

impl ManualClock {
    /// Starts at a fixed, realistic instant (2023-11-14).
    pub fn new() -> Self {
        Self(AtomicI64::new(1_700_000_000_000))
    }

    /// Moves time forward.
    pub fn advance(&self, d: Duration) {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Millis {
        Millis(self.0.load(Ordering::SeqCst))
    }
}

/// A clock running a fixed time ahead of another: the application clock of an
/// instance whose clock is skewed.
#[derive(Debug)]
pub struct SkewedClock {
    /// The true time.
    pub base: Arc<dyn Clock>,
    /// How far ahead this clock runs.
    pub ahead: Duration,
}

impl Clock for SkewedClock {
    fn now(&self) -> Millis {
        self.base.now().plus(self.ahead)
    }
}
