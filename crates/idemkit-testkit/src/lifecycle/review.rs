//! What humans and the background jobs see: parked records, the completer's
//! work list, the reaper and its review table.

use super::*;

/// A parked record ends its lease, keeps its progress and the reason, answers
/// `Parked` to the same request and `Mismatch` to another, and is never claimed
/// again, not even after the replay window. Its holder can no longer write.
pub async fn parked_record_is_never_claimed_again<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let s = scope("acct-l", "parked");
    let req = claim_req(&s, r#"{"ship":"1"}"#);
    let a = must_claim(&*store, &req).await;
    store
        .advance(
            &s,
            a.token,
            &phase("courier-intent", Some(("courier", json!({"ref": "c-1"})))),
        )
        .await
        .expect("advance");
    store
        .park(
            &s,
            a.token,
            "courier outcome unknown; it ignores idempotency keys",
        )
        .await
        .expect("park");
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::Parked);
    assert!(rec.lease_expires_at <= store.now(), "parking ends the lease");
    assert_eq!(
        rec.last_error.as_deref(),
        Some("courier outcome unknown; it ignores idempotency keys")
    );
    assert_eq!(rec.recovery_point.as_deref(), Some("courier-intent"));
    assert_eq!(rec.step_outputs["courier"], json!({"ref": "c-1"}));

    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Parked);
    assert_eq!(
        store.claim(&claim_req(&s, r#"{"ship":"2"}"#)).await.unwrap(),
        ClaimOutcome::Mismatch
    );
    // The holder's lease is over: it can neither complete nor heartbeat.
    assert_fenced(
        store.complete(&s, a.token, &response(201, "late")).await,
        "complete after park",
    );
    assert_fenced(store.heartbeat(&s, a.token, LEASE).await, "heartbeat after park");
    assert_fenced(store.abandon(&s, a.token, "x").await, "abandon after park");
    assert_fenced(store.release(&s, a.token).await, "release after park");
    let parked = record(&*store, &s).await.fencing_token;
    assert!(parked > a.token, "parking moves the record to a new token");

    clock.advance(LEASE * 2);
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Parked);
    clock.advance(WINDOW * 2);
    assert_eq!(store.claim(&req).await.unwrap(), ClaimOutcome::Parked);
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::Parked);
    assert_eq!(rec.fencing_token, parked, "nobody claimed it since");
    // Not the completer's business: a human decides.
    assert!(store.abandoned(store.now(), 100).await.unwrap().is_empty());
}

/// `abandoned` lists in-flight records whose lease has expired and that were
/// claimed at or before the cut-off, oldest first, at most `limit`; never live
/// leases, completed, released or parked records.
pub async fn abandoned_lists_expired_in_flight_records_oldest_first<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let step = Duration::from_secs(1);
    // Claimed before the cut-off but kept alive by its heartbeat.
    let (kept, l) = claimed(&*store, "ab-kept").await;
    store.heartbeat(&kept, l.token, LEASE * 10).await.unwrap();
    clock.advance(step);
    let (_, _a1) = claimed(&*store, "ab-1").await;
    clock.advance(step);
    let (_, _a2) = claimed(&*store, "ab-2").await;
    clock.advance(step);
    let (done, l) = claimed(&*store, "ab-done").await;
    store.complete(&done, l.token, &response(201, "x")).await.unwrap();
    clock.advance(step);
    let (parked, l) = claimed(&*store, "ab-parked").await;
    store.park(&parked, l.token, "review").await.unwrap();
    clock.advance(step);
    let (released, l) = claimed(&*store, "ab-released").await;
    store.release(&released, l.token).await.unwrap();
    clock.advance(step);
    // Ended at once by a retryable outcome: abandoned without waiting for expiry.
    let (a3, l) = claimed(&*store, "ab-3").await;
    store
        .advance(&a3, l.token, &phase("half-way", Some(("s", json!(true)))))
        .await
        .unwrap();
    store.abandon(&a3, l.token, "courier timeout").await.unwrap();
    let cut = store.now();
    clock.advance(step);
    let (_, _late) = claimed(&*store, "ab-late").await;

    // Nothing has expired yet except the one whose lease ended at once.
    assert_eq!(keys(&store.abandoned(cut, 10).await.unwrap()), ["ab-3"]);

    clock.advance(LEASE * 2);
    let (live, _) = claimed(&*store, "ab-live").await;

    let found = store.abandoned(cut, 10).await.unwrap();
    assert_eq!(keys(&found), ["ab-1", "ab-2", "ab-3"]);
    assert_eq!(found[2].recovery_point.as_deref(), Some("half-way"));
    assert_eq!(found[2].last_error.as_deref(), Some("courier timeout"));
    assert_eq!(
        found[0].request,
        claim_req(&found[0].scope, r#"{"key":"ab-1"}"#).request
    );
    assert_eq!(keys(&store.abandoned(cut, 2).await.unwrap()), ["ab-1", "ab-2"]);
    assert!(store.abandoned(cut, 0).await.unwrap().is_empty());
    assert_eq!(
        keys(&store.abandoned(store.now(), 10).await.unwrap()),
        ["ab-1", "ab-2", "ab-3", "ab-late"],
        "live leases ({live:?}, {kept:?}) are never listed"
    );
    // Before the first claim: nothing.
    assert!(
        store
            .abandoned(Millis(cut.0 - 60_000), 10)
            .await
            .unwrap()
            .is_empty()
    );
}

/// The reaper deletes completed and released records past the threshold, moves
/// records that never completed (expired in flight, parked) to the review list
/// with where they got to and why they stopped, and leaves live leases and
/// recent records alone. A second pass finds nothing.
pub async fn reap_deletes_old_records_and_moves_unfinished_ones_to_review<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    assert!(store.review(10).await.unwrap().is_empty());
    let step = Duration::from_secs(1);
    let (done_old, l) = claimed(&*store, "rp-done-old").await;
    store
        .complete(&done_old, l.token, &response(201, "x"))
        .await
        .unwrap();
    let (released_old, l) = claimed(&*store, "rp-released-old").await;
    store.release(&released_old, l.token).await.unwrap();
    clock.advance(step);
    let (stuck_old, l) = claimed(&*store, "rp-stuck-old").await;
    let stuck_created = store.now();
    store
        .advance(
            &stuck_old,
            l.token,
            &phase("charged", Some(("charge", json!({"id": "ch_9"})))),
        )
        .await
        .unwrap();
    store
        .abandon(&stuck_old, l.token, "courier timeout")
        .await
        .unwrap();
    clock.advance(step);
    let (parked_old, l) = claimed(&*store, "rp-parked-old").await;
    store
        .advance(
            &parked_old,
            l.token,
            &phase("courier-intent", Some(("courier", json!("c-7")))),
        )
        .await
        .unwrap();
    store.park(&parked_old, l.token, "outcome unknown").await.unwrap();
    // Claimed long ago but still held: a live lease is never touched.
    let (live_old, live_lease) = claimed(&*store, "rp-live-old").await;
    store
        .heartbeat(&live_old, live_lease.token, REAP * 2)
        .await
        .unwrap();
    // Claimed long ago, completed after the threshold: kept.
    let (done_late, late_lease) = claimed(&*store, "rp-done-late").await;
    store
        .heartbeat(&done_late, late_lease.token, REAP * 2)
        .await
        .unwrap();

    clock.advance(REAP);
    let before = store.now();
    clock.advance(step);
    store
        .complete(&done_late, late_lease.token, &response(201, "late"))
        .await
        .unwrap();
    let (done_new, l) = claimed(&*store, "rp-done-new").await;
    store
        .complete(&done_new, l.token, &response(201, "x"))
        .await
        .unwrap();
    let (released_new, l) = claimed(&*store, "rp-released-new").await;
    store.release(&released_new, l.token).await.unwrap();
    let (parked_new, l) = claimed(&*store, "rp-parked-new").await;
    store.park(&parked_new, l.token, "recent").await.unwrap();
    let (stuck_new, _) = claimed(&*store, "rp-stuck-new").await;
    clock.advance(LEASE * 2);
    let reaped_at = store.now();

    let report = store.reap(before).await.expect("reap");
    assert_eq!(
        report,
        ReapReport {
            deleted: 2,
            moved_to_review: 2
        }
    );
    for gone in [&done_old, &released_old] {
        assert!(store.get(gone).await.unwrap().is_none(), "{gone:?} reaped");
    }
    // What never completed is listed for review and stays, parked on a new
    // token: it keeps fencing, and its key never runs again as a new request.
    for listed in [&stuck_old, &parked_old] {
        let rec = record(&*store, listed).await;
        assert_eq!(rec.state, RecordState::Parked, "{listed:?}");
        assert_eq!(rec.last_error.as_deref(), Some(MOVED_TO_REVIEW));
        assert_eq!(
            store
                .claim(&claim_req(
                    listed,
                    &format!(r#"{{"key":"{}"}}"#, listed.key.as_str())
                ))
                .await
                .unwrap(),
            ClaimOutcome::Parked
        );
    }
    for kept in [
        &live_old,
        &done_late,
        &done_new,
        &released_new,
        &parked_new,
        &stuck_new,
    ] {
        assert!(store.get(kept).await.unwrap().is_some(), "{kept:?} kept");
    }
    let live = record(&*store, &live_old).await;
    assert_eq!(live.state, RecordState::InFlight);
    assert_eq!(live.fencing_token, live_lease.token);
    store
        .complete(&live_old, live_lease.token, &response(201, "still mine"))
        .await
        .expect("the live holder still completes");

    let review = store.review(10).await.expect("review");
    assert_eq!(review.len(), 2, "{review:?}");
    let (stuck, parked) = (&review[0], &review[1]);
    assert_eq!(stuck.scope, stuck_old);
    assert_eq!(stuck.state, RecordState::InFlight);
    assert_eq!(stuck.created_at, stuck_created);
    assert_eq!(stuck.reaped_at, reaped_at);
    assert_eq!(stuck.recovery_point.as_deref(), Some("charged"));
    assert_eq!(stuck.step_outputs["charge"], json!({"id": "ch_9"}));
    assert_eq!(stuck.last_error.as_deref(), Some("courier timeout"));
    assert_eq!(
        stuck.request,
        claim_req(&stuck_old, r#"{"key":"rp-stuck-old"}"#).request
    );
    assert_eq!(parked.scope, parked_old);
    assert_eq!(parked.state, RecordState::Parked);
    assert!(parked.created_at > stuck.created_at);
    assert_eq!(parked.recovery_point.as_deref(), Some("courier-intent"));
    assert_eq!(parked.step_outputs["courier"], json!("c-7"));
    assert_eq!(parked.last_error.as_deref(), Some("outcome unknown"));
    assert_eq!(store.review(1).await.unwrap(), review[..1]);

    assert_eq!(store.reap(before).await.unwrap(), ReapReport::default());
    assert_eq!(store.review(10).await.unwrap(), review);
}

/// After the reaper deleted a completed record its key is free: the next claim
/// starts a new request from scratch, on a token above every token the deleted
/// record handed out (a holder paused since then can never write to it). A
/// record listed for review is not deleted: its key answers parked.
pub async fn reaped_keys_can_be_claimed_anew<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let done = scope("acct-l", "again-done");
    let done_req = claim_req(&done, "{}");
    let first = must_claim(&*store, &done_req).await;
    // A takeover leaves a stale holder of the first token behind.
    clock.advance(LEASE * 2);
    let l = must_claim(&*store, &done_req).await;
    assert!(l.token > first.token);
    store
        .complete(&done, l.token, &response(201, "old"))
        .await
        .unwrap();
    let parked = scope("acct-l", "again-parked");
    let parked_req = claim_req(&parked, "{}");
    let p = must_claim(&*store, &parked_req).await;
    store
        .advance(&parked, p.token, &phase("p", Some(("p", json!(1)))))
        .await
        .unwrap();
    store.park(&parked, p.token, "review").await.unwrap();

    clock.advance(REAP + Duration::from_secs(1));
    let report = store.reap(store.now()).await.unwrap();
    assert_eq!(
        report,
        ReapReport {
            deleted: 1,
            moved_to_review: 1
        }
    );
    assert_eq!(store.claim(&parked_req).await.unwrap(), ClaimOutcome::Parked);
    assert!(store.get(&done).await.unwrap().is_none());

    let lease = must_claim(&*store, &done_req).await;
    assert_eq!(lease.resumed_from, None);
    assert!(
        lease.token > l.token && lease.token > first.token,
        "tokens never repeat for a reaped key: {lease:?} after {first:?} and {l:?}"
    );
    let rec = record(&*store, &done).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty());
    assert_eq!(rec.last_error, None);
    // The holders of the deleted record's tokens are fenced out of the new one.
    for stale in [first.token, l.token] {
        assert!(matches!(
            store.complete(&done, stale, &response(201, "stale")).await,
            Err(StoreError::Fenced)
        ));
    }
    store
        .complete(&done, lease.token, &response(201, "new"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(&done_req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "new"))
    );
}
