//! The `KeyStore` trait every backend implements, and the transactional extension
//! only SQL stores offer.

use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Account, FencingToken, Fingerprint, Millis, PhaseUpdate, ReapReport, Record, RecordState, ReviewEntry,
    Scope, StoredRequest, StoredResponse,
};

/// Everything a claim needs.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// (account, key).
    pub scope: Scope,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The request, stored for the completer.
    pub request: StoredRequest,
    /// Lease length for a successful claim.
    pub lease: Duration,
    /// The route's replay window.
    pub replay_window: Duration,
    /// How long a single-step claim may wait inside the store for a concurrent
    /// holder's uncommitted claim (PostgreSQL blocks on it) before answering
    /// in progress. Zero: do not wait (the store uses its shortest lock wait).
    pub lock_wait: Duration,
    /// Set by the completer: the fencing token of the abandoned record it saw.
    /// The claim then succeeds only as a takeover of exactly that record state
    /// (see [`crate::decide_resume`]); anything else is answered without running.
    pub resume: Option<FencingToken>,
    /// The recovery point a claim starts at, written by the claim's own write
    /// (so an attempt that must record "about to act" before acting, as
    /// `idemkit proxy` records its forward, needs no write of its own). A new
    /// request's record (the key absent, released or past its window) starts
    /// at it, and the lease resumes from nothing. A takeover keeps the
    /// record's recovery point, or takes this one when the record has none,
    /// and resumes from that: an attempt that died before recording anything
    /// had already reached the point its claim started at. `None`: a record
    /// starts without one. Meant for lease mode: a single-step record is
    /// completed in the transaction that claims it.
    pub recovery_point: Option<String>,
}

impl ClaimRequest {
    /// The decision this claim makes on `existing` at `now`: [`crate::decide`],
    /// or [`crate::decide_resume`] for a resume.
    pub fn decide(&self, existing: Option<&crate::RecordHead>, now: Millis) -> crate::Decision {
        match self.resume {
            Some(seen) => crate::decide_resume(existing, seen, &self.fingerprint, now, self.replay_window),
            None => crate::decide(existing, &self.fingerprint, now, self.replay_window),
        }
    }
}

/// A successful claim: the caller now holds the key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// The token every later write must carry.
    pub token: FencingToken,
    /// When the lease ends unless extended.
    pub expires_at: Millis,
    /// Set when the claim took over an abandoned attempt: where it had got to.
    pub resumed_from: Option<String>,
}

/// The result of a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The caller holds the key and must execute the request.
    Claimed(Lease),
    /// The request already completed: replay this response, do not execute.
    Replay(StoredResponse),
    /// The key was used with a different request.
    Mismatch,
    /// Another attempt holds a live lease.
    InProgress {
        /// Time left on that lease.
        retry_after: Duration,
    },
    /// The request was parked for human review; it will not run again.
    Parked,
    /// A resume ([`ClaimRequest::resume`]) found the record no longer in the
    /// abandoned state it saw (released, reaped, reused or taken over since):
    /// nothing ran.
    Stale,
}

/// Backend failures, normalised to kinds so the layer answers the same way
/// whatever the backend (a stale token in SQLite, PostgreSQL or Redis is `Fenced`).
///
/// The kinds that wrap the backend's error ([`StoreError::Unavailable`],
/// [`StoreError::Backend`], [`StoreError::Config`]) print only the kind and
/// return the backend's error from [`std::error::Error::source`], so an
/// error-chain printer (anyhow's `{:#}`, a `tracing` field given the error
/// as `&dyn Error`) shows each cause once; `{}` alone shows the kind, which
/// is what a client may be told.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The caller's fencing token is no longer current: its lease was taken over
    /// (or the record was released or reused). The write was refused.
    #[error("fencing token is stale: the lease was taken over")]
    Fenced,
    /// A single-step claim lost a race at commit (another request with the same
    /// key committed first). Nothing was committed; claim again to learn the
    /// winner's outcome.
    #[error("the claim lost a race at commit; nothing was committed")]
    Conflict,
    /// The store cannot be reached, timed out, or is overloaded; retrying later may work.
    #[error("key store unavailable")]
    Unavailable(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Stored data could not be decoded.
    #[error("key store data is corrupt: {0}")]
    Corrupt(String),
    /// The store does not offer this operation (e.g. phases on a store without them).
    #[error("this key store does not support {0}")]
    Unsupported(&'static str),
    /// Any other backend failure (the database refused or failed an
    /// operation; not retried).
    #[error("key store failure")]
    Backend(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// The store's configuration cannot work (a malformed URL, a bad schema
    /// name or key prefix, a zero pool size): found before or while
    /// connecting, not a failure of the database. Not retryable: the same
    /// configuration fails the same way. The source is the store crate's own
    /// error (e.g. `idemkit_postgres::PgConfigError`), for matching.
    #[error("key store configuration is invalid")]
    Config(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl StoreError {
    /// Whether retrying the same request later may succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_) | Self::Fenced | Self::Conflict)
    }
}

impl crate::Decision {
    /// The outcome a decision settles without writing (replay, mismatch, in
    /// progress), or `None` when the claim must be written (insert, reuse,
    /// takeover). `existing` is the record the decision was made on.
    pub fn settle(self, existing: Option<Record>) -> StoreResult<Option<ClaimOutcome>> {
        use crate::Decision;
        Ok(match self {
            Decision::Replay => Some(ClaimOutcome::Replay(
                existing
                    .and_then(|r| r.response)
                    .ok_or_else(|| StoreError::Corrupt("completed record without a response".into()))?,
            )),
            Decision::Mismatch => Some(ClaimOutcome::Mismatch),
            Decision::InProgress { retry_after } => Some(ClaimOutcome::InProgress { retry_after }),
            Decision::Parked => Some(ClaimOutcome::Parked),
            Decision::Stale => Some(ClaimOutcome::Stale),
            Decision::Insert | Decision::Reuse | Decision::Takeover => None,
        })
    }
}

/// How a claim proceeds on a record that already exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolution {
    /// Answer this without writing (replay, mismatch, in progress).
    Settled(ClaimOutcome),
    /// Move the record to the claimant with the next token.
    Move {
        /// `true`: a takeover, which keeps the recovery point and step outputs;
        /// `false`: window reuse or a released key, which starts clean.
        takeover: bool,
    },
}

impl Resolution {
    /// Decides `req` on `existing` (see [`ClaimRequest::decide`]).
    pub fn of(existing: &Record, req: &ClaimRequest, now: Millis) -> StoreResult<Self> {
        use crate::Decision;
        match req.decide(Some(&crate::RecordHead::from(existing)), now) {
            Decision::Takeover => Ok(Self::Move { takeover: true }),
            Decision::Reuse => Ok(Self::Move { takeover: false }),
            Decision::Insert => Err(StoreError::Corrupt(
                "decision `insert` for an existing record".into(),
            )),
            settled => settled
                .settle(Some(existing.clone()))?
                .map(Self::Settled)
                .ok_or_else(|| StoreError::Corrupt("unsettled decision".into())),
        }
    }
}

/// Which records [`KeyStore::list`] returns: those matching every filter that
/// is set, newest claim first (ties by account, then key), at most `limit`.
///
/// Operator tooling (`idemkit keys list`) reads through it; request handling
/// never does, so stores need no index beyond the ones they already keep.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListFilter {
    /// Only records in this state (any state when `None`).
    pub state: Option<RecordState>,
    /// Only records of this account (every account when `None`).
    pub account: Option<Account>,
    /// At most this many records.
    pub limit: usize,
}

impl Default for ListFilter {
    /// Every record, at most 100.
    fn default() -> Self {
        Self {
            state: None,
            account: None,
            limit: 100,
        }
    }
}

impl ListFilter {
    /// Whether `record` passes the state and account filters (not the limit).
    pub fn matches(&self, record: &Record) -> bool {
        self.state.is_none_or(|s| record.state == s)
            && self.account.as_ref().is_none_or(|a| record.scope.account == *a)
    }
}

/// The last error [`KeyStore::force_release`] records on the released record.
pub const FORCE_RELEASED: &str = "released by an operator";

/// The last error [`KeyStore::release`] records when it kept a record with
/// recorded progress instead of releasing it.
pub const RELEASE_REFUSED: &str = "not released: a phase or an external-call intent was recorded; \
     kept resumable at its recovery point";

/// The last error of a record the reaper moved to the review list.
pub const MOVED_TO_REVIEW: &str = "never completed: moved to the review list by the reaper";

/// Result alias for store operations.
pub type StoreResult<T, E = StoreError> = Result<T, E>;

/// A key store: arbitrates claims atomically and keeps records.
///
/// Object safe, so `Arc<dyn KeyStore>` works. Every method that takes a
/// [`FencingToken`] is a lease-holder write and must be refused with
/// [`StoreError::Fenced`] when the token is not the record's current one.
/// Implementations get their notion of "now" from an injectable [`crate::Clock`].
///
/// A service never calls it: the layers, the completer and the reaper do. An
/// operator tool or a test may read through it:
///
/// ```
/// use idemkit_core::{Account, IdempotencyKey, KeyStore, RecordState, Scope, StoreResult};
///
/// /// Where a request stands, as `idemkit keys list` shows it.
/// async fn state_of(store: &dyn KeyStore, account: &str, key: &str) -> StoreResult<Option<RecordState>> {
///     let scope = Scope::new(Account::new(account), IdempotencyKey::parse(key).expect("a valid key"));
///     Ok(store.get(&scope).await?.map(|record| record.state))
/// }
/// # let _ = state_of;
/// ```
///
/// A store of your own implements every method (the lease-mode engine calls
/// all of them; single-step routes also need [`TransactionalStore`]) and runs
/// `idemkit-testkit`'s conformance suites, which any store can run against
/// itself.
#[async_trait]
pub trait KeyStore: Send + Sync + std::fmt::Debug + 'static {
    /// Atomically claims `(account, key)`; see [`crate::decide`] for the decision
    /// every implementation must make. Check-then-insert is forbidden.
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome>;

    /// Extends the lease to now + `lease`; returns the new expiry.
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis>;

    /// Stores the response and marks the record completed.
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()>;

    /// Releases the key: the record becomes absent in effect and the next request
    /// with the key runs as a first attempt (validation errors, retryable failures
    /// before any phase committed).
    ///
    /// Conditional in the store, atomically with the fence: a record that has
    /// recorded progress (a recovery point or a step output, such as an
    /// external-call intent) is never released; it is abandoned instead (lease
    /// ended, progress kept, last error [`RELEASE_REFUSED`]), so a caller that
    /// could not tell whether progress was made can never wipe it.
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()>;

    /// The holder's release of a record whose recorded progress it knows to be
    /// void: `idemkit proxy` recorded the intent to forward, and the upstream
    /// answered a status the route policy releases (a validation-class 4xx: it
    /// refused the request without acting; a 5xx under the `retry` policy, which
    /// declares such answers safe to run again), or the request was never sent. Fenced like
    /// [`KeyStore::release`], in the same atomic write: the recovery point and
    /// step outputs are discarded and the record becomes `released` on a new
    /// token, so the next request with the key runs as a first attempt. A holder
    /// that lost its lease (taken over, parked, released by an operator) gets
    /// [`StoreError::Fenced`] and changes nothing, so it can never wipe the
    /// progress of the attempt that replaced it.
    async fn release_discarding(&self, _scope: &Scope, _token: FencingToken) -> StoreResult<()> {
        Err(StoreError::Unsupported("releasing with progress discarded"))
    }

    /// Ends the lease at once while keeping the record resumable (a retryable
    /// outcome after progress was made), recording why. The record gets a new
    /// fencing token, so a write of the old holder still on its way (a
    /// heartbeat) cannot revive the lease.
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()>;

    /// Reads a record.
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>>;

    /// The store's clock.
    fn now(&self) -> Millis;

    /// Whether [`KeyStore::wait_for_change`] really waits for a notification
    /// (PostgreSQL `LISTEN/NOTIFY`, Redis pub/sub). When `false`, waiters poll.
    fn notifies_changes(&self) -> bool {
        false
    }

    /// Commits a phase's progress (recovery point, step output) for a lease
    /// holder. SQL stores do this inside the phase's own transaction with
    /// [`TransactionalStore::advance_in_tx`]; this is for stores whose business
    /// writes live elsewhere.
    async fn advance(&self, _scope: &Scope, _token: FencingToken, _update: &PhaseUpdate) -> StoreResult<()> {
        Err(StoreError::Unsupported("phases"))
    }

    /// Parks the request for human review (fenced): its lease ends, it never runs
    /// again, and retries are answered `idempotency_request_parked`. Like
    /// [`KeyStore::abandon`], it moves the record to a new fencing token.
    async fn park(&self, _scope: &Scope, _token: FencingToken, _reason: &str) -> StoreResult<()> {
        Err(StoreError::Unsupported("parking"))
    }

    /// In-flight records whose lease has expired and that were claimed at or
    /// before `claimed_before`, oldest first: the completer's work list.
    async fn abandoned(&self, _claimed_before: Millis, _limit: usize) -> StoreResult<Vec<Record>> {
        Err(StoreError::Unsupported("listing abandoned records"))
    }

    /// Deletes completed and released records older than `before`, and lists
    /// records that never completed (in flight with an expired lease, or parked)
    /// and were claimed before `before` in the review list.
    ///
    /// What fences is kept: a record listed for review stays in the key table,
    /// parked (last error [`MOVED_TO_REVIEW`]), so its key is never claimed
    /// again as a new request (an unfinished request may have reached a
    /// downstream that ignores keys); and fencing tokens never repeat for a key
    /// whose record was deleted (stores hand out tokens above every deleted
    /// one). Callers must never pass a `before` later than now minus the replay
    /// window: [`crate::Policy`] validation and the layer's reaper enforce that.
    async fn reap(&self, _before: Millis) -> StoreResult<ReapReport> {
        Err(StoreError::Unsupported("reaping"))
    }

    /// The review list, oldest first.
    async fn review(&self, _limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        Err(StoreError::Unsupported("the review list"))
    }

    /// Records matching `filter`, newest claim first (see [`ListFilter`]). For
    /// operators; request handling never lists.
    async fn list(&self, _filter: &ListFilter) -> StoreResult<Vec<Record>> {
        Err(StoreError::Unsupported("listing records"))
    }

    /// An operator's release of a record nobody holds (a parked record, or an
    /// in-flight one whose lease has expired: its holder is gone), on a new
    /// fencing token, with last error [`FORCE_RELEASED`] so the record says who
    /// released it. Not fenced by a token; atomic with the state check instead.
    ///
    /// - Without recorded progress the record becomes `released` as
    ///   [`KeyStore::release`] leaves it: the row stays so later tokens are
    ///   higher, and the next request with the key runs as a first attempt.
    /// - With recorded progress (a recovery point, a step output, an external
    ///   call's intent) it becomes resumable instead (in flight, lease ended):
    ///   the progress survives the release, so a rerun skips committed phases and
    ///   parks again at an unfinished call to a downstream that ignores keys,
    ///   rather than calling it a second time.
    ///
    /// Returns `false`, changing nothing, for a record held by a live lease, a
    /// completed or already released one, or no record at all. A holder paused
    /// past its lease finds its token fenced afterwards.
    async fn force_release(&self, _scope: &Scope) -> StoreResult<bool> {
        Err(StoreError::Unsupported("operator release"))
    }

    /// An operator's release that also discards recorded progress, for when the
    /// operator has established that an unfinished external call did nothing
    /// (`idemkit keys release --downstream-did-nothing`): a record nobody holds
    /// (parked, or in flight with an expired lease) loses its recovery point and
    /// step outputs and becomes `released` on a new fencing token, last error
    /// [`FORCE_RELEASED`], so the next request with the key runs as a first
    /// attempt. Returns `false`, changing nothing, for any other record.
    async fn discard_progress(&self, _scope: &Scope) -> StoreResult<bool> {
        Err(StoreError::Unsupported("discarding recorded progress"))
    }

    /// Waits until the record of `scope` may have changed (completed or released)
    /// or `timeout` passes, whichever is first. Spurious wake-ups are allowed:
    /// the caller claims again either way. Stores without notifications return at
    /// once (see [`KeyStore::notifies_changes`]).
    async fn wait_for_change(&self, _scope: &Scope, _timeout: Duration) -> StoreResult<()> {
        Ok(())
    }
}

/// A claim made inside a business transaction.
pub enum TxClaim<T> {
    /// Claimed: the open transaction holds the uncommitted claim. Business writes go
    /// into it, and [`TransactionalStore::complete_in_tx`] commits all together.
    /// Dropping the transaction rolls the claim back.
    Claimed {
        /// The open transaction.
        tx: T,
        /// The (uncommitted) lease.
        lease: Lease,
    },
    /// Not claimed; the transaction was rolled back.
    Other(ClaimOutcome),
}

impl<T> std::fmt::Debug for TxClaim<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Claimed { lease, .. } => f
                .debug_struct("Claimed")
                .field("lease", lease)
                .finish_non_exhaustive(),
            Self::Other(o) => f.debug_tuple("Other").field(o).finish(),
        }
    }
}

/// The extension only SQL stores offer: sharing the business transaction.
///
/// Single-step mode claims, runs the handler's writes and stores the response in
/// one transaction, so a loser's claim is what fails and a crash leaves nothing
/// half-done. `Tx` is the backend's transaction type (e.g. an sqlx transaction);
/// this crate names no database.
#[async_trait]
pub trait TransactionalStore: KeyStore {
    /// The backend's transaction type.
    type Tx: Send + 'static;

    /// Opens a transaction and claims in it.
    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>>;

    /// Opens a transaction for a lease holder, after checking its token.
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx>;

    /// Commits a phase transaction opened with [`TransactionalStore::begin_fenced`]
    /// (a phase that does not complete the request).
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        drop(tx);
        Err(StoreError::Unsupported("committing a phase transaction"))
    }

    /// Records a phase's progress inside its transaction (fenced): the business
    /// writes and the recovery point commit together, or neither does.
    async fn advance_in_tx(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()>;

    /// Stores the response with a fenced write and commits the transaction. On
    /// [`StoreError::Fenced`] (stale token) or [`StoreError::Conflict`] (a
    /// single-step claim lost the race at commit) the whole transaction, business
    /// writes included, is rolled back.
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()>;

    /// Rolls back a transaction that will not be committed (a single-step claim
    /// released, an answer that cannot be stored), so that what it holds (the
    /// key's lock, the database's write lock) is free when this returns, before
    /// the caller answers: a retry sent on that answer finds the key free.
    /// Dropping the transaction rolls it back too, but later (the default does
    /// only that). A rollback that fails ends the connection, which rolls back.
    async fn rollback_tx(&self, tx: Self::Tx) {
        drop(tx);
    }
}

#[allow(dead_code)]
fn _assert_object_safe(_: &dyn KeyStore) {}

/// A store as the layers and jobs take it: any [`KeyStore`] by value (every
/// idemkit store is a cheap clone over one shared pool or client), an
/// `Arc<S>`, or an `Arc<dyn KeyStore>` chosen at run time.
pub trait IntoKeyStore {
    /// The shared, type-erased handle.
    fn into_key_store(self) -> std::sync::Arc<dyn KeyStore>;
}

impl<S: KeyStore> IntoKeyStore for S {
    fn into_key_store(self) -> std::sync::Arc<dyn KeyStore> {
        std::sync::Arc::new(self)
    }
}

impl<S: KeyStore> IntoKeyStore for std::sync::Arc<S> {
    fn into_key_store(self) -> std::sync::Arc<dyn KeyStore> {
        self
    }
}

impl IntoKeyStore for std::sync::Arc<dyn KeyStore> {
    fn into_key_store(self) -> std::sync::Arc<dyn KeyStore> {
        self
    }
}

/// A [`TransactionalStore`] as the single-step layer takes it: by value or as
/// an `Arc<S>`.
pub trait IntoTransactionalStore {
    /// The store.
    type Store: TransactionalStore;
    /// The shared handle.
    fn into_transactional_store(self) -> std::sync::Arc<Self::Store>;
}

impl<S: TransactionalStore> IntoTransactionalStore for S {
    type Store = S;
    fn into_transactional_store(self) -> std::sync::Arc<S> {
        std::sync::Arc::new(self)
    }
}

impl<S: TransactionalStore> IntoTransactionalStore for std::sync::Arc<S> {
    type Store = S;
    fn into_transactional_store(self) -> std::sync::Arc<S> {
        self
    }
}

#[cfg(test)]
mod store_error_tests {
    use super::StoreError;
    use std::error::Error as _;

    /// Every cause, outermost first, joined as anyhow's `{:#}` prints a chain.
    fn chain(e: &StoreError) -> String {
        let mut out = e.to_string();
        let mut next = e.source();
        while let Some(cause) = next {
            out.push_str(": ");
            out.push_str(&cause.to_string());
            next = cause.source();
        }
        out
    }

    #[test]
    fn wrapped_errors_print_their_source_once_in_a_chain() {
        for (e, kind) in [
            (
                StoreError::Unavailable("connection refused".into()),
                "key store unavailable",
            ),
            (
                StoreError::Backend("connection refused".into()),
                "key store failure",
            ),
            (
                StoreError::Config("connection refused".into()),
                "key store configuration is invalid",
            ),
        ] {
            assert_eq!(e.to_string(), kind);
            assert_eq!(chain(&e), format!("{kind}: connection refused"));
        }
    }

    #[test]
    fn a_configuration_error_is_not_retryable() {
        assert!(!StoreError::Config("bad".into()).is_retryable());
        assert!(StoreError::Unavailable("down".into()).is_retryable());
    }
}
