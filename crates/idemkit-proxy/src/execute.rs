//! A claimed request, from the forward to its record's last write: the
//! upstream's answer read as far as its disposition needs, then stored,
//! released, or (an unknown outcome) parked or abandoned for a re-send.

use super::*;

/// How long a store write that failed after the upstream answered is retried
/// in the background: the caller already has the answer, and its retry finds
/// it stored once a write gets through.
const STORE_RETRY_FOR: Duration = Duration::from_secs(300);

/// The longest pause between two of those writes.
const STORE_RETRY_MAX_PAUSE: Duration = Duration::from_secs(5);

type Sent = Result<Answer, UpstreamError>;

impl Proxy {
    /// Forwards a claimed request and finishes its record.
    pub(super) async fn execute(
        self: Arc<Self>,
        route: usize,
        attempt: Attempt,
        parts: Parts,
        bytes: Bytes,
    ) -> (&'static str, Response) {
        let forwarded = attempt.lease().resumed_from.as_deref() == Some(FORWARDED);
        if forwarded && !self.honours_keys {
            return self
                .park(
                    &attempt,
                    "an earlier attempt claimed this request to forward it (and may have) and never stored \
                     the upstream's answer",
                )
                .await;
        }
        if forwarded && idemkit_engine::completer_resume(&parts.extensions).is_some() {
            // The completer resends without the caller's credential (the
            // proxy never stores it): the upstream could not authenticate the
            // re-send, and a refusal would free a key whose first send may
            // have run. The caller's own retry re-sends; the completer parks.
            return self
                .park(
                    &attempt,
                    "the completer resumed a forwarded request: the proxy never stores the caller's credential, \
                     so only the caller's retry can re-send it",
                )
                .await;
        }
        // The answer is stored as identity bytes: a stored compressed body
        // would replay undecodable to a caller that did not ask for it (or
        // without its encoding). Each caller's answer is compressed on the
        // way out, as its own `Accept-Encoding` asks (`keyed_encoded`).
        let caller = accept_encoding(&parts.headers);
        let mut parts = parts;
        parts
            .headers
            .insert(header::ACCEPT_ENCODING, HeaderValue::from_static("identity"));
        let req = Request::from_parts(parts, Body::from(bytes));
        #[cfg(feature = "failpoints")]
        fail::fail_point!("idemkit::proxy::before_forward");
        let policy = attempt.policy().clone();
        let mut answer = Box::pin({
            let this = self.clone();
            async move { this.answer(route, req, &policy).await }
        });
        // The timeout and the lease's heartbeat cover the whole answer: its
        // head and, when it is to be stored, its body.
        let sent = attempt.run(tokio::time::timeout(self.timeout, &mut answer)).await;
        #[cfg(feature = "failpoints")]
        fail::fail_point!("idemkit::proxy::after_forward");
        match sent {
            Ok(sent) => self.finish(attempt, sent, &caller).await,
            // A key-honouring upstream may still be running the request: its
            // re-send now would only meet its own "in progress". The lease is
            // kept (heartbeaten) while the answer is awaited a while longer in
            // the background; a retry meanwhile gets the proxy's own `409 in
            // progress`, and an answer that arrives is stored for it.
            Err(_) if self.honours_keys && !self.grace.is_zero() => {
                let this = self.clone();
                self.tasks.spawn(async move {
                    let late = attempt.run(tokio::time::timeout(this.grace, answer)).await;
                    match late {
                        Ok(sent) => {
                            this.finish(attempt, sent, &caller).await;
                        }
                        Err(_) => {
                            attempt.settle(None, Disposition::Abandon).await;
                        }
                    }
                });
                let mut p = Problem::new(
                    ErrorCode::Internal,
                    format!(
                        "the upstream did not answer within {} ms; the proxy keeps waiting for its answer for up to {} ms \
                         more (a retry meanwhile is answered in progress). The upstream honours idempotency keys: \
                         retry with the same key",
                        self.timeout.as_millis(),
                        self.grace.as_millis()
                    ),
                )
                .with_status(504);
                p.retryable = true;
                (
                    outcome::ABANDONED,
                    ProblemResponse::from(p)
                        .retry_after(Duration::from_secs(1))
                        .into_response(),
                )
            }
            Err(_) => {
                self.maybe_executed(attempt, "the upstream did not answer in time", 504, None)
                    .await
            }
        }
    }

    /// Finishes the record of an upstream exchange that ended within its time.
    async fn finish(
        self: &Arc<Self>,
        attempt: Attempt,
        sent: Sent,
        caller: &HeaderMap,
    ) -> (&'static str, Response) {
        let policy = attempt.policy().clone();
        match sent {
            // The upstream's own "in progress" (it honours keys and still runs
            // an earlier send of this key): never the key's answer. This
            // attempt did nothing; the key is freed and the caller gets the
            // upstream's answer, `Retry-After` included.
            Ok(Answer::Store(parts, Ok(body))) if upstream_in_progress(&parts, &body) => {
                let counted = attempt.settle(None, Disposition::Discard).await;
                (counted, Response::from_parts(parts, Body::from(body)))
            }
            Ok(Answer::Store(parts, Ok(body))) => self.store_answer(attempt, parts, body, caller).await,
            Ok(Answer::Stream(parts, body)) => self.stream_and_store(attempt, parts, body, caller.clone()),
            Ok(Answer::Store(_, Err(e))) if e.is::<http_body_util::LengthLimitError>() => {
                let cap = policy.max_stored_body;
                let p = Problem::new(
                    ErrorCode::ResponseTooLarge,
                    format!(
                        "the upstream's answer is larger than the {cap}-byte storage cap; this key answers this problem from now on"
                    ),
                );
                let refused = attempt.unstorable(None, p, true).await;
                (
                    refused.outcome,
                    refusal_response(refused.refusal, &policy, caller),
                )
            }
            Ok(Answer::Store(parts, Err(e))) => {
                let why = format!(
                    "the upstream answered {} and its body failed part-way: {e}",
                    parts.status.as_u16()
                );
                self.maybe_executed(attempt, &why, 502, None).await
            }
            Ok(Answer::Gateway(res)) => {
                let status = res.status().as_u16();
                let why = format!(
                    "the upstream answered {status}, a gateway's answer: the service behind it may have run the request"
                );
                let hint = res.headers().get(header::RETRY_AFTER).cloned();
                self.maybe_executed(attempt, &why, status, hint).await
            }
            // Validation-class 4xx, 404/405, a status declared "not executed",
            // or (a key-honouring upstream) a 5xx under `retry`: answered, not
            // executed. Not stored, and the key is free again, as below.
            Ok(Answer::Pass(res)) => (attempt.settle(None, Disposition::Discard).await, res),
            Err(e) if e.not_sent() => {
                // Nothing was sent: the key is free again. The recorded intent is
                // discarded with the release, in one write fenced by this attempt's
                // token: a proxy that lost its lease meanwhile (another attempt took
                // the record over, perhaps forwarded and parked it) changes nothing.
                // If the store cannot be reached, the lease runs out and the attempt
                // that takes over finds the intent (re-sent to a key-honouring
                // upstream, parked otherwise): never forwarded twice blind.
                let counted = attempt.settle(None, Disposition::Discard).await;
                (counted, bad_gateway(&e))
            }
            Err(e) => {
                self.maybe_executed(
                    attempt,
                    &format!("the upstream failed after the request was sent: {e}"),
                    502,
                    None,
                )
                .await
            }
        }
    }

    /// Sends a streamed answer on as its frames arrive, recording them; once
    /// it ends, the recording is stored (the replay is the whole stream, in
    /// order), or, over the storage cap, the too-large problem is. A stream
    /// that fails part-way is an unknown outcome. The caller hanging up does
    /// not stop the recording.
    fn stream_and_store(
        self: &Arc<Self>,
        attempt: Attempt,
        parts: http::response::Parts,
        mut body: Body,
        caller: HeaderMap,
    ) -> (&'static str, Response) {
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, std::io::Error>>(16);
        let head = parts.clone();
        let this = self.clone();
        self.tasks.spawn(async move {
            let cap = attempt.policy().max_stored_body;
            let recorded = attempt
                .run(async {
                    let mut recorded = Vec::new();
                    let mut caller = Some(tx);
                    while let Some(frame) = body.frame().await {
                        let frame = match frame {
                            Ok(frame) => frame,
                            Err(e) => {
                                // The caller's body fails too: a cut stream never
                                // looks complete.
                                if let Some(tx) = &caller {
                                    let _ = tx.send(Err(std::io::Error::other(e.to_string()))).await;
                                }
                                return Err(e.to_string());
                            }
                        };
                        let Ok(data) = frame.into_data() else { continue };
                        if recorded.len() <= cap {
                            recorded.extend_from_slice(&data);
                        }
                        if let Some(tx) = &caller
                            && tx.send(Ok(data)).await.is_err()
                        {
                            caller = None; // hung up: record on
                        }
                    }
                    Ok::<_, String>(recorded)
                })
                .await;
            match recorded {
                Ok(bytes) if bytes.len() <= cap => {
                    this.store_answer(attempt, parts, Bytes::from(bytes), &caller).await;
                }
                Ok(_) => {
                    let p = Problem::new(
                        ErrorCode::ResponseTooLarge,
                        format!(
                            "the upstream's streamed answer is larger than the {cap}-byte storage cap; this key answers this problem from now on"
                        ),
                    );
                    attempt.unstorable(None, p, true).await;
                }
                Err(e) => {
                    let why = format!("the upstream's streamed answer failed part-way: {e}");
                    this.maybe_executed(attempt, &why, 502, None).await;
                }
            }
        });
        let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
        (
            outcome::EXECUTED,
            Response::from_parts(head, Body::from_stream(stream)),
        )
    }

    /// Stores the upstream's answer, read whole, and sends it. When the store
    /// fails, the caller still gets the answer (the upstream acted on it),
    /// and the write goes on in the background until it gets through.
    async fn store_answer(
        self: &Arc<Self>,
        attempt: Attempt,
        parts: http::response::Parts,
        body: Bytes,
        caller: &HeaderMap,
    ) -> (&'static str, Response) {
        let policy = attempt.policy().clone();
        // An upstream that compressed anyway: its encoding is stored with the
        // bytes, so every replay decodes as the first answer did.
        let encoded = parts
            .headers
            .get(header::CONTENT_ENCODING)
            .is_some_and(|e| !e.as_bytes().eq_ignore_ascii_case(b"identity"));
        let stored = if encoded {
            stored_response(
                &parts,
                &body,
                &Policy::clone(&policy).with_replayed_header("content-encoding"),
            )
        } else {
            stored_response(&parts, &body, &policy)
        };
        // The first answer is negotiated as its replays are: one the upstream
        // encoded anyway, in a coding this caller does not accept, is answered
        // `406` as a replay would be (the answer is stored; a retry that
        // accepts the coding gets it).
        let refused_coding = encoded
            && parts
                .headers
                .get(header::CONTENT_ENCODING)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|c| !idemkit_tower::render::accepts_encoding(caller, c));
        let first = |parts, body: Bytes, stored: &idemkit_core::StoredResponse| {
            if refused_coding {
                let mut res = replay_response_to(stored.clone(), &policy, caller);
                res.headers_mut().remove(idemkit_tower::wire::IDEMPOTENT_REPLAYED);
                res
            } else {
                Response::from_parts(parts, Body::from(body))
            }
        };
        let (scope, token) = (attempt.scope().clone(), attempt.lease().token);
        match attempt.store(None, &stored).await {
            Finished::Stored => (outcome::EXECUTED, first(parts, body, &stored)),
            Finished::Refused(refused) if store_unavailable(&refused) => {
                tracing::warn!(
                    "proxy: the upstream answered but the key store is unavailable; answering, and storing in the background"
                );
                let store = self.store.clone();
                let res = first(parts, body, &stored);
                self.tasks.spawn(async move {
                    let until = tokio::time::Instant::now() + STORE_RETRY_FOR;
                    let mut pause = Duration::from_millis(100);
                    loop {
                        tokio::time::sleep(pause).await;
                        match store.complete(&scope, token, &stored).await {
                            Ok(()) => {
                                tracing::info!("proxy: stored an answer after the key store came back");
                                return;
                            }
                            Err(idemkit_core::StoreError::Unavailable(_))
                                if tokio::time::Instant::now() < until =>
                            {
                                pause = (pause * 2).min(STORE_RETRY_MAX_PAUSE);
                            }
                            Err(e) => {
                                tracing::error!(
                                    error = %e,
                                    "proxy: gave up storing an answer; the key's retry is parked (or re-sent to a key-honouring upstream)"
                                );
                                return;
                            }
                        }
                    }
                });
                (outcome::EXECUTED, res)
            }
            Finished::Refused(refused) => (
                refused.outcome,
                refusal_response(refused.refusal, &policy, caller),
            ),
        }
    }

    /// How the answer with `status` is treated on `route`.
    fn plan(&self, route: usize, status: u16, policy: &Policy) -> Plan {
        let server_error = (500..600).contains(&status);
        if server_error && self.routes[route].not_executed.contains(&status) {
            return Plan::Pass;
        }
        match Disposition::of(status, None, policy) {
            // The upstream has no such route (or method): nothing was done, and
            // a key stored for it would only fill the store.
            Disposition::Store if matches!(status, 404 | 405) => Plan::Pass,
            Disposition::Store => Plan::Store,
            // A 502 or 504 is a gateway's answer: the service behind it may
            // still run the request (the behaviour contract, `docs/spec.md` §8), so it is not "not executed".
            _ if matches!(status, 502 | 504) => Plan::Gateway,
            // An upstream that ignores keys answered a 5xx after perhaps doing
            // the work (a 500 after commit, a sidecar's 503 on a reset): an
            // outcome the proxy cannot know, so it is the key's answer (the behaviour contract, `docs/spec.md` §5).
            _ if server_error && !self.honours_keys => Plan::Store,
            _ => Plan::Pass,
        }
    }

    /// Forwards a claimed request and reads as much of the answer as its
    /// disposition needs: all of it (up to the storage cap) when it is to be
    /// stored; only its head otherwise, the body streaming on to the caller.
    async fn answer(&self, route: usize, req: Request, policy: &Policy) -> Sent {
        let res = self.forward(req).await?;
        let status = res.status().as_u16();
        Ok(match self.plan(route, status, policy) {
            // A stream (server-sent events) goes to the caller as it comes,
            // recorded on the way for the replay (`Proxy::stream_and_store`).
            Plan::Store if is_event_stream(res.headers()) => {
                let (parts, body) = res.into_parts();
                Answer::Stream(parts, body)
            }
            Plan::Store => {
                let (parts, body) = res.into_parts();
                let body = Limited::new(body, policy.max_stored_body)
                    .collect()
                    .await
                    .map(|c| c.to_bytes());
                Answer::Store(parts, body)
            }
            Plan::Gateway => Answer::Gateway(res),
            Plan::Pass => Answer::Pass(res),
        })
    }

    /// The upstream may have executed the request and its answer is lost.
    async fn maybe_executed(
        &self,
        attempt: Attempt,
        why: &str,
        status: u16,
        hint: Option<HeaderValue>,
    ) -> (&'static str, Response) {
        if !self.honours_keys {
            return self.park(&attempt, why).await;
        }
        attempt.settle(None, Disposition::Abandon).await;
        let mut p = Problem::new(
            ErrorCode::Internal,
            format!("{why}; its outcome is unknown. The upstream honours idempotency keys: retry with the same key"),
        )
        .with_status(status);
        p.retryable = true;
        let mut res = ProblemResponse::from(p)
            .retry_after(Duration::from_secs(1))
            .into_response();
        // The upstream's own hint, when it gave one, is passed on.
        if let Some(hint) = hint {
            res.headers_mut().insert(header::RETRY_AFTER, hint);
        }
        (outcome::ABANDONED, res)
    }

    /// Parks the record for review and answers `idempotency_request_parked`.
    async fn park(&self, attempt: &Attempt, why: &str) -> (&'static str, Response) {
        let reason = format!(
            "{why}; the upstream does not honour idempotency keys, so the outcome is unknown and the request is not forwarded again"
        );
        if let Err(e) = self
            .store
            .park(attempt.scope(), attempt.lease().token, &reason)
            .await
        {
            let refused = Refused::store(&e);
            return (
                refused.outcome,
                refusal_response(refused.refusal, attempt.policy(), &HeaderMap::new()),
            );
        }
        (
            outcome::PARKED,
            problem(
                ErrorCode::RequestParked,
                format!("{reason}; it was parked for human review (`idemkit keys list --state parked`)"),
            ),
        )
    }
}

/// A refusal that says the key store could not be reached.
fn store_unavailable(refused: &Refused) -> bool {
    matches!(&refused.refusal, Refusal::Problem { problem, .. } if problem.code == ErrorCode::StoreUnavailable)
}

/// Whether an upstream's answer is its own "a request with this key is in
/// progress": a `409` with `Retry-After`, or with the problem code
/// `idempotency_request_in_progress` (idemkit's, and the IETF draft's shape).
fn upstream_in_progress(parts: &http::response::Parts, body: &[u8]) -> bool {
    if parts.status != http::StatusCode::CONFLICT {
        return false;
    }
    if parts.headers.contains_key(header::RETRY_AFTER) {
        return true;
    }
    serde_json::from_slice::<serde_json::Value>(body).is_ok_and(|doc| {
        doc.get("code").and_then(|c| c.as_str()) == Some(ErrorCode::RequestInProgress.as_str())
    })
}

/// Whether an answer is a stream of server-sent events.
fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

/// How an upstream status is treated.
enum Plan {
    Store,
    Gateway,
    Pass,
}

/// The upstream's answer to a forwarded request, as far as it was read.
enum Answer {
    /// To be stored: its head, and its body or what stopped it.
    Store(
        http::response::Parts,
        Result<Bytes, Box<dyn std::error::Error + Send + Sync>>,
    ),
    /// To be stored, and streamed to the caller as it is recorded.
    Stream(http::response::Parts, Body),
    /// A 502 or 504 the route's policy does not store: maybe executed.
    Gateway(Response),
    /// Not to be stored (the policy releases its status): passed on as it streams.
    Pass(Response),
}
