//! The operator's view and hand: listing records, force-releasing them.

use super::*;

/// `list` returns whole records matching the state and account filters,
/// newest claim first (ties by account, then key), at most `limit`.
pub async fn list_filters_by_state_and_account_newest_first<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let all = |limit| ListFilter {
        limit,
        ..ListFilter::default()
    };
    assert!(store.list(&all(10)).await.unwrap().is_empty());
    let step = Duration::from_secs(1);
    let (done, l) = claimed(&*store, "ls-done").await;
    store.complete(&done, l.token, &response(201, "x")).await.unwrap();
    clock.advance(step);
    let (parked, l) = claimed(&*store, "ls-parked").await;
    store
        .advance(
            &parked,
            l.token,
            &phase("intent", Some(("courier", json!({"intent": "k"})))),
        )
        .await
        .unwrap();
    store.park(&parked, l.token, "outcome unknown").await.unwrap();
    clock.advance(step);
    let (released, l) = claimed(&*store, "ls-released").await;
    store.release(&released, l.token).await.unwrap();
    clock.advance(step);
    let other = scope("acct-other", "ls-other");
    must_claim(&*store, &claim_req(&other, "{}")).await;
    // Claimed at the same instant: ordered by account, then key.
    let (_, _) = claimed(&*store, "ls-live-b").await;
    let (_, _) = claimed(&*store, "ls-live-a").await;

    let found = store.list(&all(10)).await.unwrap();
    assert_eq!(
        keys(&found),
        [
            "ls-live-a",
            "ls-live-b",
            "ls-other",
            "ls-released",
            "ls-parked",
            "ls-done"
        ]
    );
    assert_eq!(
        keys(&store.list(&all(2)).await.unwrap()),
        ["ls-live-a", "ls-live-b"]
    );
    assert!(store.list(&all(0)).await.unwrap().is_empty());

    let by_state = |state| ListFilter {
        state: Some(state),
        ..all(10)
    };
    let parked_list = store.list(&by_state(RecordState::Parked)).await.unwrap();
    assert_eq!(parked_list.len(), 1);
    assert_eq!(parked_list[0], record(&*store, &parked).await, "whole records");
    assert_eq!(parked_list[0].recovery_point.as_deref(), Some("intent"));
    assert_eq!(parked_list[0].last_error.as_deref(), Some("outcome unknown"));
    assert_eq!(
        keys(&store.list(&by_state(RecordState::Completed)).await.unwrap()),
        ["ls-done"]
    );
    assert_eq!(
        store.list(&by_state(RecordState::Completed)).await.unwrap()[0].response,
        Some(response(201, "x"))
    );
    assert_eq!(
        keys(&store.list(&by_state(RecordState::Released)).await.unwrap()),
        ["ls-released"]
    );
    assert_eq!(
        keys(&store.list(&by_state(RecordState::InFlight)).await.unwrap()),
        ["ls-live-a", "ls-live-b", "ls-other"]
    );

    let by_account = |account: &str, state| ListFilter {
        account: Some(Account::new(account)),
        state,
        limit: 10,
    };
    assert_eq!(
        keys(&store.list(&by_account("acct-other", None)).await.unwrap()),
        ["ls-other"]
    );
    assert_eq!(
        keys(
            &store
                .list(&by_account("acct-l", Some(RecordState::InFlight)))
                .await
                .unwrap()
        ),
        ["ls-live-a", "ls-live-b"]
    );
    assert!(
        store
            .list(&by_account("acct-other", Some(RecordState::Parked)))
            .await
            .unwrap()
            .is_empty()
    );
    assert!(store.list(&by_account("nobody", None)).await.unwrap().is_empty());
}

/// `force_release` releases records nobody holds (parked, or in flight with
/// an expired lease), on a new token with the old holder fenced. Without
/// recorded progress it leaves the usual tombstone (state `released`, the key
/// free for a first attempt); with recorded progress (an intent) the record
/// becomes resumable and the rerun takes over from its recovery point. It
/// refuses (changing nothing) live leases, completed and released records, and
/// absent ones.
pub async fn force_release_frees_only_records_nobody_holds<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    assert!(!store.force_release(&scope("acct-l", "fr-absent")).await.unwrap());

    // A live lease is never taken from its holder.
    let (live, live_lease) = claimed(&*store, "fr-live").await;
    assert!(!store.force_release(&live).await.unwrap());
    let rec = record(&*store, &live).await;
    assert_eq!(
        (rec.state, rec.fencing_token),
        (RecordState::InFlight, live_lease.token)
    );

    let (done, l) = claimed(&*store, "fr-done").await;
    store
        .complete(&done, l.token, &response(201, "kept"))
        .await
        .unwrap();
    assert!(!store.force_release(&done).await.unwrap());
    assert_eq!(
        store
            .claim(&claim_req(&done, r#"{"key":"fr-done"}"#))
            .await
            .unwrap(),
        ClaimOutcome::Replay(response(201, "kept"))
    );

    let (released, l) = claimed(&*store, "fr-released").await;
    store.release(&released, l.token).await.unwrap();
    assert!(!store.force_release(&released).await.unwrap());
    assert_eq!(record(&*store, &released).await.last_error, None, "unchanged");

    // Parked without progress: an operator decided; the key runs again as a
    // first attempt.
    let (bare, l) = claimed(&*store, "fr-parked-bare").await;
    store.park(&bare, l.token, "outcome unknown").await.unwrap();
    assert!(store.force_release(&bare).await.unwrap());
    let rec = record(&*store, &bare).await;
    assert_eq!(rec.state, RecordState::Released);
    assert!(rec.fencing_token > l.token, "the row stays, on a new token");
    assert_eq!(rec.last_error.as_deref(), Some(FORCE_RELEASED));
    let again = must_claim(&*store, &claim_req(&bare, r#"{"key":"fr-parked-bare"}"#)).await;
    assert!(again.token > rec.fencing_token, "tokens keep rising");
    assert_eq!(again.resumed_from, None, "a first attempt, not a takeover");

    // Parked with a recorded intent: the release keeps it (the behaviour contract, `docs/spec.md` §3: parking
    // exists so the call is never made twice unasked); the record becomes
    // resumable and the rerun starts from its recovery point.
    let (parked, l) = claimed(&*store, "fr-parked").await;
    let parked_req = claim_req(&parked, r#"{"key":"fr-parked"}"#);
    store
        .advance(
            &parked,
            l.token,
            &phase("intent", Some(("courier", json!({"intent": "k"})))),
        )
        .await
        .unwrap();
    store.park(&parked, l.token, "outcome unknown").await.unwrap();
    assert!(store.force_release(&parked).await.unwrap());
    let rec = record(&*store, &parked).await;
    assert_eq!(rec.state, RecordState::InFlight, "resumable, not released");
    assert!(rec.lease_expires_at <= store.now(), "nobody holds it");
    assert!(rec.fencing_token > l.token, "on a new token");
    assert_eq!(rec.last_error.as_deref(), Some(FORCE_RELEASED));
    assert_eq!(rec.recovery_point.as_deref(), Some("intent"));
    assert_eq!(rec.step_outputs["courier"], json!({"intent": "k"}));
    let again = must_claim(&*store, &parked_req).await;
    assert!(again.token > rec.fencing_token, "tokens keep rising");
    assert_eq!(
        again.resumed_from.as_deref(),
        Some("intent"),
        "a takeover from the recorded intent, not a first attempt"
    );
    let rec = record(&*store, &parked).await;
    assert_eq!(rec.step_outputs["courier"], json!({"intent": "k"}));
    assert!(!store.force_release(&parked).await.unwrap(), "held again");

    // Ended at once by a retryable outcome: nobody holds it.
    let (ended, l) = claimed(&*store, "fr-ended").await;
    store.abandon(&ended, l.token, "courier timeout").await.unwrap();
    assert!(store.force_release(&ended).await.unwrap());
    assert_fenced(
        store.heartbeat(&ended, l.token, LEASE).await,
        "heartbeat after force release",
    );

    // Abandoned by a crashed holder: free once its lease has expired.
    let (crashed, old) = claimed(&*store, "fr-crashed").await;
    assert!(!store.force_release(&crashed).await.unwrap(), "lease still live");
    clock.advance(LEASE * 2);
    assert!(store.force_release(&crashed).await.unwrap());
    assert_eq!(record(&*store, &crashed).await.state, RecordState::Released);
    assert_fenced(
        store.complete(&crashed, old.token, &response(201, "late")).await,
        "a holder paused past its lease cannot complete",
    );
    assert_fenced(
        store.advance(&crashed, old.token, &phase("late", None)).await,
        "nor advance",
    );
    let next = must_claim(&*store, &claim_req(&crashed, r#"{"key":"fr-crashed"}"#)).await;
    assert!(
        next.token > old.token,
        "tokens keep rising across an operator release"
    );
    assert_eq!(next.resumed_from, None);

    // The live lease outlived the others untouched, and now it has expired too.
    assert!(store.force_release(&live).await.unwrap());
}
