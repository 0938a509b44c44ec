//! The completer over a proxy's records (`idemkit keys complete`, or a
//! `Completer` over the proxy's router): a request the proxy claimed to
//! forward and whose answer it never stored (the process died after the
//! claim) is parked, never forwarded again, whether the upstream honours keys
//! or not. The proxy never stores the caller's credential, so the completer's
//! re-send could not be the caller's; before, the proxy answered it `401`
//! and the record stayed in flight, listed by every completer pass.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response, StatusCode};
use idemkit_core::{Account, ClaimOutcome, IdempotencyKey, KeyStore, Policy, RecordState, Scope};
use idemkit_engine::{Engine, Incoming, STORED_REQUEST_HEADERS, stored_request_headers};
use idemkit_proxy::{FORWARDED, ProxyOptions, ProxyServer, UpstreamError, UpstreamService};
use idemkit_testkit::{ManualClock, MemoryStore};
use idemkit_tower::Completer;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

const SECRET: &str = "completer test secret";
const CREDENTIAL: &str = "Bearer acct-1";

/// An upstream that counts its calls and answers `201`.
fn upstream(calls: Arc<AtomicU32>) -> UpstreamService {
    BoxCloneSyncService::new(tower::service_fn(move |_req: Request<Body>| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok::<_, UpstreamError>(
                Response::builder()
                    .status(StatusCode::CREATED)
                    .body(Body::from(r#"{"id":1}"#))
                    .expect("a response"),
            )
        }
    }))
}

fn request() -> Request<Body> {
    Request::post("/orders")
        .header("authorization", CREDENTIAL)
        .header("idempotency-key", "order-1")
        .header("content-type", "application/json")
        .body(Body::from(r#"{"item":"x"}"#))
        .expect("a request")
}

/// Claims `/orders` under `order-1` as the proxy does (the intent written
/// with the claim), and never finishes: the proxy died after its claim.
async fn claim_and_die(store: &Arc<dyn KeyStore>) -> Scope {
    let scope = Scope::new(
        Account::keyed(SECRET.as_bytes(), CREDENTIAL.as_bytes()),
        IdempotencyKey::parse("order-1").expect("a key"),
    );
    let engine =
        Engine::lease(store.clone(), Policy::new().with_lease(Duration::from_secs(1))).expect("an engine");
    let req = request();
    let mut claim = engine.claim_request(Incoming {
        scope: scope.clone(),
        method: "POST",
        target: "/orders",
        headers: stored_request_headers(req.headers(), STORED_REQUEST_HEADERS),
        body: br#"{"item":"x"}"#,
        resume: None,
    });
    claim.recovery_point = Some(FORWARDED.to_owned());
    assert!(matches!(
        store.claim(&claim).await.expect("the claim"),
        ClaimOutcome::Claimed(_)
    ));
    scope
}

async fn parks_an_abandoned_forward(honours_keys: bool) {
    let clock = Arc::new(ManualClock::new());
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));
    let calls = Arc::new(AtomicU32::new(0));
    let mut options = ProxyOptions::new("http://upstream.test", "unused://", SECRET);
    options.lease_ms = Some(1_000);
    options.upstream_honours_keys = honours_keys;
    let proxy = ProxyServer::in_process(options, store.clone(), upstream(calls.clone()))
        .await
        .expect("a proxy");
    let scope = claim_and_die(&store).await;
    clock.advance(Duration::from_secs(5));

    let report = Completer::new(store.clone(), proxy.router())
        .min_age(Duration::ZERO)
        .run_once()
        .await
        .expect("a completer pass");
    assert_eq!(report.found, 1, "the abandoned forward is listed");
    assert_eq!(report.parked, 1, "and parked: {report:?}");
    let record = store.get(&scope).await.expect("a read").expect("the record");
    assert_eq!(record.state, RecordState::Parked);
    assert_eq!(calls.load(Ordering::SeqCst), 0, "nothing was forwarded again");

    // The caller's own retry gets the parked answer, and nothing is forwarded.
    let res = proxy.router().oneshot(request()).await.expect("an answer");
    assert_eq!(res.status(), StatusCode::CONFLICT);
    let body = axum::body::to_bytes(res.into_body(), usize::MAX)
        .await
        .expect("a body");
    let doc: serde_json::Value = serde_json::from_slice(&body).expect("a problem document");
    assert_eq!(doc["code"], "idempotency_request_parked");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    // A second pass finds nothing left.
    let again = Completer::new(store.clone(), proxy.router())
        .min_age(Duration::ZERO)
        .run_once()
        .await
        .expect("a completer pass");
    assert_eq!(again.found, 0);
}

#[tokio::test]
async fn the_completer_parks_an_abandoned_forward_to_an_upstream_that_ignores_keys() {
    parks_an_abandoned_forward(false).await;
}

#[tokio::test]
async fn the_completer_parks_an_abandoned_forward_even_to_an_upstream_that_honours_keys() {
    parks_an_abandoned_forward(true).await;
}

/// The in-process form forwards to its service like the HTTP one, and
/// replays the stored answer.
#[tokio::test]
async fn an_in_process_proxy_forwards_once_and_replays() {
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::new());
    let calls = Arc::new(AtomicU32::new(0));
    let proxy = ProxyServer::in_process(
        ProxyOptions::new("http://upstream.test", "unused://", SECRET),
        store,
        upstream(calls.clone()),
    )
    .await
    .expect("a proxy");
    for replayed in [false, true] {
        let res = proxy.router().oneshot(request()).await.expect("an answer");
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(res.headers().contains_key("idempotent-replayed"), replayed);
    }
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}
