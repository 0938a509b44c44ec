//! The instrumented store decorator, the store-level event log the checker
//! reads, and an in-memory transaction adapter so `Phases` runs on the memory
//! store too.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, KeyStore, ListFilter, Millis, PhaseUpdate, ReapReport, Record,
    RecordState, ReviewEntry, Scope, StoreError, StoreResult, StoredResponse, TransactionalStore, TxClaim,
};

use crate::sched::{Permit, Phase, Sched};

/// What the store did, in the order it did it (the scheduler runs one store
/// call at a time, so this order is a linearisation of the store's history).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A claim (lease mode) took the key with this token.
    Claimed {
        /// The key.
        scope: Scope,
        /// Its new token.
        token: FencingToken,
        /// When the store call began (the logged time is when it answered):
        /// the store made the claim somewhere in between.
        started: tokio::time::Instant,
    },
    /// A heartbeat was accepted (also logged as a [`Event::FencedWrite`]):
    /// the lease runs for a lease from some time after `started`.
    Extended {
        /// The key.
        scope: Scope,
        /// The holder's token.
        token: FencingToken,
        /// When the heartbeat's store call began.
        started: tokio::time::Instant,
    },
    /// A lease-holder write was accepted.
    FencedWrite {
        /// The key.
        scope: Scope,
        /// The writer's token.
        token: FencingToken,
        /// Which write.
        op: &'static str,
    },
    /// A completion was accepted (lease mode or single-step).
    Completed {
        /// The key.
        scope: Scope,
        /// The writer's token.
        token: FencingToken,
        /// What was stored.
        response: StoredResponse,
    },
    /// An operator released a record (progress kept or discarded).
    OperatorReleased {
        /// The key.
        scope: Scope,
        /// Whether progress was discarded.
        discarded: bool,
    },
    /// An operator is about to say `--downstream-did-nothing` for a key:
    /// whether that was true when it looked (no downstream had acted for the
    /// request, nor had a call under way). Logged by the world, which knows
    /// the downstreams' effects; the checker lets only a truthful discard
    /// start a new generation.
    OperatorAttested {
        /// The key.
        scope: Scope,
        /// Whether the downstreams had truly done nothing.
        truthful: bool,
    },
}

/// The shared event log, each event with the (virtual) time it happened.
pub type Log = Arc<Mutex<Vec<(tokio::time::Instant, Event)>>>;

thread_local! {
    /// When the store call whose answer is being logged began (set around
    /// `on_ok`, which runs without an await in between).
    static CALL_STARTED: std::cell::Cell<Option<tokio::time::Instant>> = const { std::cell::Cell::new(None) };
}

/// When the store call being logged began (now, outside a call).
fn call_started() -> tokio::time::Instant {
    CALL_STARTED
        .with(|c| c.get())
        .unwrap_or_else(tokio::time::Instant::now)
}

pub(crate) fn push(log: &Log, e: Event) {
    let now = tokio::time::Instant::now();
    log.lock().unwrap_or_else(|p| p.into_inner()).push((now, e));
}

fn lost() -> StoreError {
    StoreError::Unavailable("simulated: the store's reply was lost".into())
}

fn unavailable() -> StoreError {
    StoreError::Unavailable("simulated: the store is unavailable".into())
}

/// A store handle of one instance: every call parks at the scheduler before it
/// reaches the store and again after the store answered, before the caller
/// sees the answer; faults drawn there fail the call before it runs or lose
/// its reply after it applied.
pub struct Instrumented<S: ?Sized> {
    inner: Arc<S>,
    sched: Arc<Sched>,
    instance: usize,
    log: Log,
}

impl<S: ?Sized> std::fmt::Debug for Instrumented<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Instrumented")
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl<S: ?Sized> Instrumented<S> {
    /// `inner` as seen by `instance`.
    pub fn new(inner: Arc<S>, sched: Arc<Sched>, instance: usize, log: Log) -> Self {
        Self {
            inner,
            sched,
            instance,
            log,
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<S> {
        &self.inner
    }

    async fn call<T: std::fmt::Debug, F>(
        &self,
        op: &'static str,
        fut: F,
        on_ok: impl FnOnce(&T, &Log),
    ) -> StoreResult<T>
    where
        F: Future<Output = StoreResult<T>>,
    {
        if self.sched.before_call(self.instance, op).await == Permit::Unavailable {
            return Err(unavailable());
        }
        let started = tokio::time::Instant::now();
        let result = {
            let _guard = self.sched.enter_store(op);
            fut.await
        };
        if let Ok(v) = &result {
            CALL_STARTED.with(|c| c.set(Some(started)));
            on_ok(v, &self.log);
            CALL_STARTED.with(|c| c.set(None));
        }
        self.sched.note(|| format!("    {op} -> {}", short(&result)));
        let permit = self.sched.point(self.instance, Phase::After, op).await;
        match (permit, result) {
            (Permit::LoseReply, Ok(_)) => Err(lost()),
            (_, r) => r,
        }
    }
}

fn short<T: std::fmt::Debug>(r: &StoreResult<T>) -> String {
    let mut s = match r {
        Ok(v) => format!("Ok({v:?})"),
        Err(e) => format!("Err({e})"),
    };
    s.truncate(160);
    s
}

fn fenced(scope: &Scope, token: FencingToken, op: &'static str) -> impl FnOnce(&(), &Log) {
    let scope = scope.clone();
    move |_, log| push(log, Event::FencedWrite { scope, token, op })
}

#[async_trait]
impl<S: KeyStore + ?Sized> KeyStore for Instrumented<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        let scope = req.scope.clone();
        self.call("claim", self.inner.claim(req), move |o, log| {
            if let ClaimOutcome::Claimed(lease) = o {
                push(
                    log,
                    Event::Claimed {
                        scope,
                        token: lease.token,
                        started: call_started(),
                    },
                );
            }
        })
        .await
    }
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        let s = scope.clone();
        self.call(
            "heartbeat",
            self.inner.heartbeat(scope, token, lease),
            move |_, log| {
                push(
                    log,
                    Event::FencedWrite {
                        scope: s.clone(),
                        token,
                        op: "heartbeat",
                    },
                );
                push(
                    log,
                    Event::Extended {
                        scope: s,
                        token,
                        started: call_started(),
                    },
                );
            },
        )
        .await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let (s, r) = (scope.clone(), response.clone());
        self.call(
            "complete",
            self.inner.complete(scope, token, response),
            move |_, log| {
                push(
                    log,
                    Event::Completed {
                        scope: s,
                        token,
                        response: r,
                    },
                )
            },
        )
        .await
    }
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.call(
            "release",
            self.inner.release(scope, token),
            fenced(scope, token, "release"),
        )
        .await
    }
    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.call(
            "release_discarding",
            self.inner.release_discarding(scope, token),
            fenced(scope, token, "release_discarding"),
        )
        .await
    }
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.call(
            "abandon",
            self.inner.abandon(scope, token, error),
            fenced(scope, token, "abandon"),
        )
        .await
    }
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        self.call("get", self.inner.get(scope), |_, _| {}).await
    }
    fn now(&self) -> Millis {
        self.inner.now()
    }
    fn notifies_changes(&self) -> bool {
        self.inner.notifies_changes()
    }
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.call(
            "advance",
            self.inner.advance(scope, token, update),
            fenced(scope, token, "advance"),
        )
        .await
    }
    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        self.call(
            "park",
            self.inner.park(scope, token, reason),
            fenced(scope, token, "park"),
        )
        .await
    }
    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        self.call(
            "abandoned",
            self.inner.abandoned(claimed_before, limit),
            |_, _| {},
        )
        .await
    }
    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        self.call("reap", self.inner.reap(before), |_, _| {}).await
    }
    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        self.call("review", self.inner.review(limit), |_, _| {}).await
    }
    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        self.call("list", self.inner.list(filter), |_, _| {}).await
    }
    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        let s = scope.clone();
        self.call(
            "force_release",
            self.inner.force_release(scope),
            move |done, log| {
                if *done {
                    push(
                        log,
                        Event::OperatorReleased {
                            scope: s,
                            discarded: false,
                        },
                    )
                }
            },
        )
        .await
    }
    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        let s = scope.clone();
        self.call(
            "discard_progress",
            self.inner.discard_progress(scope),
            move |done, log| {
                if *done {
                    push(
                        log,
                        Event::OperatorReleased {
                            scope: s,
                            discarded: true,
                        },
                    )
                }
            },
        )
        .await
    }
    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        // Not a store write: no yield point, so a poll loop cannot spin the scheduler.
        self.inner.wait_for_change(scope, timeout).await
    }
}

#[async_trait]
impl<S: TransactionalStore> TransactionalStore for Instrumented<S> {
    type Tx = S::Tx;

    async fn claim_in_tx(&self, req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        // The uncommitted claim is logged when its completion commits.
        self.call("claim_in_tx", self.inner.claim_in_tx(req), |_, _| {})
            .await
    }
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx> {
        let tx = self
            .call(
                "begin_fenced",
                async { self.inner.begin_fenced(scope, token).await.map(Opaque) },
                |_, _| {},
            )
            .await?;
        Ok(tx.0)
    }
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        self.call("commit", self.inner.commit(tx), |_, _| {}).await
    }
    async fn advance_in_tx(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        self.call(
            "advance_in_tx",
            self.inner.advance_in_tx(tx, scope, token, update),
            |_, _| {},
        )
        .await
    }
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let (s, r) = (scope.clone(), response.clone());
        self.call(
            "complete_in_tx",
            self.inner.complete_in_tx(tx, scope, token, response),
            move |_, log| {
                push(
                    log,
                    Event::Completed {
                        scope: s,
                        token,
                        response: r,
                    },
                )
            },
        )
        .await
    }
    async fn rollback_tx(&self, tx: Self::Tx) {
        let _ = self
            .call(
                "rollback_tx",
                async {
                    self.inner.rollback_tx(tx).await;
                    Ok(())
                },
                |_, _| {},
            )
            .await;
    }
}

/// Gives a store without transactions the [`TransactionalStore`] surface
/// `Phases` needs, for lease mode: a phase's "transaction" checks the token
/// when it opens, and its progress is written with the store's own fenced
/// [`KeyStore::advance`] when it commits. The simulated business effects of
/// the memory scenario live in downstreams, not in the store, so there is
/// nothing else to commit atomically.
#[derive(Debug)]
pub struct MemTx<S: ?Sized>(pub Arc<S>);

#[async_trait]
impl<S: KeyStore + ?Sized> KeyStore for MemTx<S> {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.0.claim(req).await
    }
    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        self.0.heartbeat(scope, token, lease).await
    }
    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        self.0.complete(scope, token, response).await
    }
    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.0.release(scope, token).await
    }
    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.0.release_discarding(scope, token).await
    }
    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        self.0.abandon(scope, token, error).await
    }
    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        self.0.get(scope).await
    }
    fn now(&self) -> Millis {
        self.0.now()
    }
    fn notifies_changes(&self) -> bool {
        self.0.notifies_changes()
    }
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.0.advance(scope, token, update).await
    }
    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        self.0.park(scope, token, reason).await
    }
    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        self.0.abandoned(claimed_before, limit).await
    }
    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        self.0.reap(before).await
    }
    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        self.0.review(limit).await
    }
    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        self.0.list(filter).await
    }
    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        self.0.force_release(scope).await
    }
    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.0.discard_progress(scope).await
    }
    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        self.0.wait_for_change(scope, timeout).await
    }
}

/// A value shown as `..` in traces.
struct Opaque<T>(T);

impl<T> std::fmt::Debug for Opaque<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("..")
    }
}

/// The pending phase write of a [`MemTx`] transaction.
#[derive(Debug, Default)]
pub struct MemPending(Option<(Scope, FencingToken, PhaseUpdate)>);

#[async_trait]
impl<S: KeyStore + ?Sized> TransactionalStore for MemTx<S> {
    type Tx = MemPending;

    async fn claim_in_tx(&self, _req: &ClaimRequest) -> StoreResult<TxClaim<Self::Tx>> {
        Err(StoreError::Unsupported("single-step claims on the memory store"))
    }
    async fn begin_fenced(&self, scope: &Scope, token: FencingToken) -> StoreResult<Self::Tx> {
        match self.0.get(scope).await? {
            Some(r) if r.fencing_token == token && r.state == RecordState::InFlight => Ok(MemPending(None)),
            _ => Err(StoreError::Fenced),
        }
    }
    async fn commit(&self, tx: Self::Tx) -> StoreResult<()> {
        match tx.0 {
            Some((scope, token, update)) => self.0.advance(&scope, token, &update).await,
            None => Ok(()),
        }
    }
    async fn advance_in_tx(
        &self,
        tx: &mut Self::Tx,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
    ) -> StoreResult<()> {
        tx.0 = Some((scope.clone(), token, update.clone()));
        Ok(())
    }
    async fn complete_in_tx(
        &self,
        tx: Self::Tx,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        // The final phase's recovery point is bookkeeping; the completion is
        // the write that matters, and it is fenced.
        drop(tx);
        self.0.complete(scope, token, response).await
    }
}
