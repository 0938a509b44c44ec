use std::sync::Arc;

use reqwest::header::HeaderValue;
use serde_json::json;

use crate::{Backend, Server, order, post_order, post_raw};

/// (name, headers, body, expected status, expected code)
type BadCase = (
    &'static str,
    Vec<(&'static str, HeaderValue)>,
    String,
    u16,
    &'static str,
);

fn hv(s: &str) -> HeaderValue {
    HeaderValue::from_str(s).unwrap()
}

/// SPEC §9 concurrency gate over real HTTP: 64 identical requests with one key at
/// once → one order row; every other answer is the identical 201 replay or
/// `409 idempotency_request_in_progress` with `Retry-After`.
async fn concurrency_gate_64_identical_requests_make_one_order(server: Server) {
    let client = reqwest::Client::new();
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (client, base, barrier) = (client.clone(), server.base.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                post_order(&client, &base, "gate", "gate-key-1", &order("GATE", 1)).await
            })
        })
        .collect();
    let answers: Vec<_> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let originals: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 201 && a.header("idempotent-replayed").is_none())
        .collect();
    assert_eq!(originals.len(), 1, "exactly one original 201: {answers:#?}");
    let original = originals[0];
    for a in &answers {
        match a.status {
            201 => {
                assert_eq!(a.body, original.body, "replay body identical");
                assert_eq!(a.header("location"), original.header("location"));
            }
            409 => {
                assert_eq!(a.code(), "idempotency_request_in_progress");
                assert!(a.header("retry-after").is_some());
            }
            other => panic!("unexpected status {other}: {a:?}"),
        }
    }
    assert_eq!(server.count("gate").await, 1);
}

/// The client lost the first response: the retry replays it byte for byte,
/// marked, and nothing runs twice.
async fn lost_response_is_replayed_not_re_executed(server: Server) {
    let client = reqwest::Client::new();
    let first = post_order(&client, &server.base, "lost", "k-lost", &order("A", 2)).await;
    assert_eq!(first.status, 201);
    assert!(first.header("idempotent-replayed").is_none());
    let body = first.json();
    assert_eq!(body["sku"], "A");
    assert_eq!(body["quantity"], 2);
    assert_eq!(
        first.header("location"),
        Some(format!("/orders/{}", body["id"]).as_str())
    );
    for _ in 0..3 {
        let again = post_order(&client, &server.base, "lost", "k-lost", &order("A", 2)).await;
        assert_eq!(again.status, 201);
        assert_eq!(again.body, first.body);
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("content-type"), first.header("content-type"));
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(server.count("lost").await, 1);
}

/// Key order and whitespace do not change the fingerprint: replay, not mismatch.
/// A different body under the same key is `409 idempotency_key_reused`.
async fn canonical_json_replays_and_different_body_conflicts(server: Server) {
    let client = reqwest::Client::new();
    let first = post_order(&client, &server.base, "fp", "k-fp", &order("A", 1)).await;
    assert_eq!(first.status, 201);
    let reordered = post_raw(
        &client,
        &server.base,
        &[
            ("authorization", hv("Bearer fp")),
            ("idempotency-key", hv("k-fp")),
            ("content-type", hv("application/json")),
        ],
        "\n{ \"quantity\" : 1 ,\n  \"sku\":\"A\" }\n",
    )
    .await;
    assert_eq!(reordered.status, 201);
    assert_eq!(reordered.body, first.body);
    assert_eq!(reordered.header("idempotent-replayed"), Some("true"));

    let different = post_order(&client, &server.base, "fp", "k-fp", &order("A", 2)).await;
    assert_eq!(different.status, 409);
    assert!(different.is_problem());
    assert_eq!(different.code(), "idempotency_key_reused");
    assert_eq!(different.json()["retryable"], false);
    assert!(different.header("idempotent-replayed").is_none());
    assert_eq!(server.count("fp").await, 1);
}

/// Keys are scoped per account: the same key from two accounts is two orders,
/// and neither sees the other's response.
async fn same_key_in_two_accounts_makes_two_orders(server: Server) {
    let client = reqwest::Client::new();
    let a = post_order(&client, &server.base, "alice", "shared", &order("A", 1)).await;
    let b = post_order(&client, &server.base, "bob", "shared", &order("A", 1)).await;
    assert_eq!((a.status, b.status), (201, 201));
    assert!(b.header("idempotent-replayed").is_none());
    assert_ne!(a.json()["id"], b.json()["id"]);
    assert_eq!(server.count("alice").await, 1);
    assert_eq!(server.count("bob").await, 1);
}

/// Every malformed request is a problem document with a stable code, and
/// creates nothing.
async fn bad_input_is_rejected_cleanly_and_creates_nothing(server: Server) {
    let client = reqwest::Client::new();
    let auth = ("authorization", hv("Bearer bad"));
    let json_ct = ("content-type", hv("application/json"));
    let body = order("A", 1).to_string();
    let cases: Vec<BadCase> = vec![
        (
            "no key",
            vec![auth.clone(), json_ct.clone()],
            body.clone(),
            400,
            "idempotency_key_missing",
        ),
        (
            "empty key",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv(""))],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "256 chars",
            vec![
                auth.clone(),
                json_ct.clone(),
                ("idempotency-key", hv(&"k".repeat(256))),
            ],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "tab",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("a\tb"))],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "space",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("a b"))],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "non-ascii",
            vec![
                auth.clone(),
                json_ct.clone(),
                (
                    "idempotency-key",
                    HeaderValue::from_bytes("clé".as_bytes()).unwrap(),
                ),
            ],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "two headers",
            vec![
                auth.clone(),
                json_ct.clone(),
                ("idempotency-key", hv("k-two")),
                ("idempotency-key", hv("k-two")),
            ],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "bad quoting",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("\"open"))],
            body.clone(),
            400,
            "idempotency_key_invalid",
        ),
        (
            "invalid json",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("k-json"))],
            "{\"sku\":".into(),
            400,
            "validation_failed",
        ),
        (
            "wrong shape",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("k-shape"))],
            json!({"sku": 5, "quantity": "x"}).to_string(),
            400,
            "validation_failed",
        ),
        (
            "unknown field",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("k-unk"))],
            json!({"sku": "A", "quantity": 1, "x": 1}).to_string(),
            400,
            "validation_failed",
        ),
        (
            "zero quantity",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("k-zero"))],
            order("A", 0).to_string(),
            400,
            "validation_failed",
        ),
        (
            "no content type",
            vec![auth.clone(), ("idempotency-key", hv("k-ct"))],
            body.clone(),
            415,
            "unsupported_media_type",
        ),
        (
            "oversized body",
            vec![auth.clone(), json_ct.clone(), ("idempotency-key", hv("k-big"))],
            format!("{{\"sku\":\"{}\",\"quantity\":1}}", "x".repeat(200_000)),
            413,
            "payload_too_large",
        ),
        (
            "no token",
            vec![json_ct.clone(), ("idempotency-key", hv("k-auth"))],
            body.clone(),
            401,
            "unauthorized",
        ),
    ];
    for (name, headers, body, status, code) in cases {
        let a = post_raw(&client, &server.base, &headers, body).await;
        assert_eq!(a.status, status, "{name}: {a:?}");
        assert!(a.is_problem(), "{name}: not a problem document: {a:?}");
        assert_eq!(a.code(), code, "{name}");
        let doc = a.json();
        for member in ["type", "title", "status", "detail", "code", "retryable"] {
            assert!(doc.get(member).is_some(), "{name}: problem lacks `{member}`");
        }
    }
    assert_eq!(server.count("bad").await, 0, "nothing half-written");
}

/// A validation error releases the key: the corrected request with the same key
/// creates the order. The quoted structured-field form is the same key.
async fn validation_error_releases_the_key_and_quoted_keys_are_equal(server: Server) {
    let client = reqwest::Client::new();
    let bad = post_order(&client, &server.base, "fix", "k-fix", &order("A", 0)).await;
    assert_eq!(bad.status, 400);
    let good = post_order(&client, &server.base, "fix", "k-fix", &order("A", 3)).await;
    assert_eq!(good.status, 201, "{good:?}");
    assert!(good.header("idempotent-replayed").is_none());
    let quoted = post_order(&client, &server.base, "fix", "\"k-fix\"", &order("A", 3)).await;
    assert_eq!(quoted.status, 201);
    assert_eq!(quoted.header("idempotent-replayed"), Some("true"));
    assert_eq!(quoted.body, good.body);
    assert_eq!(server.count("fix").await, 1);
}

/// Runs each scenario against a quickstart on SQLite, one on PostgreSQL, and one
/// with its keys in Redis (orders in SQLite).
macro_rules! on_both_backends {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(super::Server::start().await).await;
                }
            )*
        }
        mod redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(backend) = super::Backend::redis() else { return };
                    super::$name(super::Server::start_on(&backend, &[]).await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(backend) = super::Backend::postgres() else { return };
                    super::$name(super::Server::start_on(&backend, &[]).await).await;
                }
            )*
        }
    };
}

on_both_backends!(
    concurrency_gate_64_identical_requests_make_one_order,
    lost_response_is_replayed_not_re_executed,
    canonical_json_replays_and_different_body_conflicts,
    same_key_in_two_accounts_makes_two_orders,
    bad_input_is_rejected_cleanly_and_creates_nothing,
    validation_error_releases_the_key_and_quoted_keys_are_equal
);
