//! The gRPC adapter over the engine: resolve the account, read the key and the
//! one request message, begin, run the handler under the attempt, store its
//! response (message, metadata, trailers), or answer the refusal.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response};
use http_body_util::{BodyExt, Full, Limited};
use idemkit_core::{
    ClaimRequest, ErrorCode, IdempotencyKey, KeyError, NEVER_REPLAYED_HEADERS, Problem, Scope, StoredHeader,
    StoredResponse,
};
use idemkit_engine::metrics::outcome;
use idemkit_engine::{Attempt, Detached, Disposition, Finished, Incoming, Override, Panicked, Refusal};
use idemkit_engine::{ClaimMode, IdempotencyContext, stored_request_headers};
use tonic::Code;
use tonic::body::Body;
use tower::Service;
use tracing::Instrument;

use crate::body::Replayed;
use crate::frame::{self, FrameError};
use crate::layer::{KeyField, Shared};
use crate::status::{disposition, status_for};
use crate::{IDEMPOTENT_REPLAYED, TRAILER_PREFIX};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The future of [`Idempotency`].
pub type ResponseFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

/// Request metadata kept with the record; never credentials.
const STORED_REQUEST_HEADERS: &[&str] = &["content-type"];

/// Response metadata never stored: hop-by-hop and per-response entries.
const NEVER_STORED: &[&str] = &["date", "content-length", IDEMPOTENT_REPLAYED];

/// The service [`crate::IdempotencyLayer`] wraps around a tonic router.
#[derive(Clone)]
pub struct Idempotency<S> {
    inner: S,
    shared: Arc<Shared>,
}

/// The wrapped service keeps its gRPC service name, so the layered service can
/// be added to a tonic router (`Routes::add_service`, `Server::add_service`).
impl<S: tonic::server::NamedService> tonic::server::NamedService for Idempotency<S> {
    const NAME: &'static str = S::NAME;
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
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        // Use the instance that was driven to readiness; leave a fresh clone behind.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(&key_field) = self.shared.methods.get(req.uri().path()) else {
            return Box::pin(async move { Ok(inner.call(req).await?.map(Body::new)) });
        };
        let span = tracing::info_span!(
            "idemkit.grpc",
            method = req.uri().path(),
            outcome = tracing::field::Empty
        );
        let shared = self.shared.clone();
        Box::pin(
            async move {
                // Counted once in `idemkit_requests_total`, as the HTTP layer does.
                let (outcome, result) = handle(shared, inner, req, key_field).await;
                tracing::Span::current().record("outcome", outcome);
                idemkit_engine::metrics::request(outcome);
                result
            }
            .instrument(span),
        )
    }
}

async fn handle<S, B>(
    shared: Arc<Shared>,
    inner: S,
    req: Request<Body>,
    key_field: KeyField,
) -> (&'static str, Result<Response<Body>, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let (parts, body) = req.into_parts();
    // The caller's budget counts from the moment its headers arrived.
    let deadline = crate::deadline::request_deadline(&parts.headers);
    let (claim, bytes) = match prepare(&shared, &parts, body, key_field).await {
        Ok(p) => p,
        Err(status) => return (refused_outcome(&status), Ok(status.into_http())),
    };
    // The claim commits on its own, so the claim and the work go on to
    // completion detached from the call: a client that cancels (exactly when
    // clients retry), even while its key is still being claimed, leaves neither
    // a half-run handler nor a key held by nobody; its retry waits for, or
    // replays, the result. The same holds when tonic's server ends the call at
    // the caller's deadline: the handler is not cut short; it gets the
    // remaining time to honour (`IdempotencyContext::remaining` in the
    // request's extensions).
    let work = async move {
        let attempt = match shared.engine.begin_until(claim, deadline).await {
            Ok(attempt) => attempt,
            Err(refused) => return (refused.outcome, Ok(refusal_response(refused.refusal))),
        };
        // A panicking handler's attempt is settled here, wherever this runs
        // (on the call's task or, after the caller left, on its own).
        match attempt
            .catch_panic(|attempt| Box::pin(execute(inner, parts, bytes, attempt)))
            .await
        {
            Ok(done) => done,
            Err(settled) => {
                let counted = match settled {
                    outcome::LEASE_LOST | outcome::PARKED => settled,
                    _ => outcome::ERROR,
                };
                (
                    counted,
                    Ok(problem(ErrorCode::Internal, idemkit_engine::panic_detail(settled)).into_http()),
                )
            }
        }
    };
    match Detached::new(work.in_current_span()).await {
        Ok(done) => done,
        // Not the handler (its panics are settled inside): the layer's own code.
        Err(Panicked) => (
            outcome::ERROR,
            Ok(tonic::Status::internal("the call failed").into_http()),
        ),
    }
}

/// How a call refused before claiming counts: by its ErrorInfo reason.
fn refused_outcome(status: &tonic::Status) -> &'static str {
    use tonic_types::StatusExt;
    match status.get_error_details().error_info().map(|i| i.reason.as_str()) {
        Some(r) if r == ErrorCode::KeyMissing.as_str() => outcome::KEY_MISSING,
        Some(r) if r == ErrorCode::KeyInvalid.as_str() => outcome::KEY_INVALID,
        _ => outcome::REJECTED,
    }
}

/// Whether `raw` is a UUID in its canonical hyphenated form with version 4
/// and the RFC 9562 variant (either case).
fn is_uuid4(raw: &[u8]) -> bool {
    raw.len() == 36
        && raw.iter().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => *b == b'-',
            14 => *b == b'4',
            19 => matches!(b, b'8' | b'9' | b'a' | b'b' | b'A' | b'B'),
            _ => b.is_ascii_hexdigit(),
        })
}

use idemkit_core::wire::GRPC_PREVIOUS_RPC_ATTEMPTS as PREVIOUS_RPC_ATTEMPTS;

/// Counts keyed calls by the attempt they are (gRFC A6
/// `grpc-previous-rpc-attempts`, bucketed `0`, `1`, `2`, `3+`; a malformed
/// value counts as `0`), so an operator sees how often clients retry.
pub const ATTEMPTS_METRIC: &str = "idemkit_grpc_call_attempts_total";

fn count_attempt(headers: &http::HeaderMap) {
    let previous = headers
        .get(PREVIOUS_RPC_ATTEMPTS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(0);
    let bucket = match previous {
        0 => "0",
        1 => "1",
        2 => "2",
        _ => "3+",
    };
    metrics::counter!(ATTEMPTS_METRIC, "previous_attempts" => bucket).increment(1);
}

fn problem(code: ErrorCode, detail: impl Into<String>) -> tonic::Status {
    status_for(&Problem::new(code, detail), None)
}

fn key_status(e: &KeyError) -> tonic::Status {
    problem(e.code(), e.to_string())
}

/// Resolves the account, reads the key and the message, and builds the claim.
async fn prepare(
    shared: &Shared,
    parts: &Parts,
    body: Body,
    key_field: KeyField,
) -> Result<(ClaimRequest, Bytes), tonic::Status> {
    // The completer replays a stored call in-process for its record's own
    // (account, key) and the token it saw.
    if let Some((scope, token)) = idemkit_engine::completer_resume(&parts.extensions) {
        let bytes = read_body(body, shared.max_request_message.saturating_add(5)).await?;
        let mut claim = claim_for(shared, parts, scope.clone(), &bytes);
        claim.resume = Some(token);
        return Ok((claim, bytes));
    }
    count_attempt(&parts.headers);
    let account = shared
        .resolver
        .resolve(parts)
        .map_err(|refused| crate::status_for(&refused.problem, refused.retry_after))?;
    // A metadata key is checked before the message is read: a bad key costs nothing.
    let mut values = parts.headers.get_all(&shared.key_metadata).iter().peekable();
    let metadata_key = match values.peek() {
        None => None,
        Some(_) => Some(
            IdempotencyKey::from_header_values(values.map(HeaderValue::as_bytes))
                .map_err(|e| key_status(&e))?,
        ),
    };
    let bytes = read_body(body, shared.max_request_message.saturating_add(5)).await?;
    let message = frame::unary_message(&bytes).map_err(|e| match e {
        FrameError::Compressed => problem(ErrorCode::UnsupportedMediaType, e.detail()),
        _ => problem(ErrorCode::ValidationFailed, e.detail()),
    })?;
    let field_key = match key_field {
        KeyField::Metadata => None,
        KeyField::Field { number, uuid4 } => frame::string_field(message, number)
            .map_err(|_| {
                problem(
                    ErrorCode::ValidationFailed,
                    "the request message is not well-formed protobuf",
                )
            })?
            .map(|raw| {
                if uuid4 && !is_uuid4(raw) {
                    return Err(problem(
                        ErrorCode::KeyInvalid,
                        "the request id must be a UUID4 such as `7c9e6679-7425-40de-944b-e07fc1f90ae7` (AIP-155): generate it once per logical call and reuse it on every retry",
                    ));
                }
                IdempotencyKey::parse(raw).map_err(|e| key_status(&e))
            })
            .transpose()?,
    };
    let key = match (field_key, metadata_key) {
        (Some(field), Some(meta)) if field != meta => {
            return Err(problem(
                ErrorCode::KeyInvalid,
                format!(
                    "the request message's key field and the `{}` metadata name different keys",
                    shared.key_metadata
                ),
            ));
        }
        (Some(key), _) | (None, Some(key)) => key,
        (None, None) => return Err(key_status(&KeyError::Missing)),
    };
    let claim = claim_for(shared, parts, Scope::new(account, key), &bytes);
    Ok((claim, bytes))
}

/// The claim of a call: a gRPC call is a POST to its full method name; the
/// fingerprint covers the method name and the whole frame (prefix and message
/// bytes).
fn claim_for(shared: &Shared, parts: &Parts, scope: Scope, bytes: &Bytes) -> ClaimRequest {
    shared.engine.claim_request(Incoming {
        scope,
        method: "POST",
        target: parts.uri.path(),
        headers: stored_request_headers(&parts.headers, STORED_REQUEST_HEADERS),
        body: bytes,
        resume: None,
    })
}

async fn read_body(body: Body, limit: usize) -> Result<Bytes, tonic::Status> {
    match Limited::new(body, limit).collect().await {
        Ok(c) => Ok(c.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(problem(
            ErrorCode::PayloadTooLarge,
            format!("the request message is larger than {} bytes", limit - 5),
        )),
        Err(e) => Err(problem(
            ErrorCode::ValidationFailed,
            format!("could not read the request: {e}"),
        )),
    }
}

/// Runs the handler under the attempt and finishes it by the policy.
async fn execute<S, B>(
    mut inner: S,
    parts: Parts,
    bytes: Bytes,
    attempt: Attempt,
) -> (&'static str, Result<Response<Body>, S::Error>)
where
    S: Service<Request<Body>, Response = Response<B>> + Send + 'static,
    S::Future: Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let mut req = Request::from_parts(parts, Body::new(Full::new(bytes)));
    let lease = attempt.lease();
    req.extensions_mut().insert(IdempotencyContext::new(
        attempt.scope().clone(),
        lease.token,
        lease.resumed_from.clone(),
        attempt.policy().clone(),
        attempt.deadline(),
        ClaimMode::Lease,
    ));
    let response = match attempt.run(inner.call(req)).await {
        Ok(r) => r,
        Err(e) => {
            // The handler failed without an answer: nothing to store.
            return (attempt.settle(None, Disposition::Release).await, Err(e));
        }
    };
    let mut handler_outcome = response.extensions().get::<Override>().copied();
    let (mut parts, body) = response.into_parts();
    let policy = attempt.policy().clone();
    let cap = policy.max_stored_body;
    let collected = match Limited::new(body, cap).collect().await {
        Ok(c) => c,
        Err(e) => {
            let too_large = e.is::<http_body_util::LengthLimitError>();
            let problem = if too_large {
                Problem::new(
                    ErrorCode::ResponseTooLarge,
                    format!("the response is larger than the {cap}-byte storage cap; it was not stored"),
                )
            } else {
                Problem::new(ErrorCode::Internal, "the handler's response body failed")
            };
            let refused = attempt.unstorable(None, problem, too_large).await;
            return (refused.outcome, Ok(refusal_response(refused.refusal)));
        }
    };
    let mut trailers = collected.trailers().cloned();
    let data = collected.to_bytes();
    if let Some(marked) =
        crate::outcome::take(&mut parts.headers).or_else(|| trailers.as_mut().and_then(crate::outcome::take))
    {
        handler_outcome = Some(marked);
    }
    let code = grpc_code(trailers.as_ref(), &parts.headers);
    let how = disposition(code, handler_outcome, &policy);
    tracing::debug!(?code, disposition = how.label(), "idempotency: handler answered");
    let counted = match how {
        Disposition::Store => {
            let stored = to_stored(&parts, &data, trailers.as_ref());
            if let Finished::Refused(refused) = attempt.store(None, &stored).await {
                return (refused.outcome, Ok(refusal_response(refused.refusal)));
            }
            outcome::EXECUTED
        }
        // The handler settled the record itself: its parked and lease-lost
        // answers say which.
        Disposition::Leave => match code {
            Code::FailedPrecondition => outcome::PARKED,
            Code::Aborted => outcome::LEASE_LOST,
            _ => outcome::EXECUTED,
        },
        other => attempt.settle(None, other).await,
    };
    (
        counted,
        Ok(Response::from_parts(
            parts,
            Body::new(Replayed::new(data, trailers)),
        )),
    )
}

/// The call's status: from the trailers, or from the headers of a
/// trailers-only answer; `UNKNOWN` when there is none.
fn grpc_code(trailers: Option<&HeaderMap>, headers: &HeaderMap) -> Code {
    trailers
        .and_then(|t| t.get("grpc-status"))
        .or_else(|| headers.get("grpc-status"))
        .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
        .map_or(Code::Unknown, Code::from)
}

fn stored_header(name: &str, value: &HeaderValue) -> Option<StoredHeader> {
    (!NEVER_REPLAYED_HEADERS.contains(&name) && !NEVER_STORED.contains(&name)).then(|| StoredHeader {
        name: name.to_owned(),
        value: value.as_bytes().to_vec(),
    })
}

/// The response as stored: its metadata as headers, its trailers as headers
/// named [`TRAILER_PREFIX`]`name` (no HTTP header name contains `/`), its bytes
/// (the length-prefixed response message) as the body.
fn to_stored(parts: &http::response::Parts, data: &Bytes, trailers: Option<&HeaderMap>) -> StoredResponse {
    let mut headers: Vec<StoredHeader> = parts
        .headers
        .iter()
        .filter_map(|(n, v)| stored_header(n.as_str(), v))
        .collect();
    headers.extend(trailers.into_iter().flatten().filter_map(|(n, v)| {
        stored_header(n.as_str(), v).map(|mut h| {
            h.name = format!("{TRAILER_PREFIX}{}", h.name);
            h
        })
    }));
    StoredResponse {
        status: parts.status.as_u16(),
        headers,
        body: data.to_vec(),
    }
}

fn refusal_response(refusal: Refusal) -> Response<Body> {
    match refusal {
        Refusal::Replay(stored) => replay_response(stored),
        Refusal::Problem { problem, retry_after } => status_for(&problem, retry_after).into_http(),
        Refusal::Accepted { retry_after } => status_for(
            &Problem::new(
                ErrorCode::RequestInProgress,
                "a request with this idempotency key is still being processed; retry after the indicated delay",
            ),
            Some(retry_after),
        )
        .into_http(),
    }
}

fn replayed() -> (HeaderName, HeaderValue) {
    (
        HeaderName::from_static(IDEMPOTENT_REPLAYED),
        HeaderValue::from_static("true"),
    )
}

/// The stored response again, byte for byte, marked `idempotent-replayed: true`.
fn replay_response(stored: StoredResponse) -> Response<Body> {
    let is_problem = stored.headers.iter().any(|h| {
        h.name.eq_ignore_ascii_case("content-type")
            && h.value == idemkit_core::PROBLEM_CONTENT_TYPE.as_bytes()
    });
    let (name, value) = replayed();
    if is_problem {
        // What the engine stores for an answer it could not keep (a response
        // over the storage cap): the problem it was answered with.
        let problem = serde_json::from_slice::<Problem>(&stored.body)
            .unwrap_or_else(|_| Problem::new(ErrorCode::Internal, "the stored answer is unreadable"));
        let mut response = status_for(&problem, None).into_http::<Body>();
        response.headers_mut().insert(name, value);
        return response;
    }
    let mut headers = HeaderMap::new();
    let mut trailers = HeaderMap::new();
    for h in stored.headers {
        let (target, raw) = match h.name.strip_prefix(TRAILER_PREFIX) {
            Some(n) => (&mut trailers, n),
            None => (&mut headers, h.name.as_str()),
        };
        if let (Ok(n), Ok(v)) = (
            HeaderName::from_bytes(raw.as_bytes()),
            HeaderValue::from_bytes(&h.value),
        ) {
            target.append(n, v);
        }
    }
    headers.insert(name, value);
    let mut response = Response::new(Body::new(Replayed::new(
        Bytes::from(stored.body),
        (!trailers.is_empty()).then_some(trailers),
    )));
    *response.status_mut() = http::StatusCode::from_u16(stored.status).unwrap_or(http::StatusCode::OK);
    *response.headers_mut() = headers;
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid4_is_checked_strictly() {
        assert!(is_uuid4(b"7c9e6679-7425-40de-944b-e07fc1f90ae7"));
        assert!(is_uuid4(b"7C9E6679-7425-40DE-B44B-E07FC1F90AE7"));
        assert!(!is_uuid4(b"7c9e6679-7425-10de-944b-e07fc1f90ae7"), "version 1");
        assert!(!is_uuid4(b"7c9e6679-7425-40de-c44b-e07fc1f90ae7"), "variant");
        assert!(!is_uuid4(b"7c9e66797425-40de-944b-e07fc1f90ae7-"));
        assert!(!is_uuid4(b"label-order-4711"));
    }
}
