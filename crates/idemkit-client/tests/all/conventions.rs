//! The client's conventions where they differ from reqwest-retry's: what an exhausted
//! call returns, how attempts are counted, extending the classifier, and 409 responses
//! rebuilt after their body was read.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use http::{Extensions, StatusCode, header};
use idemkit_client::{
    AttemptInfo, CODE_KEY_REUSED, FatalReason, RetryErrorExt, RetryKind, RetryPolicy, Stop, Verdict,
};
use reqwest_middleware::{Middleware, Next};

use crate::server::{Fault, FaultServer};
use crate::{client, client_with, fast, retry_error};

#[tokio::test]
async fn exhausted_retries_are_an_error_holding_the_last_response_with_its_body() {
    let server = FaultServer::start().await;
    server.always("/busy", Fault::Status(503));
    let err = client(fast())
        .get(server.url("/busy"))
        .send()
        .await
        .expect_err("retries exhausted on 503 are an Err");
    assert_eq!(retry_error_ref(&err).stop(), Stop::AttemptsExhausted);
    // reqwest-retry's `Ok(last response)`, in one call.
    let last = err.into_last_response().expect("the last answer is kept");
    assert_eq!(last.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(last.text().await.unwrap(), "ok", "the last body is readable");
    assert_eq!(server.received("/busy").len(), 3);

    // No answer to hand over: the error stays an error.
    server.script("/gone", [Fault::Reset]);
    let err = client(fast().with_auto_key(idemkit_client::AutoKey::CallerOnly))
        .post(server.url("/gone"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let err = err.into_last_response().expect_err("a reset left no response");
    assert!(err.retry_error().is_some(), "{err}");
}

fn retry_error_ref(err: &reqwest_middleware::Error) -> &idemkit_client::ReqwestRetryError {
    err.retry_error().expect("a retry error")
}

#[tokio::test]
async fn max_retries_counts_retries_and_max_attempts_counts_attempts() {
    let server = FaultServer::start().await;
    server.always("/busy", Fault::Status(503));
    for (config, sent) in [
        (fast().with_max_retries(0), 1),
        (fast().with_max_retries(2), 3),
        (fast().with_max_attempts(2), 2),
    ] {
        let before = server.received("/busy").len();
        let err = retry_error(client(config).get(server.url("/busy")).send().await.unwrap_err());
        assert_eq!(err.attempts(), sent);
        assert_eq!(
            server.received("/busy").len() - before,
            sent as usize,
            "{config:?}"
        );
    }
}

#[tokio::test]
async fn a_classifier_hook_sees_the_answer_and_delegates_to_the_default() {
    let server = FaultServer::start().await;
    let seen_errors = Arc::new(AtomicU32::new(0));
    let policy = {
        let seen_errors = seen_errors.clone();
        RetryPolicy::new(fast()).with_seed(3).with_classifier_hook(
            move |attempt: &AttemptInfo<'_>, default: Verdict| {
                if attempt.error().is_some() {
                    seen_errors.fetch_add(1, Ordering::SeqCst);
                }
                let hinted = attempt
                    .headers()
                    .is_some_and(|h| h.contains_key(header::RETRY_AFTER));
                match attempt.status() {
                    // A 500 that says when to come back is worth another attempt.
                    Some(StatusCode::INTERNAL_SERVER_ERROR) if hinted => {
                        Verdict::Transient(RetryKind::Transient)
                    }
                    // This server's 503 means "down for maintenance": do not retry.
                    Some(StatusCode::SERVICE_UNAVAILABLE) => Verdict::Fatal(FatalReason::NotAllowlisted),
                    _ => default,
                }
            },
        )
    };
    let http = client_with(policy);

    server.script("/hinted", [Fault::RetryAfterSecs(500, 0), Fault::Status(201)]);
    let response = http.get(server.url("/hinted")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/hinted").len(), 2);

    // Delegated: a bare 500 is not retried, a 502 to a GET is.
    server.script("/plain", [Fault::Status(500), Fault::Status(201)]);
    let response = http.get(server.url("/plain")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(server.received("/plain").len(), 1);
    server.script("/gateway", [Fault::Status(502), Fault::Status(200)]);
    let response = http.get(server.url("/gateway")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(server.received("/gateway").len(), 2);

    // Overridden: 503 handed back at once.
    server.script("/maintenance", [Fault::Status(503), Fault::Status(200)]);
    let response = http.get(server.url("/maintenance")).send().await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(server.received("/maintenance").len(), 1);

    // The hook sees transport errors too.
    server.script("/reset", [Fault::Reset, Fault::Status(200)]);
    http.get(server.url("/reset")).send().await.unwrap();
    assert_eq!(seen_errors.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_hook_that_calls_a_transport_failure_final_ends_the_call_with_the_error() {
    let server = FaultServer::start().await;
    let http = client_with(
        RetryPolicy::new(fast()).with_classifier_hook(|_: &AttemptInfo<'_>, _: Verdict| Verdict::Success),
    );
    server.script("/reset", [Fault::Reset, Fault::Status(200)]);
    let err = retry_error(http.get(server.url("/reset")).send().await.unwrap_err());
    assert_eq!(err.stop(), Stop::NotRetryable(FatalReason::NotAllowlisted));
    assert!(matches!(err.last(), idemkit_client::Last::Error(_)));
    assert_eq!(server.received("/reset").len(), 1);
}

/// Marks every response it passes on, as an inner middleware (a tracer, a cache) does.
struct Mark;

#[derive(Clone, Debug, PartialEq)]
struct Marked(&'static str);

#[async_trait::async_trait]
impl Middleware for Mark {
    async fn handle(
        &self,
        req: reqwest::Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let mut response = next.run(req, extensions).await?;
        response.extensions_mut().insert(Marked("inner"));
        Ok(response)
    }
}

#[tokio::test]
async fn a_409_rebuilt_after_its_body_was_read_keeps_its_url_and_extensions() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Problem409(CODE_KEY_REUSED)]);
    let http = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(idemkit_client::RetryMiddleware::new(RetryPolicy::new(fast())))
        .with(Mark)
        .build();
    let url = server.url("/orders");
    let response = http.post(&url).body("{}").send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    assert_eq!(response.url().as_str(), url, "the response's URL");
    assert_eq!(response.extensions().get::<Marked>(), Some(&Marked("inner")));
    assert!(response.remote_addr().is_some(), "the connection info");
    let problem: serde_json::Value = response.json().await.unwrap();
    assert_eq!(problem["code"], CODE_KEY_REUSED, "the body, whole");
}
