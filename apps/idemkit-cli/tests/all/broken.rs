//! Each classic broken design is caught by the gate made for it, with evidence a
//! person can act on; the correct design passes every gate.

use crate::fixtures::{Design, Fixture};
use crate::{check_args, expect, idemkit};

async fn check(design: Design, extra: &[&str]) -> crate::Run {
    let fixture = Fixture::start(design).await;
    let mut extra = extra.to_vec();
    extra.push("--json");
    idemkit(check_args(&fixture.base, &extra)).await
}

const ALL_PASS: [(&str, &str); 7] = [
    ("concurrency", "pass"),
    ("replay", "pass"),
    ("mismatch", "pass"),
    ("in-progress", "pass"),
    ("bad-keys", "pass"),
    ("isolation", "pass"),
    ("fresh-key", "pass"),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_design_passes_every_gate() {
    let run = check(Design::Correct, &[]).await;
    assert_eq!(run.verdicts(), expect(&ALL_PASS), "{run:#?}");
    assert_eq!(run.code, 0, "{run:#?}");
    let report = run.report();
    assert_eq!(report["verdict"], "pass");
    assert_eq!(report["exit_code"], 0);
    assert!(run.evidence("concurrency").contains("count 0 → 1"), "{run:#?}");
    assert!(
        run.evidence("in-progress")
            .contains("409 idempotency_request_in_progress (Retry-After 1)"),
        "{run:#?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn correct_design_with_the_key_in_the_body_and_a_replay_status() {
    let fixture = Fixture::start(Design::Correct).await;
    let run = idemkit(vec![
        "check".into(),
        "--url".into(),
        format!("{}/payments", fixture.base),
        "-H".into(),
        "Authorization: Bearer payer".into(),
        "--body".into(),
        r#"{"idempotencyKey":"","sku":"GIFT","quantity":2}"#.into(),
        "--key-field".into(),
        "/idempotencyKey".into(),
        "--replay-status".into(),
        "200".into(),
        "--count-url".into(),
        format!("{}/orders/count", fixture.base),
        "--other-account-header".into(),
        "Authorization: Bearer payee".into(),
        "--id-pointer".into(),
        "/id".into(),
        "--json".into(),
    ])
    .await;
    assert_eq!(run.verdicts(), expect(&ALL_PASS), "{run:#?}");
    assert_eq!(run.code, 0);

    // Without the declared replay status, the 200 replays are caught.
    let run = idemkit(vec![
        "check".into(),
        "--url".into(),
        format!("{}/payments", fixture.base),
        "-H".into(),
        "Authorization: Bearer payer2".into(),
        "--body".into(),
        r#"{"sku":"GIFT","quantity":2}"#.into(),
        "--key-field".into(),
        "/idempotencyKey".into(),
        "--gates".into(),
        "replay".into(),
        "--json".into(),
    ])
    .await;
    assert_eq!(run.verdicts(), expect(&[("replay", "fail")]), "{run:#?}");
    assert!(
        run.evidence("replay").contains("answered 200 instead of 201"),
        "{run:#?}"
    );
}

/// Check-then-insert: every duplicate that arrives inside the gap runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn toctou_claim_is_caught_by_the_concurrency_gate() {
    let run = check(Design::Toctou, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let verdicts = run.verdicts();
    assert_eq!(
        verdicts,
        expect(&[
            ("concurrency", "fail"),
            ("replay", "pass"),
            ("mismatch", "pass"),
            ("in-progress", "fail"),
            ("bad-keys", "pass"),
            ("isolation", "pass"),
            ("fresh-key", "pass"),
        ]),
        "{run:#?}"
    );
    let evidence = run.evidence("concurrency");
    assert!(evidence.contains("effects for one key (count 0 → "), "{evidence}");
    assert!(
        evidence.contains("different successful answers to one key"),
        "{evidence}"
    );
    assert!(evidence.contains("check-then-insert"), "{evidence}");
    assert!(
        run.evidence("in-progress").contains("it ran as a new request"),
        "{run:#?}"
    );
}

/// No fingerprint: a different body under a used key silently gets the original.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_fingerprint_is_caught_by_the_mismatch_gate() {
    let run = check(Design::NoFingerprint, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let mut want = ALL_PASS;
    want[2].1 = "fail";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    let evidence = run.evidence("mismatch");
    assert!(
        evidence.contains("a different body under a used key got the original's 201 back"),
        "{evidence}"
    );
    assert!(
        evidence.contains("silent replay, the payload is not fingerprinted"),
        "{evidence}"
    );
}

/// Keys scoped by key alone: the second account is served the first one's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unscoped_keys_are_caught_by_the_isolation_gate() {
    let run = check(Design::Unscoped, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let mut want = ALL_PASS;
    want[5].1 = "fail";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    let evidence = run.evidence("isolation");
    assert!(
        evidence.contains("the other account got a replay (`Idempotent-Replayed: true`): it was served the first account's stored response"),
        "{evidence}"
    );
    assert!(
        evidence.contains("the other account's request made 0 effect(s) for it"),
        "{evidence}"
    );
}

/// Binary seen/unseen: a duplicate of a running request is told the key was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_seen_state_is_caught_by_the_in_progress_gate() {
    let run = check(Design::Binary, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let mut want = ALL_PASS;
    want[2].1 = "fail"; // the mismatch conflict is indistinguishable from the in-flight answer
    want[3].1 = "fail";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    let evidence = run.evidence("in-progress");
    assert!(
        evidence.contains("overlapping duplicates got a wrong answer"),
        "{evidence}"
    );
    assert!(
        evidence.contains(
            "409 idempotency_key_reused — no Retry-After and the same status and code as the mismatch conflict (409 idempotency_key_reused)"
        ),
        "{evidence}"
    );
    assert!(
        run.evidence("mismatch")
            .contains("a client cannot tell a reused key from one still running"),
        "{run:#?}"
    );
}

/// A new key acknowledged but never stored or applied: the write is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_but_never_applied_is_caught_by_the_fresh_key_gate() {
    let run = check(Design::NeverApplied, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(
        run.verdicts(),
        expect(&[
            ("concurrency", "fail"),
            ("replay", "fail"),
            ("mismatch", "fail"),
            ("in-progress", "fail"),
            ("bad-keys", "pass"),
            ("isolation", "fail"),
            ("fresh-key", "fail"),
        ]),
        "{run:#?}"
    );
    let evidence = run.evidence("fresh-key");
    assert!(
        evidence.contains(
            "the first fresh key was answered 201 but made no effect (count 0 → 0): acknowledged and never applied, worse than no key support"
        ),
        "{evidence}"
    );
    assert!(
        run.evidence("concurrency")
            .contains("the write was acknowledged and not applied"),
        "{run:#?}"
    );
}

/// Replays rebuilt from the body alone lose their headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lossy_replay_is_caught_by_the_replay_gate() {
    let run = check(Design::LossyReplay, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let mut want = ALL_PASS;
    want[1].1 = "fail";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    let evidence = run.evidence("replay");
    assert!(evidence.contains("retry 1's Location is []"), "{evidence}");
    assert!(
        evidence.contains("retry 1's Content-Type is [\"text/plain\"]"),
        "{evidence}"
    );
}

/// Keys never validated: a missing key means no protection, bad keys are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unvalidated_keys_are_caught_by_the_bad_keys_gate() {
    let run = check(Design::LaxKeys, &[]).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let mut want = ALL_PASS;
    want[4].1 = "fail";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    let evidence = run.evidence("bad-keys");
    for case in ["missing", "empty", "256 characters", "control character"] {
        assert!(
            evidence.contains(&format!("the {case} key was accepted: 201")),
            "{evidence}"
        );
    }
    assert!(
        evidence.contains("the refused keys left 4 effect(s)"),
        "{evidence}"
    );
}

/// A server that makes duplicates wait for the running original and replays it:
/// duplicates sent well before the original's answer demonstrably waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_the_original_passes_the_in_progress_gate() {
    let run = check(Design::Waiting, &[]).await;
    assert_eq!(run.verdicts(), expect(&ALL_PASS), "{run:#?}");
    assert_eq!(run.code, 0);
    let evidence = run.evidence("in-progress");
    assert!(evidence.contains("no in-progress conflict"), "{evidence}");
    assert!(
        evidence.contains("before the original's answer: they waited"),
        "{evidence}"
    );
}

/// Duplicates that can never overlap the original prove nothing about in-flight
/// state: inconclusive (exit 2), never a pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_overlap_is_inconclusive_not_a_pass() {
    let run = check(Design::Instant, &[]).await;
    let mut want = ALL_PASS;
    want[3].1 = "inconclusive";
    assert_eq!(run.verdicts(), expect(&want), "{run:#?}");
    assert_eq!(run.code, 2, "{run:#?}");
    assert_eq!(run.report()["verdict"], "inconclusive");
    assert!(
        run.evidence("in-progress")
            .contains("no overlap provoked in 5 rounds"),
        "{run:#?}"
    );
}
