//! Fault injection: the in-memory state behind `POST /_faults`.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The status `failNext` answers with when none is given.
pub const DEFAULT_FAIL_STATUS: u16 = 503;

/// The faults in force, as `GET /_faults` and `POST /_faults` answer them.
///
/// Counters count down: each applies to the next N calls of `POST /shipments` it
/// concerns (see [`FaultUpdate`]). Faults live in memory only; a restarted courier
/// has none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Faults {
    /// Calls still to fail with [`Faults::status`], creating nothing.
    pub fail_next: u32,
    /// The status of a `failNext` failure.
    pub status: u16,
    /// Time each call spends before its commit, while set.
    pub latency_ms: u64,
    /// Successful calls still to commit and then lose their answer (the
    /// connection is closed without a response).
    pub drop_response_after_commit: u32,
    /// Calls still to reject permanently (`422 address_rejected`), creating nothing.
    pub reject_next: u32,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            fail_next: 0,
            status: DEFAULT_FAIL_STATUS,
            latency_ms: 0,
            drop_response_after_commit: 0,
            reject_next: 0,
        }
    }
}

/// A `POST /_faults` body: any subset of the members; absent members leave their
/// fault as it is. `reset` clears every fault first, then the other members of the
/// same body apply. Unknown members are refused (`400`), so a misspelt fault never
/// silently does nothing.
///
/// ```
/// use idemkit_labels::courier::FaultUpdate;
/// let body = serde_json::to_value(FaultUpdate::fail_next(2, 503)).unwrap();
/// assert_eq!(body, serde_json::json!({"failNext": 2, "status": 503}));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FaultUpdate {
    /// Fail the next N calls with `status` (default 503); nothing is created and
    /// the problem says `retryable: true`. Applied before the key is looked at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_next: Option<u32>,
    /// The status of `failNext` failures: a transient one (408, 429 or 5xx).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Spend this long before the commit on every call while set (0 clears).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub latency_ms: Option<u64>,
    /// Commit the next N successful calls (fresh or replayed), then close the
    /// connection without answering.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drop_response_after_commit: Option<u32>,
    /// Reject the next N calls permanently with `422 address_rejected`; nothing
    /// is created, and well-behaved clients do not retry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reject_next: Option<u32>,
    /// Clear every fault (before applying the other members).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reset: bool,
}

impl FaultUpdate {
    /// `{"failNext": n, "status": status}`.
    pub fn fail_next(n: u32, status: u16) -> Self {
        Self {
            fail_next: Some(n),
            status: Some(status),
            ..Self::default()
        }
    }

    /// `{"latencyMs": ms}`.
    pub fn latency_ms(ms: u64) -> Self {
        Self {
            latency_ms: Some(ms),
            ..Self::default()
        }
    }

    /// `{"dropResponseAfterCommit": n}`.
    pub fn drop_response_after_commit(n: u32) -> Self {
        Self {
            drop_response_after_commit: Some(n),
            ..Self::default()
        }
    }

    /// `{"rejectNext": n}`.
    pub fn reject_next(n: u32) -> Self {
        Self {
            reject_next: Some(n),
            ..Self::default()
        }
    }

    /// `{"reset": true}`.
    pub fn reset() -> Self {
        Self {
            reset: true,
            ..Self::default()
        }
    }
}

/// What the fault state decides for a call before it reaches the idempotency layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Gate {
    /// Let it through.
    Proceed,
    /// Fail it with this transient status.
    Fail(u16),
    /// Reject it permanently.
    Reject,
}

/// Whether `failNext` may answer with `status`: only statuses well-behaved clients
/// retry, so the problem's `retryable: true` is true.
fn transient(status: u16) -> bool {
    matches!(status, 408 | 429 | 500..=599)
}

impl Faults {
    /// Applies an update, all or nothing.
    pub(crate) fn apply(&mut self, update: &FaultUpdate) -> Result<(), String> {
        if let Some(status) = update.status
            && !transient(status)
        {
            return Err(format!(
                "`status` {status} is not a transient failure: use 408, 429 or 500–599 (`rejectNext` is the permanent one)"
            ));
        }
        let mut next = if update.reset { Self::default() } else { *self };
        if let Some(n) = update.fail_next {
            next.fail_next = n;
        }
        if let Some(s) = update.status {
            next.status = s;
        }
        if let Some(ms) = update.latency_ms {
            next.latency_ms = ms;
        }
        if let Some(n) = update.drop_response_after_commit {
            next.drop_response_after_commit = n;
        }
        if let Some(n) = update.reject_next {
            next.reject_next = n;
        }
        *self = next;
        Ok(())
    }

    /// Decides a call's fate at the door, counting down the fault that applies.
    /// `failNext` goes first, then `rejectNext`.
    pub(crate) fn gate(&mut self) -> Gate {
        if self.fail_next > 0 {
            self.fail_next -= 1;
            Gate::Fail(self.status)
        } else if self.reject_next > 0 {
            self.reject_next -= 1;
            Gate::Reject
        } else {
            Gate::Proceed
        }
    }

    /// Whether this successful answer is to be lost, counting down the fault.
    pub(crate) fn take_drop(&mut self) -> bool {
        let drop = self.drop_response_after_commit > 0;
        if drop {
            self.drop_response_after_commit -= 1;
        }
        drop
    }

    /// The latency spent before each commit.
    pub(crate) fn latency(&self) -> Duration {
        Duration::from_millis(self.latency_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_count_down_in_order() {
        let mut f = Faults::default();
        f.apply(&FaultUpdate {
            fail_next: Some(1),
            status: Some(502),
            reject_next: Some(1),
            ..FaultUpdate::default()
        })
        .unwrap();
        assert_eq!(f.gate(), Gate::Fail(502));
        assert_eq!(f.gate(), Gate::Reject);
        assert_eq!(f.gate(), Gate::Proceed);
        f.apply(&FaultUpdate::drop_response_after_commit(1)).unwrap();
        assert!(f.take_drop());
        assert!(!f.take_drop());
    }

    #[test]
    fn partial_updates_keep_the_rest_and_reset_clears_first() {
        let mut f = Faults::default();
        f.apply(&FaultUpdate::latency_ms(50)).unwrap();
        f.apply(&FaultUpdate::fail_next(2, 503)).unwrap();
        assert_eq!(f.latency_ms, 50);
        assert_eq!(f.fail_next, 2);
        f.apply(&FaultUpdate {
            reset: true,
            reject_next: Some(3),
            ..FaultUpdate::default()
        })
        .unwrap();
        assert_eq!(
            f,
            Faults {
                reject_next: 3,
                ..Faults::default()
            }
        );
    }

    #[test]
    fn permanent_statuses_are_refused_for_fail_next_and_nothing_changes() {
        let mut f = Faults::default();
        assert!(f.apply(&FaultUpdate::fail_next(1, 404)).is_err());
        assert!(f.apply(&FaultUpdate::fail_next(1, 200)).is_err());
        assert_eq!(f, Faults::default());
        assert!(f.apply(&FaultUpdate::fail_next(1, 429)).is_ok());
    }

    #[test]
    fn wire_names_are_the_contract() {
        let u: FaultUpdate = serde_json::from_str(
            r#"{"failNext":2,"status":503,"latencyMs":10,"dropResponseAfterCommit":1,"rejectNext":1,"reset":true}"#,
        )
        .unwrap();
        assert_eq!(u.fail_next, Some(2));
        assert_eq!(u.drop_response_after_commit, Some(1));
        assert!(u.reset);
        assert!(serde_json::from_str::<FaultUpdate>(r#"{"failnext":2}"#).is_err());
        assert_eq!(
            serde_json::to_value(Faults::default()).unwrap(),
            serde_json::json!({"failNext":0,"status":503,"latencyMs":0,"dropResponseAfterCommit":0,"rejectNext":0})
        );
    }
}
