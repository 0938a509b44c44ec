//! The scenarios every store runs: every subcommand on one prepared store,
//! and `keys release` on each kind of record nobody holds.

use super::*;

/// Every subcommand but `complete` on one prepared store.
pub(crate) async fn exercise(db: Db) {
    prepare(&*db.store).await;

    // list: a table, newest first.
    let all = db.keys(&["list"]).await;
    let table = rows(ok(&all));
    let listed: Vec<(&str, &str, &str)> = table
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str()))
        .collect();
    assert_eq!(
        listed,
        [
            ("acct-b", "k-parked-2", "parked"),
            ("acct-b", "k-live", "in_flight"),
            ("acct-a", "k-stuck", "in_flight"),
            ("acct-a", "k-parked", "parked"),
            ("acct-a", "k-done", "completed"),
        ],
        "{}",
        all.stdout
    );
    assert!(all.stdout.starts_with("account"), "{}", all.stdout);
    for column in [
        "created",
        "lease/completed",
        "token",
        "recovery point",
        "last error",
    ] {
        assert!(
            all.stdout.lines().next().unwrap().contains(column),
            "{column}: {}",
            all.stdout
        );
    }
    let stuck_row = table.iter().find(|r| r[1] == "k-stuck").unwrap();
    assert!(stuck_row[4].starts_with("expired "), "{stuck_row:?}");
    assert!(stuck_row.contains(&"label".to_owned()), "{stuck_row:?}");
    assert!(stuck_row.contains(&"courier timeout".to_owned()), "{stuck_row:?}");
    let live_row = table.iter().find(|r| r[1] == "k-live").unwrap();
    assert!(live_row[4].starts_with("held until 20"), "{live_row:?}");
    let done_row = table.iter().find(|r| r[1] == "k-done").unwrap();
    assert!(
        done_row[3].ends_with('Z') && done_row[3].contains('T'),
        "RFC 3339: {done_row:?}"
    );
    assert!(done_row[4].starts_with("completed 20"), "{done_row:?}");
    assert!(all.stdout.contains("\n5 record(s)"), "{}", all.stdout);

    // list --state parked: requests awaiting review.
    let parked = db.keys(&["list", "--state", "parked"]).await;
    let table = rows(ok(&parked));
    assert_eq!(
        table.iter().map(|r| r[1].as_str()).collect::<Vec<_>>(),
        ["k-parked-2", "k-parked"],
        "{}",
        parked.stdout
    );
    let parked_row = table.iter().find(|r| r[1] == "k-parked").unwrap();
    assert!(
        parked_row.contains(&"courier-intent".to_owned()),
        "{parked_row:?}"
    );
    assert!(
        parked_row.contains(&"courier outcome unknown; it ignores keys".to_owned()),
        "{parked_row:?}"
    );
    let parked_json = db.keys(&["list", "--state", "parked", "--json"]).await.report();
    assert_eq!(
        keys_of(&parked_json, "records"),
        ["acct-b/k-parked-2", "acct-a/k-parked"]
    );
    let first = &parked_json["records"][1];
    assert_eq!(first["state"], "parked");
    assert_eq!(first["recovery_point"], "courier-intent");
    assert_eq!(first["last_error"], "courier outcome unknown; it ignores keys");
    // Parking takes a fresh token (a stale takeover cannot undo it): above the claim's.
    assert!(first["fencing_token"].as_u64().unwrap() > 1, "{first}");
    assert_eq!(first["request"], json!({"method": "POST", "path": "/orders"}));
    assert!(first["created_at"].as_str().unwrap().ends_with('Z'));

    let filtered = db
        .keys(&["list", "--account", "acct-b", "--state", "in_flight", "--json"])
        .await
        .report();
    assert_eq!(keys_of(&filtered, "records"), ["acct-b/k-live"]);
    assert_eq!(filtered["records"][0]["lease_live"], true);
    let limited = db.keys(&["list", "--limit", "2", "--json"]).await.report();
    assert_eq!(
        keys_of(&limited, "records"),
        ["acct-b/k-parked-2", "acct-b/k-live"]
    );

    // show: recovery point, step outputs, request and response.
    let shown = db
        .keys(&["show", "--account", "acct-a", "--key", "k-parked"])
        .await;
    let text = &ok(&shown).stdout;
    for expected in [
        "state           parked",
        "recovery point  courier-intent",
        "last error      courier outcome unknown; it ignores keys",
        r#"courier: {"intent":"dk-1"}"#,
        "request         POST /orders",
        "content-type: application/json",
        r#"body (16 bytes): {"sku":"parked"}"#,
        "response        -",
    ] {
        assert!(text.contains(expected), "{expected:?} in\n{text}");
    }
    let done = db
        .keys(&["show", "--account", "acct-a", "--key", "k-done", "--json"])
        .await
        .report();
    let record = &done["record"];
    assert_eq!(record["state"], "completed");
    assert_eq!(record["response"]["status"], 201);
    assert_eq!(record["response"]["body"], r#"{"id":"order-1"}"#);
    // A completed record keeps its answer, not its request body (the
    // completion drops it, issue 34 item 10); the fingerprint stays.
    assert_eq!(record["request"]["body"], "");
    assert_eq!(record["fingerprint"].as_str().unwrap().len(), 64);
    let stuck = db
        .keys(&["show", "--account", "acct-a", "--key", "k-stuck", "--json"])
        .await
        .report();
    assert_eq!(
        stuck["record"]["step_outputs"],
        json!({"label": {"done": "lbl_1"}})
    );
    assert_eq!(stuck["record"]["lease_live"], false);
    let missing = db.keys(&["show", "--account", "acct-a", "--key", "nope"]).await;
    assert_eq!(missing.code, 1, "{missing:#?}");

    // release: refused for live leases and completed records, done for parked ones.
    let live = db
        .keys(&["release", "--account", "acct-b", "--key", "k-live"])
        .await;
    assert_eq!(live.code, 1, "{live:#?}");
    assert!(live.stdout.contains("live lease"), "{}", live.stdout);
    let completed = db
        .keys(&["release", "--account", "acct-a", "--key", "k-done", "--json"])
        .await;
    assert_eq!(completed.code, 1, "{completed:#?}");
    assert_eq!(completed.report()["released"], false);
    // A parked record with a recorded intent: the release keeps the intent, so
    // the rerun resumes (and parks again at a key-ignoring downstream) instead
    // of calling it a second time.
    let parked_scope = scope("acct-a", "k-parked");
    let parked_before = db.store.get(&parked_scope).await.unwrap().unwrap();
    let released = db
        .keys(&["release", "--account", "acct-a", "--key", "k-parked"])
        .await;
    let text = &ok(&released).stdout;
    for expected in [
        "acct-a k-parked: released to resume",
        "recovery point `courier-intent`",
        "the call of courier has an intent and no result",
        "--downstream-did-nothing",
    ] {
        assert!(text.contains(expected), "{expected:?} in {text}");
    }
    let rec = db.store.get(&parked_scope).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        RecordState::InFlight,
        "resumable, not released: {rec:?}"
    );
    assert!(rec.lease_expires_at <= db.store.now(), "lease ended: {rec:?}");
    assert!(rec.fencing_token > parked_before.fencing_token, "{rec:?}");
    assert_eq!(rec.last_error.as_deref(), Some(idemkit_core::FORCE_RELEASED));
    assert_eq!(rec.recovery_point.as_deref(), Some("courier-intent"));
    assert_eq!(
        json!(rec.step_outputs),
        json!({"courier": {"intent": "dk-1"}}),
        "the intent survives the release"
    );
    assert_eq!(
        rec.request.body, parked_before.request.body,
        "the request is kept for the rerun"
    );
    // The key is taken over as a resume from the recovery point, with a higher token.
    let parked_req = claim_req(&parked_scope, r#"{"sku":"parked"}"#);
    let again = match db.store.claim(&parked_req).await.unwrap() {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("expected the released key to be resumable: {other:?}"),
    };
    assert!(again.token > rec.fencing_token, "{again:?} after {rec:?}");
    assert_eq!(again.resumed_from.as_deref(), Some("courier-intent"));
    db.store
        .complete(&parked_req.scope, again.token, &response(201, "second"))
        .await
        .unwrap();

    // reap --older-than-hours 0: completed records go, unfinished ones move to review.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reaped = db
        .keys(&[
            "reap",
            "--older-than-hours",
            "0",
            "--replay-window-hours",
            "0",
            "--json",
        ])
        .await
        .report();
    assert_eq!(reaped["deleted"], 2, "{reaped}");
    assert_eq!(reaped["moved_to_review"], 2, "{reaped}");
    // What fences stays: the live lease, and the two moved to review as parked
    // records (never claimable again as new requests).
    let left = db.keys(&["list", "--json"]).await.report();
    let mut kept = keys_of(&left, "records");
    kept.sort();
    assert_eq!(
        kept,
        ["acct-a/k-stuck", "acct-b/k-live", "acct-b/k-parked-2"],
        "{left}"
    );
    for r in left["records"].as_array().unwrap() {
        if r["key"] == "k-live" {
            assert_eq!(r["state"], "in_flight", "live leases stay: {r}");
        } else {
            assert_eq!(r["state"], "parked", "{r}");
            assert_eq!(r["last_error"], idemkit_core::MOVED_TO_REVIEW, "{r}");
        }
    }
    let again = ok(&db
        .keys(&["reap", "--older-than-hours", "0", "--replay-window-hours", "0"])
        .await)
    .stdout
    .clone();
    assert!(
        again.contains("deleted 0") && again.contains("moved 0"),
        "{again}"
    );
    let default = db.keys(&["reap", "--json"]).await.report();
    assert_eq!(
        (default["deleted"].as_u64(), default["moved_to_review"].as_u64()),
        (Some(0), Some(0))
    );

    // review: the unfinished requests, oldest first.
    let review = db.keys(&["review"]).await;
    let table = rows(ok(&review));
    assert_eq!(
        table
            .iter()
            .map(|r| (r[1].as_str(), r[2].as_str()))
            .collect::<Vec<_>>(),
        [("k-stuck", "in_flight"), ("k-parked-2", "parked")],
        "{}",
        review.stdout
    );
    assert!(table[0].contains(&"POST /orders".to_owned()), "{:?}", table[0]);
    assert!(table[0].contains(&"courier timeout".to_owned()), "{:?}", table[0]);
    let review = db.keys(&["review", "--json"]).await.report();
    assert_eq!(
        keys_of(&review, "entries"),
        ["acct-a/k-stuck", "acct-b/k-parked-2"]
    );
    assert_eq!(review["entries"][0]["recovery_point"], "label");
    assert_eq!(
        review["entries"][0]["step_outputs"],
        json!({"label": {"done": "lbl_1"}})
    );
    assert_eq!(review["entries"][1]["last_error"], "needs a human");
    assert_eq!(
        keys_of(
            &db.keys(&["review", "--limit", "1", "--json"]).await.report(),
            "entries"
        )
        .len(),
        1
    );
}

/// `keys release` on each kind of record nobody holds: progress is kept unless
/// the operator says the downstream did nothing (then it is discarded); a record
/// without progress is released as a first attempt with or without the flag.
pub(crate) async fn release_paths(db: Db) {
    prepare(&*db.store).await;
    let store = &*db.store;
    let get = |account: &'static str, key: &'static str| async move {
        store.get(&scope(account, key)).await.unwrap().unwrap()
    };

    let before = get("acct-a", "k-parked").await;
    // Without the flag, JSON: kept progress, the pending intent named.
    let kept = db
        .keys(&["release", "--account", "acct-a", "--key", "k-parked", "--json"])
        .await;
    let report = ok(&kept).report();
    assert_eq!(report["released"], true, "{report}");
    assert_eq!(report["state"], "in_flight", "{report}");
    assert_eq!(report["kept_progress"], true, "{report}");
    assert_eq!(report["recovery_point"], "courier-intent", "{report}");
    assert_eq!(report["pending_intents"], json!(["courier"]), "{report}");
    assert!(
        report["fencing_token"].as_i64().unwrap() > before.fencing_token.0,
        "{report}"
    );
    let kept = get("acct-a", "k-parked").await;
    assert_eq!(
        kept.step_outputs, before.step_outputs,
        "the intent survives the release"
    );

    // The operator says the downstream did nothing: the progress is discarded
    // and the key reruns as a first attempt.
    let stuck_before = get("acct-a", "k-stuck").await;
    assert!(!stuck_before.step_outputs.is_empty());
    let discarded = db
        .keys(&[
            "release",
            "--account",
            "acct-a",
            "--key",
            "k-stuck",
            "--downstream-did-nothing",
            "--json",
        ])
        .await;
    let report = ok(&discarded).report();
    assert_eq!(
        (&report["released"], &report["state"], &report["kept_progress"]),
        (&json!(true), &json!("released"), &json!(false)),
        "{report}"
    );
    let stuck = get("acct-a", "k-stuck").await;
    assert_eq!(stuck.state, RecordState::Released);
    assert!(stuck.step_outputs.is_empty() && stuck.recovery_point.is_none());
    assert!(stuck.fencing_token > stuck_before.fencing_token);

    // A parked record without progress, with the flag: released as before, and
    // its key reruns as a first attempt.
    let none = db
        .keys(&[
            "release",
            "--account",
            "acct-b",
            "--key",
            "k-parked-2",
            "--downstream-did-nothing",
            "--json",
        ])
        .await;
    let report = ok(&none).report();
    assert_eq!(
        (&report["released"], &report["state"], &report["kept_progress"]),
        (&json!(true), &json!("released"), &json!(false)),
        "{report}"
    );
    assert_eq!(
        report["reason"],
        "released: the next request with this key runs as a first attempt"
    );
    let rec = get("acct-b", "k-parked-2").await;
    assert_eq!(rec.state, RecordState::Released);
    assert_eq!(rec.last_error.as_deref(), Some(idemkit_core::FORCE_RELEASED));
    let req = claim_req(&scope("acct-b", "k-parked-2"), r#"{"sku":"parked-2"}"#);
    match db.store.claim(&req).await.unwrap() {
        ClaimOutcome::Claimed(lease) => {
            assert_eq!(lease.resumed_from, None, "a first attempt");
            assert!(lease.token > rec.fencing_token);
        }
        other => panic!("expected a first attempt: {other:?}"),
    }
    // Released records and missing ones are refused (exit 1), flag or not.
    let missing = db
        .keys(&[
            "release",
            "--account",
            "acct-a",
            "--key",
            "k-none",
            "--downstream-did-nothing",
        ])
        .await;
    assert_eq!(missing.code, 1, "{missing:#?}");
    assert!(missing.stdout.contains("no record"), "{}", missing.stdout);
}
