//! Conformance cases for the multi-step lifecycle (SPEC §6, §7): phases and
//! recovery points ([`KeyStore::advance`], [`TransactionalStore::advance_in_tx`]),
//! parking for human review ([`KeyStore::park`]), the completer's work list
//! ([`KeyStore::abandoned`]), the reaper ([`KeyStore::reap`],
//! [`KeyStore::review`]) and the operator's view ([`KeyStore::list`],
//! [`KeyStore::force_release`]).
//!
//! Each case takes a fresh, empty store and the [`ManualClock`] it reads time
//! from; time moves by hand, never by sleeping. Use
//! [`crate::lifecycle_conformance_tests!`] and
//! [`crate::transactional_lifecycle_tests!`] to run them for a backend.

use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{
    Account, ClaimOutcome, ClaimRequest, FORCE_RELEASED, FencingToken, KeyStore, Lease, ListFilter,
    MOVED_TO_REVIEW, Millis, PhaseUpdate, RELEASE_REFUSED, ReapReport, Record, RecordState, Scope,
    StoreError, TransactionalStore,
};
use serde_json::json;

use crate::ManualClock;
use crate::suite::{LEASE, WINDOW, claim_req, must_claim, response, scope};
use crate::tx_suite::BusinessProbe;

/// The reap threshold the cases use: three replay windows (SPEC §6 default, 72 h).
pub const REAP: Duration = Duration::from_secs(3 * 24 * 3600);

/// Every case of [`crate::lifecycle_conformance_tests!`], by name (see
/// [`crate::suite::cases`]).
pub fn cases<S: KeyStore>() -> Vec<(&'static str, crate::Case<S>)> {
    crate::__lifecycle_cases!(__case_table { store lifecycle, S; })
}

/// Every case of [`crate::transactional_lifecycle_tests!`], by name.
pub fn tx_cases<S: TransactionalStore, P: BusinessProbe<S> + 'static>()
-> Vec<(&'static str, crate::TxCase<S, P>)> {
    crate::__tx_lifecycle_cases!(__case_table { tx lifecycle, S, P; })
}

/// A phase update reaching `point`, saving `step` when given.
pub fn phase(point: &str, step: Option<(&str, serde_json::Value)>) -> PhaseUpdate {
    PhaseUpdate {
        recovery_point: point.to_owned(),
        step: step.map(|(name, value)| (name.to_owned(), value)),
    }
}

async fn record<S: KeyStore + ?Sized>(store: &S, s: &Scope) -> Record {
    store.get(s).await.expect("get").expect("record exists")
}

fn assert_fenced<T: std::fmt::Debug>(r: Result<T, StoreError>, what: &str) {
    assert!(
        matches!(r, Err(StoreError::Fenced)),
        "{what}: expected Fenced, got {r:?}"
    );
}

fn keys(records: &[Record]) -> Vec<&str> {
    records.iter().map(|r| r.scope.key.as_str()).collect()
}

/// Claims `key` (lease mode) and returns its scope and lease.
async fn claimed<S: KeyStore + ?Sized>(store: &S, key: &str) -> (Scope, Lease) {
    let s = scope("acct-l", key);
    let lease = must_claim(store, &claim_req(&s, &format!(r#"{{"key":"{key}"}}"#))).await;
    (s, lease)
}

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

    // Parked with a recorded intent: the release keeps it (SPEC §3: parking
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

/// The replay window applies to completed records only (SPEC §3): an
/// in-flight record with recorded progress, whose holder is gone and whose
/// first claim is older than the window, is taken over (a new token, resumed
/// from its recovery point, its step outputs and its generation `created_at`
/// kept), never restarted as a new request.
pub async fn unfinished_record_past_the_window_is_taken_over_not_restarted<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let s = scope("acct-l", "old-unfinished");
    let req = claim_req(&s, r#"{"ship":"old"}"#);
    let a = must_claim(&*store, &req).await;
    let created = record(&*store, &s).await.created_at;
    store
        .advance(
            &s,
            a.token,
            &phase("label-bought", Some(("label", json!({"id": "L-9"})))),
        )
        .await
        .expect("advance");
    clock.advance(WINDOW * 2);
    let b = must_claim(&*store, &req).await;
    assert!(b.token > a.token, "{b:?} after {a:?}");
    assert_eq!(
        b.resumed_from.as_deref(),
        Some("label-bought"),
        "taken over from its recovery point, not restarted"
    );
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(rec.fencing_token, b.token);
    assert_eq!(rec.created_at, created, "the request's generation is kept");
    assert_eq!(rec.recovery_point.as_deref(), Some("label-bought"));
    assert_eq!(rec.step_outputs["label"], json!({"id": "L-9"}));
    assert_eq!(rec.request.body, req.request.body);
    assert_fenced(
        store.complete(&s, a.token, &response(201, "old")).await,
        "the old holder",
    );
    store
        .complete(&s, b.token, &response(201, "resumed"))
        .await
        .expect("complete");
    assert_eq!(
        store.claim(&req).await.unwrap(),
        ClaimOutcome::Replay(response(201, "resumed"))
    );
}

/// `release` of a record with recorded progress does not release it: the
/// record stays in flight with its lease ended, its progress kept and
/// [`RELEASE_REFUSED`] as its last error, on a new token; the next claim takes
/// it over at once, from its recovery point.
pub async fn release_with_progress_is_refused_and_kept_resumable<S: KeyStore>(
    store: Arc<S>,
    _clock: Arc<ManualClock>,
) {
    let s = scope("acct-l", "release-refused");
    let req = claim_req(&s, r#"{"ship":"r"}"#);
    let a = must_claim(&*store, &req).await;
    let created = record(&*store, &s).await.created_at;
    store
        .advance(
            &s,
            a.token,
            &phase("courier-intent", Some(("courier", json!({"intent": "c-1"})))),
        )
        .await
        .expect("advance");
    store.release(&s, a.token).await.expect("release");
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight, "not released");
    assert!(rec.lease_expires_at <= store.now(), "lease ended");
    assert_eq!(rec.recovery_point.as_deref(), Some("courier-intent"));
    assert_eq!(rec.step_outputs["courier"], json!({"intent": "c-1"}));
    assert_eq!(rec.last_error.as_deref(), Some(RELEASE_REFUSED));
    assert_eq!(rec.created_at, created);
    assert!(rec.fencing_token > a.token, "on a new token");
    assert_fenced(
        store.heartbeat(&s, a.token, LEASE).await,
        "a heartbeat after the release",
    );
    // No waiting for a lease: the next attempt resumes at once.
    let b = must_claim(&*store, &req).await;
    assert!(b.token > rec.fencing_token);
    assert_eq!(b.resumed_from.as_deref(), Some("courier-intent"));
    let rec = record(&*store, &s).await;
    assert_eq!(rec.step_outputs["courier"], json!({"intent": "c-1"}));
    assert_eq!(rec.created_at, created);
}

/// `release_discarding` frees a key whose recorded progress its holder knows
/// to be void, and only for that holder: after a takeover the lapsed holder's
/// call is fenced and the new holder's progress survives it; the holder's own
/// call discards the progress in the same write, and the next request with the
/// key is a first attempt on a higher token.
pub async fn release_discarding_frees_the_key_only_for_its_holder<S: KeyStore>(
    store: Arc<S>,
    clock: Arc<ManualClock>,
) {
    let s = scope("acct-l", "release-discarding");
    let req = claim_req(&s, r#"{"fwd":1}"#);
    let a = must_claim(&*store, &req).await;
    store
        .advance(
            &s,
            a.token,
            &phase("forwarded", Some(("forward", json!({"attempt": 1})))),
        )
        .await
        .expect("advance");
    // A lapses; B takes over from the intent.
    clock.advance(LEASE + Duration::from_secs(1));
    let b = must_claim(&*store, &req).await;
    assert_eq!(b.resumed_from.as_deref(), Some("forwarded"));
    assert_fenced(
        store.release_discarding(&s, a.token).await,
        "the lapsed holder's release",
    );
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::InFlight);
    assert_eq!(
        rec.recovery_point.as_deref(),
        Some("forwarded"),
        "B's progress survives"
    );
    assert_eq!(rec.fencing_token, b.token);

    store
        .release_discarding(&s, b.token)
        .await
        .expect("the holder's release");
    let rec = record(&*store, &s).await;
    assert_eq!(rec.state, RecordState::Released);
    assert_eq!(rec.recovery_point, None);
    assert!(rec.step_outputs.is_empty(), "progress discarded");
    assert!(rec.fencing_token > b.token, "on a new token");
    assert_fenced(store.heartbeat(&s, b.token, LEASE).await, "a heartbeat after it");
    // The next request with the key (even a corrected body) runs as a first attempt.
    let c = must_claim(&*store, &claim_req(&s, r#"{"fwd":2}"#)).await;
    assert!(c.token > rec.fencing_token);
    assert_eq!(c.resumed_from, None);
}

/// A claim that starts at a recovery point (`ClaimRequest::recovery_point`)
/// writes it with the claim: a new request's record starts at it and resumes
/// from nothing; a takeover resumes from the record's own point, or from the
/// claim's when the record has none; a released or expired key starts at it
/// again, resuming from nothing.
pub async fn a_claim_starts_at_its_recovery_point<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let at = |s: &Scope, body: &str| ClaimRequest {
        recovery_point: Some("forwarded".into()),
        ..claim_req(s, body)
    };
    let s = scope("acct-l", "starts-at");
    let req = at(&s, r#"{"n":1}"#);
    let a = must_claim(&*store, &req).await;
    assert_eq!(a.resumed_from, None, "a new request resumes from nothing");
    let rec = record(&*store, &s).await;
    assert_eq!(
        rec.recovery_point.as_deref(),
        Some("forwarded"),
        "written by the claim"
    );
    assert_eq!(rec.fencing_token, a.token);

    // A lapses: the takeover resumes from the point A's claim wrote.
    clock.advance(LEASE + Duration::from_secs(1));
    let b = must_claim(&*store, &req).await;
    assert_eq!(b.resumed_from.as_deref(), Some("forwarded"));
    // B records further progress and lapses: the record's own point wins.
    store
        .advance(&s, b.token, &phase("answered", None))
        .await
        .expect("advance");
    clock.advance(LEASE + Duration::from_secs(1));
    let c = must_claim(&*store, &req).await;
    assert_eq!(c.resumed_from.as_deref(), Some("answered"));
    assert_eq!(
        record(&*store, &s).await.recovery_point.as_deref(),
        Some("answered")
    );

    // A record claimed without a point, taken over by a claim with one.
    let bare = scope("acct-l", "starts-at-bare");
    let plain = must_claim(&*store, &claim_req(&bare, r#"{"n":2}"#)).await;
    assert_eq!(record(&*store, &bare).await.recovery_point, None);
    clock.advance(LEASE + Duration::from_secs(1));
    let d = must_claim(&*store, &at(&bare, r#"{"n":2}"#)).await;
    assert!(d.token > plain.token);
    assert_eq!(d.resumed_from.as_deref(), Some("forwarded"));
    assert_eq!(
        record(&*store, &bare).await.recovery_point.as_deref(),
        Some("forwarded")
    );

    // Released (its progress discarded): the next request starts at the point again.
    store.release_discarding(&bare, d.token).await.expect("release");
    let e = must_claim(&*store, &at(&bare, r#"{"n":3}"#)).await;
    assert_eq!(e.resumed_from, None);
    assert_eq!(
        record(&*store, &bare).await.recovery_point.as_deref(),
        Some("forwarded")
    );

    // Completed and past its window: a new request, starting at the point.
    let done = scope("acct-l", "starts-at-done");
    let f = must_claim(&*store, &at(&done, r#"{"n":4}"#)).await;
    store
        .complete(&done, f.token, &response(201, "ok"))
        .await
        .expect("complete");
    clock.advance(WINDOW + Duration::from_secs(1));
    let g = must_claim(&*store, &at(&done, r#"{"n":5}"#)).await;
    assert_eq!(g.resumed_from, None);
    let rec = record(&*store, &done).await;
    assert_eq!(
        (rec.state, rec.recovery_point.as_deref()),
        (RecordState::InFlight, Some("forwarded"))
    );
}

/// `abandon` moves the record to a new fencing token: a heartbeat of the old
/// holder still on its way is refused and cannot revive the lease; the next
/// attempt takes over at once.
pub async fn abandon_moves_the_record_to_a_new_token<S: KeyStore>(store: Arc<S>, _clock: Arc<ManualClock>) {
    let s = scope("acct-l", "abandon-token");
    let req = claim_req(&s, "{}");
    let a = must_claim(&*store, &req).await;
    store
        .advance(&s, a.token, &phase("half", Some(("half", json!(1)))))
        .await
        .expect("advance");
    store
        .abandon(&s, a.token, "courier timeout")
        .await
        .expect("abandon");
    let rec = record(&*store, &s).await;
    assert!(rec.fencing_token > a.token, "abandon moves to a new token");
    assert!(rec.lease_expires_at <= store.now());
    assert_fenced(
        store.heartbeat(&s, a.token, LEASE).await,
        "a late heartbeat of the abandoning holder",
    );
    assert_fenced(
        store.advance(&s, a.token, &phase("late", None)).await,
        "a late advance",
    );
    assert_fenced(
        store.complete(&s, a.token, &response(201, "late")).await,
        "a late completion",
    );
    let rec = record(&*store, &s).await;
    assert!(rec.lease_expires_at <= store.now(), "the lease was not revived");
    assert_eq!(rec.recovery_point.as_deref(), Some("half"));
    let b = must_claim(&*store, &req).await;
    assert!(b.token > rec.fencing_token);
    assert_eq!(b.resumed_from.as_deref(), Some("half"));
}

/// The completer's resume (`ClaimRequest::resume` with the token it saw)
/// takes over exactly the abandoned record it saw. A record force-released,
/// completed, reaped or taken over since is answered without a claim
/// (`Stale`, `Replay`, `Parked`); it is never run as a fresh request.
pub async fn resume_claims_only_the_record_it_saw<S: KeyStore>(store: Arc<S>, clock: Arc<ManualClock>) {
    let resume = |s: &Scope, seen: FencingToken| ClaimRequest {
        resume: Some(seen),
        ..claim_req(s, &format!(r#"{{"key":"{}"}}"#, s.key.as_str()))
    };
    let abandoned_with_progress = |key: &'static str| {
        let store = store.clone();
        async move {
            let (s, l) = claimed(&*store, key).await;
            store
                .advance(&s, l.token, &phase("charged", Some(("charge", json!(key)))))
                .await
                .expect("advance");
            store.abandon(&s, l.token, "timeout").await.expect("abandon");
            let seen = record(&*store, &s).await.fencing_token;
            (s, seen)
        }
    };

    // The exact record it saw: taken over, from its recovery point.
    let (exact, seen) = abandoned_with_progress("rs-exact").await;
    let lease = match store.claim(&resume(&exact, seen)).await.unwrap() {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("a resume of the record it saw takes over: {other:?}"),
    };
    assert!(lease.token > seen);
    assert_eq!(lease.resumed_from.as_deref(), Some("charged"));
    // ...once: a second completer that saw the same state is stale.
    clock.advance(LEASE * 2);
    assert_eq!(
        store.claim(&resume(&exact, seen)).await.unwrap(),
        ClaimOutcome::Stale,
        "taken over since"
    );

    // Force-released without progress: the key is free, but not for a resume.
    let (bare, l) = claimed(&*store, "rs-released").await;
    store.abandon(&bare, l.token, "timeout").await.unwrap();
    let seen = record(&*store, &bare).await.fencing_token;
    assert!(store.force_release(&bare).await.unwrap());
    assert_eq!(
        store.claim(&resume(&bare, seen)).await.unwrap(),
        ClaimOutcome::Stale,
        "released since"
    );
    assert_eq!(record(&*store, &bare).await.state, RecordState::Released);

    // Force-released with progress: resumable, but on a token it never saw.
    let (kept, seen) = abandoned_with_progress("rs-forced").await;
    assert!(store.force_release(&kept).await.unwrap());
    assert_eq!(
        store.claim(&resume(&kept, seen)).await.unwrap(),
        ClaimOutcome::Stale,
        "force-released since"
    );

    // Completed since: the resume replays.
    let (done, seen) = abandoned_with_progress("rs-done").await;
    let l = must_claim(&*store, &claim_req(&done, r#"{"key":"rs-done"}"#)).await;
    store
        .complete(&done, l.token, &response(201, "done"))
        .await
        .unwrap();
    assert_eq!(
        store.claim(&resume(&done, seen)).await.unwrap(),
        ClaimOutcome::Replay(response(201, "done")),
        "completed since"
    );

    // Reaped since (moved to the review list): parked.
    let (reaped, seen) = abandoned_with_progress("rs-reaped").await;
    clock.advance(REAP + Duration::from_secs(1));
    store.reap(store.now()).await.expect("reap");
    assert_eq!(
        store.claim(&resume(&reaped, seen)).await.unwrap(),
        ClaimOutcome::Parked,
        "reaped since"
    );
    for s in [&exact, &kept, &reaped] {
        assert_ne!(
            record(&*store, s).await.recovery_point,
            None,
            "{s:?} kept its progress"
        );
    }
}
