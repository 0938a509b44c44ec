//! Stuck keys and wrong answers over gRPC (issue 30, items 5, 6, 8, 9): a real
//! tonic server on loopback, a real tonic client. A call whose deadline ends
//! while its key is being claimed, panicking handlers (attached, after the
//! call ended, on every resume), a lost completion reply, and a replay asked
//! for with an expired deadline. Each fails on the code before its fix.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::Raw;
use http::uri::PathAndQuery;
use idemkit_core::{Account, IdempotencyKey, KeyStore, PhaseUpdate, RecordState, Scope};
use idemkit_engine::IdempotencyContext;
use idemkit_testkit::{MemoryStore, Probed};
use idemkit_tonic::wire::IDEMPOTENT_REPLAYED;
use idemkit_tonic::{BearerTokenAccount, IdempotencyLayer};
use prost::Message;
use tokio::sync::Notify;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_types::StatusExt;

const CREATE: &str = "/counter.v1.Counter/Create";

/// Stands in for a hop that forwards an expired deadline (see `deadlines.rs`).
const FORWARDED_TIMEOUT: &str = "x-test-forwarded-grpc-timeout";

#[derive(Clone, PartialEq, prost::Message)]
struct CreateRequest {
    #[prost(string, tag = "1")]
    idempotency_key: String,
    /// `ok`, `panic-once` (panic on the first run), `wait-then-panic-once`
    /// (on the first run, wait for the gate, then panic), `progress-then-panic`
    /// (record progress, then panic).
    #[prost(string, tag = "2")]
    mode: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CreateReply {
    #[prost(uint64, tag = "1")]
    run: u64,
}

/// A memory store with two faults on demand (as in the HTTP tests): a claim
/// that waits for a gate and lands whether or not its caller is still there,
/// and a completion that is applied but whose reply is lost.
type Faulty = Probed<MemoryStore>;

#[derive(Clone)]
struct Counter {
    runs: Arc<AtomicUsize>,
    store: Arc<Faulty>,
    gate: Arc<Notify>,
}

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
        let this = self.clone();
        Box::pin(async move {
            let create = tower::service_fn(move |req: tonic::Request<CreateRequest>| {
                let this = this.clone();
                async move {
                    let run = this.runs.fetch_add(1, Ordering::SeqCst) as u64 + 1;
                    let ctx = req
                        .extensions()
                        .get::<IdempotencyContext>()
                        .cloned()
                        .ok_or_else(|| Status::internal("no idempotency context"))?;
                    match req.into_inner().mode.as_str() {
                        "wait-then-panic-once" if run == 1 => {
                            this.gate.notified().await;
                            panic!("handler bug on run {run}");
                        }
                        "panic-once" => assert!(run > 1, "handler bug on run {run}"),
                        "progress-then-panic" => {
                            let step = PhaseUpdate {
                                recovery_point: "reserved".into(),
                                step: Some(("reserve".into(), serde_json::json!({ "done": run }))),
                            };
                            this.store.advance(&ctx.scope, ctx.token, &step).await.unwrap();
                            panic!("handler bug after recording progress");
                        }
                        _ => {}
                    }
                    Ok::<_, Status>(tonic::Response::new(CreateReply { run }))
                }
            });
            let mut grpc =
                tonic::server::Grpc::new(tonic_prost::ProstCodec::<CreateReply, CreateRequest>::default());
            Ok(grpc.unary(create, req).await)
        })
    }
}

/// Notifies when dropped: the future holding it ended, answered or cancelled.
struct NotifyOnDrop(Arc<Notify>);

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

struct Harness {
    channel: Channel,
    counter: Counter,
    /// Notified when the server is done with a call (answered or cancelled).
    left: Arc<Notify>,
}

async fn serve() -> Harness {
    let store = Arc::new(Faulty::default());
    let counter = Counter {
        runs: Arc::default(),
        store: store.clone(),
        gate: Arc::new(Notify::new()),
    };
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret"))
        .unary_with_key_field(CREATE, 1)
        .build()
        .unwrap();
    let left = Arc::new(Notify::new());
    let signal = left.clone();
    let stack = tower::ServiceBuilder::new()
        .map_future(move |f| {
            let guard = NotifyOnDrop(signal.clone());
            async move {
                let _guard = guard;
                f.await
            }
        })
        .map_request(|mut req: http::Request<tonic::body::Body>| {
            if let Some(v) = req.headers_mut().remove(FORWARDED_TIMEOUT) {
                req.headers_mut().insert(idemkit_tonic::wire::GRPC_TIMEOUT, v);
            }
            req
        })
        .layer(layer)
        .into_inner();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = Server::builder().layer(stack).add_service(counter.clone());
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    Harness {
        channel,
        counter,
        left,
    }
}

type Answer = Result<tonic::Response<Bytes>, Status>;

async fn call(
    h: &Harness,
    key: &str,
    mode: &str,
    prepare: impl FnOnce(&mut tonic::Request<Bytes>),
) -> Answer {
    let mut client = tonic::client::Grpc::new(h.channel.clone());
    client.ready().await.unwrap();
    let msg: Bytes = CreateRequest {
        idempotency_key: key.into(),
        mode: mode.into(),
    }
    .encode_to_vec()
    .into();
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("authorization", "Bearer alice".parse().unwrap());
    prepare(&mut req);
    client.unary(req, PathAndQuery::from_static(CREATE), Raw).await
}

fn run_of(a: &tonic::Response<Bytes>) -> u64 {
    CreateReply::decode(a.get_ref().clone()).unwrap().run
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

fn scope(key: &str) -> Scope {
    Scope::new(
        Account::keyed(b"test-secret", b"alice"),
        IdempotencyKey::parse(key).unwrap(),
    )
}

/// Calls until the answer is not `ABORTED` (in progress), for at most 5 s.
async fn retry_until_settled(h: &Harness, key: &str, mode: &str) -> Answer {
    let began = Instant::now();
    loop {
        match call(h, key, mode, |_| {}).await {
            Err(s) if s.code() == Code::Aborted => {
                assert!(
                    began.elapsed() < Duration::from_secs(5),
                    "the key stayed in progress after its call ended: {s:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}

/// Item 5: the call's deadline ends while its key is being claimed, and the
/// claim lands after the server dropped the call. The claim belongs to the
/// detached work: the handler runs and the retry gets its replay, not
/// `ABORTED` for the rest of a lease nobody holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_whose_deadline_ends_mid_claim_leaves_no_key_held_by_nobody() {
    let h = serve().await;
    let gate = h.counter.store.delay_next_claim();
    let cut = call(&h, "mid-claim", "ok", |r| {
        r.set_timeout(Duration::from_millis(300))
    })
    .await;
    // The client's own timer ends the call (`CANCELLED`), or the server's.
    let code = cut.unwrap_err().code();
    assert!(
        matches!(code, Code::Cancelled | Code::DeadlineExceeded),
        "{code:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), h.left.notified())
        .await
        .expect("the server never ended the call");
    gate.notify_one(); // the claim lands now
    // The detached run goes on alone: a retry sent before its claim landed
    // would claim the fresh key itself and race it.
    let began = Instant::now();
    while h.counter.runs.load(Ordering::SeqCst) == 0 {
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the detached claim never ran the handler: the key is held by nobody"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let replay = retry_until_settled(&h, "mid-claim", "ok").await.unwrap();
    assert!(replayed(&replay), "the retry gets the detached run's answer");
    assert_eq!(run_of(&replay), 1);
    assert_eq!(h.counter.runs.load(Ordering::SeqCst), 1);
}

/// Item 6: a panic before any progress releases the key (it used to stay in
/// flight for the lease): the next call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_before_any_progress_releases_the_key() {
    let h = serve().await;
    let first = call(&h, "panic", "panic-once", |_| {}).await.unwrap_err();
    assert_eq!(first.code(), Code::Internal, "{first:?}");
    let again = call(&h, "panic", "panic-once", |_| {}).await.unwrap();
    assert!(!replayed(&again));
    assert_eq!(run_of(&again), 2);
}

/// Item 6, detached: the handler panics after the call ended at its deadline
/// (in the task the work moved to). The key is released all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_after_the_call_ended_releases_the_key() {
    let h = serve().await;
    let cut = call(&h, "late-panic", "wait-then-panic-once", |r| {
        r.set_timeout(Duration::from_millis(300))
    })
    .await;
    // The client's own timer ends the call (`CANCELLED`), or the server's.
    let code = cut.unwrap_err().code();
    assert!(
        matches!(code, Code::Cancelled | Code::DeadlineExceeded),
        "{code:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), h.left.notified())
        .await
        .expect("the server never ended the call");
    assert_eq!(
        h.counter.runs.load(Ordering::SeqCst),
        1,
        "the handler had started"
    );
    h.counter.gate.notify_one(); // it panics now, detached
    let again = retry_until_settled(&h, "late-panic", "wait-then-panic-once")
        .await
        .unwrap();
    assert!(!replayed(&again));
    assert_eq!(run_of(&again), 2);
}

/// Item 6, the bound: a handler that records progress and then panics on
/// every run is resumed a bounded number of times, then parked for review.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_on_every_resume_is_parked_after_a_bounded_number_of_runs() {
    let h = serve().await;
    for run in 1..=3 {
        let s = call(&h, "always", "progress-then-panic", |_| {})
            .await
            .unwrap_err();
        assert_eq!(s.code(), Code::Internal, "run {run}: {s:?}");
    }
    let record = h.counter.store.get(&scope("always")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Parked, "{:?}", record.last_error);
    let parked = call(&h, "always", "progress-then-panic", |_| {})
        .await
        .unwrap_err();
    assert_eq!(
        (parked.code(), reason(&parked).as_str()),
        (Code::FailedPrecondition, "idempotency_request_parked")
    );
    assert_eq!(h.counter.runs.load(Ordering::SeqCst), 3);
}

/// Item 8: the completion was applied but its reply was lost: the caller
/// gets its answer, not `idempotency_lease_lost`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_completion_reply_answers_the_stored_response() {
    let h = serve().await;
    h.counter.store.lose_next_completion_reply();
    let first = call(&h, "lost-reply", "ok", |_| {}).await.unwrap();
    assert_eq!(run_of(&first), 1);
    let again = call(&h, "lost-reply", "ok", |_| {}).await.unwrap();
    assert!(replayed(&again));
    assert_eq!(again.get_ref(), first.get_ref());
}

/// Item 9: a retry of a completed call sent with an expired `grpc-timeout`
/// gets the stored answer; a call that would have to claim is still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_still_gets_the_replay() {
    let h = serve().await;
    let first = call(&h, "late", "ok", |_| {}).await.unwrap();
    let expired = |r: &mut tonic::Request<Bytes>| {
        r.metadata_mut().insert(FORWARDED_TIMEOUT, "0m".parse().unwrap());
    };
    let late = call(&h, "late", "ok", expired).await.unwrap();
    assert!(replayed(&late));
    assert_eq!(late.get_ref(), first.get_ref());
    let fresh = call(&h, "late-fresh", "ok", expired).await.unwrap_err();
    assert_eq!(fresh.code(), Code::DeadlineExceeded);
    assert_eq!(h.counter.runs.load(Ordering::SeqCst), 1);
}
