//! Round-three hardening of the HTTP integrations (issue 30, items 14 to 18 and 20).
//! Each test failed on the code before its fix.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use idemkit_client::{
    AdaptiveTimeout, AutoKey, CallDeadline, FatalReason, Outcome, RetryLayer, RetryPolicy, Stop, TokenBucket,
    Unlimited, wire,
};
use tower::{Service, ServiceBuilder, ServiceExt};

use crate::server::{Fault, FaultServer};
use crate::tower_layer::{Transport, transport};
use crate::{client, fast, retry_error};

const MS: Duration = Duration::from_millis(1);

/// Fails the test instead of hanging it.
async fn within<T>(limit: Duration, what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: still running after {limit:?}"),
    }
}

fn post(url: impl Into<String>) -> Request<Full<Bytes>> {
    Request::post(url.into())
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

fn answer(status: StatusCode) -> Response<Full<Bytes>> {
    Response::builder()
        .status(status)
        .body(Full::new(Bytes::new()))
        .unwrap()
}

// ---- 14: a slow 409 body is read within the deadline -------------------------------

#[tokio::test]
async fn a_stalled_409_body_is_bounded_by_the_deadline_reqwest() {
    let server = FaultServer::start().await;
    server.always("/slow409", Fault::Stalled409);
    let http = client(
        fast()
            .with_auto_key(AutoKey::GenerateTrusted)
            .with_deadline(500 * MS),
    );
    let t0 = std::time::Instant::now();
    let result = within(
        Duration::from_secs(3),
        "reqwest call",
        http.post(server.url("/slow409")).body("{}").send(),
    )
    .await;
    let took = t0.elapsed();
    assert!(took < 900 * MS, "{took:?}");
    let err = retry_error(result.unwrap_err());
    assert_eq!(err.stop(), Stop::DeadlineExceeded);
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: true });
}

#[tokio::test]
async fn a_stalled_409_body_is_bounded_by_the_deadline_tower() {
    let server = FaultServer::start().await;
    server.always("/slow409", Fault::Stalled409);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(
            fast()
                .with_auto_key(AutoKey::GenerateTrusted)
                .with_deadline(500 * MS),
        ))
        .service(transport());
    let t0 = std::time::Instant::now();
    let result = within(
        Duration::from_secs(3),
        "tower call",
        svc.oneshot(post(server.url("/slow409"))),
    )
    .await;
    let took = t0.elapsed();
    assert!(took < 900 * MS, "{took:?}");
    let err = result.unwrap_err();
    assert_eq!(err.stop(), Stop::DeadlineExceeded);
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: true });
}

// ---- 15: a 409 body too large to classify, or broken, never arrives empty -------------

const BIG: usize = 100 * 1024;

#[tokio::test]
async fn a_409_body_over_the_limit_is_passed_through_whole_reqwest() {
    let server = FaultServer::start().await;
    server.script("/big", [Fault::Big409(BIG), Fault::Status(201)]);
    let response = client(fast())
        .post(server.url("/big"))
        .body("{}")
        .send()
        .await
        .unwrap();
    // Too large to read for its code: not a retry signal, handed over whole.
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = response.bytes().await.unwrap();
    assert_eq!(body.len(), BIG);
    assert!(body.ends_with(b"xx\"}"));
    assert_eq!(server.received("/big").len(), 1);
}

#[tokio::test]
async fn a_409_body_over_the_limit_is_passed_through_whole_tower() {
    let server = FaultServer::start().await;
    server.script("/big", [Fault::Big409(BIG), Fault::Status(201)]);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast()))
        .service(transport());
    let response = svc.oneshot(post(server.url("/big"))).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(body.len(), BIG);
    assert_eq!(server.received("/big").len(), 1);
}

#[tokio::test]
async fn a_broken_409_body_is_a_transport_failure_reqwest() {
    let server = FaultServer::start().await;
    server.always("/broken", Fault::Broken409);
    // Unprotected: the broken answer is not retried, and is an error, not an empty 409.
    let err = client(fast().with_auto_key(AutoKey::CallerOnly))
        .post(server.url("/broken"))
        .body("{}")
        .send()
        .await
        .expect_err("a 409 whose body broke is not an answer");
    let err = retry_error(err);
    assert_eq!(
        err.stop(),
        Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: false });
    assert!(matches!(err.last(), idemkit_client::Last::Error(_)));

    // Protected (an automatic key the caller trusts): retried like any failure after
    // sending.
    server.script("/broken2", [Fault::Broken409, Fault::Status(201)]);
    let response = client(fast().with_auto_key(AutoKey::GenerateTrusted))
        .post(server.url("/broken2"))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(server.received("/broken2").len(), 2);
}

#[tokio::test]
async fn a_broken_409_body_is_a_transport_failure_tower() {
    let server = FaultServer::start().await;
    server.always("/broken", Fault::Broken409);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast().with_auto_key(AutoKey::CallerOnly)))
        .service(transport());
    let err = svc
        .oneshot(post(server.url("/broken")))
        .await
        .expect_err("a 409 whose body broke is not an answer");
    assert_eq!(
        err.stop(),
        Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: false });
    // The response kept in the error replays what arrived, then the failure itself.
    let response = err.into_response().unwrap();
    assert!(response.into_body().collect().await.is_err());
}

// ---- 16: waiting for the inner service's readiness fits in the deadline ---------------

/// A service that, like a rate limiter of one call per `delay`, is not ready for a
/// second call until `delay` has passed.
pub(crate) struct SlowReady<S> {
    inner: S,
    calls: Arc<AtomicU32>,
    delay: Duration,
    wait: Option<Pin<Box<tokio::time::Sleep>>>,
    ready: bool,
}

impl<S> SlowReady<S> {
    pub(crate) fn new(inner: S, delay: Duration) -> Self {
        Self {
            inner,
            calls: Arc::default(),
            delay,
            wait: None,
            ready: false,
        }
    }
}

impl<S: Clone> Clone for SlowReady<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            calls: self.calls.clone(),
            delay: self.delay,
            wait: None,
            ready: false,
        }
    }
}

impl<S: Service<R>, R> Service<R> for SlowReady<S> {
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        if !self.ready && self.calls.load(Ordering::SeqCst) > 0 {
            let delay = self.delay;
            let wait = self
                .wait
                .get_or_insert_with(|| Box::pin(tokio::time::sleep(delay)));
            if wait.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.wait = None;
        }
        self.ready = true;
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> S::Future {
        self.ready = false;
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.inner.call(req)
    }
}

#[tokio::test(start_paused = true)]
async fn readiness_on_a_retry_is_bounded_by_the_deadline_tower() {
    let calls = Arc::new(AtomicU32::new(0));
    let unavailable = tower::service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::io::Error>(answer(StatusCode::SERVICE_UNAVAILABLE))
    });
    let mut limited = SlowReady::new(unavailable, 1500 * MS);
    limited.calls = calls.clone();
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast().with_deadline(Duration::from_secs(1))))
        .service(limited);
    let t0 = tokio::time::Instant::now();
    let err = svc.oneshot(post("http://svc/orders")).await.unwrap_err();
    let took = t0.elapsed();
    assert!(took <= Duration::from_secs(1), "returned after {took:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "no attempt after the deadline");
    assert_eq!(err.stop(), Stop::DeadlineExceeded);
    assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
}

// ---- 17: the caller's own deadline is honoured ------------------------------------------

/// A 503 service that records the `Request-Timeout` of every attempt.
fn recording_unavailable(
    sent: Arc<Mutex<Vec<u64>>>,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |req: Request<Full<Bytes>>| {
        let ms = req.headers()[wire::REQUEST_TIMEOUT]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        sent.lock().unwrap().push(ms);
        async move {
            tokio::time::sleep(20 * MS).await;
            Ok(answer(StatusCode::SERVICE_UNAVAILABLE))
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_callers_request_timeout_and_call_deadline_bound_the_call_tower() {
    let sent = Arc::new(Mutex::new(Vec::new()));
    let policy = RetryPolicy::new(fast().with_max_attempts(100)).with_budget(Arc::new(Unlimited));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy))
        .service(recording_unavailable(sent.clone()));

    let mut req = post("http://svc/orders");
    req.headers_mut()
        .insert(wire::REQUEST_TIMEOUT, http::HeaderValue::from_static("200"));
    let t0 = tokio::time::Instant::now();
    let err = svc.clone().oneshot(req).await.unwrap_err();
    assert!(t0.elapsed() <= 200 * MS, "{:?}", t0.elapsed());
    assert_eq!(err.stop(), Stop::DeadlineExceeded);
    let seen = std::mem::take(&mut *sent.lock().unwrap());
    assert!(seen.len() >= 2, "{seen:?}");
    assert!(seen[0] <= 200 && seen.iter().all(|ms| *ms <= 200), "{seen:?}");

    // A per-call override, as a request extension.
    let mut req = post("http://svc/orders");
    req.extensions_mut().insert(CallDeadline(150 * MS));
    let t0 = tokio::time::Instant::now();
    svc.oneshot(req).await.unwrap_err();
    assert!(t0.elapsed() <= 150 * MS, "{:?}", t0.elapsed());
    let seen = sent.lock().unwrap().clone();
    assert!(seen.iter().all(|ms| *ms <= 150), "{seen:?}");
}

#[tokio::test]
async fn a_callers_request_timeout_is_not_raised_reqwest() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Status(201)]);
    client(fast())
        .post(server.url("/orders"))
        .header(wire::REQUEST_TIMEOUT, "200")
        .body("{}")
        .send()
        .await
        .unwrap();
    let sent: u64 = server.header_values("/orders", wire::REQUEST_TIMEOUT)[0]
        .as_deref()
        .unwrap()
        .parse()
        .unwrap();
    assert!(sent <= 200, "the caller's 200 ms was sent on as {sent}");
}

// ---- 18: the adaptive attempt timeout learns from timeouts ------------------------------

#[tokio::test(start_paused = true)]
async fn the_adaptive_timeout_recovers_when_latency_rises() {
    let latency_ms = Arc::new(AtomicU64::new(30));
    let svc = {
        let latency_ms = latency_ms.clone();
        tower::service_fn(move |_req: Request<Full<Bytes>>| {
            let delay = Duration::from_millis(latency_ms.load(Ordering::SeqCst));
            async move {
                tokio::time::sleep(delay).await;
                Ok::<_, std::io::Error>(answer(StatusCode::OK))
            }
        })
    };
    let config = fast()
        .with_max_attempts(1)
        .with_adaptive_attempt_timeout(AdaptiveTimeout::new().with_min_samples(20));
    let policy = RetryPolicy::new(config).with_budget(Arc::new(Unlimited));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(policy.clone()))
        .service(svc);
    for _ in 0..300 {
        svc.clone().oneshot(post("http://svc/x")).await.unwrap();
    }
    assert_eq!(policy.current_attempt_timeout(), 100 * MS, "learned 3 x 30 ms");

    latency_ms.store(400, Ordering::SeqCst);
    let mut failures = 0;
    while svc.clone().oneshot(post("http://svc/x")).await.is_err() {
        failures += 1;
        assert!(
            failures < 200,
            "200 calls in a row timed out: the timeout never grew"
        );
    }
    assert!(failures <= 4, "{failures} failures before recovering");
    for i in 0..50 {
        assert!(
            svc.clone().oneshot(post("http://svc/x")).await.is_ok(),
            "call {i} after recovering failed (timeout {:?})",
            policy.current_attempt_timeout()
        );
    }
}

// ---- 20: budget tokens and "not sent" ---------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_retry_cancelled_in_its_backoff_keeps_no_tokens() {
    let answered = Arc::new(tokio::sync::Notify::new());
    let svc = {
        let answered = answered.clone();
        tower::service_fn(move |_req: Request<Full<Bytes>>| {
            let answered = answered.clone();
            async move {
                answered.notify_one();
                let mut response = answer(StatusCode::SERVICE_UNAVAILABLE);
                response
                    .headers_mut()
                    .insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("5"));
                Ok::<_, std::io::Error>(response)
            }
        })
    };
    let bucket = Arc::new(TokenBucket::new());
    let policy = RetryPolicy::new(fast()).with_budget(bucket.clone());
    let svc = ServiceBuilder::new().layer(RetryLayer::new(policy)).service(svc);
    let call = tokio::spawn(svc.oneshot(post("http://svc/orders")));
    answered.notified().await;
    // The layer has planned its retry and sleeps on the server's Retry-After.
    tokio::time::sleep(100 * MS).await;
    assert!(!call.is_finished());
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    assert_eq!(
        bucket.available(),
        500,
        "tokens kept for a retry that was never sent"
    );
}

#[tokio::test]
async fn unreachable_on_an_established_exchange_is_maybe_executed() {
    // An error that names "host unreachable" but came from an exchange in progress,
    // not from connecting: the request may have gone out.
    let sent = Arc::new(AtomicU32::new(0));
    let svc = {
        let sent = sent.clone();
        tower::service_fn(move |_req: Request<Full<Bytes>>| {
            sent.fetch_add(1, Ordering::SeqCst);
            async {
                let io = std::io::Error::from(std::io::ErrorKind::HostUnreachable);
                Err::<Response<Full<Bytes>>, _>(Transport(Box::new(io)))
            }
        })
    };
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast().with_auto_key(AutoKey::CallerOnly)))
        .service(svc);
    let err = svc.oneshot(post("http://svc/orders")).await.unwrap_err();
    assert_eq!(err.outcome(), &Outcome::MaybeExecuted { timed_out: false });
    assert_eq!(
        err.stop(),
        Stop::NotRetryable(FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(
        sent.load(Ordering::SeqCst),
        1,
        "an unkeyed POST that may have run was re-sent"
    );
}

#[tokio::test]
async fn a_refused_connection_through_the_tower_layer_is_not_sent() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast().with_auto_key(AutoKey::CallerOnly)))
        .service(transport());
    let err = svc
        .oneshot(post(format!("http://127.0.0.1:{port}/orders")))
        .await
        .unwrap_err();
    assert_eq!(err.outcome(), &Outcome::NotSent);
    assert_eq!(err.stop(), Stop::AttemptsExhausted);
}
