//! The in-process transport: the gates call a tower `Service` (an axum `Router`,
//! say) directly, with no socket, each request on its own tokio task so a burst
//! really runs at once.

use std::convert::Infallible;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower_service::Service;

use crate::{Answer, Request, Transport, TransportError};

/// Sends the gates' requests to an in-process tower service.
///
/// The request URLs keep their scheme and authority (any will do, e.g.
/// `http://app.test/orders`); the service sees the whole URI. Each request is
/// sent on a clone of the service, as a server would.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use idemkit_check::{CheckConfig, Gate, ServiceTransport, Template};
///
/// // Any `Service<http::Request<Full<Bytes>>>` that is `Clone`: here one that
/// // answers 201 to everything (no keys: the gates will find that out).
/// let svc = tower::service_fn(|_req: http::Request<http_body_util::Full<bytes::Bytes>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::builder().status(201).body(String::new()).unwrap())
/// });
/// let template = Template::new(http::Method::POST, "http://app.test/orders")
///     .with_body(br#"{"sku":"BOOK-1"}"#)
///     .unwrap();
/// let config = CheckConfig::new(template).with_gates(vec![Gate::Replay]);
/// let report = idemkit_check::run(&config, &ServiceTransport::new(svc), &()).await;
/// assert_ne!(report.exit_code(), 0); // a server that ignores keys never passes
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ServiceTransport<S> {
    service: S,
}

impl<S> ServiceTransport<S> {
    /// Wraps `service`.
    pub const fn new(service: S) -> Self {
        Self { service }
    }
}

#[async_trait]
impl<S, B> Transport for ServiceTransport<S>
where
    S: Service<http::Request<Full<Bytes>>, Response = http::Response<B>, Error = Infallible>
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: std::fmt::Display,
{
    async fn send(&self, request: Request) -> Result<Answer, TransportError> {
        let mut builder = http::Request::builder().method(request.method).uri(&request.url);
        if let Some(headers) = builder.headers_mut() {
            *headers = request.headers;
        }
        let req = builder
            .body(Full::new(Bytes::from(request.body)))
            .map_err(|e| TransportError(format!("building the request: {e}")))?;
        let mut service = self.service.clone();
        let task = tokio::spawn(async move {
            std::future::poll_fn(|cx| service.poll_ready(cx))
                .await
                .unwrap_or_else(|never| match never {});
            let response = service.call(req).await.unwrap_or_else(|never| match never {});
            let (parts, body) = response.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|e| TransportError(format!("reading the body: {e}")))?
                .to_bytes();
            Ok(Answer {
                status: parts.status.as_u16(),
                headers: parts.headers,
                body: body.to_vec(),
            })
        });
        task.await
            .map_err(|e| TransportError(format!("request task failed: {e}")))?
    }
}
