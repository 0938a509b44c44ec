//! An optional in-process cache of the answers this process stored, so a hot
//! replay is answered without a store round trip.
//!
//! Keyed by scope and fingerprint: a retry of the same request finds its answer;
//! the same key with another request misses and goes to the store, which
//! answers `idempotency_key_reused`. An entry lives until the record's replay
//! window would end, counted from before the store write that completed it, so
//! never past the window the store applies. A completed record does not change
//! within its window (the reaper's threshold is at least the window, and no
//! operator command touches completed records), so the cache cannot answer
//! differently from the store there. It is still off by default: it holds
//! answers in memory (up to the configured number), and an answer stored by
//! another instance is not in it, so where several instances share a store it
//! only helps retries that come back to the same instance.

use std::time::{Duration, Instant};

use idemkit_core::{Fingerprint, Scope, StoredResponse};

/// Completed answers of this process, by (scope, fingerprint).
pub(crate) struct ReplayCache {
    entries: quick_cache::sync::Cache<(Scope, Fingerprint), (Instant, StoredResponse)>,
}

impl ReplayCache {
    /// A cache of about `capacity` answers.
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: quick_cache::sync::Cache::new(capacity),
        }
    }

    /// The stored answer for this request, if this process stored it and its
    /// window has not ended.
    pub(crate) fn get(&self, scope: &Scope, fingerprint: &Fingerprint) -> Option<StoredResponse> {
        let key = (scope.clone(), *fingerprint);
        let (until, response) = self.entries.get(&key)?;
        if Instant::now() < until {
            Some(response)
        } else {
            self.entries.remove(&key);
            None
        }
    }

    /// Keeps `response` for the rest of a window of `window` that started no
    /// later than `completing` (taken before the store write that completed it).
    pub(crate) fn insert(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        completing: Instant,
        window: Duration,
    ) {
        // A window too long to add to an instant is not worth caching for.
        if let Some(until) = completing.checked_add(window) {
            self.entries
                .insert((scope.clone(), *fingerprint), (until, response.clone()));
        }
    }
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("entries", &self.entries.len())
            .finish()
    }
}
