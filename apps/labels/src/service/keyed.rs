//! Phases over a key store that is not the labels rows' database (Redis).
//!
//! [`idemkit_tower::Phases`] commits a phase's business writes and its recovery
//! point in one transaction of the store; Redis has no transaction to share with
//! SQL. Here each step follows the intent/result discipline instead: the
//! business write is made idempotent by the step's downstream key (derived from
//! the idempotency key and the request's generation, so every attempt of one
//! request uses the same one), committed in SQL on its own, and only then is the
//! result recorded in the key store with the fenced [`KeyStore::advance`] (one
//! script). A crash between the two leaves the step unrecorded; the attempt that
//! takes over runs it again and the keyed write changes nothing.

use std::collections::BTreeMap;
use std::sync::Arc;

use idemkit_core::{DownstreamKey, FencingToken, KeyStore, Millis, PhaseUpdate, Scope, StoreError};
use idemkit_tower::{CallError, IdempotencyContext, PhaseError};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

/// Saved step states, the same JSON shapes `Phases` records.
const DONE: &str = "done";
const INTENT: &str = "intent";

/// The phases of one label request whose keys live in a non-transactional store.
pub(super) struct KeyedPhases {
    keys: Arc<dyn KeyStore>,
    scope: Scope,
    token: FencingToken,
    outputs: BTreeMap<String, Value>,
    recovery_point: Option<String>,
    generation: Millis,
}

impl KeyedPhases {
    /// Loads the claimed record (recovery point, saved steps); a record that is
    /// no longer this attempt's is [`StoreError::Fenced`].
    pub(super) async fn begin(keys: Arc<dyn KeyStore>, ctx: &IdempotencyContext) -> Result<Self, StoreError> {
        let record = keys.get(&ctx.scope).await?;
        let (outputs, recovery_point, generation) = match record {
            Some(r) if r.fencing_token == ctx.token => (r.step_outputs, r.recovery_point, r.created_at),
            _ => return Err(StoreError::Fenced),
        };
        Ok(Self {
            keys,
            scope: ctx.scope.clone(),
            token: ctx.token,
            outputs,
            recovery_point,
            generation,
        })
    }

    /// The key that makes `step`'s writes idempotent, downstream and in SQL.
    pub(super) fn downstream_key(&self, step: &str) -> DownstreamKey {
        DownstreamKey::derive(&self.scope, self.generation, step)
    }

    fn saved<T: DeserializeOwned, E>(&self, name: &str) -> Option<Result<T, PhaseError<E>>> {
        let done = self.outputs.get(name)?.get(DONE)?;
        Some(serde_json::from_value(done.clone()).map_err(|e| PhaseError::Output(name.to_owned(), e)))
    }

    /// Records `name`'s state (fenced); `advance` moves the recovery point to it.
    async fn record<E>(&mut self, name: &str, state: Value, advance: bool) -> Result<(), PhaseError<E>> {
        let recovery_point = if advance {
            name.to_owned()
        } else {
            self.recovery_point.clone().unwrap_or_default()
        };
        let update = PhaseUpdate {
            recovery_point: recovery_point.clone(),
            step: Some((name.to_owned(), state.clone())),
        };
        self.keys.advance(&self.scope, self.token, &update).await?;
        self.outputs.insert(name.to_owned(), state);
        if advance {
            self.recovery_point = Some(recovery_point);
        }
        Ok(())
    }

    /// A phase whose business write `work` commits on its own, keyed by the
    /// downstream key it is given (so running it again writes nothing new);
    /// its output is then recorded. On resume a recorded phase is skipped and
    /// its output returned.
    pub(super) async fn phase<T, E>(
        &mut self,
        name: &str,
        work: impl AsyncFnOnce(DownstreamKey) -> Result<T, E>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        if let Some(saved) = self.saved(name) {
            return saved;
        }
        let out = work(self.downstream_key(name)).await.map_err(PhaseError::Work)?;
        let state =
            json!({ DONE: serde_json::to_value(&out).map_err(|e| PhaseError::Output(name.to_owned(), e))? });
        self.record(name, state, true).await?;
        fail::fail_point!("idemkit::after_phase");
        Ok(out)
    }

    /// An external call to a downstream that honours idempotency keys: the
    /// intent is recorded before calling and the result after; a recorded
    /// intent without a result is re-issued with the same key on resume. (A
    /// downstream that ignores keys would need parking instead, as
    /// `Phases::external` does; the courier honours keys.)
    pub(super) async fn external<T, E>(
        &mut self,
        name: &str,
        call: impl AsyncFnOnce(DownstreamKey) -> Result<T, CallError<E>>,
    ) -> Result<T, PhaseError<E>>
    where
        T: Serialize + DeserializeOwned,
    {
        if let Some(saved) = self.saved(name) {
            return saved;
        }
        let key = self.downstream_key(name);
        let pending = self.outputs.get(name).and_then(|v| v.get(INTENT)).is_some();
        if !pending {
            self.record(name, json!({ INTENT: key.as_str() }), false).await?;
            fail::fail_point!("idemkit::after_intent");
        }
        match call(key).await {
            Ok(out) => {
                fail::fail_point!("idemkit::after_call");
                let state = json!({ DONE: serde_json::to_value(&out).map_err(|e| PhaseError::Output(name.to_owned(), e))? });
                self.record(name, state, true).await?;
                Ok(out)
            }
            Err(err) => {
                // Only a call that certainly did not run withdraws its intent;
                // anything else (`Unknown`) keeps it, to be re-issued.
                if !err.may_have_run() {
                    self.record(name, json!({ "withdrawn": true }), false).await?;
                }
                Err(PhaseError::Call(err))
            }
        }
    }

    /// Records a step with no output (fenced): after a write that the step's
    /// SQL guards itself, it tells whether this attempt still holds the key.
    pub(super) async fn mark<E>(&mut self, name: &str) -> Result<(), PhaseError<E>> {
        self.record(name, json!({ DONE: null }), true).await
    }
}
