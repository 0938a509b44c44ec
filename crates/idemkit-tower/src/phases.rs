//! Multi-step requests: atomic phases, recovery points and external-call intents
//! (the behaviour contract, `docs/spec.md` §7).
//!
//! A request that calls systems we cannot roll back (payments, couriers, email) runs
//! as a sequence of phases under a lease-mode claim. Each phase is one fenced
//! transaction that writes business rows and advances the recovery point together.
//! An external call records its *intent* (with a downstream idempotency key derived
//! from ours) before calling, and its *result* after. A retry that takes over an
//! abandoned attempt skips completed phases (reusing their saved outputs) and
//! re-issues an unfinished call only when the downstream honours keys; otherwise the
//! request is parked for human review and never blindly re-called.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use idemkit_core::{
    DownstreamKey, ErrorCode, FencingToken, Millis, PhaseUpdate, Policy, Scope, StoreError, StoredHeader,
    StoredResponse, TransactionalStore,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tracing::Instrument;
use tracing::field::Empty;

use crate::metrics::{Settled, op, outcome, timed};
use crate::{IdempotencyContext, Override, ProblemResponse};

/// Why a phase did not produce its output.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PhaseError<E> {
    /// The phase's own work failed; its transaction rolled back. The handler's
    /// error is the [`source`](std::error::Error::source), not repeated in the
    /// message.
    #[error("phase failed")]
    Work(#[source] E),
    /// The external call failed, with whether it may have run: a
    /// [`CallError::NotExecuted`] call's intent was withdrawn, a
    /// [`CallError::Unknown`] call's intent stays for the next attempt.
    #[error(transparent)]
    Call(CallError<E>),
    /// The request was parked for human review: an earlier attempt recorded the
    /// intent to call a downstream that does not honour idempotency keys, and its
    /// result is unknown.
    #[error("parked for review: {0}")]
    Parked(String),
    /// The key store refused or failed (a stale token is [`StoreError::Fenced`]).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// A saved output could not be read back as the phase's output type.
    #[error("saved output of step `{0}` does not match its type: {1}")]
    Output(String, serde_json::Error),
}

impl<E> PhaseError<E> {
    /// The `outcome` of an `idemkit.phase` span that ended with this error.
    fn label(&self) -> &'static str {
        match self {
            Self::Work(_) => "failed",
            Self::Call(_) => "call_failed",
            Self::Parked(_) => "parked",
            Self::Store(StoreError::Fenced) => "lease_lost",
            Self::Store(_) => "store_error",
            Self::Output(..) => "output_mismatch",
        }
    }

    /// Maps the handler's error type inside, keeping every other variant.
    pub fn map_work<F>(self, f: impl FnOnce(E) -> F) -> PhaseError<F> {
        match self {
            Self::Work(e) => PhaseError::Work(f(e)),
            Self::Call(e) => PhaseError::Call(e.map(f)),
            Self::Parked(r) => PhaseError::Parked(r),
            Self::Store(e) => PhaseError::Store(e),
            Self::Output(s, e) => PhaseError::Output(s, e),
        }
    }
}

impl<E: IntoResponse> IntoResponse for PhaseError<E> {
    /// The handler's own error as it answers; the layer's problems otherwise.
    /// Parked and lease-lost answers leave the record as it is.
    fn into_response(self) -> Response {
        match self {
            Self::Work(e) => e.into_response(),
            Self::Call(e) => e.into_inner().into_response(),
            Self::Parked(reason) => (
                Override::Settled,
                axum::Extension(Settled(outcome::PARKED)),
                ProblemResponse::new(ErrorCode::RequestParked, reason),
            )
                .into_response(),
            Self::Store(StoreError::Fenced) => (
                Override::Settled,
                axum::Extension(Settled(outcome::LEASE_LOST)),
                ProblemResponse::new(
                    ErrorCode::LeaseLost,
                    "this attempt's lease was taken over by a later attempt; retry to get its result",
                )
                .retry_after(std::time::Duration::from_secs(1)),
            )
                .into_response(),
            // Unavailable is 503 with `Retry-After`, a configuration that
            // cannot work 500 idempotency_misconfigured, as the layer answers.
            Self::Store(e) => ProblemResponse::from(e).into_response(),
            Self::Output(step, e) => {
                ProblemResponse::new(ErrorCode::Internal, format!("saved output of `{step}`: {e}"))
                    .into_response()
            }
        }
    }
}

/// How an external call failed: the downstream's error, and whether the call
/// may have taken effect.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CallError<E> {
    /// The call certainly did not take effect (connection refused, a definite
    /// rejection): the intent is withdrawn and a later attempt may call again.
    #[error("external call did not take effect")]
    NotExecuted(#[source] E),
    /// The call may have taken effect (timeout, reset after sending): the intent
    /// stays, and a later attempt re-issues it only if the downstream honours keys.
    #[error("external call may have taken effect")]
    Unknown(#[source] E),
}

impl<E> CallError<E> {
    /// Whether the call may have taken effect ([`CallError::Unknown`]).
    pub fn may_have_run(&self) -> bool {
        matches!(self, Self::Unknown(_))
    }

    /// The downstream's error.
    pub fn inner(&self) -> &E {
        match self {
            Self::NotExecuted(e) | Self::Unknown(e) => e,
        }
    }

    /// The downstream's error, dropping whether the call may have run.
    pub fn into_inner(self) -> E {
        match self {
            Self::NotExecuted(e) | Self::Unknown(e) => e,
        }
    }

    /// Maps the error inside, keeping whether the call may have run.
    pub fn map<F>(self, f: impl FnOnce(E) -> F) -> CallError<F> {
        match self {
            Self::NotExecuted(e) => CallError::NotExecuted(f(e)),
            Self::Unknown(e) => CallError::Unknown(f(e)),
        }
    }
}

/// Whether a downstream de-duplicates by idempotency key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Downstream {
    /// Re-sending the same key is safe: an unfinished call is re-issued on resume.
    HonoursKeys,
    /// Re-sending may act twice: an unfinished call parks the request for review.
    IgnoresKeys,
}

/// The phases of one request. Build it in a handler under a lease-mode
/// [`crate::IdempotencyLayer`] whose store offers transactions.
///
/// ```no_run
/// # use std::sync::Arc;
/// # use idemkit_sqlite::SqliteStore;
/// # use idemkit_tower::{IdempotencyContext, Phases, Downstream, CallError, PhaseError};
/// # async fn handler(store: Arc<SqliteStore>, ctx: IdempotencyContext) -> Result<axum::response::Response, PhaseError<String>> {
/// let mut phases = Phases::begin(store, &ctx).await?;
/// let label_id: i64 = phases
///     .phase("label", async |tx| {
///         sqlx::query_scalar("INSERT INTO labels (status) VALUES ('pending') RETURNING id")
///             .fetch_one(&mut **tx).await.map_err(|e| e.to_string())
///     })
///     .await?;
/// let tracking: String = phases
///     .external("courier", Downstream::HonoursKeys, async |key| {
///         // send `key` as the courier's Idempotency-Key
///         Ok::<_, CallError<String>>(format!("TRK-{label_id}-{key}"))
///     })
///     .await?;
/// phases
///     .finish("done", async |tx| {
///         sqlx::query("UPDATE labels SET status = 'created' WHERE id = ?1").bind(label_id)
///             .execute(&mut **tx).await.map_err(|e| e.to_string())?;
///         Ok((http::StatusCode::CREATED, tracking).into_response())
///     })
///     .await
/// # }
/// # use axum::response::IntoResponse;
/// ```
pub struct Phases<S: TransactionalStore> {
    store: Arc<S>,
    scope: Scope,
    token: FencingToken,
    policy: Arc<Policy>,
    outputs: BTreeMap<String, Value>,
    recovery_point: Option<String>,
    /// The request's generation (its first claim), part of downstream keys.
    generation: Millis,
    /// The caller's deadline, handed on (shrinking) to external calls.
    deadline: Option<std::time::Instant>,
}

impl<S: TransactionalStore> std::fmt::Debug for Phases<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phases")
            .field("token", &self.token)
            .field("recovery_point", &self.recovery_point)
            .field("steps", &self.outputs.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Saved step states, as JSON in the record's step outputs.
const DONE: &str = "done";
const INTENT: &str = "intent";

impl<S: TransactionalStore> Phases<S> {
    /// Starts the phases of the request the layer claimed, or resumes them after
    /// a takeover (loading the recovery point and saved outputs).
    ///
    /// Under a single-step layer this is `StoreError::Config` (answered `500
    /// idempotency_misconfigured` through `ProblemResponse::from`): phases need
    /// the committed lease of [`crate::IdempotencyLayer::lease`].
    ///
    /// The store is taken as the layers take it: by value (every idemkit store
    /// is a cheap clone) or as an `Arc<S>`.
    pub async fn begin(
        store: impl idemkit_core::IntoTransactionalStore<Store = S>,
        ctx: &IdempotencyContext,
    ) -> Result<Self, StoreError> {
        let store = store.into_transactional_store();
        if ctx.mode() != crate::ClaimMode::Lease {
            return Err(StoreError::Config(
                "Phases need a lease-mode layer (`IdempotencyLayer::lease`); this route is single-step, whose claim is the handler's `Tx`".into(),
            ));
        }
        let record = timed(op::GET, store.get(&ctx.scope)).await?;
        let (outputs, recovery_point, generation) = match record {
            Some(r) if r.fencing_token == ctx.token => (r.step_outputs, r.recovery_point, r.created_at),
            _ => return Err(StoreError::Fenced),
        };
        Ok(Self {
            store,
            scope: ctx.scope.clone(),
            token: ctx.token,
            policy: ctx.policy.clone(),
            outputs,
            recovery_point,
            generation,
            deadline: ctx.deadline,
        })
    }

    /// The caller's deadline, if it sent one (see [`IdempotencyContext::deadline`]).
    pub fn deadline(&self) -> Option<std::time::Instant> {
        self.deadline
    }

    /// The time left until the caller's deadline (zero once it has passed), as
    /// of now; `None` without a deadline. Pass it to a downstream call as its
    /// timeout (or use [`Phases::external_with_deadline`], which does so after
    /// recording the intent).
    pub fn remaining(&self) -> Option<std::time::Duration> {
        idemkit_engine::remaining(self.deadline)
    }

    /// The last committed phase, if any.
    pub fn recovery_point(&self) -> Option<&str> {
        self.recovery_point.as_deref()
    }

    /// The idempotency key this request sends downstream for `step`: the same
    /// on every attempt of this request (takeovers keep its generation), and a
    /// new one when the key is reused after its replay window.
    pub fn downstream_key(&self, step: &str) -> DownstreamKey {
        DownstreamKey::derive(&self.scope, self.generation, step)
    }

    fn saved<T: DeserializeOwned, E>(&self, name: &str) -> Option<Result<T, PhaseError<E>>> {
        let done = self.outputs.get(name)?.get(DONE)?;
        Some(serde_json::from_value(done.clone()).map_err(|e| PhaseError::Output(name.to_owned(), e)))
    }

    async fn commit_progress<E>(
        &mut self,
        mut tx: S::Tx,
        name: &str,
        state: Value,
        advance: bool,
    ) -> Result<(), PhaseError<E>> {
        let recovery_point = if advance {
            name.to_owned()
        } else {
            self.recovery_point.clone().unwrap_or_default()
        };
        let update = PhaseUpdate {
            recovery_point: recovery_point.clone(),
            step: Some((name.to_owned(), state.clone())),
        };
        timed(
            op::ADVANCE,
            self.store
                .advance_in_tx(&mut tx, &self.scope, self.token, &update),
        )
        .await?;
        timed(op::COMMIT, self.store.commit(tx)).await?;
        self.outputs.insert(name.to_owned(), state);
        if advance {
            self.recovery_point = Some(recovery_point);
        }
        Ok(())
    }

    /// One atomic phase: `work` runs in a fenced transaction of the store, and its
    /// output is saved as step `name` with the recovery point in that same
    /// transaction. On resume a completed phase is skipped and its saved output
    /// returned. If `work` fails, its transaction rolls back.
    ///
    /// Traced as an `idemkit.phase` span (`step`, `kind = "phase"`, `outcome`).
    pub async fn phase<T, E>(
        &mut self,
        name: &str,
        work: impl AsyncFnOnce(&mut S::Tx) -> Result<T, E>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        let span = phase_span(name, "phase");
        let saved = self.has_saved(name);
        let result = self.run_phase(name, work).instrument(span.clone()).await;
        span.record("outcome", phase_outcome(saved, &result));
        result
    }

    async fn run_phase<T, E>(
        &mut self,
        name: &str,
        work: impl AsyncFnOnce(&mut S::Tx) -> Result<T, E>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        if let Some(saved) = self.saved(name) {
            return saved;
        }
        let mut tx = self.begin_fenced().await?;
        let out = work(&mut tx).await.map_err(PhaseError::Work)?;
        let state =
            json!({ DONE: serde_json::to_value(&out).map_err(|e| PhaseError::Output(name.to_owned(), e))? });
        self.commit_progress(tx, name, state, true).await?;
        fail::fail_point!("idemkit::after_phase");
        Ok(out)
    }

    /// An external call: the intent (with the downstream key) is committed before
    /// calling and the result after. On resume: a recorded result is returned
    /// without calling; a recorded intent without a result is re-issued with the
    /// same key if `downstream` honours keys, and otherwise the request is parked
    /// for review and the call is not made.
    ///
    /// Traced as an `idemkit.phase` span (`step`, `kind = "external"`, `outcome`,
    /// and `reissued` when an earlier attempt's intent was found); the
    /// downstream key is not recorded.
    pub async fn external<T, E>(
        &mut self,
        name: &str,
        downstream: Downstream,
        call: impl AsyncFnOnce(DownstreamKey) -> Result<T, CallError<E>>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        self.external_with_deadline(name, downstream, async move |key, _| call(key).await)
            .await
    }

    /// [`Phases::external`], with the caller's remaining time handed to the call:
    /// `call` receives the downstream key and the time left until the caller's
    /// deadline, measured just before the call (after the intent is committed),
    /// so each downstream call gets only what is left (`None` when the caller
    /// sent no deadline; `Some(ZERO)` once it has passed). Use it as the
    /// downstream request's timeout (`grpc-timeout`, or the REST
    /// [`idemkit_core::wire::REQUEST_TIMEOUT`]). A call that times out after sending
    /// should answer [`CallError::Unknown`]: its outcome is unknown.
    pub async fn external_with_deadline<T, E>(
        &mut self,
        name: &str,
        downstream: Downstream,
        call: impl AsyncFnOnce(DownstreamKey, Option<std::time::Duration>) -> Result<T, CallError<E>>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        let span = phase_span(name, "external");
        let saved = self.has_saved(name);
        let result = self
            .run_external(name, downstream, call)
            .instrument(span.clone())
            .await;
        span.record("outcome", phase_outcome(saved, &result));
        result
    }

    async fn run_external<T, E>(
        &mut self,
        name: &str,
        downstream: Downstream,
        call: impl AsyncFnOnce(DownstreamKey, Option<std::time::Duration>) -> Result<T, CallError<E>>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        if let Some(saved) = self.saved(name) {
            return saved;
        }
        let key = self.downstream_key(name);
        let pending = self.outputs.get(name).and_then(|v| v.get(INTENT)).is_some();
        if pending {
            tracing::Span::current().record("reissued", downstream == Downstream::HonoursKeys);
        }
        if pending && downstream == Downstream::IgnoresKeys {
            let reason = format!(
                "external step `{name}` was called by an earlier attempt with no recorded result, and its \
                 downstream does not honour idempotency keys: parked for review instead of calling again"
            );
            timed(op::PARK, self.store.park(&self.scope, self.token, &reason)).await?;
            return Err(PhaseError::Parked(reason));
        }
        if !pending {
            let tx = self.begin_fenced().await?;
            self.commit_progress(tx, name, json!({ INTENT: key.as_str() }), false)
                .await?;
            fail::fail_point!("idemkit::after_intent");
        }
        match call(key, self.remaining()).await {
            Ok(out) => {
                fail::fail_point!("idemkit::after_call");
                let state = json!({ DONE: serde_json::to_value(&out).map_err(|e| PhaseError::Output(name.to_owned(), e))? });
                let tx = self.begin_fenced().await?;
                self.commit_progress(tx, name, state, true).await?;
                Ok(out)
            }
            Err(CallError::NotExecuted(e)) => {
                // Withdraw the intent: the call certainly did not happen.
                let tx = self.begin_fenced().await?;
                self.commit_progress(tx, name, json!({ "withdrawn": true }), false)
                    .await?;
                Err(PhaseError::Call(CallError::NotExecuted(e)))
            }
            Err(e @ CallError::Unknown(_)) => Err(PhaseError::Call(e)),
        }
    }

    /// The final phase: `work` runs in a fenced transaction and returns the
    /// response, which is stored in that same transaction, so the last business
    /// writes and the completion commit together (a request with N phases costs
    /// N + 1 commits). The returned response tells the layer it is already stored.
    ///
    /// Traced as an `idemkit.phase` span (`step`, `kind = "finish"`, `outcome`).
    pub async fn finish<E>(
        self,
        name: &str,
        work: impl AsyncFnOnce(&mut S::Tx) -> Result<Response, E>,
    ) -> Result<Response, PhaseError<E>> {
        let span = phase_span(name, "finish");
        let result = self.run_finish(name, work).instrument(span.clone()).await;
        let label = match &result {
            Ok(r)
                if r.extensions()
                    .get::<Settled>()
                    .is_some_and(|s| s.0 == outcome::ERROR) =>
            {
                "response_too_large"
            }
            other => phase_outcome(false, other),
        };
        span.record("outcome", label);
        result
    }

    async fn run_finish<E>(
        self,
        name: &str,
        work: impl AsyncFnOnce(&mut S::Tx) -> Result<Response, E>,
    ) -> Result<Response, PhaseError<E>> {
        let mut tx = self.begin_fenced().await?;
        let response = work(&mut tx).await.map_err(PhaseError::Work)?;
        let (parts, body) = response.into_parts();
        let cap = self.policy.max_stored_body;
        let body = match http_body_util::Limited::new(body, cap).collect().await {
            Ok(c) => c.to_bytes(),
            Err(_) => {
                // The final phase rolls back, but earlier phases and external calls
                // may have had effects: the failure is what the key now answers (as
                // in single-step mode), never a record left in flight to be taken
                // over and fail the same way forever.
                drop(tx);
                let problem = ProblemResponse::new(
                    ErrorCode::ResponseTooLarge,
                    format!(
                        "the response is larger than the {cap}-byte storage cap; the final phase was rolled back"
                    ),
                );
                let stored = StoredResponse {
                    status: problem.problem.status,
                    headers: vec![StoredHeader {
                        name: "content-type".into(),
                        value: idemkit_core::PROBLEM_CONTENT_TYPE.as_bytes().to_vec(),
                    }],
                    body: problem.problem.to_json(),
                };
                timed(
                    op::COMPLETE,
                    self.store.complete(&self.scope, self.token, &stored),
                )
                .await?;
                return Ok((
                    Override::Settled,
                    axum::Extension(Settled(outcome::ERROR)),
                    problem,
                )
                    .into_response());
            }
        };
        let stored = StoredResponse {
            status: parts.status.as_u16(),
            headers: parts
                .headers
                .iter()
                .filter(|(n, _)| self.policy.replays_header(n.as_str()))
                .map(|(n, v)| StoredHeader {
                    name: n.as_str().to_owned(),
                    value: v.as_bytes().to_vec(),
                })
                .collect(),
            body: body.to_vec(),
        };
        let update = PhaseUpdate {
            recovery_point: name.to_owned(),
            step: None,
        };
        timed(
            op::ADVANCE,
            self.store
                .advance_in_tx(&mut tx, &self.scope, self.token, &update),
        )
        .await?;
        timed(
            op::COMPLETE,
            self.store.complete_in_tx(tx, &self.scope, self.token, &stored),
        )
        .await?;
        fail::fail_point!("idemkit::after_complete");
        let mut response = Response::from_parts(parts, Body::from(body));
        response.extensions_mut().insert(Override::Settled);
        response.extensions_mut().insert(Settled(outcome::EXECUTED));
        Ok(response)
    }

    async fn begin_fenced(&self) -> Result<S::Tx, StoreError> {
        timed(op::BEGIN_FENCED, self.store.begin_fenced(&self.scope, self.token)).await
    }

    fn has_saved(&self, name: &str) -> bool {
        self.outputs.get(name).and_then(|v| v.get(DONE)).is_some()
    }
}

/// The span of one phase. `step` is the application's constant step name,
/// never request data.
fn phase_span(step: &str, kind: &'static str) -> tracing::Span {
    tracing::info_span!("idemkit.phase", step, kind, outcome = Empty, reissued = Empty)
}

/// How a phase ended: `saved` (skipped on resume, its saved output returned),
/// `done`, or the error's label.
fn phase_outcome<T, E>(saved: bool, result: &Result<T, PhaseError<E>>) -> &'static str {
    match result {
        Ok(_) if saved => "saved",
        Ok(_) => "done",
        Err(e) => e.label(),
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("courier refused")]
    struct Courier;

    /// A phase span's `outcome` for each way a phase ends: the values
    /// `docs/metrics.md` publishes for `idemkit.phase` (keep the two lists
    /// alike), each distinct.
    #[test]
    fn phase_outcomes_are_the_documented_span_values() {
        let json = serde_json::from_str::<u8>("x").unwrap_err();
        type Case = (Result<(), PhaseError<Courier>>, bool, &'static str);
        let cases: Vec<Case> = vec![
            (Ok(()), true, "saved"),
            (Ok(()), false, "done"),
            (Err(PhaseError::Work(Courier)), false, "failed"),
            (
                Err(PhaseError::Call(CallError::Unknown(Courier))),
                false,
                "call_failed",
            ),
            (Err(PhaseError::Parked("why".into())), false, "parked"),
            (Err(PhaseError::Store(StoreError::Fenced)), false, "lease_lost"),
            (
                Err(PhaseError::Store(StoreError::Unavailable("down".into()))),
                false,
                "store_error",
            ),
            (
                Err(PhaseError::Output("label".into(), json)),
                false,
                "output_mismatch",
            ),
        ];
        let mut seen = std::collections::HashSet::new();
        for (result, saved, want) in &cases {
            let got = phase_outcome(*saved, result);
            assert_eq!(got, *want);
            assert!(seen.insert(got), "{got} names two endings");
        }
    }

    /// Each cause once in a chain, and whether the call may have run kept.
    #[test]
    fn phase_errors_keep_their_source_and_whether_the_call_may_have_run() {
        let work: PhaseError<Courier> = PhaseError::Work(Courier);
        assert_eq!(work.to_string(), "phase failed");
        assert_eq!(
            work.source().map(ToString::to_string).as_deref(),
            Some("courier refused")
        );

        let call: PhaseError<Courier> = PhaseError::Call(CallError::Unknown(Courier));
        assert_eq!(call.to_string(), "external call may have taken effect");
        assert_eq!(
            call.source().map(ToString::to_string).as_deref(),
            Some("courier refused")
        );
        let PhaseError::Call(inner) = call.map_work(|_| "mapped") else {
            panic!("map_work keeps the variant")
        };
        assert!(inner.may_have_run());
        assert_eq!(*inner.inner(), "mapped");

        let refused = CallError::NotExecuted(Courier);
        assert!(!refused.may_have_run());
        assert_eq!(refused.to_string(), "external call did not take effect");
    }
}
