//! The proxy's listener: hyper's connection builder with a header-read timer
//! (which also closes idle keep-alive connections), a cap on connections, the
//! client's address for the forwarding headers, and a graceful stop on
//! SIGTERM or SIGINT that lets in-flight forwards finish and store.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;

/// What bounds each client connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct Limits {
    /// Time to send a request head; also how long an idle keep-alive
    /// connection stays open (hyper starts the timer when it waits for a head).
    pub header_read_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// How long a stop waits for in-flight work (forwards and their stores).
    pub shutdown_grace: Duration,
}

impl Limits {
    /// The limits `options` set.
    pub(super) fn of(options: &super::ProxyOptions) -> Self {
        Self {
            header_read_timeout: Duration::from_millis(options.header_read_timeout_ms),
            max_connections: options.max_connections,
            shutdown_grace: Duration::from_millis(options.upstream_timeout_ms)
                + Duration::from_millis(if options.upstream_honours_keys {
                    options.timeout_grace_ms
                } else {
                    0
                })
                + super::STORE_MARGIN,
        }
    }
}

/// Work that must finish before the process exits: detached forwards and the
/// background writes of their answers.
#[derive(Debug, Default)]
pub(super) struct Tracker {
    running: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// Held by one piece of tracked work; dropped when it ends.
pub(super) struct Tracked(Arc<Tracker>);

impl Drop for Tracked {
    fn drop(&mut self) {
        if self.0.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Tracker {
    pub(super) fn track(self: &Arc<Self>) -> Tracked {
        self.running.fetch_add(1, Ordering::AcqRel);
        Tracked(self.clone())
    }

    /// Spawns `work`, tracked.
    pub(super) fn spawn(self: &Arc<Self>, work: impl Future<Output = ()> + Send + 'static) {
        let guard = self.track();
        tokio::spawn(async move {
            work.await;
            drop(guard);
        });
    }

    /// Resolves once no tracked work runs.
    pub(super) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.running.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Resolves on SIGTERM or SIGINT (Ctrl-C only, off Unix): the shutdown
/// future `idemkit proxy` hands to [`serve`](crate::serve).
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The most a connection's read buffer grows to (hyper's default is about
/// 400 KiB): a body streams through it in frames of at most this size, so
/// hundreds of connections sending large bodies at once hold a bounded
/// amount each. Also the cap on a request's head (larger is refused `431`).
const READ_BUFFER: usize = 64 << 10;

/// Serves `app` on `listener` until `stop`; then stops accepting, lets open
/// requests and `tracker`'s work finish (within `limits.shutdown_grace`) and
/// returns.
pub(super) async fn serve(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    tracker: Arc<Tracker>,
    stop: impl Future<Output = ()>,
) {
    let permits = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_buf_size(READ_BUFFER);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.header_read_timeout))
        .keep_alive_timeout(limits.header_read_timeout);
    tokio::pin!(stop);
    loop {
        // At the cap, the next connection waits in the listen backlog.
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            () = &mut stop => break,
        };
        let (tcp, remote) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, do not spin.
                    tracing::warn!(error = %e, "proxy: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut stop => break,
        };
        // Both directions stream: no Nagle delay on a chunk written while the
        // previous one is unacknowledged.
        let _ = tcp.set_nodelay(true);
        let svc = tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(ConnectInfo(remote));
                req
            },
        );
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(tcp), TowerToHyperService::new(svc))
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
            drop(permit);
        });
    }
    drop(listener);
    tracing::info!("proxy: stopping; finishing the requests in flight");
    let drained = tokio::time::timeout(limits.shutdown_grace, async {
        graceful.shutdown().await;
        tracker.idle().await;
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            "proxy: stopped with work still in flight after {:?}; its records are taken over after their lease",
            limits.shutdown_grace
        );
    }
}

/// The client's address, when the listener recorded it.
pub(super) fn client_addr(ext: &http::Extensions) -> Option<SocketAddr> {
    ext.get::<ConnectInfo<SocketAddr>>().map(|c| c.0)
}
