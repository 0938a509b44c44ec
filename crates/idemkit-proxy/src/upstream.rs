//! Where forwards go: the upstream over HTTP (hyper's pooled client), or a
//! service in the same process (tests and simulators, [`UpstreamService`]).

use std::error::Error as StdError;

use axum::body::Body;
use http::{Request, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

/// An error from a boxed source.
type BoxError = Box<dyn StdError + Send + Sync>;

/// An upstream served in the same process, in place of an HTTP URL
/// ([`ProxyServer::in_process`](crate::ProxyServer::in_process)): what a test
/// or a simulator puts behind the proxy. It is called with the request the
/// proxy would send over HTTP (the upstream URL's authority in its URI, the
/// hop-by-hop headers removed, the forwarding headers added).
pub type UpstreamService = BoxCloneSyncService<Request<Body>, Response<Body>, UpstreamError>;

/// Why a forward got no answer, split by what the proxy may conclude.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UpstreamError {
    /// No byte of the request reached the upstream (it could not be
    /// reached, or a pooled connection closed before the request was
    /// written): it did not run, and the key is free again.
    #[error("{0}")]
    NotSent(#[source] BoxError),
    /// The request was sent, or may have been, and no answer came (a reset,
    /// a body that failed part-way): the upstream may have run it.
    #[error("{0}")]
    MaybeSent(#[source] BoxError),
}

impl UpstreamError {
    /// Whether the upstream certainly never saw the request.
    pub fn not_sent(&self) -> bool {
        matches!(self, Self::NotSent(_))
    }

    /// hyper's error, split: a connect error, or a request hyper reports it
    /// never sent (the connection it was queued on closed first), is not sent.
    fn from_hyper(e: hyper_util::client::legacy::Error) -> Self {
        if e.is_connect() || canceled_before_sending(&e) {
            Self::NotSent(Box::new(e))
        } else {
            Self::MaybeSent(Box::new(e))
        }
    }
}

/// Whether hyper reports `e` as a request it never sent.
fn canceled_before_sending(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = StdError::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<hyper::Error>() {
            return h.is_canceled();
        }
        source = s.source();
    }
    false
}

/// The proxy's upstream.
pub(crate) enum Upstream {
    /// Over HTTP (or HTTPS). Boxed: the client is large, and the proxy
    /// holds one.
    Http(Box<Client<hyper_rustls::HttpsConnector<HttpConnector>, Body>>),
    /// In process.
    Service(UpstreamService),
}

impl Upstream {
    /// Sends `req`, streaming both bodies.
    pub(crate) async fn send(&self, req: Request<Body>) -> Result<Response<Body>, UpstreamError> {
        match self {
            Self::Http(client) => client
                .request(req)
                .await
                .map(|res| res.map(Body::new))
                .map_err(UpstreamError::from_hyper),
            Self::Service(service) => service.clone().oneshot(req).await,
        }
    }
}
