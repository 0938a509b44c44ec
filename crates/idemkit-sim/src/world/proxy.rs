//! The proxy's request path (`idemkit-proxy`, the library behind `idemkit
//! proxy`) on every instance, in front of one simulated upstream that
//! ignores keys: the trap the proxy exists for. Each instance's proxy keys
//! its writes on the instance's own instrumented store handle, so its claims,
//! heartbeats, stores, releases and parks are yield points like any other.
//!
//! The upstream acts (one effect per call, counted like the downstream that
//! ignores keys) and then answers `201` with the request's marker; with
//! faults on it may instead refuse before acting (the request never sent: a
//! stale pooled connection), act and lose its answer (a reset after the
//! request was sent), act and answer `503` (an upstream that committed and
//! then failed: the proxy must store that answer, never re-send), or take
//! 1–15 s (past the proxy's upstream timeout).

use std::sync::Arc;

use axum::body::Body;
use futures::FutureExt;
use http::{Request, Response, StatusCode};
use idemkit_core::KeyStore;
use idemkit_proxy::{ProxyOptions, ProxyServer, UpstreamError, UpstreamService};
use tower::util::BoxCloneSyncService;

use super::{Shared, Underway, item_of};

/// The proxy's scope secret: accounts are `HMAC-SHA256(secret, Authorization)`.
pub(super) const PROXY_SECRET: &str = "idemkit-sim proxy secret";

/// The paths the proxy serves (everything under it is forwarded upstream).
pub(super) const PROXY_ROUTE: &str = "/up/{*rest}";

/// The proxy's upstream timeout (virtual time).
const UPSTREAM_TIMEOUT_MS: u64 = 5_000;

/// The upstream: one API every instance's proxy forwards to.
fn upstream(shared: Arc<Shared>) -> UpstreamService {
    BoxCloneSyncService::new(tower::service_fn(move |req: Request<Body>| {
        let shared = shared.clone();
        async move {
            let key = req
                .headers()
                .get("idempotency-key")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            let body = axum::body::to_bytes(req.into_body(), usize::MAX)
                .await
                .map_err(|e| UpstreamError::MaybeSent(e.into()))?;
            let item = item_of(&body);
            if shared.sched.fault(|f| f.lost_answer) && shared.sched.with_rng(|r| r.chance(0.5)) {
                return Err(UpstreamError::NotSent(
                    "the pooled connection closed before the request was written".into(),
                ));
            }
            let underway = Underway::new(shared.clone(), item.clone());
            if shared.sched.fault(|f| f.slow) {
                let pause = shared.sched.with_rng(|r| r.millis(1000, 15000));
                tokio::time::sleep(pause).await;
            }
            let n = {
                let mut fx = shared.effects.lock().unwrap_or_else(|p| p.into_inner());
                let list = fx.ignoring.entry(item.clone()).or_default();
                list.push(key);
                list.len()
            };
            drop(underway);
            if shared.sched.fault(|f| f.lost_answer) {
                return Err(UpstreamError::MaybeSent(
                    "the connection reset after the request was sent".into(),
                ));
            }
            let (status, body) = if shared.sched.fault(|f| f.panic) {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    serde_json::json!({ "item": item, "error": "committed, then failed" }),
                )
            } else {
                (
                    StatusCode::CREATED,
                    serde_json::json!({ "item": item, "shipment": n }),
                )
            };
            Ok(Response::builder()
                .status(status)
                .header("content-type", "application/json")
                .body(Body::from(body.to_string()))
                .expect("a valid response"))
        }
    }))
}

/// An instance's proxy over its store handle, as a service to serve under
/// [`PROXY_ROUTE`] (boxed: axum refuses a `Router` there, and `nest` would
/// strip the prefix from the path the proxy records and the completer
/// resends). Its reaper starts on the schedule's runtime.
pub(super) fn service(
    store: Arc<dyn KeyStore>,
    shared: Arc<Shared>,
) -> BoxCloneSyncService<Request<Body>, axum::response::Response, std::convert::Infallible> {
    let mut options = ProxyOptions::new("http://upstream.sim", "memory://unused", PROXY_SECRET);
    options.lease_ms = Some(u64::try_from(super::LEASE.as_millis()).unwrap_or(6_000));
    options.upstream_timeout_ms = UPSTREAM_TIMEOUT_MS;
    // Its reaper passes are store calls like any other; a few per schedule.
    options.reap_interval_ms = 600_000;
    // With a store given, building awaits nothing.
    let proxy = ProxyServer::in_process(options, store, upstream(shared))
        .now_or_never()
        .expect("building an in-process proxy awaits nothing")
        .expect("valid proxy options");
    BoxCloneSyncService::new(proxy.router())
}
