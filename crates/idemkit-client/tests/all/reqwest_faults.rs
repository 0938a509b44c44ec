//! `RetryMiddleware` against the fault server.

use std::time::{Duration, Instant};

use http::StatusCode;
use idemkit_client::{
    AutoKey, CODE_IN_PROGRESS, CODE_KEY_REUSED, FatalReason, IdempotencyKey, Outcome, RetryPolicy, Stop,
    TokenBucket, wire,
};

use crate::server::{Fault, FaultServer};
use crate::{client, client_with, fast, retry_error, same_key};

const KEY: &str = "idempotency-key";

#[tokio::test]
async fn reset_before_response_is_retried_with_the_same_trusted_auto_key() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let response = client(fast().with_auto_key(AutoKey::GenerateTrusted))
        .post(server.url("/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = server.header_values("/orders", KEY);
    assert_eq!(keys.len(), 2);
    assert!(same_key(&keys), "{keys:?}");
    assert!(
        server
            .received("/orders")
            .iter()
            .all(|r| r.method == http::Method::POST)
    );
    assert!(uuid_v4(keys[0].as_deref().unwrap()));
}

#[tokio::test]
async fn reset_of_an_unkeyed_post_is_not_retried_when_only_caller_keys_count() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Reset, Fault::Status(201)]);
    let err = client(fast().with_auto_key(AutoKey::CallerOnly))
        .post(server.url("/orders"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let err = retry_error(err);
    assert_eq!(
        err.stop(),
        Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: false });
    assert_eq!(server.received("/orders").len(), 1);
    assert_eq!(server.header_values("/orders", KEY), [None]);
}

#[tokio::test]
async fn slow_response_past_the_attempt_timeout_is_retried_for_get() {
    let server = FaultServer::start().await;
    server.script(
        "/slow",
        [Fault::Delay(Duration::from_secs(3)), Fault::Status(200)],
    );
    let config = fast().with_attempt_timeout(Duration::from_millis(200));
    let started = Instant::now();
    let response = client(config).get(server.url("/slow")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.received("/slow").len(), 2);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "did not wait for the slow answer"
    );
}

#[tokio::test]
async fn post_after_a_read_timeout_is_retried_only_with_its_auto_key() {
    let server = FaultServer::start().await;
    let timeout = Duration::from_millis(200);
    // A trusted auto key attached: retried, and the server saw one key on every attempt.
    server.script("/pay", [Fault::Delay(Duration::from_secs(2)), Fault::Status(201)]);
    let response = client(
        fast()
            .with_auto_key(AutoKey::GenerateTrusted)
            .with_attempt_timeout(timeout),
    )
    .post(server.url("/pay"))
    .body("{}")
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = server.header_values("/pay", KEY);
    assert_eq!(keys.len(), 2);
    assert!(same_key(&keys), "{keys:?}");

    // No key and auto keys off: the write may have happened, so no retry.
    server.script(
        "/pay-nokey",
        [Fault::Delay(Duration::from_secs(2)), Fault::Status(201)],
    );
    let err = client(
        fast()
            .with_attempt_timeout(timeout)
            .with_auto_key(AutoKey::CallerOnly),
    )
    .post(server.url("/pay-nokey"))
    .body("{}")
    .send()
    .await
    .unwrap_err();
    let err = retry_error(err);
    assert_eq!(
        err.stop(),
        Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: true });
    assert_eq!(server.header_values("/pay-nokey", KEY), [None]);

    // A caller's key protects it even with auto keys off, and is never replaced.
    server.script(
        "/pay-key",
        [Fault::Delay(Duration::from_secs(2)), Fault::Status(201)],
    );
    let key = IdempotencyKey::derived("order-confirm", 1234);
    let response = client(
        fast()
            .with_attempt_timeout(timeout)
            .with_auto_key(AutoKey::CallerOnly),
    )
    .post(server.url("/pay-key"))
    .header(wire::IDEMPOTENCY_KEY, key.as_str())
    .body("{}")
    .send()
    .await
    .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let expected = Some("order-confirm-1234".to_owned());
    assert_eq!(
        server.header_values("/pay-key", KEY),
        [expected.clone(), expected]
    );
}

#[tokio::test]
async fn too_many_requests_with_retry_after_seconds() {
    let server = FaultServer::start().await;
    server.script("/limited", [Fault::RetryAfterSecs(429, 1), Fault::Status(200)]);
    let started = Instant::now();
    let response = client(fast()).get(server.url("/limited")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert!(
        started.elapsed() >= Duration::from_secs(1),
        "Retry-After is a floor"
    );
    assert_eq!(server.received("/limited").len(), 2);
}

#[tokio::test]
async fn too_many_requests_with_retry_after_http_date() {
    let server = FaultServer::start().await;
    server.script(
        "/limited",
        [
            Fault::RetryAfterDate(429, Duration::from_secs(2)),
            Fault::Status(200),
        ],
    );
    let started = Instant::now();
    let response = client(fast()).get(server.url("/limited")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    // HTTP dates have whole-second resolution: "now + 2 s" is 1-2 s away.
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(900), "{waited:?}");
    assert_eq!(server.received("/limited").len(), 2);
}

#[tokio::test]
async fn retry_after_past_the_deadline_stops_at_once_with_the_servers_value() {
    let server = FaultServer::start().await;
    for (path, fault) in [
        ("/secs", Fault::RetryAfterSecs(429, 30)),
        ("/date", Fault::RetryAfterDate(503, Duration::from_secs(30))),
    ] {
        server.always(path, fault);
        let started = Instant::now();
        let err = client(fast().with_deadline(Duration::from_secs(2)))
            .get(server.url(path))
            .send()
            .await
            .unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(500), "never slept");
        let err = retry_error(err);
        let Stop::RetryAfterPastDeadline { retry_after } = err.stop() else {
            panic!("{path}: {err}");
        };
        assert!(retry_after >= Duration::from_secs(29), "{retry_after:?}");
        assert_eq!(err.retry_after(), Some(retry_after));
        assert_eq!(err.attempts(), 1);
        assert!(err.to_string().contains("past the deadline"), "{err}");
        let last = err.into_response().unwrap();
        assert!(last.status() == 429 || last.status() == 503);
        assert_eq!(server.received(path).len(), 1);
    }
}

#[tokio::test]
async fn service_unavailable_storm_stops_at_the_attempt_cap() {
    let server = FaultServer::start().await;
    server.always("/storm", Fault::Status(503));
    let err = client(fast()).get(server.url("/storm")).send().await.unwrap_err();
    let err = retry_error(err);
    assert_eq!(err.stop(), Stop::AttemptsExhausted);
    assert_eq!(err.attempts(), 3);
    assert_eq!(server.received("/storm").len(), 3);
    assert_eq!(
        err.into_response().unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

#[tokio::test]
async fn in_progress_conflict_then_success() {
    let server = FaultServer::start().await;
    server.script(
        "/orders",
        [Fault::Problem409(CODE_IN_PROGRESS), Fault::Status(201)],
    );
    let key = IdempotencyKey::derived("order-create", "c-9");
    let response = client(fast())
        .post(server.url("/orders"))
        .header(wire::IDEMPOTENCY_KEY, key.as_str())
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = server.header_values("/orders", KEY);
    assert_eq!(keys, [Some(key.to_string()), Some(key.to_string())]);
}

#[tokio::test]
async fn key_reused_conflict_is_returned_untouched() {
    let server = FaultServer::start().await;
    server.always("/orders", Fault::Problem409(CODE_KEY_REUSED));
    let response = client(fast())
        .post(server.url("/orders"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.headers()["content-type"], "application/problem+json");
    // The body read for classification reaches the caller intact.
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(problem["code"], CODE_KEY_REUSED);
    assert_eq!(problem["retryable"], false);
    assert_eq!(server.received("/orders").len(), 1);
}

#[tokio::test]
async fn bad_request_and_auth_errors_are_not_retried() {
    let server = FaultServer::start().await;
    for (path, status) in [("/bad", 400), ("/auth", 401), ("/forbidden", 403), ("/boom", 500)] {
        server.always(path, Fault::Status(status));
        let response = client(fast())
            .post(server.url(path))
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(response.status().as_u16(), status);
        assert_eq!(server.received(path).len(), 1, "{path}");
    }
}

#[tokio::test]
async fn internal_server_error_is_retried_only_when_opted_in() {
    let server = FaultServer::start().await;
    server.script("/boom", [Fault::Status(500), Fault::Status(200)]);
    let config = fast().with_classifier(idemkit_client::Classifier::new().with_retry_500(true));
    let response = client(config).get(server.url("/boom")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.received("/boom").len(), 2);
}

#[tokio::test]
async fn refused_connections_are_not_sent_and_always_retried() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = client(fast().with_auto_key(AutoKey::CallerOnly))
        .post(format!("http://127.0.0.1:{port}/orders"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let err = retry_error(err);
    assert_eq!(err.outcome(), &Outcome::NotSent);
    assert_eq!(err.stop(), Stop::AttemptsExhausted);
    assert_eq!(err.attempts(), 3);
}

#[tokio::test]
async fn an_empty_budget_stops_retries_and_says_so() {
    let server = FaultServer::start().await;
    server.always("/storm", Fault::Status(503));
    let bucket = std::sync::Arc::new(TokenBucket::new().with_capacity(14));
    let http = client_with(RetryPolicy::new(fast()).with_budget(bucket.clone()));
    // The first call spends the only retry.
    let first = retry_error(http.get(server.url("/storm")).send().await.unwrap_err());
    assert_eq!(first.stop(), Stop::BudgetExhausted);
    assert_eq!(first.attempts(), 2);
    // The next call is not retried at all.
    let second = retry_error(http.get(server.url("/storm")).send().await.unwrap_err());
    assert_eq!(second.stop(), Stop::BudgetExhausted);
    assert_eq!(second.attempts(), 1);
    assert!(second.to_string().contains("retry budget exhausted"), "{second}");
    assert_eq!(server.received("/storm").len(), 3);
    assert_eq!(bucket.available(), 0);
}

#[tokio::test]
async fn attempt_and_timeout_headers_when_enabled() {
    let server = FaultServer::start().await;
    server.script("/h", [Fault::Status(502), Fault::Status(504), Fault::Status(200)]);
    let config = fast()
        .with_attempt_header(true)
        .with_timeout_header(true)
        .with_deadline(Duration::from_secs(5));
    let response = client(config).get(server.url("/h")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let attempts = server.header_values("/h", wire::IDEMKIT_ATTEMPT);
    assert_eq!(attempts, [Some("1".into()), Some("2".into()), Some("3".into())]);
    let timeouts: Vec<u64> = server
        .header_values("/h", wire::IDEMKIT_TIMEOUT_MS)
        .into_iter()
        .map(|v| v.unwrap().parse().unwrap())
        .collect();
    assert!(timeouts.iter().all(|&ms| ms <= 5_000), "{timeouts:?}");
    assert!(
        timeouts.windows(2).all(|w| w[1] <= w[0]),
        "carved from what remains: {timeouts:?}"
    );
    // GET carries no key.
    assert_eq!(server.header_values("/h", KEY), [None, None, None]);
}

#[tokio::test]
async fn every_attempt_carries_its_budget_in_the_rest_deadline_header() {
    let server = FaultServer::start().await;
    server.script("/d", [Fault::Status(503), Fault::Status(503), Fault::Status(201)]);
    // The client's name is the server's.
    assert_eq!(
        idemkit_client::wire::REQUEST_TIMEOUT,
        idemkit_core::wire::REQUEST_TIMEOUT
    );
    let config = fast().with_deadline(Duration::from_secs(5));
    let response = client(config).post(server.url("/d")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let budgets: Vec<u64> = server
        .header_values("/d", idemkit_core::wire::REQUEST_TIMEOUT)
        .into_iter()
        .map(|v| {
            idemkit_core::parse_deadline_header(&v.unwrap())
                .unwrap()
                .as_millis() as u64
        })
        .collect();
    assert_eq!(budgets.len(), 3);
    assert!(budgets[0] <= 5_000 && budgets[0] > 4_800, "{budgets:?}");
    assert!(
        budgets.windows(2).all(|w| w[1] <= w[0]),
        "carved from what remains: {budgets:?}"
    );
}

#[tokio::test]
async fn a_real_two_second_deadline_against_a_503_server() {
    let server = FaultServer::start().await;
    server.always("/storm", Fault::Status(503));
    let config = fast()
        .with_max_attempts(1_000)
        .with_backoff(idemkit_client::Backoff::full_jitter(
            Duration::from_millis(20),
            Duration::from_millis(400),
        ))
        .with_deadline(Duration::from_secs(2));
    let http =
        client_with(RetryPolicy::new(config).with_budget(std::sync::Arc::new(idemkit_client::Unlimited)));
    let started = Instant::now();
    let err = retry_error(http.get(server.url("/storm")).send().await.unwrap_err());
    let took = started.elapsed();
    assert!(took <= Duration::from_millis(2_150), "{took:?}");
    assert_eq!(err.stop(), Stop::DeadlineExceeded);
    assert!(err.attempts() > 3);
    assert_eq!(server.received("/storm").len() as u32, err.attempts());
}

fn uuid_v4(s: &str) -> bool {
    s.len() == 36 && s.as_bytes()[14] == b'4'
}
