//! Defects planted around a real store (memory or SQLite), the simulator's
//! negative controls: each must make a run report the kind of violation
//! [`Mutation::expected`] names.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, FencingToken, KeyStore, ListFilter, Millis, PhaseUpdate, ReapReport,
    Record, RecordState, ReviewEntry, Scope, StoreResult, StoredResponse, TransactionalStore, TxClaim,
};

use crate::check::Kind;

/// One planted defect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mutation {
    /// The claim ignores the fingerprint: a different request under the same
    /// key gets the first one's answer.
    IgnoresFingerprint,
    /// Keys are not scoped per account: another account's request with the
    /// same key collides.
    IgnoresAccount,
    /// `abandoned()` lists nothing: the completer never finds an orphan.
    AbandonedListsNothing,
    /// The request's generation (`created_at`) is reset on every takeover, so
    /// downstream keys change between attempts of one request.
    GenerationResetOnTakeover,
    /// `complete` is not fenced: a holder whose lease was taken over still
    /// completes.
    CompleteNotFenced,
    /// No claim ever succeeds (answers "in progress" forever).
    ClaimNeverSucceeds,
    /// A takeover of an expired in-flight record is refused forever.
    TakeoverRefused,
    /// Leases are judged by the caller's clock, and one instance's clock runs
    /// a lease ahead (SQLite: the embedded store's clock is the caller's).
    /// Not a wrapper: the world skews that instance's store clock.
    LeaseByCallerClock,
}

impl Mutation {
    /// Every mutation.
    pub const ALL: &[Mutation] = &[
        Self::IgnoresFingerprint,
        Self::IgnoresAccount,
        Self::AbandonedListsNothing,
        Self::GenerationResetOnTakeover,
        Self::CompleteNotFenced,
        Self::ClaimNeverSucceeds,
        Self::TakeoverRefused,
        Self::LeaseByCallerClock,
    ];

    /// The kinds of violation that catch this mutation.
    pub fn expected(self) -> &'static [Kind] {
        match self {
            Self::IgnoresFingerprint => &[Kind::WrongAnswer],
            Self::IgnoresAccount => &[Kind::WrongAnswer],
            Self::AbandonedListsNothing => &[Kind::Stuck],
            Self::GenerationResetOnTakeover => &[Kind::DuplicateEffect],
            Self::CompleteNotFenced => &[Kind::StaleWrite, Kind::Reopened, Kind::WrongAnswer],
            Self::ClaimNeverSucceeds => &[Kind::Stuck],
            Self::TakeoverRefused => &[Kind::Stuck],
            Self::LeaseByCallerClock => &[Kind::StolenLease],
        }
    }

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::IgnoresFingerprint => "ignores-fingerprint",
            Self::IgnoresAccount => "ignores-account",
            Self::AbandonedListsNothing => "abandoned-lists-nothing",
            Self::GenerationResetOnTakeover => "generation-reset",
            Self::CompleteNotFenced => "complete-not-fenced",
            Self::ClaimNeverSucceeds => "claim-never-succeeds",
            Self::TakeoverRefused => "takeover-refused",
            Self::LeaseByCallerClock => "lease-by-caller-clock",
        }
    }

    /// The mutation named `s`.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.iter().copied().find(|m| m.name() == s)
    }
}

/// A store with one planted defect (or none).
#[derive(Debug)]
pub struct Mutant<S: ?Sized> {
    inner: Arc<S>,
    mutation: Option<Mutation>,
}

impl<S: ?Sized> Mutant<S> {
    /// `inner` with `mutation` (none: a transparent wrapper).
    pub fn new(inner: Arc<S>, mutation: Option<Mutation>) -> Self {
        Self { inner, mutation }
    }

    fn is(&self, m: Mutation) -> bool {
        self.mutation == Some(m)
    }

    fn scope(&self, s: &Scope) -> Scope {
        if self.is(Mutation::IgnoresAccount) {
            Scope {
                account: Account::new("shared"),
                key: s.key.clone(),
            }
        } else {
            s.clone()
        }
    }
}

fn busy() -> ClaimOutcome {
    ClaimOutcome::InProgress {
        retry_after: Duration::from_secs(1),
    }
}

impl<S: KeyStore + ?Sized> Mutant<S> {
    /// The claim as the mutation changes it, or an outcome that replaces it.
    async fn mutate_claim(&self, req: &ClaimRequest) -> StoreResult<Result<ClaimRequest, ClaimOutcome>> {
        let mut req = req.clone();
        req.scope = self.scope(&req.scope);
        match self.mutation {
            Some(Mutation::ClaimNeverSucceeds) => return Ok(Err(busy())),
            Some(Mutation::IgnoresFingerprint) => {
                if let Some(r) = self.inner.get(&req.scope).await? {
                    req.fingerprint = r.fingerprint;
                }
            }
            Some(Mutation::TakeoverRefused) => {
                if let Some(r) = self.inner.get(&req.scope).await?
                    && r.state == RecordState::InFlight
                {
                    return Ok(Err(busy()));
                }
            }
            _ => {}
        }
        Ok(Ok(req))
    }

    async fn complete_token(&self, scope: &Scope, token: FencingToken) -> StoreResult<FencingToken> {
        if self.is(Mutation::CompleteNotFenced)
            && let Some(r) = self.inner.get(scope).await?
        {
            return Ok(r.fencing_token);
        }
        Ok(token)
    }
}

#[async_trait]
impl<S: KeyStore + ?Sized> KeyStore for Mutant<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        match self.mutate_claim(req).await? {
            Ok(req) => self.inner.claim(&req).await,
            Err(o) => Ok(o),
        }
    }
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        self.inner.heartbeat(&self.scope(scope), token, lease).await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let scope = self.scope(scope);
        let token = self.complete_token(&scope, token).await?;
        self.inner.complete(&scope, token, response).await
    }
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.inner.release(&self.scope(scope), token).await
    }
    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.inner.release_discarding(&self.scope(scope), token).await
    }
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.inner.abandon(&self.scope(scope), token, error).await
    }
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        let mut r = self.inner.get(&self.scope(scope)).await?;
        if self.is(Mutation::GenerationResetOnTakeover)
            && let Some(r) = r.as_mut()
            && r.state == RecordState::InFlight
        {
            // The generation follows the current attempt, not the request.
            r.created_at = Millis(r.fencing_token.0);
        }
        Ok(r)
    }
    fn now(&self) -> Millis {
        self.inner.now()
    }
    fn notifies_changes(&self) -> bool {
        self.inner.notifies_changes()
    }
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.inner.advance(&self.scope(scope), token, update).await
    }
    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        self.inner.park(&self.scope(scope), token, reason).await
    }
    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        if self.is(Mutation::AbandonedListsNothing) {
            return Ok(Vec::new());
        }
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
        self.inner.force_release(&self.scope(scope)).await
    }
    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.inner.discard_progress(&self.scope(scope)).await
    }
    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        self.inner.wait_for_change(&self.scope(scope), timeout).await
    }
}

#[async_trait]
impl<S: TransactionalStore> TransactionalStore for Mutant<S> {
    type Tx = S::Tx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        match self.mutate_claim(req).await? {
            Ok(req) => self.inner.claim_in_tx(&req).await,
            Err(o) => Ok(TxClaim::Other(o)),
        }
    }
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx> {
        self.inner.begin_fenced(&self.scope(scope), token).await
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
        self.inner
            .advance_in_tx(tx, &self.scope(scope), token, update)
            .await
    }
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let scope = self.scope(scope);
        let token = self.complete_token(&scope, token).await?;
        self.inner.complete_in_tx(tx, &scope, token, response).await
    }
    async fn rollback_tx(&self, tx: Self::Tx) {
        self.inner.rollback_tx(tx).await
    }
}
