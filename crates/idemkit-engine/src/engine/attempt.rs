//! A running attempt: the claim it holds, its heartbeat, and how it finishes.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{
    ClaimRequest, ErrorCode, KeyStore, Lease, Policy, Problem, RecordState, Scope, ServerErrorPolicy,
    StoreError, StoredResponse,
};
use tokio::task::JoinHandle;

use super::detach::{Panicked, catch_unwind};
use super::{Engine, Refusal, Refused, stored_problem};
use crate::metrics::{op, outcome, timed};

/// How a handler overrides the route's storage policy for one response
/// (the behaviour contract, `docs/spec.md` §5). Adapters attach it to a response (`idemkit_tower::Override` in an
/// axum response's parts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Override {
    /// Store and replay this response, whatever its status.
    Final,
    /// Do not store it; end the lease now so the next attempt resumes without waiting.
    Retryable,
    /// The handler already settled the record itself (its final phase stored the
    /// response, or it parked the request, or its lease was lost): the layer leaves
    /// the record as it is.
    Settled,
}

/// What happens to a handler's answer (the behaviour contract, `docs/spec.md` §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Stored; the key replays it.
    Store,
    /// Not stored; the key is free (unless progress was recorded).
    Release,
    /// Not stored; the lease ends at once and the record stays resumable.
    Abandon,
    /// The handler settled the record itself.
    Leave,
    /// Not stored, and the caller knows the progress it recorded is void (the
    /// proxy's intent to forward, answered by a status the policy releases):
    /// the key is freed with that progress discarded, in one write fenced by
    /// the attempt's token ([`idemkit_core::KeyStore::release_discarding`]).
    /// Never chosen by [`Disposition::of`].
    Discard,
}

impl Disposition {
    /// The `disposition` field of the `idemkit.complete` span.
    pub const fn label(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::Release => "release",
            Self::Abandon => "abandon",
            Self::Leave => "leave",
            Self::Discard => "discard",
        }
    }

    /// The route policy's choice for an answer with `status`, unless the handler
    /// overrode it with `outcome`.
    pub fn of(status: u16, outcome: Option<Override>, policy: &Policy) -> Self {
        match outcome {
            Some(Override::Final) => return Self::Store,
            Some(Override::Retryable) => return Self::Abandon,
            Some(Override::Settled) => return Self::Leave,
            None => {}
        }
        if (500..600).contains(&status) {
            return match policy.on_server_error {
                ServerErrorPolicy::Replay => Self::Store,
                _ => Self::Release,
            };
        }
        match status {
            // Rejected before any side effect (validation, auth, size, media type) or
            // transient (timeout, too early, throttled): the corrected or later request
            // may reuse the key.
            400 | 401 | 403 | 408 | 413 | 415 | 422 | 425 | 429 => Self::Release,
            _ => Self::Store,
        }
    }
}

/// How an attempt that had to store its answer finished.
#[derive(Debug)]
pub enum Finished {
    /// The answer is stored: send it.
    Stored,
    /// The answer could not be stored; send this instead.
    Refused(Refused),
}

/// A claim held while the handler runs.
pub struct Attempt {
    engine: Engine,
    /// Shared with [`Attempt::recovery_handle`]'s copy (the stored request
    /// is not copied per request for a panic that rarely comes).
    claim: Arc<ClaimRequest>,
    pub(super) lease: Lease,
    /// Single-step mode: the open transaction holding the uncommitted claim,
    /// until the adapter hands it to the handler (behind a mutex only so that
    /// `&Attempt` is `Send` while the handler runs).
    tx: std::sync::Mutex<Option<Box<dyn Any + Send>>>,
    /// The caller's deadline, if it sent one.
    deadline: Option<Instant>,
}

impl std::fmt::Debug for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Attempt")
            .field("lease", &self.lease)
            .field("transactional", &self.engine.tx_store.is_some())
            .finish_non_exhaustive()
    }
}

impl Attempt {
    pub(super) fn new(
        engine: Engine,
        claim: Arc<ClaimRequest>,
        lease: Lease,
        tx: Option<Box<dyn Any + Send>>,
        deadline: Option<Instant>,
    ) -> Self {
        Self {
            engine,
            claim,
            lease,
            tx: std::sync::Mutex::new(tx),
            deadline,
        }
    }

    /// The caller's deadline (`grpc-timeout` or the REST deadline header), if any.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// (account, key).
    pub fn scope(&self) -> &Scope {
        &self.claim.scope
    }

    /// The lease held (its token fences every write).
    pub fn lease(&self) -> &Lease {
        &self.lease
    }

    /// Takes the claimed request's body out of the attempt, so an adapter
    /// sends on the very bytes the claim stored instead of holding a second
    /// copy of them while its handler or upstream runs (a proxy's memory is
    /// then one copy per body in flight). Only a committed lease-mode claim
    /// gives its body up (nothing of the attempt reads it again); a
    /// single-step claim, whose commit may begin it again, or one already
    /// shared with a recovery handle, gives `None`.
    pub fn take_request_body(&mut self) -> Option<Vec<u8>> {
        if self.engine.tx_store.is_some() {
            return None;
        }
        Arc::get_mut(&mut self.claim).map(|claim| std::mem::take(&mut claim.request.body))
    }

    /// The route policy.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.engine.policy
    }

    /// Whether the claim is an uncommitted single-step claim (rolled back if the
    /// attempt is dropped) rather than a committed lease.
    pub fn is_transactional(&self) -> bool {
        self.engine.tx_store.is_some()
    }

    /// A handle to settle this lease-mode attempt with if the task running it
    /// dies (a panicking handler): the same claim and lease, no transaction.
    pub(crate) fn recovery_handle(&self) -> Attempt {
        Attempt::new(
            self.engine.clone(),
            self.claim.clone(),
            self.lease.clone(),
            None,
            self.deadline,
        )
    }

    /// Runs `work` (the handler and whatever finishes the attempt) for this
    /// attempt, and settles the attempt itself if `work` panics, wherever it is
    /// polled: on the caller's task, or in the task [`super::Detached`] moved it
    /// to after the caller left (the behaviour contract, `docs/spec.md` §3). A panic before any progress releases
    /// the key; after progress the record is abandoned, resumable, with the
    /// panic counted in its last error, and the [`Policy::panic_limit`]th panic
    /// in a row parks it for review instead. `Err` says which (an [`outcome`]:
    /// released, abandoned, parked or lease lost), for the adapter to answer its
    /// server error with.
    pub async fn catch_panic<F: Future>(
        self,
        work: impl FnOnce(Attempt) -> F,
    ) -> Result<F::Output, &'static str> {
        let orphan = self.recovery_handle();
        match catch_unwind(work(self)).await {
            Ok(out) => Ok(out),
            Err(Panicked) => {
                tracing::error!("idempotency: the handler panicked");
                Err(orphan.settle_panicked().await)
            }
        }
    }

    /// Settles an attempt whose handler panicked (see [`Attempt::catch_panic`]).
    async fn settle_panicked(self) -> &'static str {
        if self.is_transactional() {
            // The claim was never committed: its transaction went down with
            // the handler's future and rolls back.
            return outcome::RELEASED;
        }
        let store = self.engine.store.as_ref();
        let (scope, token) = (&self.claim.scope, self.lease.token);
        let limit = self.engine.policy.panic_limit.max(1);
        let record = match timed(op::GET, store.get(scope)).await {
            Ok(Some(r)) if r.fencing_token == token && r.state == RecordState::InFlight => Some(r),
            Ok(_) => return outcome::LEASE_LOST,
            Err(e) => {
                tracing::warn!(error = %e, "idempotency: could not read the record of a panicked attempt; abandoning");
                None
            }
        };
        let abandon = |n: u32| async move {
            timed(op::ABANDON, store.abandon(scope, token, &panic_error(n, limit))).await
        };
        let (counted, result) = match record {
            Some(r) if !r.has_progress() => (
                outcome::RELEASED,
                timed(op::RELEASE, store.release(scope, token)).await,
            ),
            Some(r) => {
                let n = panics_in_a_row(r.last_error.as_deref()).saturating_add(1);
                if n >= limit {
                    let reason = format!(
                        "{PANICKED} on {n} runs in a row after recording progress; parked for review instead of being resumed again"
                    );
                    tracing::error!(
                        runs = n,
                        "idempotency: the handler keeps panicking; the request is parked for review"
                    );
                    match timed(op::PARK, store.park(scope, token, &reason)).await {
                        Err(StoreError::Unsupported(_)) => (outcome::ABANDONED, abandon(n).await),
                        other => (outcome::PARKED, other),
                    }
                } else {
                    (outcome::ABANDONED, abandon(n).await)
                }
            }
            // Unread: progress may exist, so never a release; the count is lost.
            None => (outcome::ABANDONED, abandon(1).await),
        };
        match result {
            Ok(()) => counted,
            Err(StoreError::Fenced) => outcome::LEASE_LOST,
            Err(e) => {
                // The lease still expires on its own; the next attempt takes over then.
                tracing::warn!(error = %e, "idempotency: could not settle the key of a panicked attempt");
                counted
            }
        }
    }

    /// Refuses an answer a single-step handler settled itself
    /// ([`Override::Settled`], as every answer of `idemkit_tower::Phases` is): a
    /// single-step claim is uncommitted until the layer stores the answer in
    /// the handler's transaction, so leaving the record "as the handler left
    /// it" would acknowledge writes that roll back, and a `Phases` under it
    /// never sees its claim (its lease-lost answer would be retried forever).
    /// The transaction is rolled back, the key is free, and the caller gets
    /// `500 idempotency_misconfigured` (not retryable), logged once per route.
    pub async fn refuse_settled(self, tx: Option<Box<dyn Any + Send>>) -> Refused {
        self.rollback(tx).await;
        if !self
            .engine
            .misconfigured_logged
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::error!(
                "idempotency: misconfigured route: {MISCONFIGURED_SETTLED}; every such request is refused until it is fixed"
            );
        }
        Refused::new(
            outcome::ERROR,
            Refusal::problem(ErrorCode::Misconfigured, MISCONFIGURED_SETTLED),
        )
    }

    /// Takes the claim's open transaction (single-step mode), to hand to the
    /// handler; give it back to [`Attempt::store`] when the handler returns.
    pub fn take_tx(&mut self) -> Option<Box<dyn Any + Send>> {
        self.tx.get_mut().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Runs the handler. In lease mode, if it is still running after one
    /// heartbeat interval, a heartbeat task starts beating at once and keeps the
    /// lease alive until the handler ends. Most handlers finish well within a
    /// third of the lease and never pay for a spawned task; the task (not an
    /// inline future) is what keeps beating even if a handler blocks its
    /// executor thread. Single-step claims are invisible until they commit:
    /// nothing to keep alive.
    pub async fn run<F: Future>(&self, handler: F) -> F::Output {
        if self.is_transactional() {
            return handler.await;
        }
        let policy = &self.engine.policy;
        // Policy validation keeps the lease positive; the floor only guards the timer.
        let every = policy.heartbeat_interval().max(Duration::from_millis(1));
        tokio::pin!(handler);
        tokio::select! {
            biased;
            out = &mut handler => out,
            () = tokio::time::sleep(every) => {
                let _heartbeat = spawn_heartbeat(
                    self.engine.store.clone(),
                    self.claim.scope.clone(),
                    &self.lease,
                    policy.lease,
                    every,
                );
                handler.await
            }
        }
    }

    /// Stores the answer: in the claim's transaction (single-step, given back as
    /// `tx`), or with a fenced write retried briefly when the store is
    /// unavailable (the handler's effects have happened, so giving up early
    /// costs a re-execution). A single-step claim that lost the race at commit
    /// is answered with what the key now answers.
    pub async fn store(self, tx: Option<Box<dyn Any + Send>>, stored: &StoredResponse) -> Finished {
        let scope = &self.claim.scope;
        let completing = std::time::Instant::now();
        let committed = match (&self.engine.tx_store, tx) {
            (Some(tx_store), Some(tx)) => {
                timed(
                    op::COMPLETE,
                    tx_store.complete_in_tx(tx, scope, self.lease.token, stored),
                )
                .await
            }
            (Some(_), None) => {
                return Finished::Refused(Refused::new(
                    outcome::ERROR,
                    Refusal::problem(
                        ErrorCode::Internal,
                        "the handler kept the claim transaction past its return; rolled back",
                    ),
                ));
            }
            (None, _) => complete_with_retry(self.engine.store.as_ref(), scope, &self.lease, stored).await,
        };
        match committed {
            Ok(()) => {
                if let Some(replays) = &self.engine.replays {
                    replays.insert(
                        scope,
                        &self.claim.fingerprint,
                        stored,
                        completing,
                        self.engine.policy.replay_window,
                    );
                }
                Finished::Stored
            }
            Err(StoreError::Conflict) => {
                // Another request with this key committed first and this attempt's
                // writes were rolled back: answer what the key now answers.
                tracing::debug!("idempotency: single-step claim lost the race at commit");
                match self.engine.begin(ClaimRequest::clone(&self.claim)).await {
                    Err(settled) => Finished::Refused(settled),
                    Ok(mut again) => {
                        // Claimed again (the winner's record went away): let
                        // it go before answering, rolled back if it holds a
                        // transaction.
                        let tx = again.take_tx();
                        again.settle(tx, Disposition::Release).await;
                        Finished::Refused(Refused::new(
                            outcome::IN_PROGRESS,
                            Refusal::problem(
                                ErrorCode::RequestInProgress,
                                "a concurrent request with this idempotency key changed its state; retry",
                            )
                            .with_retry_after(Duration::from_secs(1)),
                        ))
                    }
                }
            }
            Err(e) => Finished::Refused(Refused::store(&e)),
        }
    }

    /// Rolls back a single-step transaction before the caller is answered, so
    /// the key's lock is free by then (see `TransactionalStore::rollback_tx`).
    async fn rollback(&self, tx: Option<Box<dyn Any + Send>>) {
        if let (Some(tx_store), Some(tx)) = (&self.engine.tx_store, tx) {
            tx_store.rollback_tx(tx).await;
        }
    }

    /// The answer could not be stored (larger than the storage cap, or its body
    /// failed). Single-step: everything rolls back, nothing happened. Lease
    /// mode: the handler's effects may have happened, so a too-large answer is
    /// stored as `problem` (what the key now answers); a failed body releases.
    pub async fn unstorable(
        self,
        tx: Option<Box<dyn Any + Send>>,
        problem: Problem,
        too_large: bool,
    ) -> Refused {
        if self.is_transactional() {
            self.rollback(tx).await;
            return Refused::new(
                outcome::ERROR,
                Refusal::Problem {
                    problem,
                    retry_after: None,
                },
            );
        }
        if too_large {
            let stored = stored_problem(&problem);
            return match complete_with_retry(
                self.engine.store.as_ref(),
                &self.claim.scope,
                &self.lease,
                &stored,
            )
            .await
            {
                Ok(()) => Refused::new(
                    outcome::ERROR,
                    Refusal::Problem {
                        problem,
                        retry_after: None,
                    },
                ),
                Err(e) => Refused::store(&e),
            };
        }
        self.settle(tx, Disposition::Release).await;
        Refused::new(
            outcome::ERROR,
            Refusal::Problem {
                problem,
                retry_after: None,
            },
        )
    }

    /// Releases or abandons the key without storing an answer, and says which
    /// (an [`outcome`]). In single-step mode both are a rollback: the claim was
    /// never committed.
    pub async fn settle(self, tx: Option<Box<dyn Any + Send>>, how: Disposition) -> &'static str {
        if self.is_transactional() {
            self.rollback(tx).await;
            return outcome::RELEASED;
        }
        let store = self.engine.store.as_ref();
        let (scope, token) = (&self.claim.scope, self.lease.token);
        let (counted, result) = match how {
            Disposition::Abandon => (
                outcome::ABANDONED,
                timed(
                    op::ABANDON,
                    store.abandon(scope, token, "handler marked the outcome retryable"),
                )
                .await,
            ),
            Disposition::Discard => (
                outcome::RELEASED,
                timed(op::RELEASE, store.release_discarding(scope, token)).await,
            ),
            // A request that recorded progress (a phase, an external-call intent)
            // keeps it: the next attempt resumes from the recovery point instead of
            // starting over. When the read fails (the store flapping) progress may
            // exist, so the record is abandoned, never released; and the store's
            // release itself refuses to wipe recorded progress.
            _ => match timed(op::GET, store.get(scope)).await {
                Ok(Some(r)) if !r.has_progress() => (
                    outcome::RELEASED,
                    timed(op::RELEASE, store.release(scope, token)).await,
                ),
                Ok(Some(_)) => (
                    outcome::ABANDONED,
                    timed(
                        op::ABANDON,
                        store.abandon(scope, token, "the handler failed after recording progress"),
                    )
                    .await,
                ),
                Ok(None) => (outcome::LEASE_LOST, Err(StoreError::Fenced)),
                Err(e) => {
                    tracing::warn!(error = %e, "idempotency: could not read the record to settle it; abandoning");
                    (
                        outcome::ABANDONED,
                        timed(
                            op::ABANDON,
                            store.abandon(
                                scope,
                                token,
                                "the handler failed and the record could not be read",
                            ),
                        )
                        .await,
                    )
                }
            },
        };
        match result {
            Ok(()) => counted,
            Err(StoreError::Fenced) => outcome::LEASE_LOST,
            Err(e) => {
                // The lease still expires on its own; the next attempt takes over then.
                tracing::warn!(error = %e, "idempotency: could not release the key");
                counted
            }
        }
    }
}

/// Why a single-step route's answer marked [`Override::Settled`] is refused.
const MISCONFIGURED_SETTLED: &str = "the handler answered `Override::Settled` (it settled the record itself, as `Phases` does) \
     under a single-step (transactional) idempotency layer, whose claim commits only with the answer the layer stores; \
     its transaction was rolled back, nothing was stored and the key is free. Use a lease-mode layer \
     (`IdempotencyLayer::lease`) for routes that use `Phases` or settle their own record";

/// How the last error of a record abandoned after a panic begins.
const PANICKED: &str = "the handler panicked";

/// The last error of a record abandoned after its `n`th panic in a row.
fn panic_error(n: u32, limit: u32) -> String {
    format!("{PANICKED} (run {n} in a row; parked for review at {limit})")
}

/// How many runs in a row panicked, from the record's last error (0 when the
/// last attempt ended any other way).
fn panics_in_a_row(last_error: Option<&str>) -> u32 {
    last_error
        .and_then(|e| e.strip_prefix(PANICKED)?.strip_prefix(" (run "))
        .and_then(|rest| rest.split(' ').next()?.parse().ok())
        .unwrap_or(0)
}

/// Aborts the heartbeat when the request ends, however it ends.
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn spawn_heartbeat(
    store: Arc<dyn KeyStore>,
    scope: Scope,
    lease: &Lease,
    length: Duration,
    every: Duration,
) -> AbortOnDrop {
    let token = lease.token;
    AbortOnDrop(tokio::spawn(async move {
        // The first beat is due now: the handler has already run one interval.
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            match timed(op::HEARTBEAT, store.heartbeat(&scope, token, length)).await {
                Ok(_) => {}
                Err(StoreError::Fenced) => {
                    tracing::warn!(
                        "idempotency: lease lost to a takeover; this attempt's completion will be refused"
                    );
                    return;
                }
                Err(e) => tracing::warn!(error = %e, "idempotency: heartbeat failed; will retry"),
            }
        }
    }))
}

/// Lease-mode completion, retried briefly when the store is unavailable.
///
/// An `Unavailable` may be a lost reply to a write that landed; the re-sent
/// write is then fenced by its own first delivery (the record is completed).
/// So a refusal after an `Unavailable` is checked against the record: when it
/// is completed with this very answer, the completion stands and the caller
/// gets its answer, never "your writes were discarded".
async fn complete_with_retry(
    store: &dyn KeyStore,
    scope: &Scope,
    lease: &Lease,
    stored: &StoredResponse,
) -> Result<(), StoreError> {
    let mut delay = Duration::from_millis(50);
    let mut unsure = false;
    for attempt in 1.. {
        match timed(op::COMPLETE, store.complete(scope, lease.token, stored)).await {
            Err(StoreError::Unavailable(e)) if attempt < 4 => {
                tracing::warn!(error = %e, attempt, "idempotency: completion failed; retrying");
                unsure = true;
                tokio::time::sleep(delay.mul_f64(rand::random_range(0.5..1.0))).await;
                delay *= 2;
            }
            Err(StoreError::Fenced) if unsure => return completed_with(store, scope, stored).await,
            other => return other,
        }
    }
    unreachable!("the loop returns")
}

/// Whether the record of `scope` is completed with `stored` (an earlier
/// delivery of this completion landed): `Ok` if so, `Fenced` if it holds
/// anything else, the read's error if it cannot be read.
async fn completed_with(
    store: &dyn KeyStore,
    scope: &Scope,
    stored: &StoredResponse,
) -> Result<(), StoreError> {
    match timed(op::GET, store.get(scope)).await? {
        Some(r) if r.state == RecordState::Completed && r.response.as_ref() == Some(stored) => {
            tracing::debug!("idempotency: an earlier delivery of the completion landed; its reply was lost");
            Ok(())
        }
        _ => Err(StoreError::Fenced),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispositions_follow_the_spec() {
        let p = Policy::new();
        let d = |s: u16, o| Disposition::of(s, o, &p);
        assert_eq!(d(201, None), Disposition::Store);
        assert_eq!(d(404, None), Disposition::Store);
        assert_eq!(d(409, None), Disposition::Store);
        assert_eq!(d(400, None), Disposition::Release);
        assert_eq!(d(422, None), Disposition::Release);
        assert_eq!(d(429, None), Disposition::Release);
        assert_eq!(d(500, None), Disposition::Release);
        assert_eq!(d(502, Some(Override::Final)), Disposition::Store);
        assert_eq!(d(201, Some(Override::Retryable)), Disposition::Abandon);
        let replay = Policy::new().with_server_error_policy(ServerErrorPolicy::Replay);
        assert_eq!(Disposition::of(502, None, &replay), Disposition::Store);
    }

    /// The `disposition` field of the `idemkit.complete` span, which
    /// operators filter traces on: one stable name each.
    #[test]
    fn each_disposition_has_its_own_stable_label() {
        let all = [
            (Disposition::Store, "store"),
            (Disposition::Release, "release"),
            (Disposition::Abandon, "abandon"),
            (Disposition::Leave, "leave"),
            (Disposition::Discard, "discard"),
        ];
        for (d, label) in all {
            assert_eq!(d.label(), label);
        }
    }

    #[test]
    fn panics_are_counted_from_the_last_error() {
        assert_eq!(panics_in_a_row(None), 0);
        assert_eq!(panics_in_a_row(Some("handler marked the outcome retryable")), 0);
        assert_eq!(panics_in_a_row(Some(&panic_error(1, 3))), 1);
        assert_eq!(panics_in_a_row(Some(&panic_error(17, 30))), 17);
        assert_eq!(panics_in_a_row(Some("the handler panicked (run x")), 0);
    }
}
