//! The gRPC layer end to end: a real tonic server on loopback with a counter
//! service under the layer, a real tonic client, on the in-memory store and on
//! SQLite.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::Raw;
use http::uri::PathAndQuery;
use idemkit_core::KeyStore;
use idemkit_tonic::wire::IDEMPOTENT_REPLAYED;
use idemkit_tonic::{BearerTokenAccount, IdempotencyLayer};
use prost::Message;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_types::StatusExt;

const CREATE: &str = "/counter.v1.Counter/Create";

#[derive(Clone, PartialEq, prost::Message)]
struct CreateRequest {
    #[prost(string, tag = "1")]
    idempotency_key: String,
    #[prost(string, tag = "2")]
    name: String,
    #[prost(uint64, tag = "3")]
    sleep_ms: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CreateReply {
    #[prost(uint64, tag = "1")]
    id: u64,
    #[prost(string, tag = "2")]
    name: String,
}

/// The test service: `Create` counts its runs and answers the run's number.
#[derive(Clone)]
struct Counter(Arc<AtomicUsize>);

impl tonic::server::NamedService for Counter {
    const NAME: &'static str = "counter.v1.Counter";
}

impl tower::Service<http::Request<tonic::body::Body>> for Counter {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let runs = self.0.clone();
        Box::pin(async move {
            if req.uri().path() != CREATE {
                return Ok(Status::unimplemented("no such method").into_http());
            }
            let create = tower::service_fn(move |req: tonic::Request<CreateRequest>| {
                let runs = runs.clone();
                async move {
                    let req = req.into_inner();
                    if req.name.is_empty() {
                        return Err(Status::invalid_argument("name is required"));
                    }
                    tokio::time::sleep(Duration::from_millis(req.sleep_ms)).await;
                    let id = runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
                    let mut response = tonic::Response::new(CreateReply { id, name: req.name });
                    response
                        .metadata_mut()
                        .insert("x-run", id.to_string().parse().unwrap());
                    Ok::<_, Status>(response)
                }
            });
            let mut grpc =
                tonic::server::Grpc::new(tonic_prost::ProstCodec::<CreateReply, CreateRequest>::default());
            Ok(grpc.unary(create, req).await)
        })
    }
}

struct Harness {
    channel: Channel,
    runs: Arc<AtomicUsize>,
}

async fn serve(store: Arc<dyn KeyStore>) -> Harness {
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret"))
        .unary_with_key_field(CREATE, 1)
        .build()
        .unwrap();
    let runs = Arc::new(AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Server::builder().layer(layer).add_service(Counter(runs.clone()));
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Harness { channel, runs }
}

/// What a call answered: the reply's bytes and metadata, or the status.
type Answer = Result<tonic::Response<Bytes>, Status>;

fn message(key: &str, name: &str, sleep_ms: u64) -> Bytes {
    CreateRequest {
        idempotency_key: key.into(),
        name: name.into(),
        sleep_ms,
    }
    .encode_to_vec()
    .into()
}

async fn call(channel: &Channel, token: &str, metadata_key: Option<&str>, msg: Bytes) -> Answer {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    if let Some(k) = metadata_key {
        req.metadata_mut().insert("idempotency-key", k.parse().unwrap());
    }
    client.unary(req, PathAndQuery::from_static(CREATE), Raw).await
}

fn replayed(r: &tonic::Response<Bytes>) -> bool {
    r.metadata().get(IDEMPOTENT_REPLAYED).is_some_and(|v| v == "true")
}

fn reason(s: &Status) -> String {
    s.get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default()
}

async fn suite(store: Arc<dyn KeyStore>) {
    let h = serve(store).await;
    let ch = &h.channel;

    // First call runs; the same key replays byte-identical, with its metadata.
    let first = call(ch, "alice", None, message("k-1", "one", 0)).await.unwrap();
    assert!(!replayed(&first));
    assert_eq!(CreateReply::decode(first.get_ref().clone()).unwrap().id, 1);
    let again = call(ch, "alice", None, message("k-1", "one", 0)).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(again.metadata().get("x-run"), first.metadata().get("x-run"));
    assert_eq!(h.runs.load(Ordering::SeqCst), 1);

    // The key in metadata with an empty field is the same request key; another
    // account's same key is another key.
    let by_meta = call(ch, "alice", Some("k-2"), message("", "two", 0))
        .await
        .unwrap();
    assert!(!replayed(&by_meta));
    let by_meta_again = call(ch, "alice", Some("k-2"), message("", "two", 0))
        .await
        .unwrap();
    assert!(replayed(&by_meta_again));
    assert_eq!(by_meta_again.get_ref(), by_meta.get_ref());
    let bob = call(ch, "bob", None, message("k-1", "one", 0)).await.unwrap();
    assert!(!replayed(&bob));
    assert_eq!(h.runs.load(Ordering::SeqCst), 3);

    // A different message with the same key.
    let reused = call(ch, "alice", None, message("k-1", "other", 0))
        .await
        .unwrap_err();
    assert_eq!(reused.code(), Code::FailedPrecondition);
    assert_eq!(reason(&reused), "idempotency_key_reused");
    assert_eq!(reused.get_error_details().error_info().unwrap().domain, "idemkit");

    // No key at all; a key field and metadata that disagree; no credentials.
    let missing = call(ch, "alice", None, message("", "x", 0)).await.unwrap_err();
    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(reason(&missing), "idempotency_key_missing");
    let clash = call(ch, "alice", Some("k-a"), message("k-b", "x", 0))
        .await
        .unwrap_err();
    assert_eq!(clash.code(), Code::InvalidArgument);
    assert_eq!(reason(&clash), "idempotency_key_invalid");
    let mut anon = tonic::client::Grpc::new(ch.clone());
    anon.ready().await.unwrap();
    let unauth = anon
        .unary(
            tonic::Request::new(message("k-9", "x", 0)),
            PathAndQuery::from_static(CREATE),
            Raw,
        )
        .await
        .unwrap_err();
    assert_eq!(unauth.code(), Code::Unauthenticated);
    assert_eq!(h.runs.load(Ordering::SeqCst), 3);

    // The handler's INVALID_ARGUMENT releases the key: the corrected request runs.
    let invalid = call(ch, "alice", None, message("k-3", "", 0)).await.unwrap_err();
    assert_eq!(invalid.code(), Code::InvalidArgument);
    let fixed = call(ch, "alice", None, message("k-3", "three", 0)).await.unwrap();
    assert!(!replayed(&fixed));
    assert_eq!(h.runs.load(Ordering::SeqCst), 4);

    // 32 concurrent calls with one key: one run; every other answer is its
    // replay or ABORTED with RetryInfo.
    let msg = message("k-race", "race", 300);
    let answers = futures::future::join_all((0..32).map(|_| call(ch, "carol", None, msg.clone()))).await;
    assert_eq!(h.runs.load(Ordering::SeqCst), 5);
    let winners: Vec<_> = answers.iter().flatten().filter(|r| !replayed(r)).collect();
    assert_eq!(winners.len(), 1, "exactly one call ran the handler");
    let winner = winners[0].get_ref();
    for a in &answers {
        match a {
            Ok(r) => assert_eq!(r.get_ref(), winner),
            Err(s) => {
                assert_eq!(s.code(), Code::Aborted, "{s:?}");
                assert_eq!(reason(s), "idempotency_request_in_progress");
                let delay = s.get_error_details().retry_info().and_then(|r| r.retry_delay);
                assert!(delay.is_some_and(|d| d >= Duration::from_secs(1)), "{s:?}");
            }
        }
    }
    let after = call(ch, "carol", None, msg).await.unwrap();
    assert!(replayed(&after));
    assert_eq!(after.get_ref(), winner);
    assert_eq!(h.runs.load(Ordering::SeqCst), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store() {
    suite(Arc::new(idemkit_testkit::MemoryStore::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_store() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("idemkit-tonic-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let store = idemkit_sqlite::SqliteStore::connect(&path).await.unwrap();
    suite(Arc::new(store)).await;
    let _ = std::fs::remove_file(&path);
}

/// Every guarded call is counted once in `idemkit_requests_total` by outcome,
/// as the HTTP layer counts its requests (a recorder local to this test's
/// thread; server and client run on this thread's runtime).
#[test]
fn calls_are_counted_by_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let h = serve(Arc::new(idemkit_testkit::MemoryStore::new())).await;
            let ch = &h.channel;
            call(ch, "alice", None, message("m-1", "one", 0)).await.unwrap();
            call(ch, "alice", None, message("m-1", "one", 0)).await.unwrap();
            let reused = call(ch, "alice", None, message("m-1", "other", 0))
                .await
                .unwrap_err();
            assert_eq!(reason(&reused), "idempotency_key_reused");
            let missing = call(ch, "alice", None, message("", "x", 0)).await.unwrap_err();
            assert_eq!(reason(&missing), "idempotency_key_missing");
        })
    });
    // A snapshot drains counters: read every outcome from one snapshot.
    let all: Vec<(String, u64)> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == idemkit_engine::metrics::REQUESTS)
        .map(|(key, _, _, value)| {
            let outcome = key
                .key()
                .labels()
                .find(|l| l.key() == "outcome")
                .map(|l| l.value().to_owned())
                .unwrap_or_default();
            let DebugValue::Counter(n) = value else {
                panic!("{value:?}")
            };
            (outcome, n)
        })
        .collect();
    let get = |o: &str| all.iter().filter(|(k, _)| k == o).map(|(_, n)| *n).sum::<u64>();
    assert_eq!(get("executed"), 1, "{all:?}");
    assert_eq!(get("replayed"), 1, "{all:?}");
    assert_eq!(get("key_reused"), 1, "{all:?}");
    assert_eq!(get("key_missing"), 1, "{all:?}");
}
