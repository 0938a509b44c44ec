//! Deadlines (issue 15) over real HTTP: the caller's `Request-Timeout` header
//! (milliseconds remaining) becomes the request's deadline. An expired one is
//! refused before the key is claimed; a live one reaches the handler and its
//! downstream calls, shrinking; single-step handlers are bounded by it, lease-mode
//! handlers are not cut short.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::scope;
use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::wire::REQUEST_TIMEOUT;
use idemkit_core::{KeyStore, Policy};
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_tower::{CallError, Downstream, IdempotencyContext, IdempotencyLayer, PhaseError, Phases, Tx};
use serde_json::{Value, json};

use super::{Answer, Runs, generic, rows, serve, sqlite};

async fn send(base: &str, key: &str, deadline: Option<&str>) -> Answer {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth("a")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}");
    if let Some(d) = deadline {
        req = req.header(REQUEST_TIMEOUT, d);
    }
    let res = req.send().await.unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap().to_vec(),
    }
}

fn micros(d: Option<Duration>) -> Value {
    d.map_or(Value::Null, |d| json!(d.as_micros() as u64))
}

fn remaining_of(a: &Answer, field: &str) -> Option<Duration> {
    a.json()[field].as_u64().map(Duration::from_micros)
}

/// A lease-mode route whose handler answers the time it was told it has left.
fn reporting(store: Arc<dyn KeyStore>, runs: Runs) -> Router {
    let layer = generic(store, Policy::new()).build().unwrap();
    Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>, ctx: IdempotencyContext| async move {
                runs.next();
                (
                    StatusCode::CREATED,
                    axum::Json(json!({ "remaining_us": micros(ctx.remaining()), "has_deadline": ctx.deadline.is_some() })),
                )
            })
            .layer(layer),
        )
        .with_state(runs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_deadline_is_refused_before_claiming_and_a_live_one_reaches_the_handler() {
    let store: Arc<dyn KeyStore> = Arc::new(idemkit_testkit::MemoryStore::new());
    let runs = Runs::default();
    let base = serve(reporting(store.clone(), runs.clone())).await;

    // Expired on arrival: 504 deadline_exceeded, not retryable, nothing ran,
    // nothing was written (the key was never claimed).
    let expired = send(&base, "dl-1", Some("0")).await;
    assert_eq!(expired.status, 504, "{:?}", expired.json());
    assert_eq!(expired.code(), "deadline_exceeded");
    assert_eq!(expired.json()["retryable"], false);
    assert!(expired.headers.get("retry-after").is_none());
    assert_eq!(runs.get(), 0);
    assert!(
        store.get(&scope("a", "dl-1")).await.unwrap().is_none(),
        "the key was claimed"
    );

    // A live deadline reaches the handler, no larger than what was sent.
    let sent = Duration::from_millis(2000);
    let live = send(&base, "dl-1", Some("2000")).await;
    assert_eq!(live.status, 201, "{:?}", live.json());
    let left = remaining_of(&live, "remaining_us").expect("the handler saw no deadline");
    assert!(left <= sent, "{left:?} > {sent:?}");
    assert!(left > Duration::from_millis(500), "only {left:?} of {sent:?}");
    assert_eq!(runs.get(), 1);
    assert!(store.get(&scope("a", "dl-1")).await.unwrap().is_some());

    // Its replay is the stored answer, whatever deadline the retry sends
    // (a replay costs no handler time).
    let replay = send(&base, "dl-1", Some("5")).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, live.body);
    assert_eq!(runs.get(), 1);

    // No header, or a malformed one (ignored), means no deadline.
    for (key, header) in [
        ("dl-2", None),
        ("dl-3", Some("1.5")),
        ("dl-4", Some("-1")),
        ("dl-5", Some("12345678901")),
    ] {
        let a = send(&base, key, header).await;
        assert_eq!(a.status, 201, "{header:?}");
        assert_eq!(a.json()["has_deadline"], false, "{header:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_call_gets_only_what_is_left() {
    let store = sqlite(None).await;
    let handed: Arc<Mutex<Vec<Option<Duration>>>> = Arc::default();
    let layer = IdempotencyLayer::lease(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .build()
    .unwrap();
    type Shared = (Arc<SqliteStore>, Arc<Mutex<Vec<Option<Duration>>>>);
    let app = Router::new()
        .route(
            "/op",
            post(
                |State((store, handed)): State<Shared>, ctx: IdempotencyContext| async move {
                    let before = ctx.remaining();
                    let mut phases = Phases::begin(store, &ctx).await?;
                    assert_eq!(phases.deadline(), ctx.deadline);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let given = phases
                        .external_with_deadline("courier", Downstream::HonoursKeys, async |_key, left| {
                            Ok::<_, CallError<StatusCode>>(left.map(|d| d.as_micros() as u64))
                        })
                        .await?;
                    handed.lock().unwrap().push(given.map(Duration::from_micros));
                    // The unchanged `external` still compiles and works.
                    phases
                        .external("ledger", Downstream::HonoursKeys, async |_key| {
                            Ok::<_, CallError<StatusCode>>(1u8)
                        })
                        .await?;
                    phases
                        .finish("done", async move |_tx| {
                            Ok((
                                StatusCode::CREATED,
                                axum::Json(json!({ "before_us": micros(before) })),
                            )
                                .into_response())
                        })
                        .await
                        .map_err(|e: PhaseError<StatusCode>| e)
                },
            )
            .layer(layer),
        )
        .with_state((store.clone(), handed.clone()));
    let base = serve(app).await;

    let a = send(&base, "ext-1", Some("2000")).await;
    assert_eq!(a.status, 201, "{:?}", a.json());
    let before = remaining_of(&a, "before_us").unwrap();
    let given = handed.lock().unwrap()[0].expect("the call got no deadline");
    assert!(before <= Duration::from_millis(2000));
    assert!(
        given + Duration::from_millis(50) <= before,
        "the call got {given:?}, the handler had {before:?} 50 ms earlier"
    );
    assert!(given > Duration::ZERO);

    // Without a deadline the call is told there is none.
    let b = send(&base, "ext-2", None).await;
    assert_eq!(b.status, 201);
    assert_eq!(handed.lock().unwrap()[1], None);
}

/// A single-step route whose handler writes a row, then takes `sleep`.
fn slow_tx_route(store: Arc<SqliteStore>, sleep: Duration) -> Router {
    let layer = IdempotencyLayer::single_step(store, idemkit_tower::BearerTokenAccount::new("test-secret"))
        .build()
        .unwrap();
    Router::new().route(
        "/op",
        post(move |ctx: IdempotencyContext, mut tx: Tx<SqliteTx>| async move {
            sqlx::query("INSERT INTO rows (account, n) VALUES (?1, 1)")
                .bind(ctx.scope.account.as_str().to_owned())
                .execute(&mut **tx)
                .await
                .unwrap();
            tokio::time::sleep(sleep).await;
            StatusCode::CREATED
        })
        .layer(layer),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_step_handler_is_bounded_by_the_deadline_and_rolls_back() {
    let store = sqlite(None).await;
    let base = serve(slow_tx_route(store.clone(), Duration::from_millis(400))).await;
    let a = send(&base, "tx-1", Some("100")).await;
    assert_eq!(a.status, 504, "{:?}", a.json());
    assert_eq!(a.code(), "deadline_exceeded");
    assert_eq!(rows(&store).await, 0, "the business write rolled back");
    assert!(
        store.get(&scope("a", "tx-1")).await.unwrap().is_none(),
        "the claim rolled back"
    );
    // With enough time the same key runs and commits.
    let b = send(&base, "tx-1", Some("5000")).await;
    assert_eq!(b.status, 201);
    assert_eq!(rows(&store).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_mode_handler_is_not_cut_short_and_its_answer_is_stored() {
    let store: Arc<dyn KeyStore> = Arc::new(idemkit_testkit::MemoryStore::new());
    let runs = Runs::default();
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, format!("run-{}", runs.next()))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let a = send(&base, "lease-1", Some("50")).await;
    assert_eq!(a.status, 201);
    assert_eq!(a.body, b"run-1");
    let again = send(&base, "lease-1", Some("50")).await;
    assert!(again.replayed());
    assert_eq!(again.body, b"run-1");
    assert_eq!(runs.get(), 1);
}
