//! The request lifecycle, protocol-neutral (the behaviour contract, `docs/spec.md` §3–§7): begin (fingerprint,
//! claim, wait/reject/accept) → a running attempt (heartbeat, fencing) → finish
//! (store, release, abandon by policy) → replay.
//!
//! It knows no axum, hyper body type or tonic: adapters hand it a request's
//! scope, method, target, selected headers and body bytes, and get back either
//! an [`Attempt`] to run their handler under or a [`Refusal`] (a stored response
//! to replay, or a problem with its stable code) to answer without running
//! anything. The HTTP adapter (`idemkit_tower::Idempotency`) is one such adapter; a gRPC
//! adapter or a proxy is another. Nothing in this module tree may import a
//! protocol crate (a test reads the sources to keep it so).

mod attempt;
mod detach;
mod erased;
mod replays;

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{
    ClaimOutcome, ClaimRequest, Decision, ErrorCode, FencingToken, Fingerprinter, IdempotencyKey,
    InFlightBehavior, IntoKeyStore, IntoTransactionalStore, KeyError, KeyStore, Policy, Problem, RecordHead,
    Scope, StoreError, StoredHeader, StoredRequest, StoredResponse, TxClaim,
};
use tracing::Instrument;
use tracing::field::Empty;

pub use attempt::{Attempt, Disposition, Finished, Override};
pub use detach::{Detached, Panicked};
use erased::ErasedTxStore;
use replays::ReplayCache;

use crate::metrics::{self, op, outcome, timed};

/// The store an [`Engine`] claims keys in, and with it the engine's mode:
/// lease mode over any [`KeyStore`], or single-step mode over a
/// [`TransactionalStore`](idemkit_core::TransactionalStore), whose claim is the
/// handler's own open transaction.
#[derive(Clone)]
pub struct EngineStore {
    store: Arc<dyn KeyStore>,
    tx_store: Option<Arc<dyn ErasedTxStore>>,
}

impl EngineStore {
    /// Lease mode: the claim commits as `in_flight` under a heartbeat-kept
    /// lease, and the answer is stored with a fenced write.
    pub fn lease(store: impl IntoKeyStore) -> Self {
        Self {
            store: store.into_key_store(),
            tx_store: None,
        }
    }

    /// Single-step mode: the claim, the handler's writes and the stored answer
    /// commit in one transaction of `store`.
    pub fn single_step(store: impl IntoTransactionalStore) -> Self {
        let store = store.into_transactional_store();
        let tx_store: Arc<dyn ErasedTxStore> = store.clone();
        Self {
            store,
            tx_store: Some(tx_store),
        }
    }

    /// Whether claims share the handler's transaction (single-step mode).
    pub fn is_transactional(&self) -> bool {
        self.tx_store.is_some()
    }

    /// The store, as a [`KeyStore`].
    pub fn key_store(&self) -> &Arc<dyn KeyStore> {
        &self.store
    }
}

impl std::fmt::Debug for EngineStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineStore")
            .field("transactional", &self.tx_store.is_some())
            .finish_non_exhaustive()
    }
}

/// The engine of one route: its store, policy and fingerprinter.
#[derive(Clone)]
pub struct Engine {
    pub(crate) store: Arc<dyn KeyStore>,
    /// Set in single-step (transactional) mode.
    pub(crate) tx_store: Option<Arc<dyn ErasedTxStore>>,
    pub(crate) policy: Arc<Policy>,
    pub(crate) fingerprinter: Fingerprinter,
    /// The answers this process stored, when the route keeps them in memory.
    pub(crate) replays: Option<Arc<ReplayCache>>,
    /// Set once a misconfiguration found on a request was logged (see
    /// `Attempt::refuse_settled`): logged once, refused every time.
    pub(crate) misconfigured_logged: Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("transactional", &self.tx_store.is_some())
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// One request as an adapter sees it, reduced to what the contract needs.
#[derive(Debug, Clone)]
pub struct Incoming<'a> {
    /// (account, key).
    pub scope: Scope,
    /// The method (an HTTP method, or a gRPC full method name).
    pub method: &'a str,
    /// The route path with its query string (part of the fingerprint).
    pub target: &'a str,
    /// Headers kept with the record for the completer; never credentials.
    pub headers: Vec<StoredHeader>,
    /// The body bytes.
    pub body: &'a [u8],
    /// Set by the completer: the token of the abandoned record it resumes.
    pub resume: Option<FencingToken>,
}

/// A request answered without running the handler. Exhaustive on purpose: an
/// adapter must answer each kind.
#[derive(Debug, Clone)]
pub enum Refusal {
    /// The request already completed: replay this.
    Replay(StoredResponse),
    /// Another attempt holds the key and the route answers `202` with a status
    /// URL (the `accepted` in-flight behaviour); retry after this long.
    Accepted {
        /// The in-progress hint.
        retry_after: Duration,
    },
    /// A problem with its stable code (key reused, in progress, parked, store
    /// unavailable, …), and `Retry-After` where the client should wait.
    Problem {
        /// The document.
        problem: Problem,
        /// The hint, if any.
        retry_after: Option<Duration>,
    },
}

impl Refusal {
    fn problem(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self::Problem {
            problem: Problem::new(code, detail),
            retry_after: None,
        }
    }

    fn with_retry_after(self, d: Duration) -> Self {
        match self {
            Self::Problem { problem, .. } => Self::Problem {
                problem,
                retry_after: Some(d),
            },
            other => other,
        }
    }

    /// The answer for a store failure.
    pub fn store(e: &StoreError) -> Self {
        let (problem, retry_after) = store_problem(e);
        Self::Problem { problem, retry_after }
    }
}

/// The problem a store failure is answered with, and its `Retry-After`.
pub fn store_problem(e: &StoreError) -> (Problem, Option<Duration>) {
    match e {
        StoreError::Fenced => (
            Problem::new(
                ErrorCode::LeaseLost,
                "this attempt's lease was taken over by a later attempt; its writes were discarded; retry to get the stored result",
            ),
            Some(Duration::from_secs(1)),
        ),
        StoreError::Config(_) => {
            tracing::error!(error = %e, "idempotency: misconfigured");
            (
                Problem::new(
                    ErrorCode::Misconfigured,
                    match std::error::Error::source(e) {
                        Some(cause) => format!("the idempotency configuration cannot work: {cause}"),
                        None => format!("the idempotency configuration cannot work: {e}"),
                    },
                ),
                None,
            )
        }
        StoreError::Unavailable(_) => {
            tracing::warn!(error = %e, "idempotency: store unavailable");
            (
                Problem::new(
                    ErrorCode::StoreUnavailable,
                    "the idempotency store is unavailable; retry with the same key",
                ),
                Some(Duration::from_secs(1)),
            )
        }
        _ => {
            tracing::error!(error = %e, "idempotency: store failure");
            (
                Problem::new(
                    ErrorCode::Internal,
                    "the idempotency store failed; retry with the same key",
                ),
                None,
            )
        }
    }
}

/// A refusal and how it counts in [`metrics::REQUESTS`].
#[derive(Debug)]
pub struct Refused {
    /// The answer.
    pub refusal: Refusal,
    /// The `outcome` label.
    pub outcome: &'static str,
}

impl Refused {
    fn new(outcome: &'static str, refusal: Refusal) -> Self {
        Self { refusal, outcome }
    }

    /// The refusal for a store failure, counted as `store_unavailable` or `error`.
    pub fn store(e: &StoreError) -> Self {
        Self::new(metrics::store_outcome(e), Refusal::store(e))
    }
}

/// The problem for a key that cannot be used.
pub fn key_problem(e: &KeyError) -> Problem {
    Problem::new(e.code(), e.to_string())
}

/// Reads the key from a string field of a JSON body (`pointer`, RFC 6901).
pub fn key_from_json(body: &[u8], pointer: &str) -> Result<IdempotencyKey, Problem> {
    let value: serde_json::Value = serde_json::from_slice(body).map_err(|e| {
        Problem::new(
            ErrorCode::ValidationFailed,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    match value.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Err(key_problem(&KeyError::Missing)),
        Some(serde_json::Value::String(s)) => IdempotencyKey::parse(s).map_err(|e| key_problem(&e)),
        Some(_) => Err(Problem::new(
            ErrorCode::KeyInvalid,
            format!("`{pointer}` must be a string"),
        )),
    }
}

impl Engine {
    /// The engine of a route claiming in `store` under `policy` (validated
    /// here), fingerprinting bodies with `fingerprinter`.
    pub fn new(
        store: EngineStore,
        policy: Policy,
        fingerprinter: Fingerprinter,
    ) -> Result<Self, idemkit_core::PolicyError> {
        policy.validate()?;
        Ok(Self {
            store: store.store,
            tx_store: store.tx_store,
            policy: Arc::new(policy),
            fingerprinter,
            replays: None,
            misconfigured_logged: Arc::default(),
        })
    }

    /// Keeps up to about `capacity` of the answers this engine stores in memory
    /// and replays them without the store until their window ends (see
    /// `ReplayCache`). Off unless called.
    pub fn with_replay_cache(mut self, capacity: usize) -> Self {
        self.replays = Some(Arc::new(ReplayCache::new(capacity)));
        self
    }

    /// A lease-mode engine over any store, for adapters outside this crate (the
    /// gRPC layer in `idemkit-tonic`): the claim commits as `in_flight` with a
    /// heartbeat-kept lease, the answer is stored with a fenced write, and the
    /// body is fingerprinted as bytes or canonical JSON with nothing excluded.
    pub fn lease(store: impl IntoKeyStore, policy: Policy) -> Result<Self, idemkit_core::PolicyError> {
        Self::new(EngineStore::lease(store), policy, Fingerprinter::new())
    }

    /// The route policy.
    pub fn policy(&self) -> &Arc<Policy> {
        &self.policy
    }

    /// The key store.
    pub fn store(&self) -> &Arc<dyn KeyStore> {
        &self.store
    }

    /// Whether claims share the handler's transaction (single-step mode).
    pub fn is_transactional(&self) -> bool {
        self.tx_store.is_some()
    }

    /// Rolls back a single-step claim's transaction before the caller is
    /// answered (see `TransactionalStore::rollback_tx`); a lease-mode engine
    /// has none, and drops it. `tx` is what a single-step [`Attempt`] handed
    /// the adapter (the store's transaction, type-erased).
    pub async fn rollback_tx(&self, tx: Box<dyn std::any::Any + Send>) {
        if let Some(tx_store) = &self.tx_store {
            tx_store.rollback_tx(tx).await;
        }
    }

    /// The claim for `req`: its fingerprint (method, target with query, body)
    /// and the request kept for the completer.
    pub fn claim_request(&self, req: Incoming<'_>) -> ClaimRequest {
        ClaimRequest {
            fingerprint: self.fingerprinter.compute(req.method, req.target, req.body),
            scope: req.scope,
            request: StoredRequest {
                method: req.method.to_owned(),
                path: req.target.to_owned(),
                headers: req.headers,
                body: req.body.to_vec(),
            },
            lease: self.policy.lease,
            replay_window: self.policy.replay_window,
            lock_wait: match self.policy.in_flight {
                InFlightBehavior::Wait(d) => d,
                _ => Duration::ZERO,
            },
            resume: req.resume,
            recovery_point: None,
        }
    }

    /// Begins a request with no caller deadline: [`Engine::begin_until`] with `None`.
    pub async fn begin(&self, claim: ClaimRequest) -> Result<Attempt, Refused> {
        self.begin_until(claim, None).await
    }

    /// Begins a request: claims its key (waiting for a live holder when the
    /// policy says so), in an `idemkit.claim` span recording the outcome and
    /// fencing token. `Ok` hands the caller the attempt to run its handler
    /// under; `Err` is the answer to give without running anything.
    ///
    /// `deadline` is the caller's (from `grpc-timeout` or the REST
    /// [`idemkit_core::wire::REQUEST_TIMEOUT`]). A request whose deadline has already
    /// passed is refused with `deadline_exceeded` before its key is claimed:
    /// nothing is written and the key stays free. A completed request's stored
    /// answer is still replayed whatever the deadline (a replay costs nothing,
    /// the behaviour contract, `docs/spec.md` §10): its record is read, not claimed. Waiting for a live holder
    /// (the `wait` in-flight behaviour) stops at the deadline. The attempt
    /// carries the deadline so the adapter can hand the remaining time on.
    pub async fn begin_until(
        &self,
        claim: ClaimRequest,
        deadline: Option<Instant>,
    ) -> Result<Attempt, Refused> {
        if let Some(replays) = &self.replays
            && claim.resume.is_none()
            && let Some(stored) = replays.get(&claim.scope, &claim.fingerprint)
        {
            tracing::debug!(
                status = stored.status,
                "idempotency: replay from the process's cache"
            );
            return Err(Refused::new(outcome::REPLAYED, Refusal::Replay(stored)));
        }
        if let Some(refused) = deadline_refusal(deadline) {
            return Err(self.replay_or(&claim, refused).await);
        }
        let span = tracing::info_span!("idemkit.claim", outcome = Empty, token = Empty);
        let result = self.acquire(&claim, deadline).instrument(span.clone()).await;
        match &result {
            Ok((lease, _)) => {
                span.record("token", lease.token.0);
                span.record(
                    "outcome",
                    if lease.resumed_from.is_some() {
                        "resumed"
                    } else {
                        "claimed"
                    },
                );
            }
            Err(refused) => {
                span.record("outcome", refused.outcome);
            }
        }
        result.map(|(lease, tx)| Attempt::new(self.clone(), Arc::new(claim), lease, tx, deadline))
    }

    /// The stored answer of a completed request (a read, no claim), or
    /// `refused` when there is none (or the record cannot be read).
    async fn replay_or(&self, claim: &ClaimRequest, refused: Refused) -> Refused {
        if claim.resume.is_some() {
            return refused;
        }
        match timed(op::GET, self.store.get(&claim.scope)).await {
            Ok(Some(record)) => {
                let head = RecordHead::from(&record);
                if claim.decide(Some(&head), self.store.now()) == Decision::Replay
                    && let Some(stored) = record.response
                {
                    tracing::debug!(
                        status = stored.status,
                        "idempotency: replay, although the caller's deadline has passed"
                    );
                    return Refused::new(outcome::REPLAYED, Refusal::Replay(stored));
                }
            }
            Ok(None) => {}
            Err(e) => {
                tracing::debug!(error = %e, "idempotency: could not look for a replay past the deadline")
            }
        }
        refused
    }

    async fn acquire(
        &self,
        claim: &ClaimRequest,
        deadline: Option<Instant>,
    ) -> Result<(idemkit_core::Lease, Option<Box<dyn std::any::Any + Send>>), Refused> {
        let wait_until = match self.policy.in_flight {
            // Waiting past the caller's deadline helps nobody.
            InFlightBehavior::Wait(d) => Some(match deadline {
                Some(deadline) => (tokio::time::Instant::now() + d).min(deadline.into()),
                None => tokio::time::Instant::now() + d,
            }),
            _ => None,
        };
        let mut poll = Duration::from_millis(20);
        loop {
            let outcome = match &self.tx_store {
                Some(tx_store) => match timed(op::CLAIM, tx_store.claim_in_tx(claim)).await {
                    Ok(TxClaim::Claimed { tx, lease }) => return Ok((lease, Some(tx))),
                    Ok(TxClaim::Other(o)) => o,
                    Err(e) => return Err(Refused::store(&e)),
                },
                None => match timed(op::CLAIM, self.store.claim(claim)).await {
                    Ok(ClaimOutcome::Claimed(lease)) => return Ok((lease, None)),
                    Ok(o) => o,
                    Err(e) => return Err(Refused::store(&e)),
                },
            };
            match outcome {
                ClaimOutcome::Replay(stored) => {
                    tracing::debug!(status = stored.status, "idempotency: replay");
                    return Err(Refused::new(outcome::REPLAYED, Refusal::Replay(stored)));
                }
                ClaimOutcome::Mismatch => {
                    tracing::debug!("idempotency: key reused with a different request");
                    return Err(Refused::new(
                        outcome::KEY_REUSED,
                        Refusal::Problem {
                            problem: Problem::new(
                                ErrorCode::KeyReused,
                                "this idempotency key was already used with a different request (method, path, query or body); use a new key for a new request",
                            )
                            .with_status(self.policy.mismatch_status.as_u16()),
                            retry_after: None,
                        },
                    ));
                }
                ClaimOutcome::Parked => {
                    return Err(Refused::new(
                        outcome::PARKED,
                        Refusal::problem(
                            ErrorCode::RequestParked,
                            "this request was parked for human review (an external call's outcome is unknown); \
                             it will not run again",
                        ),
                    ));
                }
                ClaimOutcome::Stale => {
                    // Only the completer resumes; the record moved on since it listed it.
                    return Err(Refused::new(
                        outcome::STALE,
                        Refusal::problem(
                            ErrorCode::RequestInProgress,
                            "the abandoned attempt this resume was for is no longer abandoned; nothing ran",
                        )
                        .with_retry_after(Duration::from_secs(1)),
                    ));
                }
                ClaimOutcome::InProgress { retry_after }
                    if self.policy.in_flight == InFlightBehavior::Accepted =>
                {
                    return Err(Refused::new(
                        outcome::IN_PROGRESS,
                        Refusal::Accepted {
                            retry_after: self.policy.in_progress_hint(retry_after),
                        },
                    ));
                }
                ClaimOutcome::InProgress { retry_after } => {
                    let now = tokio::time::Instant::now();
                    match wait_until {
                        Some(until) if now < until => {
                            // Jittered polling, doubling up to 250 ms: many waiters on one
                            // key do not hit the store in lock-step.
                            let jitter = rand::random_range(0.5..1.0);
                            let nap = poll.mul_f64(jitter).min(until - now);
                            if self.store.notifies_changes() {
                                // Woken by the store when the holder finishes; the
                                // timeout only bounds a lost notification.
                                let bound = (until - now).min(Duration::from_secs(1));
                                if let Err(e) = self.store.wait_for_change(&claim.scope, bound).await {
                                    return Err(Refused::store(&e));
                                }
                            } else {
                                tokio::time::sleep(nap).await;
                                poll = (poll * 2).min(Duration::from_millis(250));
                            }
                        }
                        _ => {
                            tracing::debug!("idempotency: request in progress");
                            return Err(Refused::new(
                                outcome::IN_PROGRESS,
                                Refusal::problem(
                                    ErrorCode::RequestInProgress,
                                    "a request with this idempotency key is still being processed; retry after the indicated delay",
                                )
                                .with_retry_after(self.policy.in_progress_hint(retry_after)),
                            ));
                        }
                    }
                }
                _ => {
                    return Err(Refused::new(
                        outcome::ERROR,
                        Refusal::problem(ErrorCode::Internal, "unknown claim outcome"),
                    ));
                }
            }
        }
    }
}

/// What the caller of a panicked handler is told, given how its attempt was
/// settled (the `Err` of [`Attempt::catch_panic`]).
pub fn panic_detail(settled: &str) -> &'static str {
    match settled {
        outcome::RELEASED => {
            "the handler failed before recording any progress; the key is free, retry with it"
        }
        outcome::ABANDONED => {
            "the handler failed after recording progress; retry with the same key to resume"
        }
        outcome::PARKED => {
            "the handler failed on every resume; the request was parked for review and will not run again"
        }
        _ => "the handler failed; retry with the same key to get the request's result",
    }
}

/// The time left until `deadline` (zero once it has passed); `None` without one.
pub fn remaining(deadline: Option<Instant>) -> Option<Duration> {
    deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The refusal of a request whose deadline has already passed (before claiming).
fn deadline_refusal(deadline: Option<Instant>) -> Option<Refused> {
    let deadline = deadline?;
    if Instant::now() < deadline {
        return None;
    }
    tracing::debug!("idempotency: the caller's deadline has passed; refused before claiming");
    Some(Refused::new(
        outcome::REJECTED,
        Refusal::problem(
            ErrorCode::DeadlineExceeded,
            "the caller's deadline had passed when the request arrived; nothing ran and the key was not claimed",
        ),
    ))
}

/// A stored response for a problem document (what a failure that must be
/// replayed is stored as).
pub(crate) fn stored_problem(problem: &Problem) -> StoredResponse {
    StoredResponse {
        status: problem.status,
        headers: vec![StoredHeader {
            name: "content-type".into(),
            value: idemkit_core::PROBLEM_CONTENT_TYPE.as_bytes().to_vec(),
        }],
        body: problem.to_json(),
    }
}

/// The status a replay answers with: the stored one, or the route's replay
/// status for a stored 2xx.
pub fn replay_status(stored: &StoredResponse, policy: &Policy) -> u16 {
    match policy.replay_status {
        Some(s) if (200..300).contains(&stored.status) => s,
        _ => stored.status,
    }
}

#[cfg(test)]
mod tests {
    /// The engine stays protocol-neutral: no source file of this module tree
    /// names a protocol crate.
    #[test]
    fn the_engine_knows_no_protocol() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/engine");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for banned in ["axum", "hyper", "http_body", "tonic", "http::"] {
                let hits = text
                    .lines()
                    .filter(|l| !l.trim_start().starts_with("//"))
                    .filter(|l| l.contains(banned) && !l.contains("\""))
                    .count();
                assert_eq!(hits, 0, "{} names `{banned}`", path.display());
            }
        }
    }
}
