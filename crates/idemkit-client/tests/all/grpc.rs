//! `GrpcRetryLayer` over a real tonic channel against a real tonic server on loopback.
//! The server is a hand-written tower service with hand-written prost messages (no
//! code generation); it answers from a per-method script and records the metadata of
//! every attempt.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes};
use http::HeaderMap;
use http::uri::PathAndQuery;
use http_body_util::{BodyExt, Full};
use idemkit_client::{
    AutoKey, CODE_IN_PROGRESS, GrpcRetryError, GrpcRetryLayer, GrpcRetryService, RetryConfig, RetryPolicy,
    Stop, parse_grpc_timeout, wire,
};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};
use tower::{ServiceBuilder, ServiceExt};

use crate::fast;

#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct Reply {
    #[prost(uint64, tag = "1")]
    pub(crate) attempt: u64,
}

/// What the server answers to one attempt.
#[derive(Clone)]
pub(crate) enum Script {
    /// `OK` with a [`Reply`] (status in the trailers).
    Ok,
    /// A trailers-only error status.
    Fail(Status),
    /// The same status, after an (empty) message stream, in the trailers.
    FailInTrailers(Code),
    /// `UNAVAILABLE` with `grpc-retry-pushback-ms: <value>`.
    Pushback(&'static str),
    /// Sleep, then the next step.
    Sleep(Duration, Box<Script>),
    /// Bidirectional streaming: one [`Reply`] per message received, as it arrives.
    Echo,
    /// Server streaming: this many [`Reply`]s, one per interval.
    Ticks(u64, Duration),
    /// Client streaming: one [`Reply`] carrying how many messages arrived.
    Count,
}

#[derive(Default)]
struct Shared {
    scripts: Mutex<HashMap<String, VecDeque<Script>>>,
    seen: Mutex<Vec<(String, HeaderMap, Instant)>>,
}

#[derive(Clone, Default)]
struct Scripted(Arc<Shared>);

impl tonic::server::NamedService for Scripted {
    const NAME: &'static str = "test.v1.Scripted";
}

impl tower::Service<http::Request<tonic::body::Body>> for Scripted {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let shared = self.0.clone();
        Box::pin(async move {
            let path = req.uri().path().to_owned();
            let attempt = {
                let mut seen = shared.seen.lock().unwrap();
                seen.push((path.clone(), req.headers().clone(), Instant::now()));
                seen.iter().filter(|(p, ..)| *p == path).count() as u64
            };
            let step = shared
                .scripts
                .lock()
                .unwrap()
                .get_mut(&path)
                .and_then(VecDeque::pop_front)
                .unwrap_or(Script::Ok);
            Ok(answer(step, attempt, req).await)
        })
    }
}

async fn answer(
    mut step: Script,
    attempt: u64,
    req: http::Request<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    while let Script::Sleep(d, next) = step {
        tokio::time::sleep(d).await;
        step = *next;
    }
    match step {
        Script::Ok => {
            let reply = tower::service_fn(move |_: tonic::Request<Bytes>| async move {
                Ok::<_, Status>(tonic::Response::new(Reply { attempt }))
            });
            let mut grpc = tonic::server::Grpc::new(ReplyCodec);
            grpc.unary(reply, req).await
        }
        Script::Fail(status) => status.into_http(),
        Script::FailInTrailers(code) => {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", (code as i32).to_string().parse().unwrap());
            let body = Full::new(Bytes::new()).with_trailers(async move { Some(Ok(trailers)) });
            http::Response::builder()
                .header("content-type", "application/grpc")
                .body(tonic::body::Body::new(body))
                .unwrap()
        }
        Script::Pushback(value) => {
            let mut response = Status::unavailable("busy").into_http::<tonic::body::Body>();
            response
                .headers_mut()
                .insert(wire::GRPC_RETRY_PUSHBACK_MS, value.parse().unwrap());
            response
        }
        Script::Echo => {
            let echo = tower::service_fn(|req: tonic::Request<tonic::Streaming<Bytes>>| async move {
                let replies =
                    futures::stream::unfold((req.into_inner(), 0u64), |(mut inbound, n)| async move {
                        match inbound.message().await {
                            Ok(Some(_)) => Some((Ok(Reply { attempt: n + 1 }), (inbound, n + 1))),
                            _ => None,
                        }
                    });
                let replies: ReplyStream = Box::pin(replies);
                Ok::<_, Status>(tonic::Response::new(replies))
            });
            tonic::server::Grpc::new(ReplyCodec).streaming(echo, req).await
        }
        Script::Ticks(count, every) => {
            let ticks = tower::service_fn(move |_: tonic::Request<Bytes>| async move {
                let replies = futures::stream::unfold(0u64, move |i| async move {
                    if i == count {
                        return None;
                    }
                    tokio::time::sleep(every).await;
                    Some((Ok(Reply { attempt: i + 1 }), i + 1))
                });
                let replies: ReplyStream = Box::pin(replies);
                Ok::<_, Status>(tonic::Response::new(replies))
            });
            tonic::server::Grpc::new(ReplyCodec)
                .server_streaming(ticks, req)
                .await
        }
        Script::Count => {
            let count = tower::service_fn(|req: tonic::Request<tonic::Streaming<Bytes>>| async move {
                let mut inbound = req.into_inner();
                let mut n = 0;
                while inbound.message().await?.is_some() {
                    n += 1;
                }
                Ok::<_, Status>(tonic::Response::new(Reply { attempt: n }))
            });
            tonic::server::Grpc::new(ReplyCodec)
                .client_streaming(count, req)
                .await
        }
        Script::Sleep(..) => unreachable!(),
    }
}

type ReplyStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<Reply, Status>> + Send>>;

/// Server side: decodes raw bytes, encodes a [`Reply`].
#[derive(Clone, Copy, Default)]
struct ReplyCodec;

impl Encoder for ReplyCodec {
    type Item = Reply;
    type Error = Status;
    fn encode(&mut self, item: Reply, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst).map_err(|e| Status::internal(e.to_string()))
    }
}

impl Decoder for ReplyCodec {
    type Item = Bytes;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}

impl Codec for ReplyCodec {
    type Encode = Reply;
    type Decode = Bytes;
    type Encoder = ReplyCodec;
    type Decoder = ReplyCodec;
    fn encoder(&mut self) -> ReplyCodec {
        ReplyCodec
    }
    fn decoder(&mut self) -> ReplyCodec {
        ReplyCodec
    }
}

/// Client side: sends raw bytes, decodes a [`Reply`].
#[derive(Clone, Copy, Default)]
pub(crate) struct Raw;

impl Encoder for Raw {
    type Item = Bytes;
    type Error = Status;
    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Reply;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Reply>, Status> {
        Reply::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

impl Codec for Raw {
    type Encode = Bytes;
    type Decode = Reply;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

pub(crate) struct Harness {
    shared: Arc<Shared>,
    pub(crate) channel: Channel,
}

impl Harness {
    pub(crate) async fn start() -> Self {
        let shared = Arc::new(Shared::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let router = Server::builder().add_service(Scripted(shared.clone()));
        tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
        let channel = Channel::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Self { shared, channel }
    }

    pub(crate) fn script(&self, method: &str, steps: impl IntoIterator<Item = Script>) {
        self.shared
            .scripts
            .lock()
            .unwrap()
            .insert(path(method), steps.into_iter().collect());
    }

    /// The metadata of every attempt at `method`.
    pub(crate) fn seen(&self, method: &str) -> Vec<(HeaderMap, Instant)> {
        let path = path(method);
        self.shared
            .seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(p, ..)| *p == path)
            .map(|(_, h, at)| (h.clone(), *at))
            .collect()
    }

    pub(crate) fn values(&self, method: &str, name: &str) -> Vec<Option<String>> {
        self.seen(method)
            .iter()
            .map(|(h, _)| h.get(name).map(|v| v.to_str().unwrap().to_owned()))
            .collect()
    }

    pub(crate) fn client(&self, config: RetryConfig) -> GrpcRetryService<Channel> {
        ServiceBuilder::new()
            .layer(
                // `Create` is declared unary: its trailers are read and judged too.
                GrpcRetryLayer::new(RetryPolicy::new(config).with_seed(11))
                    .with_unary_method("/test.v1.Scripted/Create"),
            )
            .service(self.channel.clone())
    }
}

pub(crate) fn path(method: &str) -> String {
    format!("/test.v1.Scripted/{method}")
}

pub(crate) async fn call(
    client: GrpcRetryService<Channel>,
    method: &str,
    key: Option<&str>,
) -> Result<tonic::Response<Reply>, Status> {
    let mut grpc = tonic::client::Grpc::new(client);
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(Bytes::from_static(b"\x0a\x03abc"));
    if let Some(key) = key {
        req.metadata_mut().insert("idempotency-key", key.parse().unwrap());
    }
    let path = PathAndQuery::try_from(path(method)).unwrap();
    grpc.unary(req, path, Raw).await
}

fn uuid_v4(s: &str) -> bool {
    s.len() == 36 && s.as_bytes()[14] == b'4'
}

#[tokio::test]
async fn unavailable_twice_then_ok_is_three_attempts_with_one_key() {
    let h = Harness::start().await;
    h.script(
        "Create",
        [
            Script::Fail(Status::unavailable("down")),
            Script::FailInTrailers(Code::Unavailable),
            Script::Ok,
        ],
    );
    let reply = call(h.client(fast()), "Create", None).await.unwrap();
    assert_eq!(reply.get_ref().attempt, 3);
    let keys = h.values("Create", "idempotency-key");
    assert_eq!(keys.len(), 3);
    let first = keys[0].clone().expect("a generated key");
    assert!(uuid_v4(&first), "{first}");
    assert!(
        keys.iter().all(|k| k.as_deref() == Some(first.as_str())),
        "{keys:?}"
    );
}

#[tokio::test]
async fn a_callers_key_is_kept_on_every_attempt() {
    let h = Harness::start().await;
    h.script("Create", [Script::Fail(Status::unavailable("down")), Script::Ok]);
    call(h.client(fast()), "Create", Some("order-7")).await.unwrap();
    assert_eq!(
        h.values("Create", "idempotency-key"),
        [Some("order-7".into()), Some("order-7".into())]
    );
}

#[tokio::test]
async fn invalid_argument_is_one_attempt_and_reaches_the_caller_as_is() {
    let h = Harness::start().await;
    h.script(
        "Create",
        [Script::Fail(Status::invalid_argument("name is required"))],
    );
    let status = call(h.client(fast()), "Create", None).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert_eq!(status.message(), "name is required");
    assert_eq!(h.seen("Create").len(), 1);
}

#[tokio::test]
async fn aborted_in_progress_is_retried_after_its_retry_info() {
    let h = Harness::start().await;
    let mut details = ErrorDetails::with_error_info(CODE_IN_PROGRESS, "idemkit", HashMap::new());
    details.set_retry_info(Some(Duration::from_millis(300)));
    let in_progress = Status::with_error_details(Code::Aborted, "in progress", details);
    h.script("Create", [Script::Fail(in_progress), Script::Ok]);
    let reply = call(h.client(fast()), "Create", None).await.unwrap();
    assert_eq!(reply.get_ref().attempt, 2);
    let seen = h.seen("Create");
    let waited = seen[1].1 - seen[0].1;
    assert!(waited >= Duration::from_millis(300), "{waited:?}");

    // A plain ABORTED (another reason) is not retried.
    let other = Status::with_error_details(
        Code::Aborted,
        "conflict",
        ErrorDetails::with_error_info("something_else", "idemkit", HashMap::new()),
    );
    h.script("Other", [Script::Fail(other)]);
    let status = call(h.client(fast()), "Other", None).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert_eq!(h.seen("Other").len(), 1);
}

#[tokio::test]
async fn deadline_exceeded_is_retried_only_with_a_key() {
    let h = Harness::start().await;
    let keyless = fast().with_auto_key(AutoKey::CallerOnly);
    h.script(
        "Slow",
        [Script::Fail(Status::deadline_exceeded("too slow")), Script::Ok],
    );
    let err = h
        .client(keyless)
        .oneshot(unary_request("Slow"))
        .await
        .unwrap_err();
    assert_eq!(
        err.stop_reason(),
        Stop::NotRetryable(idemkit_client::FatalReason::MaybeExecutedUnprotected)
    );
    assert_eq!(err.status().code(), Code::DeadlineExceeded);
    assert_eq!(h.seen("Slow").len(), 1);
    assert_eq!(h.values("Slow", "idempotency-key"), [None]);

    // Through tonic, the caller sees the server's own status.
    h.script("Slow2", [Script::Fail(Status::deadline_exceeded("too slow"))]);
    let status = call(h.client(keyless), "Slow2", None).await.unwrap_err();
    assert_eq!(
        (status.code(), status.message()),
        (Code::DeadlineExceeded, "too slow")
    );

    // With a key (the caller's, or an automatic one the caller trusts) it is retried.
    h.script(
        "Slow3",
        [Script::Fail(Status::deadline_exceeded("too slow")), Script::Ok],
    );
    call(h.client(keyless), "Slow3", Some("k-1")).await.unwrap();
    h.script(
        "Slow4",
        [Script::Fail(Status::deadline_exceeded("too slow")), Script::Ok],
    );
    call(
        h.client(fast().with_auto_key(AutoKey::GenerateTrusted)),
        "Slow4",
        None,
    )
    .await
    .unwrap();
    assert_eq!((h.seen("Slow3").len(), h.seen("Slow4").len()), (2, 2));

    // The default automatic key is sent but not trusted: no published policy names
    // the method, so the call may have run and is not sent again.
    h.script(
        "Slow5",
        [Script::Fail(Status::deadline_exceeded("too slow")), Script::Ok],
    );
    let status = call(h.client(fast()), "Slow5", None).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded);
    assert_eq!(h.seen("Slow5").len(), 1);
}

/// A unary request for `method` as the tonic client would send it (one frame).
pub(crate) fn unary_request(method: &str) -> http::Request<tonic::body::Body> {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&5u32.to_be_bytes());
    frame.extend_from_slice(b"\x0a\x03abc");
    http::Request::post(format!("http://localhost{}", path(method)))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(tonic::body::Body::new(Full::new(Bytes::from(frame))))
        .unwrap()
}

#[tokio::test]
async fn each_attempt_carries_a_shrinking_grpc_timeout() {
    let h = Harness::start().await;
    let slow_unavailable = || {
        Script::Sleep(
            Duration::from_millis(30),
            Box::new(Script::Fail(Status::unavailable("down"))),
        )
    };
    h.script("Create", [slow_unavailable(), slow_unavailable(), Script::Ok]);
    let config = fast().with_deadline(Duration::from_secs(5));
    call(h.client(config), "Create", None).await.unwrap();
    let budgets: Vec<Duration> = h
        .values("Create", "grpc-timeout")
        .into_iter()
        .map(|v| parse_grpc_timeout(&v.unwrap().parse().unwrap()).unwrap())
        .collect();
    assert_eq!(budgets.len(), 3);
    assert!(budgets[0] <= Duration::from_secs(5), "{budgets:?}");
    assert!(budgets[0] > Duration::from_millis(4_900), "{budgets:?}");
    assert!(
        budgets.windows(2).all(|w| w[1] < w[0]),
        "carved from what remains: {budgets:?}"
    );
    // gRPC carries its own deadline header, not the REST one.
    assert_eq!(h.values("Create", "request-timeout"), [None, None, None]);

    // A caller's shorter grpc-timeout still bounds the call.
    h.script("Short", [Script::Ok]);
    let mut grpc = tonic::client::Grpc::new(h.client(config));
    grpc.ready().await.unwrap();
    let mut req = tonic::Request::new(Bytes::new());
    req.set_timeout(Duration::from_millis(800));
    grpc.unary(req, PathAndQuery::try_from(path("Short")).unwrap(), Raw)
        .await
        .unwrap();
    let sent = h.values("Short", "grpc-timeout")[0].clone().unwrap();
    let sent = parse_grpc_timeout(&sent.parse().unwrap()).unwrap();
    assert!(sent <= Duration::from_millis(800), "{sent:?}");
}

#[tokio::test]
async fn pushback_is_a_floor_and_a_negative_one_stops() {
    let h = Harness::start().await;
    h.script("Push", [Script::Pushback("400"), Script::Ok]);
    call(h.client(fast()), "Push", None).await.unwrap();
    let seen = h.seen("Push");
    assert_eq!(seen.len(), 2);
    let waited = seen[1].1 - seen[0].1;
    assert!(waited >= Duration::from_millis(400), "{waited:?}");

    // Above the cap: stop at once, like a long Retry-After.
    h.script("Long", [Script::Pushback("90000"), Script::Ok]);
    let err = h.client(fast()).oneshot(unary_request("Long")).await.unwrap_err();
    assert_eq!(
        err.stop_reason(),
        Stop::RetryAfterAboveCap {
            retry_after: Duration::from_secs(90)
        }
    );

    for refusal in ["-1", "soon"] {
        let method = format!("No{}", refusal.len());
        h.script(&method, [Script::Pushback(refusal), Script::Ok]);
        let err: GrpcRetryError = h
            .client(fast())
            .oneshot(unary_request(&method))
            .await
            .unwrap_err();
        assert_eq!(err.stop_reason(), Stop::RetryRefused, "{refusal}");
        assert_eq!(err.attempts(), 1);
        assert_eq!(err.status().code(), Code::Unavailable);
        assert_eq!(h.seen(&method).len(), 1, "{refusal}");
    }
}

/// gRFC A6: every retry carries `grpc-previous-rpc-attempts` (how many attempts came
/// before it); the first attempt carries none.
#[tokio::test]
async fn retries_tell_the_server_how_many_attempts_came_before() {
    let h = Harness::start().await;
    h.script(
        "Prev",
        [
            Script::Fail(Status::unavailable("down")),
            Script::Fail(Status::unavailable("down")),
            Script::Ok,
        ],
    );
    call(h.client(fast()), "Prev", None).await.unwrap();
    let previous = h.values("Prev", idemkit_client::wire::GRPC_PREVIOUS_RPC_ATTEMPTS);
    assert_eq!(
        previous,
        [None, Some("1".to_owned()), Some("2".to_owned())],
        "grpc-previous-rpc-attempts on attempts 1, 2, 3"
    );
}
