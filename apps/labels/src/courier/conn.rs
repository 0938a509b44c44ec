//! The accept loop. Not `axum::serve`: `dropResponseAfterCommit` must close a
//! connection without answering after the commit, so each connection is served by
//! a hyper connection future this module owns, and dropping that future is what
//! closes the socket unanswered.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;
use tower::ServiceExt;

/// Put in every request's extensions: pulling it makes the connection task drop
/// the connection (no response is written, the socket closes).
#[derive(Clone, Debug)]
pub(crate) struct KillSwitch(Arc<Notify>);

impl KillSwitch {
    pub(crate) fn pull(&self) {
        // `notify_one` keeps a permit when nobody waits yet: the pull is never lost.
        self.0.notify_one();
    }
}

/// Serves `router` on `listener` until `shutdown` resolves, then stops accepting,
/// lets in-flight requests finish and closes idle connections.
pub(crate) async fn serve(router: Router, listener: TcpListener, shutdown: impl Future<Output = ()> + Send) {
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    conns.spawn(connection(router.clone(), stream, stop_rx.clone()));
                }
                Err(e) => accept_error(e).await,
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    drop(listener);
    let _ = stop_tx.send(true);
    while conns.join_next().await.is_some() {}
}

/// As `axum::serve` does: a failed handshake is the client's problem; anything
/// else (e.g. out of file descriptors) is waited out instead of spinning.
async fn accept_error(e: std::io::Error) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(e.kind(), ConnectionRefused | ConnectionAborted | ConnectionReset) {
        return;
    }
    tracing::warn!(error = %e, "courier: accept failed; retrying in 1 s");
    tokio::time::sleep(Duration::from_secs(1)).await;
}

async fn connection(router: Router, stream: TcpStream, mut stop: watch::Receiver<bool>) {
    let _ = stream.set_nodelay(true);
    let kill = KillSwitch(Arc::new(Notify::new()));
    let switch = kill.clone();
    let service = hyper::service::service_fn(move |mut req: http::Request<Incoming>| {
        req.extensions_mut().insert(switch.clone());
        router.clone().oneshot(req)
    });
    let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = conn.as_mut() => return,
            // Returning drops the connection future: the socket closes unanswered.
            () = kill.0.notified() => return,
            _ = stop.changed(), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}
