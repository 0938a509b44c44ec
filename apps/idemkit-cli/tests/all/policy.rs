//! `idemkit check --policy`: the labels service's published `x-idempotency` matches
//! what it does (real processes), and a policy that says otherwise fails the policy
//! gate with each difference named.

use axum::Router;
use axum::routing::get;
use serde_json::{Value, json};

use crate::labels::{Labels, body};
use crate::{expect, idemkit};

/// Everything the check needs to know comes from the published policy: no
/// `--key-field`, no `--replay-status`.
fn args(labels: &Labels, policy: &str, gates: &str) -> Vec<String> {
    let template = body("check", "GB");
    let mut alt = template.clone();
    alt["courier"] = json!("dhl");
    [
        "check",
        "--url",
        &format!("{}/labels", labels.base),
        "--body",
        &template.to_string(),
        "--alt-body",
        &alt.to_string(),
        "-H",
        "Authorization: Bearer demo-token-acme",
        "--count-url",
        &format!("{}/_stats", labels.courier),
        "--count-pointer",
        "/shipments",
        "--policy",
        policy,
        "--gates",
        gates,
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labels_service_does_what_its_x_idempotency_says() {
    let labels = Labels::start();
    labels.faults(json!({"latencyMs": 300})).await;
    let run = idemkit(args(&labels, "/openapi.json", "replay,mismatch,bad-keys,policy")).await;
    assert_eq!(
        run.verdicts(),
        expect(&[
            ("replay", "pass"),
            ("mismatch", "pass"),
            ("bad-keys", "pass"),
            ("policy", "pass"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.code, 0, "{run:#?}");
    let report = run.report();
    assert_eq!(
        report["target"]["key"], "key in body at /idempotencyKey",
        "taken from the policy"
    );
    let evidence = run.evidence("policy");
    assert!(
        evidence.contains("key in the body field /idempotencyKey → 201, retry → 200 replay"),
        "{evidence}"
    );
    assert!(
        evidence.contains("mismatch → 409 idempotency_key_reused"),
        "{evidence}"
    );
    assert!(
        evidence.contains("missing key → 400 idempotency_key_missing"),
        "{evidence}"
    );
    assert!(evidence.contains("idempotency_request_in_progress"), "{evidence}");

    // The JSON policy document next to the contract says the same.
    let run = idemkit(args(&labels, "/docs/idempotency.json", "policy")).await;
    assert_eq!(run.verdicts(), expect(&[("policy", "pass")]), "{run:#?}");
}

/// A policy that publishes what the service does not do: a header key, a 422
/// mismatch, replays keeping their 201, another marker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_the_service_does_not_keep_fails_with_each_difference() {
    let labels = Labels::start();
    labels.faults(json!({"latencyMs": 300})).await;
    let mut doc: Value = reqwest::get(format!("{}/openapi.json", labels.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let x = &mut doc["paths"]["/labels"]["post"]["x-idempotency"];
    x["conflicts"]["mismatch"]["status"] = json!(422);
    x["replay"]["status"] = Value::Null;
    x["replay"]["marker"]["header"] = json!("X-Replayed");
    let wrong = doc.clone();
    let router = Router::new().route("/wrong.json", get(move || async move { axum::Json(wrong) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });

    let mut a = args(&labels, &format!("{base}/wrong.json"), "policy");
    // The check is told the key travels in the body, as the service reads it.
    a.extend(["--key-field".into(), "/idempotencyKey".into()]);
    let run = idemkit(a).await;
    assert_eq!(run.verdicts(), expect(&[("policy", "fail")]), "{run:#?}");
    assert_eq!(run.code, 1);
    let evidence = run.evidence("policy");
    assert!(
        evidence.contains("replay status: published the stored status (201), observed 200"),
        "{evidence}"
    );
    assert!(
        evidence.contains("replay marker: published `X-Replayed: true`"),
        "{evidence}"
    );
    assert!(
        evidence
            .contains("mismatch: published 422 idempotency_key_reused, observed 409 idempotency_key_reused"),
        "{evidence}"
    );

    // A published header key that the service does not read.
    doc["paths"]["/labels"]["post"]["x-idempotency"]["key"] =
        json!({"in": "header", "name": "Idempotency-Key"});
    let router = Router::new().route("/header.json", get(move || async move { axum::Json(doc) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    let mut a = args(&labels, &format!("{base}/header.json"), "policy");
    a.extend(["--key-field".into(), "/idempotencyKey".into()]);
    let run = idemkit(a).await;
    assert_eq!(run.verdicts(), expect(&[("policy", "fail")]), "{run:#?}");
    assert!(
        run.evidence("policy")
            .contains("key location: the policy publishes the header Idempotency-Key, the check was told the body field /idempotencyKey"),
        "{run:#?}"
    );
}
