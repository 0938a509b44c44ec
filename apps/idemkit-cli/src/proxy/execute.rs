//! A claimed request, from the forward to its record's last write: the
//! upstream's answer read as far as its disposition needs, then stored,
//! released, or (an unknown outcome) parked or abandoned for a re-send.

use super::*;

impl Proxy {
    /// Forwards a claimed request and finishes its record.
    pub(super) async fn execute(
        &self,
        attempt: Attempt,
        parts: Parts,
        bytes: Bytes,
    ) -> (&'static str, Response) {
        let policy = attempt.policy().clone();
        if attempt.lease().resumed_from.as_deref() == Some(FORWARDED) && !self.honours_keys {
            return self
                .park(
                    &attempt,
                    "an earlier attempt claimed this request to forward it (and may have) and never stored \
                     the upstream's answer",
                )
                .await;
        }
        let req = Request::from_parts(parts, Body::from(bytes));
        #[cfg(feature = "failpoints")]
        fail::fail_point!("idemkit::proxy::before_forward");
        // The timeout and the lease's heartbeat cover the whole answer: its
        // head and, when it is to be stored, its body.
        let sent = attempt
            .run(tokio::time::timeout(self.timeout, self.answer(req, &policy)))
            .await;
        #[cfg(feature = "failpoints")]
        fail::fail_point!("idemkit::proxy::after_forward");
        match sent {
            Ok(Ok(Answer::Store(parts, Ok(body)))) => store_response(attempt, parts, body).await,
            Ok(Ok(Answer::Store(_, Err(e)))) if e.is::<http_body_util::LengthLimitError>() => {
                let cap = policy.max_stored_body;
                let p = Problem::new(
                    ErrorCode::ResponseTooLarge,
                    format!(
                        "the upstream's answer is larger than the {cap}-byte storage cap; this key answers this problem from now on"
                    ),
                );
                let refused = attempt.unstorable(None, p, true).await;
                (refused.outcome, refusal_response(refused.refusal, &policy))
            }
            Ok(Ok(Answer::Store(parts, Err(e)))) => {
                let why = format!(
                    "the upstream answered {} and its body failed part-way: {e}",
                    parts.status.as_u16()
                );
                self.maybe_executed(attempt, &why, 502).await
            }
            Ok(Ok(Answer::Gateway(res))) => {
                let status = res.status().as_u16();
                let why = format!(
                    "the upstream answered {status}, a gateway's answer: the service behind it may have run the request"
                );
                self.maybe_executed(attempt, &why, status).await
            }
            // Validation-class 4xx, or 5xx under `retry`: answered, not executed.
            // Not stored, and the key is free again, as below.
            Ok(Ok(Answer::Pass(res))) => (attempt.settle(None, Disposition::Discard).await, res),
            Ok(Err(e)) if e.is_connect() => {
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
            Ok(Err(e)) => {
                self.maybe_executed(
                    attempt,
                    &format!("the upstream failed after the request was sent: {e}"),
                    502,
                )
                .await
            }
            Err(_) => {
                self.maybe_executed(attempt, "the upstream did not answer in time", 504)
                    .await
            }
        }
    }

    /// Forwards a claimed request and reads as much of the answer as its
    /// disposition needs: all of it (up to the storage cap) when it is to be
    /// stored; only its head otherwise, the body streaming on to the caller.
    async fn answer(
        &self,
        req: Request,
        policy: &Policy,
    ) -> Result<Answer, hyper_util::client::legacy::Error> {
        let res = self.forward(req).await?;
        let status = res.status().as_u16();
        Ok(match Disposition::of(status, None, policy) {
            Disposition::Store => {
                let (parts, body) = res.into_parts();
                let body = Limited::new(body, policy.max_stored_body)
                    .collect()
                    .await
                    .map(|c| c.to_bytes());
                Answer::Store(parts, body)
            }
            // A 502 or 504 is a gateway's answer: the service behind it may
            // still run the request (SPEC §8), so it is not "not executed".
            _ if matches!(status, 502 | 504) => Answer::Gateway(res),
            _ => Answer::Pass(res),
        })
    }

    /// The upstream may have executed the request and its answer is lost.
    async fn maybe_executed(&self, attempt: Attempt, why: &str, status: u16) -> (&'static str, Response) {
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
        (
            outcome::ABANDONED,
            ProblemResponse::from(p)
                .retry_after(Duration::from_secs(1))
                .into_response(),
        )
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
                refusal_response(refused.refusal, attempt.policy()),
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

/// The upstream's answer to a forwarded request, as far as it was read.
enum Answer {
    /// To be stored: its head, and its body or what stopped it.
    Store(
        http::response::Parts,
        Result<Bytes, Box<dyn std::error::Error + Send + Sync>>,
    ),
    /// A 502 or 504 the route's policy does not store: maybe executed.
    Gateway(Response),
    /// Not to be stored (the policy releases its status): passed on as it streams.
    Pass(Response),
}
