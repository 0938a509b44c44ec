//! The gRPC path: the real tonic adapter (`idemkit-tonic`'s layer) in front
//! of a unary method whose handler runs the same [`Phases`](idemkit_tower::Phases)
//! steps as the REST `/pay` (a final phase, then the layer stores the reply),
//! and clients that call it through the real `idemkit-client` gRPC retry
//! policy (`GrpcRetryLayer`: retries by gRPC code, `grpc-timeout` per
//! attempt). In process: requests are `http::Request`s carrying gRPC frames,
//! served by the layer's tower service, no sockets.

use std::convert::Infallible;
use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures::FutureExt;
use http::uri::PathAndQuery;
use http::{HeaderMap, Request, Response};
use http_body_util::BodyExt;
use idemkit_client::GrpcRetryLayer;
use idemkit_core::{ErrorCode, TransactionalStore};
use idemkit_engine::IdempotencyContext;
use idemkit_tonic::{BearerTokenAccount, IdempotencyLayer};
use prost::Message;
use tonic::body::Body;
use tonic::{Code, Status};
use tonic_types::StatusExt;
use tower::util::BoxCloneSyncService;
use tower::{Layer, ServiceExt};

use super::{AppState, HandlerError, Spec, World, pay_steps};
use crate::adapter::ACCOUNT_SECRET;
use crate::check::Answer;

/// The simulated method.
pub(super) const PAY: &str = "/sim.v1.Sim/Pay";

/// An error from a boxed source.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An instance's gRPC server: the layer over the method's service.
pub(super) type GrpcServer = BoxCloneSyncService<Request<Body>, Response<Body>, Infallible>;

#[derive(Clone, PartialEq, prost::Message)]
struct PayRequest {
    #[prost(string, tag = "1")]
    item: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PayReply {
    /// The answer's fields as JSON, so the checker reads gRPC and REST
    /// answers alike.
    #[prost(string, tag = "1")]
    json: String,
}

/// The method's service (what `tonic-prost-build` would generate for it).
struct Method<St> {
    app: AppState<St>,
}

impl<St> Clone for Method<St> {
    fn clone(&self) -> Self {
        Self {
            app: self.app.clone(),
        }
    }
}

impl<St: TransactionalStore> tower::Service<Request<Body>> for Method<St> {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Response<Body>, Infallible>>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Infallible>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Body>) -> Self::Future {
        let app = self.app.clone();
        Box::pin(async move {
            let pay = tower::service_fn(move |req: tonic::Request<PayRequest>| {
                let app = app.clone();
                async move { pay(&app, req).await }
            });
            let mut grpc =
                tonic::server::Grpc::new(tonic_prost::ProstCodec::<PayReply, PayRequest>::default());
            Ok(grpc.unary(pay, req).await)
        })
    }
}

/// The handler: the phases, a last phase, the reply (the layer stores it).
async fn pay<St: TransactionalStore>(
    app: &AppState<St>,
    req: tonic::Request<PayRequest>,
) -> Result<tonic::Response<PayReply>, Status> {
    let ctx = req
        .extensions()
        .get::<IdempotencyContext>()
        .cloned()
        .ok_or_else(|| Status::internal("Pay runs behind the idempotency layer"))?;
    let item = req.into_inner().item;
    let mut steps = pay_steps(app, &ctx, item).await.map_err(unavailable)?;
    steps
        .phases
        .phase("done", async |_tx| Ok::<_, HandlerError>(()))
        .await
        .map_err(unavailable)?;
    Ok(tonic::Response::new(PayReply {
        json: steps.json().to_string(),
    }))
}

/// A failed step as the handler's status: `UNAVAILABLE` (retry with the same
/// key; the engine abandons a record with progress rather than free it).
fn unavailable(e: idemkit_tower::PhaseError<HandlerError>) -> Status {
    Status::unavailable(e.to_string())
}

/// An instance's gRPC server over its store handle.
pub(super) fn server<St: TransactionalStore>(app: AppState<St>) -> GrpcServer {
    let store: Arc<dyn idemkit_core::KeyStore> = app.store.clone();
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new(ACCOUNT_SECRET))
        .policy(super::policy())
        .unary(PAY)
        .build()
        .expect("a valid layer");
    BoxCloneSyncService::new(layer.layer(Method { app }))
}

/// The gRPC server as a route of the instance's router (axum bodies in and
/// out), which is how the completer reaches it.
pub(super) fn routable(
    server: GrpcServer,
) -> BoxCloneSyncService<Request<axum::body::Body>, axum::response::Response, Infallible> {
    BoxCloneSyncService::new(
        server
            .map_request(|req: Request<axum::body::Body>| req.map(Body::new))
            .map_response(|res: Response<Body>| res.map(axum::body::Body::new)),
    )
}

/// A gRPC frame (uncompressed) around `message`.
fn frame(message: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + message.len());
    out.put_u8(0);
    out.put_u32(u32::try_from(message.len()).expect("a small message"));
    out.put_slice(message);
    out.freeze()
}

/// The answer a gRPC exchange gives, in the checker's terms: `OK` as a
/// success whose body is the frames the layer stores (and replays
/// byte-identical) and whose view is the reply's JSON; a status as its
/// idemkit problem code (`google.rpc.ErrorInfo`) and that code's HTTP
/// status, or the handler's own `UNAVAILABLE` (503) and `INTERNAL` (500).
fn answer(
    spec: usize,
    headers: &HeaderMap,
    data: &Bytes,
    trailers: Option<&HeaderMap>,
    final_check: bool,
) -> Answer {
    let status = trailers
        .and_then(Status::from_header_map)
        .or_else(|| Status::from_header_map(headers));
    match status {
        None => Answer::hung_up(spec, final_check),
        Some(s) if s.code() == Code::Ok => {
            let json = data
                .get(5..)
                .and_then(|m| PayReply::decode(m).ok())
                .map(|r| r.json.into_bytes());
            Answer::grpc(spec, 201, None, data.to_vec(), json, final_check)
        }
        Some(s) => {
            let reason = s.get_error_details().error_info().map(|i| i.reason.clone());
            let http = match reason
                .as_ref()
                .and_then(|r| serde_json::from_value::<ErrorCode>(serde_json::Value::String(r.clone())).ok())
            {
                Some(code) => code.default_status(),
                None => match s.code() {
                    Code::Unavailable => 503,
                    Code::Internal | Code::Unknown => 500,
                    // The client's own deadline or a cancelled call.
                    Code::DeadlineExceeded | Code::Cancelled => 0,
                    _ => 400,
                },
            };
            let body = serde_json::json!({ "code": reason, "grpc": s.code() as i32, "message": s.message() });
            Answer::grpc(
                spec,
                http,
                reason,
                body.to_string().into_bytes(),
                None,
                final_check,
            )
        }
    }
}

/// Reads a response whole: its head, its data frames, its trailers.
async fn read(res: Response<Body>) -> Result<(http::response::Parts, Bytes, Option<HeaderMap>), BoxError> {
    let (parts, body) = res.into_parts();
    let collected = body.collect().await?;
    let trailers = collected.trailers().cloned();
    Ok((parts, collected.to_bytes(), trailers))
}

/// The same response, rebuilt from what was read.
fn rebuild(parts: http::response::Parts, data: Bytes, trailers: Option<HeaderMap>) -> Response<Body> {
    let mut frames = vec![Ok::<_, Infallible>(http_body::Frame::data(data))];
    if let Some(t) = trailers {
        frames.push(Ok(http_body::Frame::trailers(t)));
    }
    let body = http_body_util::StreamBody::new(futures::stream::iter(frames));
    Response::from_parts(parts, Body::new(body))
}

impl World {
    /// One gRPC attempt at a live instance: the answer it gave, and the
    /// response to hand back. An instance that crashes under it resets the
    /// connection.
    async fn grpc_attempt(
        &self,
        spec: usize,
        req: Request<Body>,
        final_check: bool,
    ) -> (Answer, io::Result<Response<Body>>) {
        let inst = self.live();
        let call = async {
            let res = inst.grpc.clone().oneshot(req).await.expect("infallible server");
            read(res).await
        };
        match std::panic::AssertUnwindSafe(call).catch_unwind().await {
            Ok(Ok((parts, data, trailers))) => (
                answer(spec, &parts.headers, &data, trailers.as_ref(), final_check),
                Ok(rebuild(parts, data, trailers)),
            ),
            Ok(Err(e)) => (Answer::hung_up(spec, final_check), Err(io::Error::other(e))),
            Err(_) => (
                Answer::hung_up(spec, final_check),
                Err(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "the instance crashed",
                )),
            ),
        }
    }

    /// A gRPC client's call through the real gRPC retry policy.
    pub(super) async fn grpc_client(self: Arc<Self>, spec: Spec) {
        let policy = self.retry_policy(|config| config);
        let world = self.clone();
        let id = spec.id;
        let transport = tower::service_fn(move |req: Request<Body>| {
            let world = world.clone();
            async move {
                let (answer, res) = world.grpc_attempt(id, req, false).await;
                world.record(answer);
                res
            }
        });
        let service = GrpcRetryLayer::new(policy)
            .with_unary_method(PAY)
            .layer(transport);
        let mut grpc = tonic::client::Grpc::new(service);
        let outcome = match grpc.ready().await {
            Ok(()) => {
                let mut req = tonic::Request::new(PayRequest {
                    item: spec.item.to_owned(),
                });
                let md = req.metadata_mut();
                md.insert(
                    "authorization",
                    format!("Bearer {}", spec.account).parse().expect("ascii"),
                );
                md.insert("idempotency-key", spec.key.parse().expect("ascii"));
                grpc.unary(
                    req,
                    PathAndQuery::from_static(PAY),
                    tonic_prost::ProstCodec::default(),
                )
                .await
                .map(|r: tonic::Response<PayReply>| r.into_inner().json)
            }
            Err(e) => Err(Status::unavailable(e.to_string())),
        };
        self.sched.note(|| format!("grpc client {id}: {outcome:?}"));
    }

    /// One gRPC call with a minute to answer, no retries (the final checks).
    pub(super) async fn grpc_final(&self, spec: &Spec) -> Answer {
        let message = PayRequest {
            item: spec.item.to_owned(),
        }
        .encode_to_vec();
        let req = Request::post(PAY)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .header("authorization", format!("Bearer {}", spec.account))
            .header("idempotency-key", spec.key)
            .header("grpc-timeout", "60S")
            .body(Body::new(http_body_util::Full::new(frame(&message))))
            .expect("a valid request");
        let answer = match tokio::time::timeout(
            Duration::from_secs(60),
            self.grpc_attempt(spec.id, req, true),
        )
        .await
        {
            Ok((answer, _)) => answer,
            Err(_) => Answer::hung_up(spec.id, true),
        };
        self.record(answer.clone());
        answer
    }
}
