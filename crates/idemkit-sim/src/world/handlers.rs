//! The simulated application: the handlers every instance serves (the REST
//! lease-mode `/pay` written with the real `Phases`, the plain `/echo`, the
//! single-step `/order` on the SQL stores), the downstreams they call, and the
//! effects those downstreams count for the checker.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idemkit_core::TransactionalStore;
use idemkit_postgres::PgTx;
use idemkit_sqlite::SqliteTx;
use idemkit_tower::{CallError, Downstream, IdempotencyContext, PhaseError, Phases, Tx};

use crate::sched::Sched;

/// Effects at the simulated downstreams, by request marker.
#[derive(Debug, Default)]
pub struct Effects {
    /// The downstream that ignores keys: every call acts.
    pub ignoring: BTreeMap<String, Vec<String>>,
    /// The downstream that honours keys: the keys it acted on.
    pub honouring: BTreeMap<String, Vec<String>>,
    honoured: BTreeMap<String, String>,
    /// Calls to the downstream that ignores keys under way (started, not yet
    /// acted nor dropped), by request marker: what an operator who checks the
    /// downstream cannot rule out.
    pub in_progress: BTreeMap<String, usize>,
}

impl Effects {
    /// Whether either downstream acted, or may still act, for `item`: what
    /// the operator truthfully knows after checking the downstream systems.
    pub fn touched(&self, item: &str) -> bool {
        self.ignoring.get(item).is_some_and(|c| !c.is_empty())
            || self.honouring.get(item).is_some_and(|c| !c.is_empty())
            || self.in_progress.get(item).is_some_and(|n| *n > 0)
    }
}

/// Counts a call to the downstream that ignores keys as under way until it
/// acted or its future was dropped.
pub(super) struct Underway {
    shared: Arc<Shared>,
    item: String,
}

impl Underway {
    pub(super) fn new(shared: Arc<Shared>, item: String) -> Self {
        *shared
            .effects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .in_progress
            .entry(item.clone())
            .or_default() += 1;
        Self { shared, item }
    }
}

impl Drop for Underway {
    fn drop(&mut self) {
        let mut fx = self.shared.effects.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = fx.in_progress.get_mut(&self.item) {
            *n = n.saturating_sub(1);
        }
    }
}

/// What handlers share: the scheduler (for faults) and the downstreams.
#[derive(Debug)]
pub struct Shared {
    pub(super) sched: Arc<Sched>,
    pub(super) effects: Mutex<Effects>,
}

pub(super) struct AppState<St: ?Sized> {
    pub(super) store: Arc<St>,
    pub(super) shared: Arc<Shared>,
}

impl<St: ?Sized> Clone for AppState<St> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            shared: self.shared.clone(),
        }
    }
}

pub(super) fn item_of(body: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("item").and_then(|i| i.as_str()).map(str::to_owned))
        .unwrap_or_default()
}

fn maybe_panic(shared: &Shared) {
    if shared.sched.fault(|f| f.panic) {
        panic!("simulated handler panic");
    }
}

pub(super) type HandlerError = (StatusCode, String);

/// A plain lease-mode handler (no phases, no downstream): its answer is
/// stored by the layer itself, so the layer's own completion and its
/// in-process replay cache run (a `Phases` handler completes the record
/// itself). It echoes the request's marker.
pub(super) async fn echo(body: Bytes) -> Response {
    let item = item_of(&body);
    (
        StatusCode::CREATED,
        axum::Json(serde_json::json!({ "item": item })),
    )
        .into_response()
}

/// What the lease-mode handlers' phases recorded: the reservation, the charge
/// at the downstream that ignores keys, the note at the one that honours them.
pub(super) struct Steps<St: TransactionalStore> {
    pub(super) phases: Phases<St>,
    item: String,
    reserved: String,
    charge: String,
    note: String,
}

impl<St: TransactionalStore> Steps<St> {
    /// The answer's fields (every one recorded, so a resumed run answers
    /// the same).
    pub(super) fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "item": self.item, "reserved": self.reserved, "charge": self.charge, "note": self.note
        })
    }
}

/// The lease-mode handlers' steps, written with the real [`Phases`]: a
/// phase, a call to a downstream that ignores keys, a call to one that
/// honours them. The REST handler ends them with `finish`; the gRPC one with
/// a last phase, the layer storing its reply.
pub(super) async fn pay_steps<St: TransactionalStore>(
    app: &AppState<St>,
    ctx: &IdempotencyContext,
    item: String,
) -> Result<Steps<St>, PhaseError<HandlerError>> {
    maybe_panic(&app.shared);
    let mut phases = Phases::begin(app.store.clone(), ctx).await?;
    let reserved: String = phases
        .phase("reserve", async |_tx| Ok::<_, HandlerError>(format!("r-{item}")))
        .await?;
    if item == "boom" {
        panic!("simulated panic on every run");
    }
    maybe_panic(&app.shared);
    let shared = app.shared.clone();
    let it = item.clone();
    let charge: String = phases
        .external("charge", Downstream::IgnoresKeys, async move |key| {
            let underway = Underway::new(shared.clone(), it.clone());
            // A slow downstream: the attempt outlives its lease unless its
            // heartbeats get through.
            if shared.sched.fault(|f| f.slow) {
                let pause = shared.sched.with_rng(|r| r.millis(1000, 15000));
                tokio::time::sleep(pause).await;
            }
            let mut fx = shared.effects.lock().unwrap_or_else(|p| p.into_inner());
            let list = fx.ignoring.entry(it).or_default();
            list.push(key.as_str().to_owned());
            let id = format!("ch-{}", list.len());
            drop(fx);
            drop(underway);
            if shared.sched.fault(|f| f.lost_answer) {
                return Err(CallError::Unknown((
                    StatusCode::BAD_GATEWAY,
                    "charge timed out".into(),
                )));
            }
            Ok(id)
        })
        .await?;
    maybe_panic(&app.shared);
    let shared = app.shared.clone();
    let it = item.clone();
    let note: String = phases
        .external("notify", Downstream::HonoursKeys, async move |key| {
            let mut fx = shared.effects.lock().unwrap_or_else(|p| p.into_inner());
            let k = key.as_str().to_owned();
            let answer = match fx.honoured.get(&k) {
                Some(a) => a.clone(),
                None => {
                    let a = format!("n-{}", fx.honoured.len());
                    fx.honoured.insert(k.clone(), a.clone());
                    fx.honouring.entry(it).or_default().push(k);
                    a
                }
            };
            drop(fx);
            if shared.sched.fault(|f| f.lost_answer) {
                return Err(CallError::Unknown((
                    StatusCode::BAD_GATEWAY,
                    "notify timed out".into(),
                )));
            }
            Ok(answer)
        })
        .await?;
    Ok(Steps {
        phases,
        item,
        reserved,
        charge,
        note,
    })
}

/// The REST lease-mode handler: [`pay_steps`], then the final phase, which
/// stores the answer with its last write.
pub(super) async fn pay<St: TransactionalStore>(
    State(app): State<AppState<St>>,
    ctx: IdempotencyContext,
    body: Bytes,
) -> Result<Response, PhaseError<HandlerError>> {
    let steps = pay_steps(&app, &ctx, item_of(&body)).await?;
    let mut answer = steps.json();
    answer["token"] = ctx.token.0.into();
    steps
        .phases
        .finish("done", async |_tx| {
            Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
        })
        .await
}

/// What a single-step handler needs: the scheduler (faults, and its business
/// write as a scheduled call) and which instance runs it.
#[derive(Clone)]
pub(super) struct OrderState {
    pub(super) shared: Arc<Shared>,
    pub(super) instance: usize,
}

/// The answer of a single-step handler once its business write ran (or failed).
fn order_answer<E: std::fmt::Display>(
    item: String,
    id: Result<Result<i64, E>, crate::sched::IoFault>,
) -> Response {
    match id {
        Ok(Ok(id)) => (
            StatusCode::CREATED,
            axum::Json(serde_json::json!({ "item": item, "row": id })),
        )
            .into_response(),
        Ok(Err(e)) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

/// The single-step handler: its business write is a row in the store's own
/// SQLite database, committed with the claim and the answer. The write is
/// network (or worker-thread) I/O outside the store's calls, so it runs as a
/// scheduled call ([`Sched::io`]): the driver waits for it rather than let
/// virtual time run on while it is on the wire.
pub(super) async fn order(mut tx: Tx<SqliteTx>, State(st): State<OrderState>, body: Bytes) -> Response {
    let item = item_of(&body);
    maybe_panic(&st.shared);
    let insert = sqlx::query_scalar::<_, i64>("INSERT INTO sim_orders (item) VALUES (?1) RETURNING id")
        .bind(&item)
        .fetch_one(&mut **tx);
    let id = st.shared.sched.io(st.instance, "business_write", insert).await;
    order_answer(item, id)
}

/// The single-step handler on PostgreSQL.
pub(super) async fn order_pg(mut tx: Tx<PgTx>, State(st): State<OrderState>, body: Bytes) -> Response {
    let item = item_of(&body);
    maybe_panic(&st.shared);
    let insert = sqlx::query_scalar::<_, i64>("INSERT INTO sim_orders (item) VALUES ($1) RETURNING id")
        .bind(&item)
        .fetch_one(&mut **tx);
    let id = st.shared.sched.io(st.instance, "business_write", insert).await;
    order_answer(item, id)
}
