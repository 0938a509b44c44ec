//! Deliberately broken stores: the negative controls of the suites. Each
//! [`Mutation`] reintroduces one defect that real stores once had or could
//! have; a suite that passes against a mutant proves nothing, so the testkit's
//! own tests assert that the suites catch every one.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, KeyStore, ListFilter, MOVED_TO_REVIEW, Millis, PhaseUpdate,
    ReapReport, Record, RecordState, ReviewEntry, Scope, StoreResult, StoredResponse,
};

use crate::{ManualClock, MemoryStore};

/// One defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mutation {
    /// An unfinished record older than the replay window is restarted as a new
    /// request, its intents dropped (the window applied to in-flight records).
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
    /// A release wipes recorded progress (the store's release is not
    /// conditional on "no progress recorded").
    ReleaseWipesProgress,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: &[Mutation] = &[
        Self::RestartAfterWindow,
        Self::ReaperDeletesUnfinished,
        Self::ResumeIgnoresToken,
        Self::NoFencing,
        Self::ReleaseWipesProgress,
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

fn has_progress(r: &Record) -> bool {
    r.recovery_point.is_some() || !r.step_outputs.is_empty()
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
                    && r.state == RecordState::InFlight
                    && r.lease_expires_at <= now
                    && r.created_at.plus(req.replay_window) <= now
                {
                    self.inner.remove(&req.scope);
                }
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
            && has_progress(&r)
        {
            // What an unconditional release did: the key is absent in effect.
            self.inner.remove(scope);
            return Ok(());
        }
        self.inner.release(scope, token).await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let token = self.token_for(scope, token).await;
        self.inner.abandon(scope, token, error).await
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
        self.inner.force_release(scope).await
    }
}
