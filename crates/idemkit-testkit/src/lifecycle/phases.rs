//! Phases: recovery points and step outputs saved by the holder (in lease mode
//! and inside a transaction), fenced on its token, and resumed by a takeover.

use super::*;

/// `advance` saves the recovery point and step outputs; a later step with the
/// same name replaces its output (it is not merged); step names are JSON keys
/// whatever characters they hold. A takeover resumes from the recovery point,
/// with the outputs kept.
pub async fn advance_saves_progress_and_takeover_resumes_from_it<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let s = scope("acct-l", "phases");
    let req = claim_req(&s, r#"{"sku":"A"}"#);
    let a = must_claim(&*store, &req).await;
    store
        .advance(
            &s,
            a.token,
            &phase("charged", Some(("charge", json!({"id": "ch_1", "amount": 1250})))),
        )
        .await
        .expect("advance 1");
    let odd = r#"we"ird.$[0] 'name'"#;
    store
        .advance(
            &s,
            a.token,
            &phase("intent-recorded", Some((odd, json!([1, null, {"x": "y"}])))),
        )
        .await
        .expect("advance 2");
    // A later output under the same name replaces the earlier one.
    store
        .advance(
            &s,
            a.token,
            &phase("recharged", Some(("charge", json!({"id": "ch_2"})))),
        )
        .await
        .expect("advance 3");
    // No step: only the recovery point moves.
    store
        .advance(&s, a.token, &phase("label-bought", None))
        .await
        .expect("advance 4");

    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.recovery_point.as_deref(), Some("label-bought"));
    assert_eq!(rec.step_outputs.len(), 2, "{:?}", rec.step_outputs);
    assert_eq!(rec.step_outputs["charge"], json!({"id": "ch_2"}));
    assert_eq!(rec.step_outputs[odd], json!([1, null, {"x": "y"}]));

    // The holder dies; the next attempt takes over from the recovery point.
    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    assert!(b.token > a.token);
    assert_eq!(b.resumed_from.as_deref(), Some("label-bought"));
    let rec = record(&*store, &s).await;
    assert_eq!(rec.step_outputs["charge"], json!({"id": "ch_2"}));
    assert_eq!(rec.step_outputs[odd], json!([1, null, {"x": "y"}]));
    // The new holder carries on and completes.
    store
        .advance(&s, b.token, &phase("notified", Some(("email", json!("sent")))))
        .await
        .expect("advance after takeover");
    store
        .complete(&s, b.token, &response(201, "done"))
        .await
        .expect("complete");
    let rec = record(&*store, &s).await;
    assert_eq!(rec.recovery_point.as_deref(), Some("notified"));
    assert_eq!(rec.step_outputs.len(), 3);
}

/// `advance` and `park` are lease-holder writes: a stale token (taken over,
/// completed, released) is refused and changes nothing.
pub async fn stale_token_cannot_advance_or_park<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-l", "stale");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    assert_fenced(
        store
            .advance(&s, a.token, &phase("a-step", Some(("a", json!(1)))))
            .await,
        "advance with a taken-over token",
    );
    assert_fenced(
        store.park(&s, a.token, "a parks").await,
        "park with a taken-over token",
    );
    assert_fenced(
        store
            .advance(&s, FencingToken(b.token.0 + 1), &phase("future", None))
            .await,
        "advance with a token never handed out",
    );
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty());
    assert_eq!(rec.last_error, None);

    store
        .complete(&s, b.token, &response(201, "B"))
        .await
        .expect("complete");
    assert_fenced(
        store.advance(&s, b.token, &phase("late", None)).await,
        "advance after completion",
    );
    assert_fenced(store.park(&s, b.token, "late").await, "park after completion");
    assert_eq!(record(&*store, &s).await.state, RecordState::Completed);

    let r = scope("acct-l", "stale-released");
    let c = must_claim(&*store, &claim_req(&r, "{}")).await;
    store.release(&r, c.token).await.expect("release");
    assert_fenced(
        store.advance(&r, c.token, &phase("late", None)).await,
        "advance after release",
    );
    assert_fenced(store.park(&r, c.token, "late").await, "park after release");
}

/// A phase transaction: business row and progress commit together when the
/// transaction commits (a phase that does not complete), and again when the
/// last phase completes.
pub async fn advance_in_tx_commits_with_the_business_writes<S, P>(
    store: Arc<S>,
    probe: P,
    _clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-l", "tx-phases");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&*store, &req).await;

    let mut tx = store.begin_fenced(&s, lease.token).await.expect("begin_fenced");
    probe.insert(&mut tx, "tx-phase-1").await;
    store
        .advance_in_tx(
            &mut tx,
            &s,
            lease.token,
            &phase("reserved", Some(("reservation", json!({"slot": 4})))),
        )
        .await
        .expect("advance_in_tx");
    assert_eq!(probe.count("tx-phase-1").await, 0, "uncommitted");
    assert_eq!(record(&*store, &s).await.recovery_point, None, "uncommitted");
    store.commit(tx).await.expect("commit the phase");
    assert_eq!(probe.count("tx-phase-1").await, 1);
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.recovery_point.as_deref(), Some("reserved"));
    assert_eq!(rec.step_outputs["reservation"], json!({"slot": 4}));

    let mut tx = store.begin_fenced(&s, lease.token).await.expect("begin_fenced");
    probe.insert(&mut tx, "tx-phase-2").await;
    store
        .advance_in_tx(
            &mut tx,
            &s,
            lease.token,
            &phase("shipped", Some(("label", json!("L-1")))),
        )
        .await
        .expect("advance_in_tx");
    store
        .complete_in_tx(tx, &s, lease.token, &response(201, "shipped"))
        .await
        .expect("complete_in_tx");
    assert_eq!(probe.count("tx-phase-2").await, 1);
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.recovery_point.as_deref(), Some("shipped"));
    assert_eq!(rec.step_outputs.len(), 2);
    assert_eq!(rec.step_outputs["label"], json!("L-1"));
    assert_eq!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "shipped"))
    );
}

/// A dropped phase transaction (crash, error) rolls back its progress with its
/// business writes: the record stays at the previous recovery point, which is
/// where a takeover resumes.
pub async fn dropped_phase_rolls_back_progress_with_business_writes<S, P>(
    store: Arc<S>,
    probe: P,
    clock: Arc<ManualClock>,
) where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-l", "tx-drop-phase");
    let req = claim_req(&s, "{}");
    let lease = must_claim(&*store, &req).await;
    let mut tx = store.begin_fenced(&s, lease.token).await.unwrap();
    probe.insert(&mut tx, "tx-drop-1").await;
    store
        .advance_in_tx(&mut tx, &s, lease.token, &phase("one", Some(("one", json!(1)))))
        .await
        .unwrap();
    store.commit(tx).await.expect("commit the phase");

    let mut tx = store.begin_fenced(&s, lease.token).await.unwrap();
    probe.insert(&mut tx, "tx-drop-2").await;
    store
        .advance_in_tx(&mut tx, &s, lease.token, &phase("two", Some(("two", json!(2)))))
        .await
        .unwrap();
    drop(tx);
    assert_eq!(probe.count("tx-drop-1").await, 1);
    assert_eq!(probe.count("tx-drop-2").await, 0, "rolled back");
    let rec = record(&*store, &s).await;
    assert_eq!(rec.recovery_point.as_deref(), Some("one"));
    assert_eq!(rec.step_outputs.len(), 1);
    assert!(!rec.step_outputs.contains_key("two"));

    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    assert_eq!(b.resumed_from.as_deref(), Some("one"));
}

/// A holder whose lease was taken over cannot advance inside a transaction: the
/// progress write is fenced by its own token (whatever token opened the
/// transaction), its business writes roll back with the transaction, and the
/// current holder's progress is intact.
pub async fn stale_token_cannot_advance_in_a_tx<S, P>(store: Arc<S>, probe: P, clock: Arc<ManualClock>)
where
    S: TransactionalStore,
    P: BusinessProbe<S>,
{
    let s = scope("acct-l", "tx-stale-phase");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    clock.advance(LEASE * 2);
    let b = must_claim(&*store, &req).await;
    // A's phase transaction, opened while B holds the key (B's token passes the
    // opening check in backends that do not lock there); A advances with its own.
    let mut tx = store.begin_fenced(&s, b.token).await.unwrap();
    probe.insert(&mut tx, "tx-stale-a").await;
    let err = store
        .advance_in_tx(&mut tx, &s, a.token, &phase("a-phase", Some(("a", json!("A")))))
        .await;
    assert_fenced(err, "advance_in_tx with a taken-over token");
    drop(tx);
    assert_eq!(probe.count("tx-stale-a").await, 0);
    assert!(matches!(
        store.begin_fenced(&s, a.token).await,
        Err(StoreError::Fenced)
    ));
    let rec = record(&*store, &s).await;
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty());

    let mut tx = store.begin_fenced(&s, b.token).await.unwrap();
    probe.insert(&mut tx, "tx-stale-b").await;
    store
        .advance_in_tx(&mut tx, &s, b.token, &phase("b-phase", Some(("b", json!("B")))))
        .await
        .expect("the current holder advances");
    store.commit(tx).await.expect("commit the phase");
    assert_eq!(probe.count("tx-stale-b").await, 1);
    assert_eq!(
        record(&*store, &s).await.recovery_point.as_deref(),
        Some("b-phase")
    );
}
