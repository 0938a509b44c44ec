//! `RetryLayer` over a real HTTP transport (reqwest behind a tower `service_fn`).

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use idemkit_client::{AutoKey, CODE_IN_PROGRESS, CODE_KEY_REUSED, ReplayBody, RetryLayer, RetryPolicy, Stop};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};

use crate::server::{Fault, FaultServer};
use crate::{fast, same_key};

type TransportError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug)]
pub(crate) struct Transport(pub(crate) TransportError);

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Transport {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// An HTTP client as a tower service, the shape of a hyper or tonic client.
pub(crate) fn transport<B>()
-> impl Service<Request<B>, Response = Response<reqwest::Body>, Error = Transport, Future = impl Send>
+ Clone
+ Send
+ 'static
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let client = reqwest::Client::new();
    tower::service_fn(move |req: Request<B>| {
        let client = client.clone();
        async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await.map_err(|e| Transport(e.into()))?.to_bytes();
            let req = reqwest::Request::try_from(Request::from_parts(parts, bytes))
                .map_err(|e| Transport(e.into()))?;
            let response = client.execute(req).await.map_err(|e| Transport(e.into()))?;
            Ok(Response::from(response))
        }
    })
}

fn post(url: String) -> Request<Full<Bytes>> {
    Request::post(url)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap()
}

#[tokio::test]
async fn in_progress_then_success_with_one_auto_key() {
    let server = FaultServer::start().await;
    server.script(
        "/orders",
        [Fault::Problem409(CODE_IN_PROGRESS), Fault::Status(201)],
    );
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryPolicy::new(fast()).with_seed(1)))
        .service(transport());
    let response = svc.oneshot(post(server.url("/orders"))).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let keys = server.header_values("/orders", "idempotency-key");
    assert_eq!(keys.len(), 2);
    assert!(same_key(&keys), "{keys:?}");
    // Each attempt carries its remaining budget in the REST deadline header.
    let budgets: Vec<u64> = server
        .header_values("/orders", idemkit_client::wire::REQUEST_TIMEOUT)
        .into_iter()
        .map(|v| v.unwrap().parse().unwrap())
        .collect();
    assert!(budgets[0] <= 10_000 && budgets[1] <= budgets[0], "{budgets:?}");
}

#[tokio::test]
async fn reset_is_retried_and_key_reused_is_returned_with_its_body() {
    let server = FaultServer::start().await;
    server.script("/orders", [Fault::Reset, Fault::Problem409(CODE_KEY_REUSED)]);
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast().with_auto_key(AutoKey::GenerateTrusted)))
        .service(transport());
    let response = svc.oneshot(post(server.url("/orders"))).await.unwrap();
    assert_eq!(response.status(), StatusCode::CONFLICT);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(problem["code"], CODE_KEY_REUSED);
    assert_eq!(server.received("/orders").len(), 2);
}

#[tokio::test]
async fn storm_stops_at_the_cap_and_keeps_the_last_response() {
    let server = FaultServer::start().await;
    server.always("/storm", Fault::Status(503));
    let mut svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast()))
        .service(transport());
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(
            Request::get(server.url("/storm"))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.stop(), Stop::AttemptsExhausted);
    assert_eq!(err.attempts(), 3);
    assert_eq!(
        err.into_response().unwrap().status(),
        StatusCode::SERVICE_UNAVAILABLE
    );
}

/// A streaming body stand-in: cannot be replayed.
struct Stream(BoxBody<Bytes, Infallible>);

impl ReplayBody for Stream {
    fn try_clone_body(&self) -> Option<Self> {
        None
    }
}

impl http_body::Body for Stream {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::pin::Pin::new(&mut self.0).poll_frame(cx)
    }
}

#[tokio::test]
async fn bodies_that_cannot_be_cloned_are_sent_once() {
    let server = FaultServer::start().await;
    server.always("/upload", Fault::Status(503));
    let svc = ServiceBuilder::new()
        .layer(RetryLayer::new(fast()))
        .service(transport());
    let body = Stream(Full::new(Bytes::from_static(b"chunk")).boxed());
    let err = svc
        .oneshot(Request::put(server.url("/upload")).body(body).unwrap())
        .await
        .unwrap_err();
    assert_eq!(err.stop(), Stop::NotReplayable);
    assert_eq!(server.received("/upload").len(), 1);
}
