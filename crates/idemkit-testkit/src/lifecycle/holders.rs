//! Holders and the claims that follow them: release, release that discards
//! progress, abandon, takeover past the window, a claim that starts at a
//! recovery point, and the completer's resume.

use super::*;

/// The replay window applies to completed records only (the behaviour contract, `docs/spec.md` §3): an
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
