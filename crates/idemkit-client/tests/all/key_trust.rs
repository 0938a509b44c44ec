//! Whether a generated key makes a *maybe executed* write retryable, against a real
//! server that ignores keys: it performs every request it reads (each request it logs
//! is one effect), then drops the connection before answering ([`Fault::Reset`]).

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::Full;
use idemkit_client::{
    AutoKey, CODE_IN_PROGRESS, FatalReason, Outcome, PublishedPolicy, RetryLayer, RetryPolicy, Stop,
};
use tower::{ServiceBuilder, ServiceExt};

use crate::server::{Fault, FaultServer};
use crate::{client, client_with, fast, retry_error, same_key};

const KEY: &str = "idempotency-key";

/// A published policy (the JSON policy document) for `POST /orders` (key in the
/// `Idempotency-Key` header), `POST /labels` (key in the body) and
/// `POST /orders/{id}/void` (not retry-safe).
fn published(base: &str) -> PublishedPolicy {
    let doc = serde_json::json!({"version": 1, "operations": [
        {"method": "POST", "path": "/orders", "x-idempotency": {
            "version": 1, "key": {"in": "header", "name": "Idempotency-Key"}}},
        {"method": "POST", "path": "/labels", "x-idempotency": {
            "version": 1, "key": {"in": "body", "name": "/idempotencyKey"}}},
        {"method": "POST", "path": "/orders/{id}/void", "x-idempotency": {
            "version": 1, "retrySafe": false, "key": {"in": "header", "name": "Idempotency-Key"}}},
    ]});
    PublishedPolicy::from_document(base, &doc).unwrap()
}

#[tokio::test]
async fn a_lost_answer_to_a_post_with_the_default_key_is_not_sent_again() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let result = client(fast()).post(server.url("/orders")).body("{}").send().await;
    let effects = server.received("/orders").len();
    assert_eq!(effects, 1, "the server performed the write {effects} times");
    let err = retry_error(result.expect_err("the answer was lost"));
    assert_eq!(err.stop(), Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed));
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: false });
    let message = err.to_string();
    assert!(
        message.contains("automatic idempotency key") && message.contains("not known to honour"),
        "{message}"
    );
    // The key still went out: a server that honours keys can use it.
    assert!(server.header_values("/orders", KEY)[0].is_some());
}

#[tokio::test]
async fn a_lost_answer_to_a_post_with_the_default_key_is_not_sent_again_tower() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast()))
        .service(crate::tower_layer::transport());
    let result = svc.oneshot(post(&server, "/orders")).await;
    assert_eq!(server.received("/orders").len(), 1, "effects");
    let err = result.expect_err("the answer was lost");
    assert_eq!(err.stop(), Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed));
}

#[tokio::test]
async fn a_published_policy_naming_the_route_makes_it_retryable_with_the_same_key() {
    let server = FaultServer::start().await;
    let base = server.url("");
    let http = client_with(
        RetryPolicy::new(fast())
            .with_seed(7)
            .with_published_policy(published(&base)),
    );
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let response = http.post(server.url("/orders")).body("{}").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/orders").len(), 2, "effects");
    let keys = server.header_values("/orders", KEY);
    assert!(same_key(&keys), "{keys:?}");

    // Routes the policy does not name, names with the key in the body, or marks not
    // retry-safe: the generated header key protects nothing there.
    for path in ["/refunds", "/labels", "/orders/7/void"] {
        server.script(path, [Fault::Reset, Fault::Status(201)]);
        let err = retry_error(http.post(server.url(path)).body("{}").send().await.unwrap_err());
        assert_eq!(
            err.stop(),
            Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed),
            "{path}"
        );
        assert_eq!(server.received(path).len(), 1, "{path}: effects");
    }
}

#[tokio::test]
async fn a_published_policy_is_followed_by_the_tower_layer() {
    let server = FaultServer::start().await;
    let policy = RetryPolicy::new(fast()).with_published_policy(published(&server.url("")));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(crate::tower_layer::transport());
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let response = svc.oneshot(post(&server, "/orders")).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/orders").len(), 2, "effects");
    assert!(same_key(&server.header_values("/orders", KEY)));
}

#[tokio::test]
async fn a_published_policy_overrides_trust_in_every_route() {
    let server = FaultServer::start().await;
    let http = client_with(
        RetryPolicy::new(fast().with_auto_key(AutoKey::GenerateTrusted))
            .with_published_policy(published(&server.url(""))),
    );
    // Not described: trusted, as the caller said.
    server.script("/refunds", [Fault::Reset, Fault::Status(201)]);
    http.post(server.url("/refunds")).body("{}").send().await.unwrap();
    assert_eq!(server.received("/refunds").len(), 2);
    // Described as not retry-safe: the published word wins.
    server.script("/orders/7/void", [Fault::Reset, Fault::Status(201)]);
    http.post(server.url("/orders/7/void"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    assert_eq!(server.received("/orders/7/void").len(), 1);
}

#[tokio::test]
async fn an_in_progress_answer_to_this_key_proves_the_route_honours_it_for_this_call_only() {
    let server = FaultServer::start().await;
    let http = client(fast());
    // The server answered this call's key "in progress": it de-duplicates by it, so the
    // lost answer that follows is safe to ask for again.
    server.script(
        "/orders",
        [
            Fault::Problem409(CODE_IN_PROGRESS),
            Fault::Reset,
            Fault::Status(201),
        ],
    );
    let response = http.post(server.url("/orders")).body("{}").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/orders").len(), 3);
    assert!(same_key(&server.header_values("/orders", KEY)));

    // The next call on the same route has a new key the server has not shown it knows.
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let err = retry_error(
        http.post(server.url("/orders"))
            .body("{}")
            .send()
            .await
            .unwrap_err(),
    );
    assert_eq!(err.stop(), Stop::NotRetryable(FatalReason::AutoKeyUnconfirmed));
    assert_eq!(server.received("/orders").len(), 4);
}

#[tokio::test]
async fn a_caller_key_and_an_idempotent_method_stay_protected_by_default() {
    let server = FaultServer::start().await;
    let http = client(fast());
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let response = http
        .post(server.url("/orders"))
        .header(KEY, "order-42")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/orders").len(), 2);
    server.script("/items/1", [Fault::Reset, Fault::Status(200)]);
    let response = http
        .request(Method::PUT, server.url("/items/1"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.received("/items/1").len(), 2);
}

fn post(server: &FaultServer, path: &str) -> http::Request<Full<Bytes>> {
    http::Request::post(server.url(path))
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}
