//! Retry budget: a limit on retries shared by every call of one client, so that an
//! outage does not multiply the load on the server by the attempt cap.

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::classify::RetryKind;

/// Tokens taken for one retry; handed back to [`Budget::deposit`] when that retry
/// succeeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Withdrawal {
    /// Tokens taken.
    pub cost: u32,
}

/// A retry budget shared by all calls of a client.
///
/// Object safe: the policy holds an `Arc<dyn Budget>`.
pub trait Budget: Send + Sync + fmt::Debug {
    /// Asks to spend tokens for one retry of `kind`. `None` means the budget is empty
    /// and the retry must not happen.
    fn withdraw(&self, kind: RetryKind) -> Option<Withdrawal>;

    /// Records a successful attempt. `refund` is the withdrawal that paid for it when
    /// it was a retry, `None` when it succeeded on the first try.
    fn deposit(&self, refund: Option<Withdrawal>);

    /// Gives back the tokens of a retry that was paid for but never sent (the caller
    /// cancelled during the backoff, or the deadline ended the call first). The
    /// default keeps them spent, as a budget without this method always did.
    fn refund(&self, withdrawal: Withdrawal) {
        let _ = withdrawal;
    }

    /// Tokens left, for dashboards; `None` (the default) for a budget that does not
    /// count tokens.
    fn remaining(&self) -> Option<u32> {
        None
    }
}

#[allow(dead_code)]
fn _object_safe(_: &dyn Budget) {}

/// The default budget: a token bucket after the AWS SDKs' current retry behaviour.
///
/// | event | tokens |
/// |---|---|
/// | capacity (and initial fill) | 500 |
/// | retry after a transient error (incl. timeouts) | −14 |
/// | retry after throttling (429, `409 in progress`) | −5 |
/// | that retry succeeds | + its cost |
/// | first-try success | +1 |
///
/// With the defaults a client can absorb about 35 transient retries in a row before
/// it stops retrying, and earns them back as calls succeed.
///
/// ```
/// use idemkit_client::{Budget, RetryKind, TokenBucket};
///
/// let bucket = TokenBucket::new().with_capacity(20);
/// assert!(bucket.withdraw(RetryKind::Transient).is_some()); // 20 -> 6
/// assert!(bucket.withdraw(RetryKind::Transient).is_none()); // 6 < 14
/// assert!(bucket.withdraw(RetryKind::Throttling).is_some()); // 6 -> 1
/// ```
#[derive(Debug)]
pub struct TokenBucket {
    capacity: u32,
    transient_cost: u32,
    throttling_cost: u32,
    success_reward: u32,
    tokens: AtomicU32,
}

impl TokenBucket {
    /// Default capacity.
    pub const DEFAULT_CAPACITY: u32 = 500;
    /// Default cost of a retry after a transient error (incl. timeouts).
    pub const DEFAULT_TRANSIENT_COST: u32 = 14;
    /// Default cost of a retry after throttling.
    pub const DEFAULT_THROTTLING_COST: u32 = 5;
    /// Default tokens earned by a first-try success.
    pub const DEFAULT_SUCCESS_REWARD: u32 = 1;

    /// A full bucket with the default numbers.
    #[must_use]
    pub const fn new() -> Self {
        Self {
            capacity: Self::DEFAULT_CAPACITY,
            transient_cost: Self::DEFAULT_TRANSIENT_COST,
            throttling_cost: Self::DEFAULT_THROTTLING_COST,
            success_reward: Self::DEFAULT_SUCCESS_REWARD,
            tokens: AtomicU32::new(Self::DEFAULT_CAPACITY),
        }
    }

    /// Sets the capacity (the bucket starts full).
    #[must_use]
    pub const fn with_capacity(mut self, capacity: u32) -> Self {
        self.capacity = capacity;
        self.tokens = AtomicU32::new(capacity);
        self
    }

    /// Sets the cost of a retry after a transient error.
    #[must_use]
    pub const fn with_transient_cost(mut self, cost: u32) -> Self {
        self.transient_cost = cost;
        self
    }

    /// Sets the cost of a retry after throttling.
    #[must_use]
    pub const fn with_throttling_cost(mut self, cost: u32) -> Self {
        self.throttling_cost = cost;
        self
    }

    /// Sets the tokens earned by a first-try success.
    #[must_use]
    pub const fn with_success_reward(mut self, reward: u32) -> Self {
        self.success_reward = reward;
        self
    }

    /// Tokens currently available.
    #[must_use]
    pub fn available(&self) -> u32 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// The capacity.
    #[must_use]
    pub const fn capacity(&self) -> u32 {
        self.capacity
    }

    fn add(&self, amount: u32) {
        let _ = self
            .tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
                Some(t.saturating_add(amount).min(self.capacity))
            });
    }
}

impl Default for TokenBucket {
    fn default() -> Self {
        Self::new()
    }
}

impl Budget for TokenBucket {
    fn withdraw(&self, kind: RetryKind) -> Option<Withdrawal> {
        let cost = match kind {
            RetryKind::Throttling => self.throttling_cost,
            RetryKind::Transient => self.transient_cost,
        };
        self.tokens
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| t.checked_sub(cost))
            .ok()
            .map(|_| Withdrawal { cost })
    }

    fn deposit(&self, refund: Option<Withdrawal>) {
        self.add(refund.map_or(self.success_reward, |w| w.cost));
    }

    fn refund(&self, withdrawal: Withdrawal) {
        self.add(withdrawal.cost);
    }

    fn remaining(&self) -> Option<u32> {
        Some(self.available())
    }
}

/// No budget: every retry the attempt cap allows is made. For comparison and tests;
/// in production it lets an outage multiply the load by the attempt cap.
#[derive(Debug, Clone, Copy, Default)]
pub struct Unlimited;

impl Budget for Unlimited {
    fn withdraw(&self, _kind: RetryKind) -> Option<Withdrawal> {
        Some(Withdrawal { cost: 0 })
    }

    fn deposit(&self, _refund: Option<Withdrawal>) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aws_numbers() {
        let b = TokenBucket::new();
        assert_eq!(b.available(), 500);
        let w = b.withdraw(RetryKind::Transient).unwrap();
        assert_eq!(b.available(), 486);
        b.deposit(Some(w));
        assert_eq!(b.available(), 500);
        b.deposit(None);
        assert_eq!(b.available(), 500, "never above capacity");
        let w = b.withdraw(RetryKind::Throttling).unwrap();
        assert_eq!(w.cost, 5);
        b.deposit(None);
        assert_eq!(b.available(), 496);
    }

    #[test]
    fn empties_after_35_transient_retries() {
        let b = TokenBucket::new();
        let granted = std::iter::from_fn(|| b.withdraw(RetryKind::Transient)).count();
        assert_eq!(granted, 35);
        assert!(b.withdraw(RetryKind::Transient).is_none());
        assert!(b.withdraw(RetryKind::Throttling).is_some(), "10 tokens left");
    }
}
