//! [`Probed`]: any store, seen from the test: its claims and transaction
//! rollbacks counted, its reads failing on demand, a claim held back until
//! the test lets it land, a completion's reply lost after it applied, every
//! operation otherwise forwarded unchanged.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, KeyStore, ListFilter, Millis, PhaseUpdate, ReapReport, Record,
    ReviewEntry, Scope, StoreError, StoreResult, StoredResponse, TransactionalStore, TxClaim,
};

/// Wraps `S`, forwarding every [`KeyStore`] operation (optional ones too, so
/// the inner store's own answers stand) and, for a transactional `S`, every
/// [`TransactionalStore`] one, and lets a test count the claims that reach
/// the store ([`Probed::claims`]) and the transactions rolled back explicitly
/// ([`Probed::rollbacks`]), make `get` fail as an unreachable store does
/// ([`Probed::fail_reads`]), hold the next claim back
/// ([`Probed::delay_next_claim`]) and lose the next completion's reply
/// ([`Probed::lose_next_completion_reply`]).
#[derive(Debug, Default)]
pub struct Probed<S> {
    inner: Arc<S>,
    claims: AtomicUsize,
    rollbacks: AtomicUsize,
    failing_reads: AtomicBool,
    held_claim: Mutex<Option<Arc<Notify>>>,
    losing_completion_reply: AtomicBool,
}

impl<S> Probed<S> {
    /// Wraps `inner`; nothing counted yet, reads succeed.
    pub fn new(inner: S) -> Self {
        Self {
            inner: Arc::new(inner),
            claims: AtomicUsize::new(0),
            rollbacks: AtomicUsize::new(0),
            failing_reads: AtomicBool::new(false),
            held_claim: Mutex::new(None),
            losing_completion_reply: AtomicBool::new(false),
        }
    }

    /// Holds the next lease-mode claim back until the returned gate is
    /// notified (`notify_one`). The held claim runs on a task of its own, so
    /// a caller that drops its future meanwhile does not stop it: it lands
    /// when the gate opens, as a claim already sent to a store does.
    pub fn delay_next_claim(&self) -> Arc<Notify> {
        let gate = Arc::new(Notify::new());
        *self
            .held_claim
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(gate.clone());
        gate
    }

    /// The next `complete` applies, then answers `Unavailable`: its reply was
    /// lost on the way back.
    pub fn lose_next_completion_reply(&self) {
        self.losing_completion_reply.store(true, Ordering::SeqCst);
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// How many claims reached the store.
    pub fn claims(&self) -> usize {
        self.claims.load(Ordering::SeqCst)
    }

    /// How many transactions were rolled back through
    /// [`TransactionalStore::rollback_tx`] (not merely dropped).
    pub fn rollbacks(&self) -> usize {
        self.rollbacks.load(Ordering::SeqCst)
    }

    /// From now on `get` answers `Unavailable` (`true`) or reads again (`false`).
    pub fn fail_reads(&self, failing: bool) {
        self.failing_reads.store(failing, Ordering::SeqCst);
    }
}

#[async_trait]
impl<S: KeyStore> KeyStore for Probed<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        let held = self
            .held_claim
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(gate) = held else {
            return self.inner.claim(req).await;
        };
        let (inner, req) = (self.inner.clone(), req.clone());
        tokio::spawn(async move {
            gate.notified().await;
            inner.claim(&req).await
        })
        .await
        .map_err(|e| StoreError::Unavailable(format!("the held claim's task failed: {e}").into()))?
    }
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        self.inner.heartbeat(scope, token, lease).await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        self.inner.complete(scope, token, response).await?;
        if self.losing_completion_reply.swap(false, Ordering::SeqCst) {
            return Err(StoreError::Unavailable("the completion's reply was lost".into()));
        }
        Ok(())
    }
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.inner.release(scope, token).await
    }
    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.inner.release_discarding(scope, token).await
    }
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.inner.abandon(scope, token, error).await
    }
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        if self.failing_reads.load(Ordering::SeqCst) {
            return Err(StoreError::Unavailable("pool timed out".into()));
        }
        self.inner.get(scope).await
    }
    fn now(&self) -> Millis {
        self.inner.now()
    }
    fn notifies_changes(&self) -> bool {
        self.inner.notifies_changes()
    }
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.inner.advance(scope, token, update).await
    }
    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        self.inner.park(scope, token, reason).await
    }
    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        self.inner.abandoned(claimed_before, limit).await
    }
    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        self.inner.reap(before).await
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
    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.inner.discard_progress(scope).await
    }
    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        self.inner.wait_for_change(scope, timeout).await
    }
}

#[async_trait]
impl<S: TransactionalStore> TransactionalStore for Probed<S> {
    type Tx = S::Tx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        self.inner.claim_in_tx(req).await
    }
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx> {
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
        self.inner.advance_in_tx(tx, scope, token, update).await
    }
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        self.inner.complete_in_tx(tx, scope, token, response).await
    }
    async fn rollback_tx(&self, tx: Self::Tx) {
        self.rollbacks.fetch_add(1, Ordering::SeqCst);
        self.inner.rollback_tx(tx).await
    }
}
