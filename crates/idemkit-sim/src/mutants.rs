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
    /// The replay window is mis-measured (seconds read as milliseconds): a
    /// completed record counts as expired almost at once, and a retry runs
    /// the request again.
    ReplayWindowMismeasured,
    /// Single-step: the claim commits on its own, before the business write
    /// (a lease claim, then a transaction for the handler). A rolled-back or
    /// crashed attempt leaves the key held in flight until its lease ends
    /// (the behaviour contract: single-step, the transaction rolls back and the key is free).
    /// Planted above the instrumented handle ([`TxMutant`]).
    ClaimCommittedEarly,
    /// Single-step: the business write commits in one transaction and the
    /// completion is written in another ([`TxMutant`]): a failure in between
    /// leaves the row without the answer, and the retry writes it again.
    CompletionOutsideTx,
    /// Single-step: a rollback that leaves the key's lock (the transaction is
    /// kept open, not rolled back) ([`TxMutant`]): the key answers "in
    /// progress" while nobody works on it.
    RollbackKeepsLock,
    /// The operator says `keys release --downstream-did-nothing` although a
    /// downstream acted (or had a call under way): the discarded progress
    /// lets the next attempt call it again. Not a store defect: planted in
    /// the operator actor, judged against the downstreams' own counts.
    OperatorLies,
    /// One of the testkit's [`idemkit_testkit::mutants::MutantStore`]
    /// defects, as the memory store of the simulation.
    Testkit(TestkitMutation),
}

/// The testkit's mutations ([`idemkit_testkit::mutants::Mutation`]).
pub type TestkitMutation = idemkit_testkit::mutants::Mutation;

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
        Self::ReplayWindowMismeasured,
        Self::ClaimCommittedEarly,
        Self::CompletionOutsideTx,
        Self::RollbackKeepsLock,
        Self::OperatorLies,
        Self::Testkit(TestkitMutation::RestartAfterWindow),
        Self::Testkit(TestkitMutation::ReaperDeletesUnfinished),
        Self::Testkit(TestkitMutation::ResumeIgnoresToken),
        Self::Testkit(TestkitMutation::NoFencing),
        Self::Testkit(TestkitMutation::ReleaseWipesProgress),
        Self::Testkit(TestkitMutation::TokensDoNotRise),
        Self::Testkit(TestkitMutation::AbandonKeepsToken),
        Self::Testkit(TestkitMutation::CheckThenInsert),
        Self::Testkit(TestkitMutation::TakeoverIgnoresState),
        Self::Testkit(TestkitMutation::TakeoverIgnoresLease),
    ];

    /// Whether this defect is planted on the single-step path, above the
    /// instrumented handle ([`TxMutant`]).
    pub fn single_step(self) -> bool {
        matches!(
            self,
            Self::ClaimCommittedEarly | Self::CompletionOutsideTx | Self::RollbackKeepsLock
        )
    }

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
            Self::ReplayWindowMismeasured => &[Kind::DuplicateEffect, Kind::Reopened, Kind::WrongAnswer],
            Self::ClaimCommittedEarly => &[Kind::Stuck],
            // A second business row once the retry runs again; or, when no
            // retry came, the claim left in flight with no transaction open.
            Self::CompletionOutsideTx => &[Kind::DuplicateEffect, Kind::Stuck],
            Self::RollbackKeepsLock => &[Kind::Stuck],
            Self::OperatorLies => &[Kind::DuplicateEffect],
            Self::Testkit(m) => match m {
                TestkitMutation::NoFencing
                | TestkitMutation::TokensDoNotRise
                | TestkitMutation::AbandonKeepsToken => &[
                    Kind::StaleWrite,
                    Kind::Reopened,
                    Kind::WrongAnswer,
                    Kind::DuplicateEffect,
                    Kind::StolenLease,
                ],
                TestkitMutation::TakeoverIgnoresLease => &[Kind::StolenLease],
                TestkitMutation::CheckThenInsert => {
                    &[Kind::StolenLease, Kind::DuplicateEffect, Kind::WrongAnswer]
                }
                TestkitMutation::TakeoverIgnoresState => {
                    &[Kind::Reopened, Kind::DuplicateEffect, Kind::WrongAnswer]
                }
                TestkitMutation::ResumeIgnoresToken
                | TestkitMutation::ReleaseWipesProgress
                | TestkitMutation::RestartAfterWindow
                | TestkitMutation::ReaperDeletesUnfinished => {
                    &[Kind::DuplicateEffect, Kind::Lost, Kind::WrongAnswer]
                }
                _ => &[],
            },
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
            Self::ReplayWindowMismeasured => "replay-window-mismeasured",
            Self::ClaimCommittedEarly => "claim-committed-early",
            Self::CompletionOutsideTx => "completion-outside-tx",
            Self::RollbackKeepsLock => "rollback-keeps-lock",
            Self::OperatorLies => "operator-lies",
            Self::Testkit(m) => match m {
                TestkitMutation::RestartAfterWindow => "testkit-restart-after-window",
                TestkitMutation::ReaperDeletesUnfinished => "testkit-reaper-deletes-unfinished",
                TestkitMutation::ResumeIgnoresToken => "testkit-resume-ignores-token",
                TestkitMutation::NoFencing => "testkit-no-fencing",
                TestkitMutation::ReleaseWipesProgress => "testkit-release-wipes-progress",
                TestkitMutation::TokensDoNotRise => "testkit-tokens-do-not-rise",
                TestkitMutation::AbandonKeepsToken => "testkit-abandon-keeps-token",
                TestkitMutation::CheckThenInsert => "testkit-check-then-insert",
                TestkitMutation::TakeoverIgnoresState => "testkit-takeover-ignores-state",
                TestkitMutation::TakeoverIgnoresLease => "testkit-takeover-ignores-lease",
                _ => "testkit-other",
            },
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
            Some(Mutation::ReplayWindowMismeasured) => {
                // Seconds read as milliseconds.
                req.replay_window /= 1000;
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

/// Open transactions a [`Mutation::RollbackKeepsLock`] kept instead of
/// rolling them back; the world drops them before it cleans up.
pub type Leaks = Arc<std::sync::Mutex<Vec<Box<dyn std::any::Any + Send>>>>;

/// How many transactions [`Mutation::RollbackKeepsLock`] keeps open (each
/// holds a pooled connection; a few suffice to hold keys).
const MAX_LEAKS: usize = 2;

/// The single-step defects, planted above an instrumented handle so that
/// each store call they make (a separate commit, a separate completion) is a
/// scheduled call of its own, where faults land between them.
#[derive(Debug)]
pub struct TxMutant<S: ?Sized> {
    inner: Arc<S>,
    mutation: Option<Mutation>,
    leaks: Leaks,
}

impl<S: ?Sized> TxMutant<S> {
    /// `inner` with `mutation` (only [`Mutation::single_step`] ones act here).
    pub fn new(inner: Arc<S>, mutation: Option<Mutation>, leaks: Leaks) -> Self {
        Self {
            inner,
            mutation: mutation.filter(|m| m.single_step()),
            leaks,
        }
    }
}

#[async_trait]
impl<S: KeyStore + ?Sized> KeyStore for TxMutant<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.inner.claim(req).await
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
        self.inner.complete(scope, token, response).await
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
impl<S: TransactionalStore + ?Sized> TransactionalStore for TxMutant<S> {
    type Tx = S::Tx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        match self.mutation {
            Some(Mutation::ClaimCommittedEarly | Mutation::CompletionOutsideTx) => {
                // The claim commits on its own; the handler gets a fenced
                // transaction opened after it.
                match self.inner.claim(req).await? {
                    ClaimOutcome::Claimed(lease) => {
                        let tx = self.inner.begin_fenced(&req.scope, lease.token).await?;
                        Ok(TxClaim::Claimed { lease, tx })
                    }
                    other => Ok(TxClaim::Other(other)),
                }
            }
            _ => self.inner.claim_in_tx(req).await,
        }
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
        if self.mutation == Some(Mutation::CompletionOutsideTx) {
            // The business write commits, then the completion is a write of its own.
            self.inner.commit(tx).await?;
            return self.inner.complete(scope, token, response).await;
        }
        self.inner.complete_in_tx(tx, scope, token, response).await
    }
    async fn rollback_tx(&self, tx: Self::Tx) {
        if self.mutation == Some(Mutation::RollbackKeepsLock) {
            let mut leaks = self.leaks.lock().unwrap_or_else(|p| p.into_inner());
            if leaks.len() < MAX_LEAKS {
                leaks.push(Box::new(tx));
                return;
            }
        }
        self.inner.rollback_tx(tx).await
    }
}
