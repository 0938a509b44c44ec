use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, Decision, FencingToken, KeyStore, Lease, Millis, Record, RecordHead,
    RecordState, Scope, StoreError, StoreResult, StoredResponse, SystemClock, decide,
};

/// An in-memory [`KeyStore`]: one mutex over a map. The claim decision runs under
/// the mutex, which is what makes it atomic here.
#[derive(Debug)]
pub struct MemoryStore {
    records: Mutex<HashMap<Scope, Record>>,
    clock: Arc<dyn Clock>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// An empty store on the system clock.
    pub fn new() -> Self {
        Self::with_clock(Arc::new(SystemClock))
    }

    /// An empty store on the given clock.
    pub fn with_clock(clock: Arc<dyn Clock>) -> Self {
        Self {
            records: Mutex::new(HashMap::new()),
            clock,
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Scope, Record>> {
        // A panic while holding the lock leaves consistent data (every write is a
        // single assignment), so poisoning is ignored.
        self.records.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn with_held<T>(
        &self,
        scope: &Scope,
        token: FencingToken,
        f: impl FnOnce(&mut Record, Millis) -> T,
    ) -> StoreResult<T> {
        let now = self.clock.now();
        let mut map = self.lock();
        match map.get_mut(scope) {
            Some(r) if r.fencing_token == token && r.state == RecordState::InFlight => Ok(f(r, now)),
            _ => Err(StoreError::Fenced),
        }
    }
}

#[async_trait]
impl KeyStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        let now = self.clock.now();
        let expires_at = now.plus(req.lease);
        let mut map = self.lock();
        let existing = map.get(&req.scope);
        let decision = decide(
            existing.map(RecordHead::from).as_ref(),
            &req.fingerprint,
            now,
            req.replay_window,
        );
        let next = FencingToken(existing.map_or(0, |r| r.fencing_token.0) + 1);
        let fresh = || Record {
            scope: req.scope.clone(),
            fingerprint: req.fingerprint,
            state: RecordState::InFlight,
            created_at: now,
            completed_at: None,
            lease_expires_at: expires_at,
            fencing_token: next,
            recovery_point: None,
            step_outputs: BTreeMap::new(),
            request: req.request.clone(),
            response: None,
            last_error: None,
        };
        Ok(match decision {
            Decision::Insert | Decision::Reuse => {
                map.insert(req.scope.clone(), fresh());
                ClaimOutcome::Claimed(Lease {
                    token: next,
                    expires_at,
                    resumed_from: None,
                })
            }
            Decision::Takeover => {
                let r = map
                    .get_mut(&req.scope)
                    .ok_or_else(|| StoreError::Corrupt("vanished".into()))?;
                r.fencing_token = next;
                r.lease_expires_at = expires_at;
                ClaimOutcome::Claimed(Lease {
                    token: next,
                    expires_at,
                    resumed_from: r.recovery_point.clone(),
                })
            }
            Decision::Replay => ClaimOutcome::Replay(
                existing
                    .and_then(|r| r.response.clone())
                    .ok_or_else(|| StoreError::Corrupt("completed without response".into()))?,
            ),
            Decision::Mismatch => ClaimOutcome::Mismatch,
            Decision::InProgress { retry_after } => ClaimOutcome::InProgress { retry_after },
        })
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        self.with_held(scope, token, |r, now| {
            r.lease_expires_at = now.plus(lease);
            r.lease_expires_at
        })
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        self.with_held(scope, token, |r, now| {
            r.state = RecordState::Completed;
            r.completed_at = Some(now);
            r.response = Some(response.clone());
            r.last_error = None;
        })
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.with_held(scope, token, |r, _| {
            r.state = RecordState::Released;
            r.lease_expires_at = Millis(0);
            r.request.body.clear();
        })
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.with_held(scope, token, |r, now| {
            r.lease_expires_at = now;
            r.last_error = Some(error.to_owned());
        })
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        Ok(self.lock().get(scope).cloned())
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }
}
