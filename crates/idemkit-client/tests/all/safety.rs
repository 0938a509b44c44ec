//! The safety rules added after the first review, each against the real fault server:
//! a gateway's 502/504 is *maybe executed*, PUT/DELETE get automatic keys, `Retry-After`
//! is capped, and clients told the same `Retry-After` spread out above it. Plus the one
//! way to read the last answer after retries ran out.

use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use idemkit_client::{AutoKey, FatalReason, IdempotencyKey, Outcome, RetryConfig, RetryErrorExt, Stop, wire};

use crate::server::{Fault, FaultServer};
use crate::{client, fast, retry_error, same_key};

const KEY: &str = "idempotency-key";

/// Bounds a call that the old code would have let sleep (nearly) forever.
async fn within<T>(limit: Duration, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(limit, fut)
        .await
        .expect("the call should have returned at once")
}

#[tokio::test]
async fn gateway_502_and_504_to_a_keyless_post_are_not_retried() {
    let server = FaultServer::start().await;
    for (path, status) in [("/bad-gateway", 502), ("/gateway-timeout", 504)] {
        server.script(path, [Fault::Status(status), Fault::Status(201)]);
        let err = client(fast().with_auto_key(AutoKey::CallerOnly))
            .post(server.url(path))
            .body("{}")
            .send()
            .await
            .expect_err("a 502/504 to an unprotected POST is maybe executed");
        let err = retry_error(err);
        assert_eq!(
            err.stop_reason(),
            Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected),
            "{path}"
        );
        assert_eq!(err.attempts(), 1);
        assert_eq!(err.status().map(|s| s.as_u16()), Some(status));
        assert_eq!(server.received(path).len(), 1, "{path}: sent once");
        assert_eq!(server.header_values(path, KEY), [None]);
    }
}

#[tokio::test]
async fn gateway_502_and_504_are_retried_when_the_request_is_protected() {
    let server = FaultServer::start().await;
    // A caller's key, an automatic key, or an idempotent method each protect it.
    let caller_key = IdempotencyKey::derived("order-confirm", 7);
    let cases: [(&str, Method, RetryConfig, bool); 3] = [
        (
            "/keyed",
            Method::POST,
            fast().with_auto_key(AutoKey::CallerOnly),
            true,
        ),
        (
            "/auto",
            Method::POST,
            fast().with_auto_key(AutoKey::GenerateTrusted),
            false,
        ),
        (
            "/get",
            Method::GET,
            fast().with_auto_key(AutoKey::CallerOnly),
            false,
        ),
    ];
    for (path, method, config, with_key) in cases {
        server.script(path, [Fault::Status(502), Fault::Status(504), Fault::Status(200)]);
        let mut request = client(config).request(method.clone(), server.url(path));
        if with_key {
            request = request.header(wire::IDEMPOTENCY_KEY, caller_key.as_str());
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), StatusCode::OK, "{path}");
        assert_eq!(server.received(path).len(), 3, "{path}");
        let keys = server.header_values(path, KEY);
        if method == Method::POST {
            assert!(same_key(&keys), "{path}: {keys:?}");
        }
    }
}

#[tokio::test]
async fn keyless_put_and_delete_get_one_automatic_key() {
    let server = FaultServer::start().await;
    for method in [Method::PUT, Method::DELETE] {
        let path = format!("/items/{method}");
        server.script(&path, [Fault::Status(503), Fault::Status(200)]);
        let response = client(fast())
            .request(method.clone(), server.url(&path))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let keys = server.header_values(&path, KEY);
        assert_eq!(keys.len(), 2, "{method}");
        assert!(same_key(&keys), "{method}: one key on every attempt: {keys:?}");
        assert!(uuid::Uuid::parse_str(keys[0].as_deref().unwrap()).is_ok());
    }
    // A GET still carries none.
    client(fast()).get(server.url("/items")).send().await.unwrap();
    assert_eq!(server.header_values("/items", KEY), [None]);
}

#[tokio::test]
async fn a_huge_retry_after_ends_the_retries_at_once_even_without_a_deadline() {
    let server = FaultServer::start().await;
    server.always("/huge", Fault::RetryAfterSecs(429, 999_999_999));
    let started = Instant::now();
    let err = within(
        Duration::from_secs(5),
        client(fast().without_deadline()).get(server.url("/huge")).send(),
    )
    .await
    .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(1), "never slept");
    let err = retry_error(err);
    assert_eq!(
        err.stop_reason(),
        Stop::RetryAfterAboveCap {
            retry_after: Duration::from_secs(999_999_999)
        }
    );
    assert_eq!(err.retry_after(), Some(Duration::from_secs(999_999_999)));
    assert_eq!(err.attempts(), 1);
    // The caller gets the answer with the server's hint.
    assert_eq!(err.status(), Some(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(err.headers().unwrap()["retry-after"], "999999999");
    assert!(err.to_string().contains("longer than the client waits"), "{err}");
    assert_eq!(server.received("/huge").len(), 1);
}

#[tokio::test]
async fn the_retry_after_cap_is_configurable_and_inclusive() {
    let server = FaultServer::start().await;
    // Above a 1 s cap: stop at once (the 30 s default deadline would have allowed it).
    server.always("/two", Fault::RetryAfterSecs(503, 2));
    let capped = fast().with_retry_after_cap(Duration::from_secs(1));
    let started = Instant::now();
    let err = retry_error(client(capped).get(server.url("/two")).send().await.unwrap_err());
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(
        err.stop_reason(),
        Stop::RetryAfterAboveCap {
            retry_after: Duration::from_secs(2)
        }
    );
    // Equal to the cap: honoured.
    server.script("/one", [Fault::RetryAfterSecs(503, 1), Fault::Status(200)]);
    let started = Instant::now();
    let response = client(capped).get(server.url("/one")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(started.elapsed() >= Duration::from_secs(1));
}

#[tokio::test]
async fn clients_told_the_same_retry_after_spread_out_above_it() {
    const CLIENTS: usize = 24;
    let server = FaultServer::start().await;
    // Default throttling backoff (base 1 s): each retry lands in [1 s, 2 s] after the 429.
    let config = RetryConfig::new();
    let mut calls = Vec::new();
    for i in 0..CLIENTS {
        let path = format!("/herd/{i}");
        server.script(&path, [Fault::RetryAfterSecs(429, 1), Fault::Status(200)]);
        let http = idemkit_client_policy(config);
        let url = server.url(&path);
        calls.push(tokio::spawn(async move { http.get(url).send().await }));
    }
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap().status(), StatusCode::OK);
    }
    let mut waits: Vec<Duration> = (0..CLIENTS)
        .map(|i| {
            let r = server.received(&format!("/herd/{i}"));
            assert_eq!(r.len(), 2);
            r[1].at - r[0].at
        })
        .collect();
    waits.sort();
    assert!(
        waits[0] >= Duration::from_millis(990),
        "Retry-After is a floor: {waits:?}"
    );
    assert!(waits[CLIENTS - 1] <= Duration::from_millis(2_200), "{waits:?}");
    // Sleeping exactly the floor would put every retry within a few ms of 1 s.
    let spread = waits[CLIENTS - 1] - waits[0];
    eprintln!(
        "retry waits after Retry-After: 1: min {:?}, max {:?}, spread {spread:?}",
        waits[0],
        waits[CLIENTS - 1]
    );
    assert!(
        spread >= Duration::from_millis(400),
        "retries not spread: {waits:?}"
    );
    let after_floor = waits
        .iter()
        .filter(|w| **w >= Duration::from_millis(1_100))
        .count();
    assert!(
        after_floor >= CLIENTS / 2,
        "most retries land above the floor: {waits:?}"
    );
}

/// A client with its own policy (and unseeded jitter, as in production).
fn idemkit_client_policy(config: RetryConfig) -> reqwest_middleware::ClientWithMiddleware {
    crate::client_with(idemkit_client::RetryPolicy::new(config))
}

#[tokio::test]
async fn exhausted_retries_hand_over_the_last_answer_and_the_stop_reason() {
    let server = FaultServer::start().await;
    server.always("/storm", Fault::Status(503));
    let err = client(fast())
        .post(server.url("/storm"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    // reqwest's own helpers know nothing about it…
    assert_eq!(err.status(), None);
    // …the retry error does, borrowed or by value.
    let gave_up = err.retry_error().expect("a retry error");
    assert_eq!(gave_up.stop_reason(), Stop::AttemptsExhausted);
    assert_eq!(gave_up.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    let gave_up = err.into_retry_error().expect("a retry error");
    assert_eq!(gave_up.attempts(), 3);
    assert!(gave_up.headers().unwrap().contains_key("content-length"));
    assert_eq!(
        gave_up.last_response().map(reqwest::Response::status),
        Some(StatusCode::SERVICE_UNAVAILABLE)
    );
    assert!(matches!(gave_up.outcome(), Outcome::Answered(_)));
    let body = gave_up.into_response().unwrap().text().await.unwrap();
    assert_eq!(body, "ok");

    // An error that never reached the retry layer comes back as itself.
    let err = client(fast()).get("not a url").send().await.unwrap_err();
    assert!(err.into_retry_error().is_err());
}
