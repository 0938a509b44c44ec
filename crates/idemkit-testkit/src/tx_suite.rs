//! Conformance cases for the transactional extension ([`TransactionalStore`]):
//! business writes share the claim's transaction and are fenced with it.

use std::sync::Arc;

use async_trait::async_trait;
use idemkit_core::{ClaimOutcome, PhaseUpdate, StoreError, TransactionalStore, TxClaim};

use crate::ManualClock;
use crate::suite::{LEASE, claim_req, must_claim, response, scope};

/// How the suite writes and counts business rows in a backend's transaction.
#[async_trait]
pub trait BusinessProbe<S: TransactionalStore>: Send + Sync {
    /// Inserts one business row tagged `tag` inside `tx`.
    async fn insert(&self, tx: &mut S::Tx, tag: &str);
    /// Counts committed business rows tagged `tag`.
    async fn count(&self, tag: &str) -> usize;
}

/// Every case of this suite, by name (see [`crate::suite::cases`]).
pub fn cases<S: TransactionalStore, P: BusinessProbe<S> + 'static>()
-> Vec<(&'static str, crate::TxCase<S, P>)> {
    crate::__tx_cases!(__case_table { tx tx_suite, S, P; })
}

async fn claim_tx<S: TransactionalStore>(
    store: &S,
    req: &idemkit_core::ClaimRequest,
) -> (S::Tx, idemkit_core::Lease) {
    match store.claim_in_tx(req).await.expect("claim_in_tx") {
        TxClaim::Claimed { tx, lease } => (tx, lease),
        TxClaim::Other(o) => panic!("expected a claim, got {o:?}"),
    }
}

/// Claim, business row and response commit together; the retry replays.
pub async fn claim_business_write_and_response_commit_together<S, P>(
    store: Arc<S>,
    probe: P,
    _clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-1");
    let req = claim_req(&s, "{}");
    let (mut tx, lease) = claim_tx(&*store, &req).await;
    probe.insert(&mut tx, "tx-1").await;
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "one"))
        .await
        .unwrap();
    assert_eq!(probe.count("tx-1").await, 1);
    match store.claim_in_tx(&req).await.unwrap() {
        TxClaim::Other(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "one")),
        other => panic!("expected replay, got {other:?}"),
    }
    assert_eq!(probe.count("tx-1").await, 1);
}

/// Dropping the transaction (validation error, panic, crash) rolls back the claim
/// and the business rows: the key is absent again.
pub async fn dropped_transaction_rolls_back_claim_and_writes<S, P>(
    store: Arc<S>,
    probe: P,
    _clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-drop");
    let req = claim_req(&s, "{}");
    let (mut tx, _lease) = claim_tx(&*store, &req).await;
    probe.insert(&mut tx, "tx-drop").await;
    drop(tx);
    assert_eq!(probe.count("tx-drop").await, 0);
    assert!(store.get(&s).await.unwrap().is_none());
    let (tx, lease) = claim_tx(&*store, &req).await;
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
}

/// A holder whose lease was taken over cannot even open a fenced transaction.
pub async fn stale_token_cannot_open_a_transaction<S, P>(store: Arc<S>, _probe: P, clock: Arc<ManualClock>)
where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-stale");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    assert!(matches!(
        store.begin_fenced(&s, a.token).await,
        Err(StoreError::Fenced)
    ));
    let tx = store.begin_fenced(&s, b.token).await.expect("current holder");
    store
        .complete_in_tx(tx, &s, b.token, &response(201, "B"))
        .await
        .unwrap();
}

/// A completion with a stale token is refused and the business writes made in
/// the same transaction roll back with it; the replay is the current holder's.
pub async fn fenced_completion_rolls_back_business_writes<S, P>(
    store: Arc<S>,
    probe: P,
    clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-fence");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    // A's phase transaction: opened while B holds the key (B's token passes the
    // opening check in backends that do not lock there), A writes, then tries to
    // complete with its own stale token.
    let mut tx = store.begin_fenced(&s, b.token).await.unwrap();
    probe.insert(&mut tx, "tx-fence-a").await;
    let err = store.complete_in_tx(tx, &s, a.token, &response(201, "A")).await;
    assert!(matches!(err, Err(StoreError::Fenced)), "{err:?}");
    assert_eq!(
        probe.count("tx-fence-a").await,
        0,
        "A's business write rolled back"
    );
    let mut tx = store.begin_fenced(&s, b.token).await.unwrap();
    probe.insert(&mut tx, "tx-fence-b").await;
    store
        .complete_in_tx(tx, &s, b.token, &response(201, "B"))
        .await
        .unwrap();
    assert_eq!(probe.count("tx-fence-b").await, 1);
    assert_eq!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "B"))
    );
}

/// 64 concurrent single-step requests with one key: one business row; every
/// other answer is the stored response, in-progress, or a conflict at commit
/// whose writes were rolled back.
pub async fn concurrent_single_step_requests_write_once<S, P>(
    store: Arc<S>,
    probe: P,
    _clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S> + 'static,
{
    let s = scope("acct-a", "tx-race");
    let req = claim_req(&s, "{}");
    let probe = Arc::new(probe);
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (store, req, probe, barrier, s) = (
                store.clone(),
                req.clone(),
                probe.clone(),
                barrier.clone(),
                s.clone(),
            );
            tokio::spawn(async move {
                barrier.wait().await;
                match store.claim_in_tx(&req).await.expect("claim") {
                    TxClaim::Claimed { mut tx, lease } => {
                        probe.insert(&mut tx, "tx-race").await;
                        match store
                            .complete_in_tx(tx, &s, lease.token, &response(201, "race"))
                            .await
                        {
                            Ok(()) => None,
                            // Lost at commit: rolled back, nothing written.
                            Err(StoreError::Conflict) => Some(ClaimOutcome::InProgress {
                                retry_after: Default::default(),
                            }),
                            Err(e) => panic!("complete: {e}"),
                        }
                    }
                    TxClaim::Other(o) => Some(o),
                }
            })
        })
        .collect();
    let mut executed = 0;
    for t in tasks {
        match t.await.unwrap() {
            None => executed += 1,
            Some(ClaimOutcome::Replay(r)) => assert_eq!(r, response(201, "race")),
            Some(ClaimOutcome::InProgress { .. }) => {}
            Some(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executed, 1);
    assert_eq!(probe.count("tx-race").await, 1);
}

/// A single-step claim over an existing record (here a released one) takes a
/// token above that record's, so fencing tokens keep growing for the key.
pub async fn single_step_claim_over_a_record_raises_its_token<S, P>(
    store: Arc<S>,
    _probe: P,
    _clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-token");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    store.release(&s, a.token).await.unwrap();
    let seen = store
        .get(&s)
        .await
        .unwrap()
        .expect("a released record")
        .fencing_token;
    let (tx, lease) = claim_tx(&*store, &req).await;
    assert!(lease.token > seen, "token {:?} after {seen:?}", lease.token);
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
    assert_eq!(store.get(&s).await.unwrap().unwrap().fencing_token, lease.token);
}

/// A single-step takeover of a lapsed attempt that recorded progress resumes
/// from it and keeps it in the completed record.
pub async fn single_step_takeover_keeps_progress<S, P>(store: Arc<S>, _probe: P, clock: Arc<ManualClock>)
where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-a", "tx-keep");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    let mut tx = store.begin_fenced(&s, a.token).await.unwrap();
    let update = PhaseUpdate {
        recovery_point: "booked".into(),
        step: Some(("courier".into(), serde_json::json!({ "done": "TRK-1" }))),
    };
    store.advance_in_tx(&mut tx, &s, a.token, &update).await.unwrap();
    store.commit(tx).await.unwrap();
    clock.advance(LEASE * 2);
    let (tx, lease) = claim_tx(&*store, &req).await;
    assert_eq!(lease.resumed_from.as_deref(), Some("booked"));
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "ok"))
        .await
        .unwrap();
    let r = store.get(&s).await.unwrap().unwrap();
    assert_eq!(r.recovery_point.as_deref(), Some("booked"));
    assert!(r.step_outputs.contains_key("courier"), "{:?}", r.step_outputs);
}
