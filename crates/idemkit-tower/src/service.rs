//! The service: claim → handler → store → response, or replay at the claim.

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Limited};
use idemkit_core::{
    ClaimOutcome, ClaimRequest, ErrorCode, FencingToken, IdempotencyKey, InFlightBehavior, KeyError,
    KeyStore, Lease, Policy, Scope, ServerErrorPolicy, StoreError, StoredHeader, StoredRequest,
    StoredResponse, TxClaim,
};
use tokio::task::JoinHandle;
use tower::Service;
use tracing::Instrument;
use tracing::field::Empty;

use crate::extract::{IdempotencyContext, TxSlot};
use crate::layer::{IDEMPOTENT_REPLAYED, KeySource, Shared};
use crate::metrics::{self, InFlight, Settled, op, outcome, timed};
use crate::{Outcome, ProblemResponse};

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Request headers kept with the record (for the completer); never credentials.
const STORED_REQUEST_HEADERS: &[&str] = &["content-type", "accept", "content-language"];

/// The service [`crate::IdempotencyLayer`] wraps around a route.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> std::fmt::Debug for Idempotency<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").finish_non_exhaustive()
    }
}

impl<S> Idempotency<S> {
    pub(crate) fn new(inner: S, shared: Arc<Shared>) -> Self {
        Self { inner, shared }
    }
}

impl<S, B> Service<Request<Body>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // Use the instance that was driven to readiness; leave a fresh clone behind.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        if !shared.methods.contains(req.method()) {
            return Box::pin(async move { Ok(inner.call(req).await?.map(Body::new)) });
        }
        Box::pin(process(shared, inner, req))
    }
}

/// The claim a request holds while its handler runs.
enum Held {
    /// Generic mode: committed `in_flight` with a lease.
    Lease(Lease),
    /// Single-step mode: the open transaction holding the uncommitted claim.
    Tx(Box<dyn Any + Send>, Lease),
}

impl Held {
    fn lease(&self) -> &Lease {
        match self {
            Self::Lease(l) | Self::Tx(_, l) => l,
        }
    }
}

/// What happens to the handler's response (SPEC §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Disposition {
    Store,
    Release,
    Abandon,
    /// The handler settled the record itself.
    Leave,
}

impl Disposition {
    const fn label(self) -> &'static str {
        match self {
            Self::Store => "store",
            Self::Release => "release",
            Self::Abandon => "abandon",
            Self::Leave => "leave",
        }
    }
}

fn disposition(status: StatusCode, outcome: Option<Outcome>, policy: &Policy) -> Disposition {
    match outcome {
        Some(Outcome::Final) => return Disposition::Store,
        Some(Outcome::Retryable) => return Disposition::Abandon,
        Some(Outcome::Settled) => return Disposition::Leave,
        None => {}
    }
    if status.is_server_error() {
        return match policy.on_server_error {
            ServerErrorPolicy::Replay => Disposition::Store,
            _ => Disposition::Release,
        };
    }
    match status.as_u16() {
        // Rejected before any side effect (validation, auth, size, media type) or
        // transient (timeout, too early, throttled): the corrected or later request
        // may reuse the key.
        400 | 401 | 403 | 408 | 413 | 415 | 422 | 425 | 429 => Disposition::Release,
        _ => Disposition::Store,
    }
}

/// A request answered without running the handler, and how it counts.
struct Refused {
    response: Response,
    outcome: &'static str,
}

impl Refused {
    fn new(outcome: &'static str, response: impl IntoResponse) -> Self {
        Self {
            response: response.into_response(),
            outcome,
        }
    }

    fn store(e: &StoreError) -> Self {
        Self::new(metrics::store_outcome(e), store_problem(e))
    }
}

/// One request under the layer: counted once in [`metrics::REQUESTS`] and traced
/// as an `idemkit.request` span. Spans and events carry a short digest of
/// (account, key), never the key, the account or a body.
async fn process<S, B>(shared: Arc<Shared>, inner: S, req: Request<Body>) -> Result<Response, S::Error>
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let span = tracing::info_span!("idemkit.request", key_hash = Empty, outcome = Empty);
    let (outcome, result) = handle(shared, inner, req).instrument(span.clone()).await;
    span.record("outcome", outcome);
    metrics::request(outcome);
    result
}

async fn handle<S, B>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<Body>,
) -> (&'static str, Result<Response, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    let (claim, bytes) = match prepare(&shared, &parts, body).await {
        Ok(p) => p,
        Err(problem) => {
            let outcome = match problem.problem.code {
                ErrorCode::KeyMissing => outcome::KEY_MISSING,
                ErrorCode::KeyInvalid => outcome::KEY_INVALID,
                _ => outcome::REJECTED,
            };
            return (outcome, Ok(problem.into_response()));
        }
    };
    let span = tracing::Span::current();
    if !span.is_disabled() {
        // Hashed only when someone listens: requests without a subscriber pay nothing.
        span.record("key_hash", metrics::key_hash(&claim.scope));
    }
    let held = match claim_key(&shared, &claim).await {
        Ok(held) => held,
        Err(refused) => return (refused.outcome, Ok(refused.response)),
    };
    if matches!(held, Held::Tx(..)) {
        // Single-step: if the client goes away the connection's future is
        // dropped, the transaction rolls back and the key is free again.
        return execute(&shared, inner, parts, bytes, claim, held).await;
    }
    // Lease mode: the claim is committed, so the work goes on to completion
    // detached from the connection (SPEC §3). A client that hangs up mid-request
    // (exactly when clients retry) leaves neither a half-run handler nor a key
    // stuck until its lease expires: its retry waits for, or replays, the result.
    let scope = claim.scope.clone();
    let lease = held.lease().clone();
    let task = {
        let shared = shared.clone();
        tokio::spawn(
            async move { execute(&shared, inner, parts, bytes, claim, held).await }
                .instrument(tracing::Span::current()),
        )
    };
    match task.await {
        Ok(done) => done,
        Err(e) => {
            // The handler panicked (or the runtime is shutting down): nothing to
            // store; hand the key back, or keep recorded progress resumable.
            tracing::error!(error = %e, "idempotency: the handler task failed");
            let counted = settle_unstored(&shared, None, &scope, &lease, Disposition::Release).await;
            let problem = ProblemResponse::new(ErrorCode::Internal, "the handler failed");
            (
                if counted == outcome::LEASE_LOST {
                    counted
                } else {
                    outcome::ERROR
                },
                Ok(problem.into_response()),
            )
        }
    }
}

/// Resolves the account, reads the key and the body, and fingerprints.
async fn prepare(
    shared: &Shared,
    parts: &Parts,
    body: Body,
) -> Result<(ClaimRequest, Bytes), ProblemResponse> {
    // The completer replays a stored request in-process for its record's own
    // (account, key); clients cannot set request extensions.
    if let Some(resume) = parts.extensions.get::<crate::jobs::Resume>() {
        let bytes = read_body(body, shared.max_request_body).await?;
        return Ok(claim_request(
            shared,
            parts,
            resume.scope.clone(),
            bytes,
            Some(resume.token),
        ));
    }
    let account = shared.resolver.resolve(parts)?;
    // A header key is checked before the body is read: a bad key costs nothing.
    let header_key = match &shared.key_source {
        KeySource::Header(name) => Some(IdempotencyKey::from_header_values(
            parts.headers.get_all(name).iter().map(HeaderValue::as_bytes),
        )),
        KeySource::JsonField(_) => None,
    };
    if let Some(Err(e)) = &header_key {
        return Err(key_problem(e));
    }
    let bytes = read_body(body, shared.max_request_body).await?;
    if let Some(validate) = &shared.validator {
        // The route's own validation comes before the key is looked up: an invalid
        // body is answered the same whatever state its key is in.
        validate(parts, &bytes)?;
    }
    let key = match (header_key, &shared.key_source) {
        (Some(Ok(k)), _) => k,
        (_, KeySource::JsonField(pointer)) => key_from_json(&bytes, pointer)?,
        _ => unreachable!("header keys were checked above"),
    };
    Ok(claim_request(
        shared,
        parts,
        Scope::new(account, key),
        bytes,
        None,
    ))
}

fn claim_request(
    shared: &Shared,
    parts: &Parts,
    scope: Scope,
    bytes: Bytes,
    resume: Option<FencingToken>,
) -> (ClaimRequest, Bytes) {
    // The query string is part of the request (SPEC §2).
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |p| p.as_str());
    let fingerprint = shared
        .fingerprinter
        .compute(parts.method.as_str(), target, &bytes);
    let request = StoredRequest {
        method: parts.method.to_string(),
        path: target.to_owned(),
        headers: STORED_REQUEST_HEADERS
            .iter()
            .filter_map(|name| {
                parts.headers.get(*name).map(|v| StoredHeader {
                    name: (*name).to_owned(),
                    value: v.as_bytes().to_vec(),
                })
            })
            .collect(),
        body: bytes.to_vec(),
    };
    let claim = ClaimRequest {
        scope,
        fingerprint,
        request,
        lease: shared.policy.lease,
        replay_window: shared.policy.replay_window,
        lock_wait: match shared.policy.in_flight {
            InFlightBehavior::Wait(d) => d,
            _ => Duration::ZERO,
        },
        resume,
    };
    (claim, bytes)
}

fn key_problem(e: &KeyError) -> ProblemResponse {
    ProblemResponse::new(e.code(), e.to_string())
}

/// How much of an oversized body is read and discarded before answering 413, so
/// that clients still sending get the problem document instead of a reset.
const OVERSIZE_DRAIN: usize = 8 * 1024 * 1024;

async fn read_body(mut body: Body, limit: usize) -> Result<Bytes, ProblemResponse> {
    let mut buf = bytes::BytesMut::new();
    let mut seen = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ProblemResponse::new(
                ErrorCode::ValidationFailed,
                format!("could not read the request body: {e}"),
            )
        })?;
        let Ok(data) = frame.into_data() else { continue };
        seen = seen.saturating_add(data.len());
        if seen <= limit {
            buf.extend_from_slice(&data);
        } else if seen > limit.saturating_add(OVERSIZE_DRAIN) {
            break;
        }
    }
    if seen > limit {
        return Err(ProblemResponse::new(
            ErrorCode::PayloadTooLarge,
            format!("the request body is larger than {limit} bytes"),
        ));
    }
    Ok(buf.freeze())
}

fn key_from_json(bytes: &[u8], pointer: &str) -> Result<IdempotencyKey, ProblemResponse> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        ProblemResponse::new(
            ErrorCode::ValidationFailed,
            format!("the body is not valid JSON: {e}"),
        )
    })?;
    match value.pointer(pointer) {
        None | Some(serde_json::Value::Null) => Err(key_problem(&KeyError::Missing)),
        Some(serde_json::Value::String(s)) => IdempotencyKey::parse(s).map_err(|e| key_problem(&e)),
        Some(_) => Err(ProblemResponse::new(
            ErrorCode::KeyInvalid,
            format!("`{pointer}` must be a string"),
        )),
    }
}

/// [`acquire`] in an `idemkit.claim` span recording its outcome and fencing token.
async fn claim_key(shared: &Shared, claim: &ClaimRequest) -> Result<Held, Refused> {
    let span = tracing::info_span!("idemkit.claim", outcome = Empty, token = Empty);
    let result = acquire(shared, claim).instrument(span.clone()).await;
    match &result {
        Ok(held) => {
            let lease = held.lease();
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
    result
}

/// Claims the key, waiting for a live holder when the policy says so.
async fn acquire(shared: &Shared, claim: &ClaimRequest) -> Result<Held, Refused> {
    let wait_until = match shared.policy.in_flight {
        InFlightBehavior::Wait(d) => Some(tokio::time::Instant::now() + d),
        _ => None,
    };
    let mut poll = Duration::from_millis(20);
    loop {
        let outcome = match &shared.tx_store {
            Some(tx_store) => match timed(op::CLAIM, tx_store.claim_in_tx(claim)).await {
                Ok(TxClaim::Claimed { tx, lease }) => return Ok(Held::Tx(tx, lease)),
                Ok(TxClaim::Other(o)) => o,
                Err(e) => return Err(Refused::store(&e)),
            },
            None => match timed(op::CLAIM, shared.store.claim(claim)).await {
                Ok(ClaimOutcome::Claimed(lease)) => return Ok(Held::Lease(lease)),
                Ok(o) => o,
                Err(e) => return Err(Refused::store(&e)),
            },
        };
        match outcome {
            ClaimOutcome::Replay(stored) => {
                tracing::debug!(status = stored.status, "idempotency: replay");
                return Err(Refused::new(
                    outcome::REPLAYED,
                    replay_response(stored, &shared.policy),
                ));
            }
            ClaimOutcome::Mismatch => {
                tracing::debug!("idempotency: key reused with a different request");
                return Err(Refused::new(
                    outcome::KEY_REUSED,
                    ProblemResponse::new(
                        ErrorCode::KeyReused,
                        "this idempotency key was already used with a different request (method, path or body); use a new key for a new request",
                    )
                    .with_status(shared.policy.mismatch_status.as_u16()),
                ));
            }
            ClaimOutcome::Parked => {
                return Err(Refused::new(
                    outcome::PARKED,
                    ProblemResponse::new(
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
                    ProblemResponse::new(
                        ErrorCode::RequestInProgress,
                        "the abandoned attempt this resume was for is no longer abandoned; nothing ran",
                    )
                    .retry_after(Duration::from_secs(1)),
                ));
            }
            ClaimOutcome::InProgress { retry_after }
                if shared.policy.in_flight == InFlightBehavior::Accepted =>
            {
                return Err(Refused::new(
                    outcome::IN_PROGRESS,
                    crate::status::accepted(
                        shared,
                        &claim.scope,
                        shared.policy.in_progress_hint(retry_after),
                    ),
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
                        if shared.store.notifies_changes() {
                            // Woken by the store when the holder finishes; the
                            // timeout only bounds a lost notification.
                            let bound = (until - now).min(Duration::from_secs(1));
                            if let Err(e) = shared.store.wait_for_change(&claim.scope, bound).await {
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
                            ProblemResponse::new(
                                ErrorCode::RequestInProgress,
                                "a request with this idempotency key is still being processed; retry after the indicated delay",
                            )
                            .retry_after(shared.policy.in_progress_hint(retry_after)),
                        ));
                    }
                }
            }
            _ => {
                return Err(Refused::new(
                    outcome::ERROR,
                    ProblemResponse::new(ErrorCode::Internal, "unknown claim outcome"),
                ));
            }
        }
    }
}

/// Aborts the heartbeat when the request ends, however it ends (including a
/// dropped future when the client disconnects).
struct AbortOnDrop(JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the handler; if it is still running after one heartbeat interval, a
/// heartbeat task starts beating at once and keeps the lease alive until the
/// handler ends. Most handlers finish well within a third of the lease and never
/// pay for a spawned task; the task (not an inline future) is what keeps beating
/// even if a handler blocks its executor thread.
async fn with_heartbeat<F: std::future::Future>(
    handler: F,
    store: &Arc<dyn KeyStore>,
    scope: &Scope,
    lease: &Lease,
    policy: &Policy,
) -> F::Output {
    // Policy validation keeps the lease positive; the floor only guards the timer.
    let every = policy.heartbeat_interval().max(Duration::from_millis(1));
    tokio::pin!(handler);
    tokio::select! {
        biased;
        out = &mut handler => out,
        () = tokio::time::sleep(every) => {
            let _heartbeat = spawn_heartbeat(store.clone(), scope.clone(), lease, policy.lease, every);
            handler.await
        }
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

async fn execute<S, B>(
    shared: &Shared,
    mut inner: S,
    parts: Parts,
    bytes: Bytes,
    claim: ClaimRequest,
    held: Held,
) -> (&'static str, Result<Response, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let _in_flight = InFlight::enter();
    let scope = claim.scope.clone();
    let lease = held.lease().clone();
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(IdempotencyContext {
        scope: scope.clone(),
        token: lease.token,
        resumed_from: lease.resumed_from.clone(),
        policy: shared.policy.clone(),
    });
    let slot = match held {
        Held::Tx(tx, _) => {
            let slot = TxSlot::default();
            slot.put(tx);
            req.extensions_mut().insert(slot.clone());
            Some(slot)
        }
        Held::Lease(_) => None,
    };

    fail::fail_point!("idemkit::after_claim");
    let result = match slot {
        // Single-step claims are invisible until they commit: nothing to keep alive.
        Some(_) => inner.call(req).await,
        None => with_heartbeat(inner.call(req), &shared.store, &scope, &lease, &shared.policy).await,
    };
    let span = tracing::info_span!(
        "idemkit.complete",
        token = lease.token.0,
        status = Empty,
        disposition = Empty,
        outcome = Empty
    );
    let (counted, result) = async {
        let response = match result {
            Ok(r) => r,
            Err(e) => {
                // The handler failed without an answer: nothing to store.
                tracing::Span::current().record("disposition", "release");
                let counted = settle_unstored(shared, slot, &scope, &lease, Disposition::Release).await;
                return (counted, Err(e));
            }
        };
        let handler_outcome = response.extensions().get::<Outcome>().copied();
        let how = disposition(response.status(), handler_outcome, &shared.policy);
        let current = tracing::Span::current();
        current.record("status", response.status().as_u16());
        current.record("disposition", how.label());
        match how {
            Disposition::Store => {
                let (counted, response) = store_response(shared, slot, &claim, &lease, response).await;
                (counted, Ok(response))
            }
            Disposition::Leave => {
                let counted = response
                    .extensions()
                    .get::<Settled>()
                    .map_or(outcome::EXECUTED, |s| s.0);
                (counted, Ok(response.map(Body::new)))
            }
            other => {
                let counted = settle_unstored(shared, slot, &scope, &lease, other).await;
                (counted, Ok(response.map(Body::new)))
            }
        }
    }
    .instrument(span.clone())
    .await;
    span.record("outcome", counted);
    (counted, result)
}

/// Releases or abandons the key without storing a response, and says which
/// (an [`outcome`]). In single-step mode both are a rollback: the claim was
/// never committed.
async fn settle_unstored(
    shared: &Shared,
    slot: Option<TxSlot>,
    scope: &Scope,
    lease: &Lease,
    how: Disposition,
) -> &'static str {
    if let Some(slot) = slot {
        drop(slot.take());
        return outcome::RELEASED;
    }
    let store = shared.store.as_ref();
    let (counted, result) = match how {
        Disposition::Abandon => (
            outcome::ABANDONED,
            timed(
                op::ABANDON,
                store.abandon(scope, lease.token, "handler marked the outcome retryable"),
            )
            .await,
        ),
        // A request that recorded progress (a phase, an external-call intent)
        // keeps it: the next attempt resumes from the recovery point instead of
        // starting over. When the read fails (the store flapping) progress may
        // exist, so the record is abandoned, never released; and the store's
        // release itself refuses to wipe recorded progress.
        _ => match timed(op::GET, store.get(scope)).await {
            Ok(Some(r)) if r.recovery_point.is_none() && r.step_outputs.is_empty() => (
                outcome::RELEASED,
                timed(op::RELEASE, store.release(scope, lease.token)).await,
            ),
            Ok(Some(_)) => (
                outcome::ABANDONED,
                timed(
                    op::ABANDON,
                    store.abandon(scope, lease.token, "the handler failed after recording progress"),
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
                            lease.token,
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

async fn store_response<B>(
    shared: &Shared,
    slot: Option<TxSlot>,
    claim: &ClaimRequest,
    lease: &Lease,
    response: Response<B>,
) -> (&'static str, Response)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let scope = &claim.scope;
    let (parts, body) = response.into_parts();
    let cap = shared.policy.max_stored_body;
    let body = match Limited::new(body, cap).collect().await {
        Ok(c) => c.to_bytes(),
        Err(e) => {
            let too_large = e.is::<http_body_util::LengthLimitError>();
            let problem = if too_large {
                ProblemResponse::new(
                    ErrorCode::ResponseTooLarge,
                    format!("the response is larger than the {cap}-byte storage cap; nothing was committed"),
                )
            } else {
                ProblemResponse::new(ErrorCode::Internal, "the handler's response body failed")
            };
            return match slot {
                // Single-step: roll everything back; nothing happened.
                Some(slot) => {
                    drop(slot.take());
                    (outcome::ERROR, problem.into_response())
                }
                // Generic: the handler's effects may have happened, so the failure is
                // what the key now answers (too large), or the key is released (body error).
                None if too_large => {
                    let stored = stored_problem(&problem);
                    match complete_with_retry(shared.store.as_ref(), scope, lease, &stored).await {
                        Ok(()) => (outcome::ERROR, problem.into_response()),
                        Err(e) => (metrics::store_outcome(&e), store_problem(&e).into_response()),
                    }
                }
                None => {
                    settle_unstored(shared, None, scope, lease, Disposition::Release).await;
                    (outcome::ERROR, problem.into_response())
                }
            };
        }
    };
    let stored = StoredResponse {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| shared.policy.replays_header(name.as_str()))
            .map(|(name, value)| StoredHeader {
                name: name.as_str().to_owned(),
                value: value.as_bytes().to_vec(),
            })
            .collect(),
        body: body.to_vec(),
    };
    let committed = match slot {
        Some(slot) => match slot.take() {
            Some(tx) => match &shared.tx_store {
                Some(tx_store) => {
                    timed(
                        op::COMPLETE,
                        tx_store.complete_in_tx(tx, scope, lease.token, &stored),
                    )
                    .await
                }
                None => Err(StoreError::Corrupt(
                    "transaction without a transactional store".into(),
                )),
            },
            None => {
                return (
                    outcome::ERROR,
                    ProblemResponse::new(
                        ErrorCode::Internal,
                        "the handler kept the claim transaction past its return; rolled back",
                    )
                    .into_response(),
                );
            }
        },
        None => complete_with_retry(shared.store.as_ref(), scope, lease, &stored).await,
    };
    match committed {
        Ok(()) => (outcome::EXECUTED, Response::from_parts(parts, Body::from(body))),
        Err(StoreError::Conflict) => {
            // Another request with this key committed first and this attempt's
            // writes were rolled back: answer what the key now answers.
            tracing::debug!("idempotency: single-step claim lost the race at commit");
            match claim_key(shared, claim).await {
                Err(settled) => (settled.outcome, settled.response),
                Ok(_) => (
                    outcome::IN_PROGRESS,
                    ProblemResponse::new(
                        ErrorCode::RequestInProgress,
                        "a concurrent request with this idempotency key changed its state; retry",
                    )
                    .retry_after(Duration::from_secs(1))
                    .into_response(),
                ),
            }
        }
        Err(e) => (metrics::store_outcome(&e), store_problem(&e).into_response()),
    }
}

/// Generic-mode completion, retried briefly when the store is unavailable: the
/// handler's effects have happened, so giving up early costs a re-execution.
async fn complete_with_retry(
    store: &dyn KeyStore,
    scope: &Scope,
    lease: &Lease,
    stored: &StoredResponse,
) -> Result<(), StoreError> {
    let mut delay = Duration::from_millis(50);
    for attempt in 1.. {
        match timed(op::COMPLETE, store.complete(scope, lease.token, stored)).await {
            Err(StoreError::Unavailable(e)) if attempt < 4 => {
                tracing::warn!(error = %e, attempt, "idempotency: completion failed; retrying");
                tokio::time::sleep(delay.mul_f64(rand::random_range(0.5..1.0))).await;
                delay *= 2;
            }
            other => return other,
        }
    }
    unreachable!("the loop returns")
}

fn stored_problem(p: &ProblemResponse) -> StoredResponse {
    StoredResponse {
        status: p.problem.status,
        headers: vec![StoredHeader {
            name: "content-type".into(),
            value: idemkit_core::PROBLEM_CONTENT_TYPE.as_bytes().to_vec(),
        }],
        body: p.problem.to_json(),
    }
}

pub(crate) fn store_problem(e: &StoreError) -> ProblemResponse {
    match e {
        StoreError::Fenced => ProblemResponse::new(
            ErrorCode::LeaseLost,
            "this attempt's lease was taken over by a later attempt; its writes were discarded; retry to get the stored result",
        )
        .retry_after(Duration::from_secs(1)),
        StoreError::Unavailable(_) => {
            tracing::warn!(error = %e, "idempotency: store unavailable");
            ProblemResponse::new(ErrorCode::StoreUnavailable, "the idempotency store is unavailable; retry with the same key")
                .retry_after(Duration::from_secs(1))
        }
        _ => {
            tracing::error!(error = %e, "idempotency: store failure");
            ProblemResponse::new(ErrorCode::Internal, "the idempotency store failed; retry with the same key")
        }
    }
}

/// Rebuilds a stored response: same status (or the route's replay status for a
/// stored 2xx), allowlisted headers, byte-identical body, plus the replay marker.
pub(crate) fn replay_response(stored: StoredResponse, policy: &Policy) -> Response {
    let status = match policy.replay_status {
        Some(s) if (200..300).contains(&stored.status) => s,
        _ => stored.status,
    };
    let mut res = Response::new(Body::from(stored.body));
    *res.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    for h in stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(h.name.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) {
            res.headers_mut().append(name, value);
        }
    }
    res.headers_mut().insert(
        HeaderName::from_static(IDEMPOTENT_REPLAYED),
        HeaderValue::from_static("true"),
    );
    res
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispositions_follow_the_spec() {
        let p = Policy::new();
        let d = |s: u16, o| disposition(StatusCode::from_u16(s).unwrap(), o, &p);
        assert_eq!(d(201, None), Disposition::Store);
        assert_eq!(d(404, None), Disposition::Store);
        assert_eq!(d(409, None), Disposition::Store);
        assert_eq!(d(400, None), Disposition::Release);
        assert_eq!(d(422, None), Disposition::Release);
        assert_eq!(d(429, None), Disposition::Release);
        assert_eq!(d(500, None), Disposition::Release);
        assert_eq!(d(502, Some(Outcome::Final)), Disposition::Store);
        assert_eq!(d(201, Some(Outcome::Retryable)), Disposition::Abandon);
        let replay = Policy::new().with_server_error_policy(ServerErrorPolicy::Replay);
        assert_eq!(
            disposition(StatusCode::BAD_GATEWAY, None, &replay),
            Disposition::Store
        );
    }

    #[test]
    fn replay_status_override_applies_to_success_only() {
        let p = Policy::new().with_replay_status(200);
        let ok = replay_response(
            StoredResponse {
                status: 201,
                headers: vec![],
                body: b"x".to_vec(),
            },
            &p,
        );
        assert_eq!(ok.status(), 200);
        assert_eq!(ok.headers()[IDEMPOTENT_REPLAYED], "true");
        let failed = replay_response(
            StoredResponse {
                status: 502,
                headers: vec![],
                body: vec![],
            },
            &p,
        );
        assert_eq!(failed.status(), 502);
    }
}
