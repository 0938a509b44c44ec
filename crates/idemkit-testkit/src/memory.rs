use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, Decision, FORCE_RELEASED, FencingToken, KeyStore, Lease, ListFilter,
    MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, RecordHead, RecordState,
    ReviewEntry, Scope, StoreError, StoreResult, StoredResponse, SystemClock,
};

/// An in-memory [`KeyStore`]: one mutex over a map. The claim decision runs under
/// the mutex, which is what makes it atomic here. The review list is a `Vec`
/// behind the same mutex, so a reaper pass is atomic too.
#[derive(Debug)]
pub struct MemoryStore {
    records: Mutex<Records>,
    clock: Arc<dyn Clock>,
}

#[derive(Debug, Default)]
struct Records {
    /// Boxed: a record is a few hundred bytes, and a growing map moves every
    /// entry when it rehashes. Hashed with aHash, keyed at random per
    /// process (keys are client-chosen: a keyed hash, as SipHash is, but a
    /// quarter of its cost on a scope's ~90 bytes).
    keys: Keys,
    review: Vec<ReviewEntry>,
    tokens: Tokens,
}

type Keys = HashMap<Scope, Box<Record>, ahash::RandomState>;

/// The last fencing token handed out, store-wide: tokens never repeat, even
/// for a key whose record the reaper deleted. A field of its own, so a
/// caller holding an entry of `keys` can still draw one.
#[derive(Debug, Default)]
struct Tokens(i64);

impl Tokens {
    fn next(&mut self) -> FencingToken {
        self.0 += 1;
        FencingToken(self.0)
    }
}

impl std::ops::Deref for Records {
    type Target = Keys;
    fn deref(&self) -> &Self::Target {
        &self.keys
    }
}

impl std::ops::DerefMut for Records {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.keys
    }
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
            records: Mutex::new(Records::default()),
            clock,
        }
    }

    /// Deletes a record outright (mutant stores use it to model broken reapers
    /// and restarts).
    pub(crate) fn remove(&self, scope: &Scope) {
        self.lock().keys.remove(scope);
    }

    fn lock(&self) -> MutexGuard<'_, Records> {
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
        self.with_held_bumping(scope, token, false, f)
    }

    /// Like `with_held`; with `bump`, the record also gets a new fencing token,
    /// so a write of the old holder already on its way (a heartbeat) is refused.
    fn with_held_bumping<T>(
        &self,
        scope: &Scope,
        token: FencingToken,
        bump: bool,
        f: impl FnOnce(&mut Record, Millis) -> T,
    ) -> StoreResult<T> {
        let now = self.clock.now();
        let mut guard = self.lock();
        let next = if bump { Some(guard.tokens.next()) } else { None };
        match guard.keys.get_mut(scope) {
            Some(r) if r.fencing_token == token && r.state == RecordState::InFlight => {
                if let Some(next) = next {
                    r.fencing_token = next;
                }
                Ok(f(r, now))
            }
            _ => Err(StoreError::Fenced),
        }
    }
}

impl MemoryStore {
    /// The decision a claim would make now, without writing anything (mutant
    /// stores use it to model a check-then-insert claim).
    pub(crate) fn peek_decision(&self, req: &ClaimRequest) -> Decision {
        let now = self.clock.now();
        let map = self.lock();
        req.decide(
            map.keys.get(&req.scope).map(|r| RecordHead::from(&**r)).as_ref(),
            now,
        )
    }

    /// Sets a record's fencing token outright (mutant stores use it to model
    /// tokens that do not rise).
    pub(crate) fn set_token(&self, scope: &Scope, token: FencingToken) {
        if let Some(r) = self.lock().keys.get_mut(scope) {
            r.fencing_token = token;
        }
    }

    /// A claim whose decision is made by `decide` (given the record's head, or
    /// `None`, and now) instead of [`ClaimRequest::decide`]; the write follows
    /// the decision under the same lock. Mutant stores use it to model broken
    /// claim rules.
    pub(crate) fn claim_deciding(
        &self,
        req: &ClaimRequest,
        decide: impl FnOnce(Option<&RecordHead>, Millis) -> Decision,
    ) -> StoreResult<ClaimOutcome> {
        let now = self.clock.now();
        let expires_at = now.plus(req.lease);
        // Built before the lock is taken (a first request is the common case),
        // so the lock covers one hash, the decision and the write.
        let fresh = Box::new(Record {
            scope: req.scope.clone(),
            fingerprint: req.fingerprint,
            state: RecordState::InFlight,
            created_at: now,
            completed_at: None,
            lease_expires_at: expires_at,
            fencing_token: FencingToken(0),
            recovery_point: req.recovery_point.clone(),
            step_outputs: BTreeMap::new(),
            request: req.request.clone(),
            response: None,
            last_error: None,
        });
        let key = req.scope.clone();
        let mut guard = self.lock();
        let records = &mut *guard;
        let entry = records.keys.entry(key);
        let decision = decide(
            match &entry {
                Entry::Occupied(o) => Some(RecordHead::from(&**o.get())),
                Entry::Vacant(_) => None,
            }
            .as_ref(),
            now,
        );
        let next = match decision {
            Decision::Insert | Decision::Reuse | Decision::Takeover => records.tokens.next(),
            _ => FencingToken(0),
        };
        Ok(match (decision, entry) {
            (Decision::Insert | Decision::Reuse, entry) => {
                let mut fresh = fresh;
                fresh.fencing_token = next;
                match entry {
                    Entry::Occupied(mut o) => *o.get_mut() = fresh,
                    Entry::Vacant(v) => {
                        v.insert(fresh);
                    }
                }
                ClaimOutcome::Claimed(Lease {
                    token: next,
                    expires_at,
                    resumed_from: None,
                })
            }
            (Decision::Takeover, Entry::Occupied(mut o)) => {
                let r = o.get_mut();
                r.state = RecordState::InFlight;
                r.fencing_token = next;
                r.lease_expires_at = expires_at;
                if r.recovery_point.is_none() {
                    r.recovery_point.clone_from(&req.recovery_point);
                }
                ClaimOutcome::Claimed(Lease {
                    token: next,
                    expires_at,
                    resumed_from: r.recovery_point.clone(),
                })
            }
            (Decision::Replay, Entry::Occupied(o)) => ClaimOutcome::Replay(
                o.get()
                    .response
                    .clone()
                    .ok_or_else(|| StoreError::Corrupt("completed without response".into()))?,
            ),
            (Decision::Takeover | Decision::Replay, Entry::Vacant(_)) => {
                return Err(StoreError::Corrupt(
                    "a decision about a record that is not there".into(),
                ));
            }
            (Decision::Mismatch, _) => ClaimOutcome::Mismatch,
            (Decision::InProgress { retry_after }, _) => ClaimOutcome::InProgress { retry_after },
            (Decision::Parked, _) => ClaimOutcome::Parked,
            (Decision::Stale, _) => ClaimOutcome::Stale,
        })
    }
}

#[async_trait]
impl KeyStore for MemoryStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.claim_deciding(req, |head, now| req.decide(head, now))
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
            // A completed record replays its answer: its request body is
            // never read again.
            r.request.body = Vec::new();
        })
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.with_held_bumping(scope, token, true, |r, now| {
            if r.has_progress() {
                // Progress was recorded: keep it (see `KeyStore::release`).
                r.lease_expires_at = now;
                r.last_error = Some(RELEASE_REFUSED.to_owned());
            } else {
                r.state = RecordState::Released;
                r.lease_expires_at = Millis(0);
                r.request.body = Vec::new();
            }
        })
    }

    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.with_held_bumping(scope, token, true, |r, _| {
            r.recovery_point = None;
            r.step_outputs.clear();
            r.state = RecordState::Released;
            r.lease_expires_at = Millis(0);
            r.request.body = Vec::new();
        })
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.with_held_bumping(scope, token, true, |r, now| {
            r.lease_expires_at = now;
            r.last_error = Some(error.to_owned());
        })
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        Ok(self.lock().get(scope).map(|r| (**r).clone()))
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }

    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.with_held(scope, token, |r, _| {
            r.recovery_point = Some(update.recovery_point.clone());
            if let Some((name, value)) = &update.step {
                r.step_outputs.insert(name.clone(), value.clone());
            }
        })
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        self.with_held_bumping(scope, token, true, |r, now| {
            r.state = RecordState::Parked;
            r.lease_expires_at = now;
            r.last_error = Some(reason.to_owned());
        })
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        let now = self.clock.now();
        let map = self.lock();
        let mut found: Vec<&Record> = map
            .values()
            .filter(|r| {
                r.state == RecordState::InFlight
                    && r.lease_expires_at <= now
                    && r.created_at <= claimed_before
            })
            .map(|r| &**r)
            .collect();
        found.sort_by(|a, b| {
            (a.created_at, a.scope.account.as_str(), a.scope.key.as_str()).cmp(&(
                b.created_at,
                b.scope.account.as_str(),
                b.scope.key.as_str(),
            ))
        });
        Ok(found.into_iter().take(limit).cloned().collect())
    }

    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        let now = self.clock.now();
        let mut guard = self.lock();
        let Records { keys, review, tokens } = &mut *guard;
        let mut report = ReapReport::default();
        let mut moved = Vec::new();
        keys.retain(|_, r| {
            let unfinished = match r.state {
                RecordState::Parked => true,
                RecordState::InFlight => r.lease_expires_at <= now,
                _ => false,
            };
            if unfinished && r.created_at < before {
                let listed = review
                    .iter()
                    .any(|e| e.scope == r.scope && e.created_at == r.created_at);
                if !listed {
                    moved.push(ReviewEntry {
                        scope: r.scope.clone(),
                        state: r.state,
                        created_at: r.created_at,
                        reaped_at: now,
                        recovery_point: r.recovery_point.clone(),
                        step_outputs: r.step_outputs.clone(),
                        last_error: r.last_error.clone(),
                        request: r.request.clone(),
                    });
                    // The record stays, parked, so it keeps fencing and is never
                    // claimed again as a new request (see `KeyStore::reap`).
                    r.fencing_token = tokens.next();
                    r.state = RecordState::Parked;
                    r.lease_expires_at = r.lease_expires_at.min(now);
                    r.last_error = Some(MOVED_TO_REVIEW.to_owned());
                }
                return true;
            }
            let expired = match r.state {
                RecordState::Completed => r.completed_at.unwrap_or(r.created_at) < before,
                RecordState::Released => r.created_at < before,
                _ => false,
            };
            if expired {
                report.deleted += 1;
            }
            !expired
        });
        moved.sort_by(|a, b| {
            (a.created_at, a.scope.account.as_str(), a.scope.key.as_str()).cmp(&(
                b.created_at,
                b.scope.account.as_str(),
                b.scope.key.as_str(),
            ))
        });
        report.moved_to_review = moved.len() as u64;
        review.extend(moved);
        Ok(report)
    }

    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        let map = self.lock();
        let mut entries: Vec<&ReviewEntry> = map.review.iter().collect();
        // Stable: entries claimed at the same instant keep the order they were reaped in.
        entries.sort_by_key(|e| e.created_at);
        Ok(entries.into_iter().take(limit).cloned().collect())
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        let map = self.lock();
        let mut found: Vec<&Record> = map.values().map(|r| &**r).filter(|r| filter.matches(r)).collect();
        found.sort_by(|a, b| {
            (b.created_at, a.scope.account.as_str(), a.scope.key.as_str()).cmp(&(
                a.created_at,
                b.scope.account.as_str(),
                b.scope.key.as_str(),
            ))
        });
        Ok(found.into_iter().take(filter.limit).cloned().collect())
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now();
        let mut map = self.lock();
        let next = map.tokens.next();
        let Some(r) = map.keys.get_mut(scope) else {
            return Ok(false);
        };
        let unheld = match r.state {
            RecordState::Parked => true,
            RecordState::InFlight => r.lease_expires_at <= now,
            _ => false,
        };
        if unheld {
            r.fencing_token = next;
            r.last_error = Some(FORCE_RELEASED.to_owned());
            if r.has_progress() {
                // Recorded progress (an intent above all) survives: the record
                // becomes resumable, and a rerun parks again at an unfinished call
                // to a downstream that ignores keys.
                r.state = RecordState::InFlight;
                r.lease_expires_at = r.lease_expires_at.min(now);
            } else {
                r.state = RecordState::Released;
                r.lease_expires_at = Millis(0);
                r.request.body = Vec::new();
            }
        }
        Ok(unheld)
    }

    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        let now = self.clock.now();
        let mut map = self.lock();
        let next = map.tokens.next();
        let Some(r) = map.keys.get_mut(scope) else {
            return Ok(false);
        };
        let unheld = match r.state {
            RecordState::Parked => true,
            RecordState::InFlight => r.lease_expires_at <= now,
            _ => false,
        };
        if unheld {
            r.fencing_token = next;
            r.state = RecordState::Released;
            r.lease_expires_at = Millis(0);
            r.recovery_point = None;
            r.step_outputs.clear();
            r.request.body = Vec::new();
            r.last_error = Some(FORCE_RELEASED.to_owned());
        }
        Ok(unheld)
    }
}
