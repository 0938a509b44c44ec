//! The HTTP adapter over the engine: extract the key, account and body, begin,
//! run the handler under the attempt, finish, or answer the refusal (replay,
//! problem, `202`).

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Request};
use http_body_util::{BodyExt, Limited};
use idemkit_core::{ClaimRequest, ErrorCode, FencingToken, IdempotencyKey, Scope};
use tower::Service;
use tracing::Instrument;
use tracing::field::Empty;

use crate::extract::TxSlot;
use crate::future::ResponseFuture;
use crate::metrics::{self, InFlight, Settled, outcome};
use crate::response::{refusal_response, refused_response};
use crate::shared::{KeySource, Shared};
use crate::{ClaimMode, IdempotencyContext};
use crate::{Override, ProblemResponse};
use idemkit_engine::{
    Attempt, Detached, Disposition, Finished, Incoming, Panicked, key_from_json, key_problem,
};
use idemkit_engine::{STORED_REQUEST_HEADERS, completer_resume, stored_request_headers, stored_response};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

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

/// The layer takes a request with any [`http_body::Body`] (as tower-http's
/// layers do) and hands the service it wraps an axum [`Body`]: the request's
/// body is read once, for its fingerprint, and handed on as those bytes.
impl<S, B, ReqBody> Service<Request<ReqBody>> for Idempotency<S>
where
    S: Service<Request<Body>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ReqBody: http_body::Body<Data = Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        // An axum `Body` is taken as it is (`Body::new` does not box it twice).
        let req = req.map(Body::new);
        // Use the instance that was driven to readiness; leave a fresh clone behind.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        if !shared.methods.contains(req.method()) {
            return ResponseFuture::new(async move { Ok(inner.call(req).await?.map(Body::new)) });
        }
        ResponseFuture::new(process(shared, inner, req))
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
    let repeatable = matches!(shared.key_source, KeySource::Repeatability);
    let (outcome, mut result) = handle(shared, inner, req).instrument(span.clone()).await;
    if repeatable && let Ok(response) = &mut result {
        // OASIS Repeatable Requests: every answer says whether the request was
        // accepted (ran, or its first answer is replayed) or rejected because of
        // its repeatability headers.
        if let Some(value) = crate::conventions::repeatability_result(outcome, response.status().as_u16()) {
            response.headers_mut().insert(
                HeaderName::from_static(crate::shared::REPEATABILITY_RESULT),
                HeaderValue::from_static(value),
            );
        }
    }
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
    // The caller's budget counts from the moment its headers arrived.
    let deadline = request_deadline(&parts);
    let (claim, bytes) = match Box::pin(prepare(&shared, &parts, body)).await {
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
    if shared.engine.is_transactional() {
        // Single-step: if the client goes away the connection's future is
        // dropped, the transaction (claim included) rolls back and the key is
        // free again.
        return Box::pin(claim_and_execute(shared, inner, parts, bytes, claim, deadline)).await;
    }
    // Lease mode: the claim commits on its own, so the claim and the work go
    // on to completion detached from the connection (the behaviour contract, `docs/spec.md` §3). A client that
    // hangs up mid-request (exactly when clients retry), even while its key is
    // still being claimed, leaves neither a half-run handler nor a key held by
    // nobody until its lease expires: its retry waits for, or replays, the
    // result.
    let task = Detached::new(
        claim_and_execute(shared, inner, parts, bytes, claim, deadline).instrument(tracing::Span::current()),
    );
    match task.await {
        Ok(done) => done,
        // Not the handler (its panics are settled inside): the layer's own code.
        Err(Panicked) => (
            outcome::ERROR,
            Ok(ProblemResponse::new(ErrorCode::Internal, "the request failed").into_response()),
        ),
    }
}

/// Claims the key, runs the handler under the attempt and finishes it; a
/// panicking handler's attempt is settled here too, wherever this is polled.
async fn claim_and_execute<S, B>(
    shared: Arc<Shared>,
    inner: S,
    parts: Parts,
    bytes: Bytes,
    claim: ClaimRequest,
    deadline: Option<std::time::Instant>,
) -> (&'static str, Result<Response, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let scope = claim.scope.clone();
    let mut attempt = match Box::pin(shared.engine.begin_until(claim, deadline)).await {
        Ok(attempt) => attempt,
        Err(refused) => {
            return (
                refused.outcome,
                Ok(refusal_response(&shared, &scope, refused.refusal, &parts.headers)),
            );
        }
    };
    // Single-step: the claim's transaction, handed to the handler through
    // this slot (its `Tx` guard puts it back when dropped, a panic included).
    let slot = attempt.take_tx().map(|tx| {
        let slot = TxSlot::default();
        slot.put(tx);
        slot
    });
    let held = slot.clone();
    match attempt
        .catch_panic(|attempt| Box::pin(execute(inner, parts, bytes, attempt, slot)))
        .await
    {
        Ok(done) => done,
        Err(settled) => {
            // A panicked single-step handler's transaction is rolled back
            // before the answer, so the key's lock is free by then.
            if let Some(tx) = held.and_then(|s| s.take()) {
                shared.engine.rollback_tx(tx).await;
            }
            let problem = ProblemResponse::new(ErrorCode::Internal, idemkit_engine::panic_detail(settled));
            let counted = match settled {
                outcome::LEASE_LOST | outcome::PARKED => settled,
                _ => outcome::ERROR,
            };
            (counted, Ok(problem.into_response()))
        }
    }
}

/// The caller's deadline: now plus the milliseconds of the REST
/// [`idemkit_core::wire::REQUEST_TIMEOUT`]. A malformed or repeated header is ignored
/// (as gRPC servers ignore a malformed `grpc-timeout`); the completer's
/// in-process replays have none.
fn request_deadline(parts: &Parts) -> Option<std::time::Instant> {
    if completer_resume(&parts.extensions).is_some() {
        return None;
    }
    let mut values = parts.headers.get_all(idemkit_core::wire::REQUEST_TIMEOUT).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let budget = idemkit_core::parse_deadline_header(value.to_str().ok()?)?;
    // A budget too large to add is no deadline at all.
    std::time::Instant::now().checked_add(budget)
}

/// Resolves the account, reads the key and the body, and builds the claim.
async fn prepare(
    shared: &Shared,
    parts: &Parts,
    body: Body,
) -> Result<(ClaimRequest, Bytes), ProblemResponse> {
    // The completer replays a stored request in-process for its record's own
    // (account, key); clients cannot set request extensions.
    if let Some((scope, token)) = completer_resume(&parts.extensions) {
        let bytes = read_body(body, shared.max_request_body).await?;
        return Ok(claim_request(shared, parts, scope.clone(), bytes, Some(token)));
    }
    let account = shared.resolver.resolve(parts)?;
    // A header key is checked before the body is read: a bad key costs nothing.
    let header_key = match &shared.key_source {
        KeySource::Header(name) => Some(
            IdempotencyKey::from_header_values(parts.headers.get_all(name).iter().map(HeaderValue::as_bytes))
                .map_err(|e| ProblemResponse::from(key_problem(&e))),
        ),
        KeySource::Repeatability => Some(crate::conventions::read_repeatable(
            &parts.headers,
            shared.engine.policy().replay_window,
            std::time::SystemTime::now(),
        )),
        KeySource::JsonField(_) => None,
    };
    let header_key = header_key.transpose()?;
    let bytes = read_body(body, shared.max_request_body).await?;
    if let Some(validate) = &shared.validator {
        // The route's own validation comes before the key is looked up: an invalid
        // body is answered the same whatever state its key is in.
        validate(parts, &bytes)?;
    }
    let key = match (header_key, &shared.key_source) {
        (Some(k), _) => k,
        (None, KeySource::JsonField(pointer)) => key_from_json(&bytes, pointer)?,
        (None, _) => unreachable!("header keys were read above"),
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
    // The query string is part of the request (the behaviour contract, `docs/spec.md` §2).
    let target = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path(), |p| p.as_str());
    let claim = shared.engine.claim_request(Incoming {
        scope,
        method: parts.method.as_str(),
        target,
        headers: stored_request_headers(&parts.headers, STORED_REQUEST_HEADERS),
        body: &bytes,
        resume,
    });
    (claim, bytes)
}

/// How much of an oversized body is read and discarded before answering 413, so
/// that clients still sending get the problem document instead of a reset.
const OVERSIZE_DRAIN: usize = 8 * 1024 * 1024;

/// Reads a keyed request's body, as the layer does: up to `limit` bytes, else
/// `413 payload_too_large` (after draining up to 8 MiB more, so a client still
/// sending reads the problem instead of a reset); a body that fails to arrive
/// is `400 validation_failed`. `idemkit proxy` reads its keyed requests with it.
pub async fn read_body(mut body: Body, limit: usize) -> Result<Bytes, ProblemResponse> {
    // A body that arrives in one frame (most small ones) is kept as it came;
    // later frames are appended to a copy, sized once from the body's length
    // when it is declared (hyper's `Content-Length`): no buffer grown by
    // doubling, and no second copy left behind by each growth.
    let declared = usize::try_from(http_body::Body::size_hint(&body).lower())
        .unwrap_or(usize::MAX)
        .min(limit);
    let mut first: Option<Bytes> = None;
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
            match first.take() {
                None if buf.is_empty() => first = Some(data),
                held => {
                    if let Some(held) = held {
                        buf.reserve(declared.max(held.len() + data.len()));
                        buf.extend_from_slice(&held);
                    }
                    buf.extend_from_slice(&data);
                }
            }
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
    Ok(first.unwrap_or_else(|| buf.freeze()))
}

/// Runs the handler under the attempt and finishes it by the route's policy.
async fn execute<S, B>(
    mut inner: S,
    parts: Parts,
    bytes: Bytes,
    attempt: Attempt,
    slot: Option<TxSlot>,
) -> (&'static str, Result<Response, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let _in_flight = InFlight::enter();
    let lease = attempt.lease().clone();
    let mut req = Request::from_parts(parts, Body::from(bytes));
    req.extensions_mut().insert(IdempotencyContext::new(
        attempt.scope().clone(),
        lease.token,
        lease.resumed_from.clone(),
        attempt.policy().clone(),
        attempt.deadline(),
        if slot.is_some() {
            ClaimMode::SingleStep
        } else {
            ClaimMode::Lease
        },
    ));
    if let Some(slot) = &slot {
        req.extensions_mut().insert(slot.clone());
    }

    fail::fail_point!("idemkit::after_claim");
    let result = match attempt.deadline() {
        // Single-step: the caller's deadline bounds the handler. Dropping it
        // rolls its transaction (claim and business writes) back, exactly as
        // when the caller hangs up at its deadline, so nothing happened and the
        // key is free. Lease mode is never cut short: the claim is committed
        // and the work detached, so it runs to completion and stores its answer
        // for the caller's retry; the handler and its downstream calls get the
        // remaining time (`IdempotencyContext::remaining`) to honour instead.
        Some(deadline) if attempt.is_transactional() => {
            match tokio::time::timeout_at(deadline.into(), attempt.run(inner.call(req))).await {
                Ok(result) => result,
                Err(_) => {
                    // The handler's `Tx` guard put the transaction back when it
                    // was dropped. Dropped here too, not rolled back through the
                    // store: a statement the deadline cut short may still run,
                    // and an explicit rollback would wait for it. The caller's
                    // deadline has passed, so the answer goes now; the
                    // `ROLLBACK` follows with the connection's release.
                    drop(slot.and_then(|s| s.take()));
                    let counted = attempt.settle(None, Disposition::Release).await;
                    tracing::debug!(
                        "idempotency: the caller's deadline passed; the handler's transaction was rolled back"
                    );
                    let problem = ProblemResponse::new(
                        ErrorCode::DeadlineExceeded,
                        "the caller's deadline passed while the handler ran; its transaction was rolled back, nothing was stored and the key is free",
                    );
                    return (counted, Ok(problem.into_response()));
                }
            }
        }
        _ => attempt.run(inner.call(req)).await,
    };
    let tx = slot.and_then(|s| s.take());
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
                return (attempt.settle(tx, Disposition::Release).await, Err(e));
            }
        };
        let handler_outcome = response.extensions().get::<Override>().copied();
        let how = Disposition::of(response.status().as_u16(), handler_outcome, attempt.policy());
        let current = tracing::Span::current();
        current.record("status", response.status().as_u16());
        current.record("disposition", how.label());
        match how {
            Disposition::Store => {
                let (counted, response) = store_response(attempt, tx, response).await;
                (counted, Ok(response))
            }
            Disposition::Leave if attempt.is_transactional() => {
                let refused = attempt.refuse_settled(tx).await;
                (refused.outcome, Ok(refused_response(refused.refusal)))
            }
            Disposition::Leave => {
                let counted = response
                    .extensions()
                    .get::<Settled>()
                    .map_or(outcome::EXECUTED, |s| s.0);
                (counted, Ok(response.map(Body::new)))
            }
            other => (attempt.settle(tx, other).await, Ok(response.map(Body::new))),
        }
    }
    .instrument(span.clone())
    .await;
    span.record("outcome", counted);
    (counted, result)
}

/// Collects the handler's answer (up to the storage cap) and stores it.
async fn store_response<B>(
    attempt: Attempt,
    tx: Option<Box<dyn std::any::Any + Send>>,
    response: Response<B>,
) -> (&'static str, Response)
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = response.into_parts();
    let policy = attempt.policy().clone();
    if crate::conventions::is_streaming(&parts.headers) {
        // A stream has no end to wait for: recording it would hold the answer
        // until the cap, and replaying part of it would be a truncated replay.
        // It is refused like an oversized answer (nothing committed in
        // single-step mode; in lease mode the handler ran, so this failure is
        // what every retry gets, never a second run). The stream is dropped
        // unread.
        drop(body);
        let problem = ProblemResponse::new(
            ErrorCode::StreamingUnsupported,
            "the route answered with a stream (`text/event-stream`), which is never stored for replay; streaming answers belong on routes without idempotency keys",
        );
        let refused = attempt.unstorable(tx, problem.problem, true).await;
        return (refused.outcome, refused_response(refused.refusal));
    }
    let cap = policy.max_stored_body;
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
            let refused = attempt.unstorable(tx, problem.problem, too_large).await;
            return (refused.outcome, refused_response(refused.refusal));
        }
    };
    let stored = stored_response(&parts, &body, &policy);
    match attempt.store(tx, &stored).await {
        Finished::Stored => (outcome::EXECUTED, Response::from_parts(parts, Body::from(body))),
        Finished::Refused(refused) => (refused.outcome, refused_response(refused.refusal)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunked(chunks: &[&'static str]) -> Body {
        let frames: Vec<Result<Bytes, std::io::Error>> = chunks
            .iter()
            .map(|c| Ok(Bytes::from_static(c.as_bytes())))
            .collect();
        Body::from_stream(futures::stream::iter(frames))
    }

    #[tokio::test]
    async fn a_body_is_read_whole_from_any_number_of_frames() {
        let one = Bytes::from_static(b"{\"a\":1}");
        let read = read_body(Body::from(one.clone()), 1024).await.unwrap();
        assert_eq!(read, one);
        assert_eq!(read.as_ptr(), one.as_ptr(), "one frame is kept, not copied");
        for chunks in [
            &["{\"a\"", ":1", "}"][..],
            &["", "{\"a\":1}"][..],
            &["", "", "{\"a\"", "", ":1}"][..],
        ] {
            assert_eq!(read_body(chunked(chunks), 1024).await.unwrap(), one, "{chunks:?}");
        }
        let err = read_body(chunked(&["{\"a\"", ":1}"]), 5).await.unwrap_err();
        assert_eq!(err.problem.code, ErrorCode::PayloadTooLarge);
    }
}
