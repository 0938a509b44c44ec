//! Round-three hardening of the gRPC layer (issue 30, items 13, 16, 17 and 19), over a
//! real tonic channel and server. Each test failed on the code before its fix.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::PathAndQuery;
use idemkit_client::{CallDeadline, GrpcRetryLayer, RetryPolicy, Stop, parse_grpc_timeout};
use tonic::{Code, Status};
use tower::{ServiceBuilder, ServiceExt};

use crate::fast;
use crate::grpc::{Harness, Raw, Script, path, unary_request};
use crate::hardening::SlowReady;

const MS: Duration = Duration::from_millis(1);

async fn within<T>(limit: Duration, what: &str, fut: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: still running after {limit:?}"),
    }
}

fn budgets(h: &Harness, method: &str) -> Vec<Option<String>> {
    h.values(method, "grpc-timeout")
}

// ---- 13: the caller's grpc-timeout bounds the whole call --------------------------------

#[tokio::test]
async fn a_callers_grpc_timeout_bounds_sleeps_and_pushback() {
    let h = Harness::start().await;
    h.script(
        "Push",
        [
            Script::Pushback("1000"),
            Script::Pushback("1000"),
            Script::Pushback("1000"),
        ],
    );
    let mut grpc = tonic::client::Grpc::new(h.client(fast()));
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(Bytes::from_static(b"\x0a\x03abc"));
    req.set_timeout(300 * MS);
    let t0 = Instant::now();
    let status = within(
        Duration::from_secs(5),
        "call",
        grpc.unary(req, PathAndQuery::try_from(path("Push")).unwrap(), Raw),
    )
    .await
    .unwrap_err();
    let took = t0.elapsed();
    assert!(took < 450 * MS, "returned after {took:?}");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    let sent = budgets(&h, "Push");
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent.iter().all(|v| v.as_deref() != Some("0m")), "{sent:?}");
}

#[tokio::test]
async fn the_caller_deadline_ends_the_call_as_deadline_exceeded_not_cancelled() {
    // UNAVAILABLE after 100 ms each time, with a caller budget of 350 ms: the call ends
    // before any attempt would go out with nothing left.
    let h = Harness::start().await;
    let slow_unavailable = || Script::Sleep(100 * MS, Box::new(Script::Fail(Status::unavailable("down"))));
    h.script(
        "Slow",
        [slow_unavailable(), slow_unavailable(), slow_unavailable()],
    );
    let mut grpc = tonic::client::Grpc::new(h.client(fast().with_max_attempts(10)));
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(Bytes::from_static(b"\x0a\x03abc"));
    req.set_timeout(350 * MS);
    let t0 = Instant::now();
    let status = grpc
        .unary(req, PathAndQuery::try_from(path("Slow")).unwrap(), Raw)
        .await
        .unwrap_err();
    assert!(t0.elapsed() < 500 * MS, "{:?}", t0.elapsed());
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Unavailable),
        "{status:?}"
    );
    let sent: Vec<Duration> = budgets(&h, "Slow")
        .into_iter()
        .map(|v| parse_grpc_timeout(&v.unwrap().parse().unwrap()).unwrap())
        .collect();
    assert!(
        sent.iter().all(|d| *d >= 10 * MS),
        "an attempt went out with nothing left: {sent:?}"
    );
    assert!(sent.iter().all(|d| *d <= 350 * MS), "{sent:?}");
}

// ---- 16: readiness on a retry fits in the deadline ---------------------------------------

#[tokio::test]
async fn readiness_on_a_retry_is_bounded_by_the_deadline_grpc() {
    let h = Harness::start().await;
    h.script(
        "Create",
        [
            Script::Fail(Status::unavailable("down")),
            Script::Fail(Status::unavailable("down")),
        ],
    );
    let limited = SlowReady::new(h.channel.clone(), 1500 * MS);
    let policy = RetryPolicy::new(fast().with_deadline(Duration::from_secs(1))).with_seed(3);
    let client = ServiceBuilder::new()
        .layer(GrpcRetryLayer::new(policy))
        .service(limited);
    let t0 = Instant::now();
    let err = within(
        Duration::from_secs(5),
        "call",
        client.oneshot(unary_request("Create")),
    )
    .await
    .unwrap_err();
    let took = t0.elapsed();
    assert!(took <= 1100 * MS, "returned after {took:?}");
    assert_eq!(h.seen("Create").len(), 1, "no attempt after the deadline");
    assert_eq!(err.stop_reason(), Stop::DeadlineExceeded);
}

// ---- 17: a per-call deadline ---------------------------------------------------------------

#[tokio::test]
async fn a_call_deadline_extension_bounds_a_grpc_call() {
    let h = Harness::start().await;
    h.script("Create", [Script::Ok]);
    let mut req = unary_request("Create");
    req.extensions_mut().insert(CallDeadline(200 * MS));
    h.client(fast()).oneshot(req).await.unwrap();
    let sent = budgets(&h, "Create")[0].clone().unwrap();
    let sent = parse_grpc_timeout(&sent.parse().unwrap()).unwrap();
    assert!(sent <= 200 * MS, "{sent:?}");
}

// ---- 19: streaming methods pass through, unregistered ---------------------------------------

#[tokio::test]
async fn an_unregistered_bidi_stream_passes_through() {
    let h = Harness::start().await;
    h.script("Chat", [Script::Echo]);
    let mut grpc = tonic::client::Grpc::new(h.client(fast()));
    grpc.ready().await.unwrap();
    let (tx, rx) = futures::channel::mpsc::unbounded::<Bytes>();
    tx.unbounded_send(Bytes::from_static(b"one")).unwrap();
    within(Duration::from_secs(5), "bidi call", async {
        let response = grpc
            .streaming(
                tonic::Request::new(rx),
                PathAndQuery::try_from(path("Chat")).unwrap(),
                Raw,
            )
            .await
            .unwrap();
        let mut inbound = response.into_inner();
        assert_eq!(inbound.message().await.unwrap().unwrap().attempt, 1);
        tx.unbounded_send(Bytes::from_static(b"two")).unwrap();
        assert_eq!(inbound.message().await.unwrap().unwrap().attempt, 2);
        drop(tx);
        assert!(inbound.message().await.unwrap().is_none());
    })
    .await;
    assert_eq!(h.seen("Chat").len(), 1);
}

#[tokio::test]
async fn an_unregistered_server_stream_is_neither_cut_nor_reopened() {
    let h = Harness::start().await;
    h.script("Watch", [Script::Ticks(5, 150 * MS), Script::Ticks(5, 150 * MS)]);
    let config = fast().with_attempt_timeout(300 * MS);
    let mut grpc = tonic::client::Grpc::new(h.client(config));
    grpc.ready().await.unwrap();
    let replies = within(Duration::from_secs(5), "server stream", async {
        let response = grpc
            .server_streaming(
                tonic::Request::new(Bytes::from_static(b"\x0a\x03abc")),
                PathAndQuery::try_from(path("Watch")).unwrap(),
                Raw,
            )
            .await
            .unwrap();
        let mut inbound = response.into_inner();
        let mut replies = Vec::new();
        while let Some(reply) = inbound.message().await.unwrap() {
            replies.push(reply.attempt);
        }
        replies
    })
    .await;
    assert_eq!(replies, [1, 2, 3, 4, 5]);
    assert_eq!(h.seen("Watch").len(), 1, "the stream was re-opened");
    // Nothing cut the stream at the attempt timeout on the server side either.
    assert_eq!(budgets(&h, "Watch"), [None]);
}

#[tokio::test]
async fn a_client_stream_is_sent_once_as_it_arrives_never_buffered_or_retried() {
    let h = Harness::start().await;
    // Two messages, both ready at once: not one unary message, so not buffered for
    // retries, and a failure is not retried.
    h.script(
        "Upload",
        [Script::Fail(Status::unavailable("down")), Script::Count],
    );
    let mut grpc = tonic::client::Grpc::new(h.client(fast()));
    grpc.ready().await.unwrap();
    let two = futures::stream::iter([Bytes::from_static(b"a"), Bytes::from_static(b"b")]);
    let status = grpc
        .client_streaming(
            tonic::Request::new(two),
            PathAndQuery::try_from(path("Upload")).unwrap(),
            Raw,
        )
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(h.seen("Upload").len(), 1, "a stream was retried");
    // A stream whose later messages come later reaches the server whole.
    grpc.ready().await.unwrap();
    let (tx, rx) = futures::channel::mpsc::unbounded::<Bytes>();
    tx.unbounded_send(Bytes::from_static(b"a")).unwrap();
    let sender = tokio::spawn(async move {
        tokio::time::sleep(100 * MS).await;
        tx.unbounded_send(Bytes::from_static(b"b")).unwrap();
        tx.unbounded_send(Bytes::from_static(b"c")).unwrap();
    });
    let reply = within(
        Duration::from_secs(5),
        "client stream",
        grpc.client_streaming(
            tonic::Request::new(rx),
            PathAndQuery::try_from(path("Upload")).unwrap(),
            Raw,
        ),
    )
    .await
    .unwrap();
    sender.await.unwrap();
    assert_eq!(reply.get_ref().attempt, 3);
    assert_eq!(h.seen("Upload").len(), 2);
}

#[tokio::test]
async fn an_unregistered_method_is_committed_at_the_response_headers() {
    // gRFC A6: once response headers arrive the call is committed; a status in the
    // trailers of a method not declared unary is handed over, not retried.
    let h = Harness::start().await;
    h.script("Other", [Script::FailInTrailers(Code::Unavailable), Script::Ok]);
    let status = crate::grpc::call(h.client(fast()), "Other", None)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(h.seen("Other").len(), 1);
    // Declared unary, the same answer is judged and retried.
    h.script("Create", [Script::FailInTrailers(Code::Unavailable), Script::Ok]);
    let reply = crate::grpc::call(h.client(fast()), "Create", None).await.unwrap();
    assert_eq!(reply.get_ref().attempt, 2);
}
