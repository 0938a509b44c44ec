//! OASIS Repeatable Requests against the real labels process: `POST
//! /repeatable/labels` keyed by `Repeatability-Request-ID`, the client sending
//! the headers because the published policy says so, and `idemkit check`
//! probing the route from its published policy.

use std::time::{Duration, SystemTime};

use http::Method;
use idemkit_client::{KeyLocation, PublishedPolicy, RetryConfig, RetryMiddleware};
use serde_json::{Value, json};

use crate::labels::{Labels, body};
use crate::{expect, idemkit};

fn label() -> Value {
    let mut b = body("unused", "GB");
    b.as_object_mut().unwrap().remove("idempotencyKey");
    b
}

async fn post(
    labels: &Labels,
    headers: &[(&str, String)],
    body: &Value,
) -> (u16, reqwest::header::HeaderMap, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/repeatable/labels", labels.base))
        .bearer_auth("demo-token-acme")
        .json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    (status, headers, res.json().await.unwrap_or(Value::Null))
}

fn result(h: &reqwest::header::HeaderMap) -> &str {
    h.get("repeatability-result").map_or("", |v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_labels_service_speaks_oasis_repeatable_requests() {
    let labels = Labels::start();
    let now = httpdate::fmt_http_date(SystemTime::now());
    let id = || {
        vec![
            (
                "repeatability-request-id",
                "7c9e6679-7425-40de-944b-e07fc1f90ae7".to_owned(),
            ),
            ("repeatability-first-sent", now.clone()),
        ]
    };
    let (status, h, first) = post(&labels, &id(), &label()).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(result(&h), "accepted");
    assert_eq!(first["status"], "created");
    let (status, h, again) = post(&labels, &id(), &label()).await;
    assert_eq!(status, 200);
    assert_eq!(h["idempotent-replayed"], "true");
    assert_eq!(result(&h), "accepted");
    assert_eq!(again, first);
    assert_eq!(labels.stats().await["shipments"], 1, "booked once");

    let mut other = label();
    other["courier"] = json!("dhl");
    let (status, h, problem) = post(&labels, &id(), &other).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (409, Some("idempotency_key_reused"))
    );
    assert_eq!(result(&h), "rejected");

    let stale = httpdate::fmt_http_date(SystemTime::now() - Duration::from_secs(25 * 3600));
    let (status, h, problem) = post(
        &labels,
        &[
            ("repeatability-request-id", "r-stale".to_owned()),
            ("repeatability-first-sent", stale),
        ],
        &label(),
    )
    .await;
    assert_eq!(status, 412);
    assert_eq!(problem["code"], "repeatability_first_sent_out_of_window");
    assert_eq!(result(&h), "rejected");

    let (status, _, problem) = post(&labels, &[("idempotency-key", "k".to_owned())], &label()).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (400, Some("idempotency_key_missing"))
    );
    let (status, _, problem) = post(&labels, &id(), &body("in-body", "GB")).await;
    assert_eq!(
        (status, problem["code"].as_str()),
        (400, Some("validation_failed"))
    );
    assert_eq!(labels.stats().await["shipments"], 1);

    // The policy says where the key goes; the client follows it.
    let doc: Value = reqwest::get(format!("{}/openapi.json", labels.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let policy = PublishedPolicy::from_document(&labels.base, &doc).unwrap();
    let url = format!("{}/repeatable/labels", labels.base);
    let op = policy.operation(&Method::POST, &url).unwrap();
    assert_eq!(op.key, Some(KeyLocation::Repeatability));
    assert_eq!(
        policy
            .operation(&Method::POST, &format!("{}/labels", labels.base))
            .unwrap()
            .key,
        Some(KeyLocation::Body("/idempotencyKey".into()))
    );
    // Without the two headers the route answers 400: the client sends them
    // because the published policy says so (their reuse across retries is
    // tested in idemkit-client).
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(op.configure(RetryConfig::new())))
        .build();
    let before = labels.stats().await["shipments"].as_u64().unwrap();
    let res = client
        .post(&url)
        .bearer_auth("demo-token-acme")
        .header("content-type", "application/json")
        .body(label().to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(result(res.headers()), "accepted");
    assert_eq!(labels.stats().await["shipments"].as_u64().unwrap(), before + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemkit_check_probes_the_repeatable_route_from_its_policy() {
    let labels = Labels::start();
    labels.faults(json!({"latencyMs": 300})).await;
    let template = label();
    let mut alt = template.clone();
    alt["courier"] = json!("dhl");
    let args: Vec<String> = [
        "check",
        "--url",
        &format!("{}/repeatable/labels", labels.base),
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
        "/openapi.json",
        "--gates",
        "replay,mismatch,bad-keys,policy",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let run = idemkit(args).await;
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
}
