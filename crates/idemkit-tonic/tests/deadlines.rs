//! Deadlines over gRPC (issue 15): a real tonic server on loopback with a
//! service under the layer, a real tonic client. The caller's `grpc-timeout`
//! reaches the handler as `IdempotencyContext::deadline`; an already-expired
//! one is refused with `DEADLINE_EXCEEDED` before the key is claimed.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use common::Raw;
use http::uri::PathAndQuery;
use idemkit_core::{Account, IdempotencyKey, KeyStore, Scope};
use idemkit_engine::IdempotencyContext;
use idemkit_tonic::{BearerTokenAccount, IdempotencyLayer};
use prost::Message;
use tonic::transport::{Channel, Server};
use tonic::{Code, Status};
use tonic_types::StatusExt;

const CREATE: &str = "/counter.v1.Counter/Create";

/// Stands in for a hop that forwards the caller's deadline after it ran out:
/// the shim layer (outside the idempotency layer) copies this metadata entry
/// into `grpc-timeout`. A tonic client cannot send an expired `grpc-timeout`
/// itself: its own timer ends the call before the server answers.
const FORWARDED_TIMEOUT: &str = "x-test-forwarded-grpc-timeout";

#[derive(Clone, PartialEq, prost::Message)]
struct CreateRequest {
    #[prost(string, tag = "1")]
    idempotency_key: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct CreateReply {
    /// The time the handler had left, in microseconds (0 when it had no deadline).
    #[prost(uint64, tag = "1")]
    remaining_us: u64,
    #[prost(bool, tag = "2")]
    had_deadline: bool,
}

/// `Create` counts its runs and answers what the layer told it about the deadline.
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
            let create = tower::service_fn(move |req: tonic::Request<CreateRequest>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    let ctx = req
                        .extensions()
                        .get::<IdempotencyContext>()
                        .cloned()
                        .ok_or_else(|| Status::internal("no idempotency context"))?;
                    let remaining = ctx.remaining();
                    Ok::<_, Status>(tonic::Response::new(CreateReply {
                        remaining_us: remaining.map_or(0, |d| d.as_micros() as u64),
                        had_deadline: remaining.is_some(),
                    }))
                }
            });
            let mut grpc =
                tonic::server::Grpc::new(tonic_prost::ProstCodec::<CreateReply, CreateRequest>::default());
            Ok(grpc.unary(create, req).await)
        })
    }
}

/// Copies [`FORWARDED_TIMEOUT`] into `grpc-timeout` (see there).
fn forward_timeout(mut req: http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body> {
    if let Some(v) = req.headers_mut().remove(FORWARDED_TIMEOUT) {
        req.headers_mut().insert(idemkit_tonic::wire::GRPC_TIMEOUT, v);
    }
    req
}

async fn serve(store: Arc<dyn KeyStore>, runs: Arc<AtomicUsize>) -> Channel {
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret"))
        .unary_with_key_field(CREATE, 1)
        .build()
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stack = tower::ServiceBuilder::new()
        .map_request(forward_timeout)
        .layer(layer)
        .into_inner();
    let router = Server::builder().layer(stack).add_service(Counter(runs));
    tokio::spawn(router.serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)));
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

async fn call(
    channel: &Channel,
    key: &str,
    prepare: impl FnOnce(&mut tonic::Request<Bytes>),
) -> Result<CreateReply, Status> {
    let mut client = tonic::client::Grpc::new(channel.clone());
    client.ready().await.unwrap();
    let msg: Bytes = CreateRequest {
        idempotency_key: key.into(),
    }
    .encode_to_vec()
    .into();
    let mut req = tonic::Request::new(msg);
    req.metadata_mut()
        .insert("authorization", "Bearer alice".parse().unwrap());
    prepare(&mut req);
    let reply = client.unary(req, PathAndQuery::from_static(CREATE), Raw).await?;
    Ok(CreateReply::decode(reply.into_inner()).unwrap())
}

fn scope(key: &str) -> Scope {
    Scope::new(
        Account::keyed(b"test-secret", b"alice"),
        IdempotencyKey::parse(key).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_deadline_reaches_the_handler_and_an_expired_one_is_refused_before_claiming() {
    let store = Arc::new(idemkit_testkit::MemoryStore::new());
    let runs = Arc::new(AtomicUsize::new(0));
    let ch = serve(store.clone(), runs.clone()).await;

    // A 2 s client deadline (tonic sends it as `grpc-timeout`) is seen by the
    // handler, shrunk by the time the request took to get there.
    let sent = Duration::from_secs(2);
    let reply = call(&ch, "dl-live", |r| r.set_timeout(sent)).await.unwrap();
    assert!(reply.had_deadline, "the handler saw no deadline");
    let remaining = Duration::from_micros(reply.remaining_us);
    assert!(remaining <= sent, "{remaining:?} > {sent:?}");
    assert!(
        remaining > Duration::from_millis(500),
        "{remaining:?} left of {sent:?}"
    );
    assert!(store.get(&scope("dl-live")).await.unwrap().is_some());
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // Without a deadline the handler is told so.
    let reply = call(&ch, "dl-none", |_| {}).await.unwrap();
    assert!(!reply.had_deadline);
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // A deadline that has already passed when the request arrives: refused with
    // DEADLINE_EXCEEDED and the stable reason, nothing ran, nothing was written.
    for expired in ["0n", "0m", "0S"] {
        let key = format!("dl-expired-{expired}");
        let err = call(&ch, &key, |r| {
            r.metadata_mut()
                .insert(FORWARDED_TIMEOUT, expired.parse().unwrap());
        })
        .await
        .unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        let info = err.get_error_details().error_info().cloned().expect("ErrorInfo");
        assert_eq!(info.reason, "deadline_exceeded");
        assert_eq!(info.metadata.get("retryable").map(String::as_str), Some("false"));
        assert!(
            store.get(&scope(&key)).await.unwrap().is_none(),
            "{key} was claimed"
        );
    }
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    // The same key with a live deadline afterwards is free and runs.
    let reply = call(&ch, "dl-expired-0n", |r| r.set_timeout(sent)).await.unwrap();
    assert!(reply.had_deadline);
    assert_eq!(runs.load(Ordering::SeqCst), 3);

    // A malformed `grpc-timeout` is ignored, as gRPC servers do.
    let reply = call(&ch, "dl-malformed", |r| {
        r.metadata_mut()
            .insert(FORWARDED_TIMEOUT, "soon".parse().unwrap());
    })
    .await
    .unwrap();
    assert!(!reply.had_deadline);
}
