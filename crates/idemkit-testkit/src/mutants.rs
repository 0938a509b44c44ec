//! Deliberately broken stores: the negative controls of the suites. Each
//! [`Mutation`] reintroduces one defect that real stores once had or could
//! have; a suite that passes against a mutant proves nothing, so the testkit's
//! own tests assert that the suites catch every one.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, Decision, FencingToken, KeyStore, Lease, ListFilter, MOVED_TO_REVIEW, Millis,
    PhaseUpdate, ReapReport, Record, RecordState, ReviewEntry, Scope, StoreResult, StoredResponse,
    TransactionalStore, TxClaim,
};

use crate::tx_suite::BusinessProbe;
use crate::{ManualClock, MemoryStore};

/// One defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mutation {
    /// An unfinished record older than the replay window is restarted as a new
    /// request, its intents dropped (the window applied to unfinished records:
    /// an in-flight one whose lease ran out, or one parked for review).
    RestartAfterWindow,
    /// The reaper deletes the records it lists for review, so their keys can be
    /// claimed again as new requests.
    ReaperDeletesUnfinished,
    /// The completer's resume is an ordinary claim: a record released or
    /// reaped since it was listed runs again from scratch.
    ResumeIgnoresToken,
    /// Lease-holder writes ignore the fencing token: a holder whose lease was
    /// taken over still completes.
    NoFencing,
    /// A release wipes recorded progress: the holder's `release` is not
    /// conditional on "no progress recorded", and the operator's
    /// `force_release` drops the progress it must keep.
    ReleaseWipesProgress,
    /// A takeover or reuse of an existing record hands out the record's
    /// current token again instead of a higher one, so the holder it replaced
    /// is not fenced out.
    TokensDoNotRise,
    /// `abandon` ends the lease but keeps the token: a heartbeat of the old
    /// holder still on its way revives the lease it gave up.
    AbandonKeepsToken,
    /// The claim is check-then-insert: it reads the record, decides, yields
    /// (another claim runs in between), then writes what it decided. Two
    /// concurrent first claims both win.
    CheckThenInsert,
    /// A takeover judges the lease alone, not the state: a completed or parked
    /// record whose lease ran out is reopened and run again.
    TakeoverIgnoresState,
    /// A takeover ignores the lease: an in-flight record is taken from a holder
    /// whose lease is still alive.
    TakeoverIgnoresLease,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: &[Mutation] = &[
        Self::RestartAfterWindow,
        Self::ReaperDeletesUnfinished,
        Self::ResumeIgnoresToken,
        Self::NoFencing,
        Self::ReleaseWipesProgress,
        Self::TokensDoNotRise,
        Self::AbandonKeepsToken,
        Self::CheckThenInsert,
        Self::TakeoverIgnoresState,
        Self::TakeoverIgnoresLease,
    ];
}

/// A [`MemoryStore`] with one [`Mutation`].
#[derive(Debug)]
pub struct MutantStore {
    inner: MemoryStore,
    mutation: Mutation,
}

impl MutantStore {
    /// A fresh mutant on the given clock.
    pub fn new(mutation: Mutation, clock: Arc<ManualClock>) -> Self {
        Self::with_clock(mutation, clock)
    }

    /// A fresh mutant on any clock (the simulator's virtual one).
    pub fn with_clock(mutation: Mutation, clock: Arc<dyn idemkit_core::Clock>) -> Self {
        Self {
            inner: MemoryStore::with_clock(clock),
            mutation,
        }
    }

    /// The token a write is made with: the caller's, or with
    /// [`Mutation::NoFencing`] whatever the record's current one is.
    async fn token_for(&self, scope: &Scope, token: FencingToken) -> FencingToken {
        if self.mutation != Mutation::NoFencing {
            return token;
        }
        match self.inner.get(scope).await {
            Ok(Some(r)) => r.fencing_token,
            _ => token,
        }
    }
}

#[async_trait]
impl KeyStore for MutantStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        match self.mutation {
            Mutation::ResumeIgnoresToken if req.resume.is_some() => {
                let plain = ClaimRequest {
                    resume: None,
                    ..req.clone()
                };
                return self.inner.claim(&plain).await;
            }
            Mutation::RestartAfterWindow => {
                let now = self.inner.now();
                if let Some(r) = self.inner.get(&req.scope).await?
                    && (r.state == RecordState::InFlight && r.lease_expires_at <= now
                        || r.state == RecordState::Parked)
                    && r.created_at.plus(req.replay_window) <= now
                {
                    self.inner.remove(&req.scope);
                }
            }
            Mutation::TokensDoNotRise => {
                let before = self.inner.get(&req.scope).await?;
                return Ok(match (self.inner.claim(req).await?, before) {
                    (ClaimOutcome::Claimed(lease), Some(old)) => {
                        self.inner.set_token(&req.scope, old.fencing_token);
                        ClaimOutcome::Claimed(Lease {
                            token: old.fencing_token,
                            ..lease
                        })
                    }
                    (outcome, _) => outcome,
                });
            }
            Mutation::CheckThenInsert => {
                let decided = self.inner.peek_decision(req);
                // The window between the read and the write: other claims run here.
                tokio::time::sleep(Duration::from_millis(1)).await;
                return self.inner.claim_deciding(req, |_, _| decided);
            }
            Mutation::TakeoverIgnoresState => {
                return self.inner.claim_deciding(req, |head, now| match head {
                    Some(h)
                        if req.resume.is_none()
                            && h.state != RecordState::Released
                            && h.fingerprint == req.fingerprint
                            && h.lease_expires_at <= now =>
                    {
                        Decision::Takeover
                    }
                    _ => req.decide(head, now),
                });
            }
            Mutation::TakeoverIgnoresLease => {
                return self.inner.claim_deciding(req, |head, now| match head {
                    Some(h)
                        if req.resume.is_none()
                            && h.state == RecordState::InFlight
                            && h.fingerprint == req.fingerprint =>
                    {
                        Decision::Takeover
                    }
                    _ => req.decide(head, now),
                });
            }
            _ => {}
        }
        self.inner.claim(req).await
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        let token = self.token_for(scope, token).await;
        self.inner.heartbeat(scope, token, lease).await
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.complete(scope, token, response).await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        if self.mutation == Mutation::ReleaseWipesProgress
            && let Some(r) = self.inner.get(scope).await?
            && r.fencing_token == token
            && r.state == RecordState::InFlight
            && r.has_progress()
        {
            // What an unconditional release did: the key is absent in effect.
            self.inner.remove(scope);
            return Ok(());
        }
        self.inner.release(scope, token).await
    }

    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.release_discarding(scope, token).await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.abandon(scope, token, error).await?;
        if self.mutation == Mutation::AbandonKeepsToken {
            self.inner.set_token(scope, token);
        }
        Ok(())
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        self.inner.get(scope).await
    }

    fn now(&self) -> Millis {
        self.inner.now()
    }

    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.advance(scope, token, update).await
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.park(scope, token, reason).await
    }

    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        self.inner.abandoned(claimed_before, limit).await
    }

    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        let report = self.inner.reap(before).await?;
        if self.mutation == Mutation::ReaperDeletesUnfinished {
            let listed = self
                .inner
                .list(&ListFilter {
                    state: Some(RecordState::Parked),
                    account: None,
                    limit: usize::MAX,
                })
                .await?;
            for r in listed {
                if r.last_error.as_deref() == Some(MOVED_TO_REVIEW) {
                    self.inner.remove(&r.scope);
                }
            }
        }
        Ok(report)
    }

    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        self.inner.review(limit).await
    }

    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        self.inner.list(filter).await
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        if self.mutation == Mutation::ReleaseWipesProgress
            && let Some(r) = self.inner.get(scope).await?
            && matches!(r.state, RecordState::InFlight | RecordState::Parked)
            && r.has_progress()
        {
            self.inner.remove(scope);
            return Ok(true);
        }
        self.inner.force_release(scope).await
    }
}

/// A [`TransactionalStore`] whose lease-holder writes ignore the fencing
/// token ([`Mutation::NoFencing`] for SQL stores): every fenced write, inside a
/// transaction or not, is made with the record's current token instead of the
/// caller's. The transactional suites' negative control; other mutations need
/// a store's SQL and are modelled on [`MutantStore`] only.
#[derive(Debug)]
pub struct UnfencedTx<S> {
    inner: Arc<S>,
}

impl<S: TransactionalStore> UnfencedTx<S> {
    /// Wraps a fresh store.
    pub fn new(inner: Arc<S>) -> Self {
        Self { inner }
    }

    /// The store it wraps.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    async fn current(&self, scope: &Scope, token: FencingToken) -> FencingToken {
        match self.inner.get(scope).await {
            Ok(Some(r)) => r.fencing_token,
            _ => token,
        }
    }
}

#[async_trait]
impl<S: TransactionalStore> KeyStore for UnfencedTx<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.inner.claim(req).await
    }
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        let token = self.current(scope, token).await;
        self.inner.heartbeat(scope, token, lease).await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.complete(scope, token, response).await
    }
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.release(scope, token).await
    }
    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.release_discarding(scope, token).await
    }
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.abandon(scope, token, error).await
    }
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        self.inner.get(scope).await
    }
    fn now(&self) -> Millis {
        self.inner.now()
    }
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.advance(scope, token, update).await
    }
    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.park(scope, token, reason).await
    }
}

#[async_trait]
impl<S: TransactionalStore> TransactionalStore for UnfencedTx<S> {
    type Tx = S::Tx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        self.inner.claim_in_tx(req).await
    }
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx> {
        let token = self.current(scope, token).await;
        self.inner.begin_fenced(scope, token).await
    }
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        self.inner.commit(tx).await
    }
    async fn advance_in_tx(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.advance_in_tx(tx, scope, token, update).await
    }
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let token = self.current(scope, token).await;
        self.inner.complete_in_tx(tx, scope, token, response).await
    }
    async fn rollback_tx(&self, tx: Self::Tx) {
        self.inner.rollback_tx(tx).await
    }
}

/// A [`BusinessProbe`] of the wrapped store, for [`UnfencedTx`].
pub struct UnfencedProbe<P>(pub P);

#[async_trait]
impl<S: TransactionalStore, P: BusinessProbe<S>> BusinessProbe<UnfencedTx<S>> for UnfencedProbe<P> {
    async fn insert(&self, tx: &mut S::Tx, tag: &str) {
        self.0.insert(tx, tag).await
    }
    async fn count(&self, tag: &str) -> usize {
        self.0.count(tag).await
    }
}
