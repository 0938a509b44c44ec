//! The layer over real HTTP on loopback: in-process axum servers, real clients,
//! real concurrency, SQLite and in-memory stores.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http::{HeaderName, StatusCode, header};
use idemkit_core::{
    InFlightBehavior, KeyStore, MismatchStatus, Policy, ServerErrorPolicy, StoreError, TransactionalStore,
};
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::{ManualClock, MemoryStore};
use idemkit_tower::{
    BearerTokenAccount, ConfigError, IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, Json,
    Outcome, Reaper, Tx,
};
use serde_json::{Value, json};

/// Serves `app` on a free loopback port; the server lives until the test ends.
async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

#[derive(Debug)]
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

async fn send(base: &str, key: Option<&str>, account: &str, body: &Value) -> Answer {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth(account)
        .header("content-type", "application/json")
        .body(body.to_string());
    if let Some(key) = key {
        req = req.header("idempotency-key", key);
    }
    let res = req.send().await.unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap().to_vec(),
    }
}

#[derive(Clone, Default)]
struct Runs(Arc<AtomicUsize>);

impl Runs {
    fn next(&self) -> usize {
        self.0.fetch_add(1, Ordering::SeqCst) + 1
    }
    fn get(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

fn memory() -> Arc<dyn KeyStore> {
    Arc::new(MemoryStore::new())
}

fn generic(store: Arc<dyn KeyStore>, policy: Policy) -> IdempotencyLayerBuilder {
    IdempotencyLayer::builder(store)
        .policy(policy)
        .resolver(BearerTokenAccount)
}

/// A route whose handler counts its runs and answers with `f(run)`.
fn counting<F>(layer: IdempotencyLayer, runs: Runs, f: F) -> Router
where
    F: Fn(usize) -> Response + Clone + Send + Sync + 'static,
{
    Router::new()
        .route(
            "/op",
            post(move |State(runs): State<Runs>| {
                let f = f.clone();
                async move { f(runs.next()) }
            })
            .layer(layer),
        )
        .with_state(runs)
}

#[tokio::test]
async fn replays_never_carry_cookies_or_unlisted_headers() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_replayed_header("x-allowed"))
        .build()
        .unwrap();
    let app = counting(layer, runs.clone(), |n| {
        (
            StatusCode::CREATED,
            [
                (header::SET_COOKIE, "session=abc".to_owned()),
                (HeaderName::from_static("x-allowed"), format!("run-{n}")),
                (HeaderName::from_static("x-unlisted"), "no".to_owned()),
                (header::CONTENT_TYPE, "application/json".to_owned()),
            ],
            format!("{{\"run\":{n}}}"),
        )
            .into_response()
    });
    let base = serve(app).await;
    let first = send(&base, Some("k"), "a", &json!({})).await;
    assert_eq!(first.status, 201);
    assert!(
        first.headers.get("set-cookie").is_some(),
        "the original keeps its cookie"
    );
    let replay = send(&base, Some("k"), "a", &json!({})).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert!(replay.headers.get("set-cookie").is_none(), "cookie replayed");
    assert!(replay.headers.get("x-unlisted").is_none());
    assert_eq!(replay.headers["x-allowed"], "run-1");
    assert_eq!(replay.headers["content-type"], "application/json");
    assert_eq!(runs.get(), 1);
}

async fn sqlite(clock: Option<Arc<ManualClock>>) -> Arc<SqliteStore> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-tower-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut store = SqliteStore::open(dir.join("t.db")).await.unwrap();
    if let Some(clock) = clock {
        store = store.with_clock(clock);
    }
    sqlx::query("CREATE TABLE rows (account TEXT NOT NULL, n INTEGER NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    Arc::new(store)
}

async fn rows(store: &SqliteStore) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM rows")
        .fetch_one(store.pool())
        .await
        .unwrap()
}

/// A single-step route that inserts a row and answers `size` bytes.
fn tx_route(store: Arc<SqliteStore>, policy: Policy, size: usize) -> Router {
    let layer = IdempotencyLayer::transactional(store)
        .policy(policy)
        .resolver(BearerTokenAccount)
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
            (StatusCode::CREATED, "x".repeat(size))
        })
        .layer(layer),
    )
}

#[tokio::test]
async fn response_too_large_to_store_rolls_everything_back() {
    let store = sqlite(None).await;
    let base = serve(tx_route(
        store.clone(),
        Policy::new().with_max_stored_body(1024),
        1025,
    ))
    .await;
    let a = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(a.status, 500);
    assert_eq!(a.code(), "idempotency_response_too_large");
    assert_eq!(a.json()["retryable"], false);
    assert_eq!(rows(&store).await, 0, "business write rolled back");
    let scope = idemkit_testkit::suite::scope("a", "big");
    assert!(store.get(&scope).await.unwrap().is_none(), "claim rolled back");
    // Exactly at the cap is fine.
    let base = serve(tx_route(
        store.clone(),
        Policy::new().with_max_stored_body(1024),
        1024,
    ))
    .await;
    let ok = send(&base, Some("fits"), "a", &json!({})).await;
    assert_eq!(ok.status, 201);
    assert_eq!(ok.body.len(), 1024);
    assert_eq!(send(&base, Some("fits"), "a", &json!({})).await.body, ok.body);
    assert_eq!(rows(&store).await, 1);
}

#[tokio::test]
async fn too_large_in_lease_mode_answers_the_same_failure_every_time() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_max_stored_body(10))
        .build()
        .unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        (StatusCode::OK, "x".repeat(11)).into_response()
    }))
    .await;
    let a = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (500, "idempotency_response_too_large")
    );
    let b = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(b.status, 500);
    assert!(b.replayed());
    assert_eq!(runs.get(), 1, "the handler's effects are not repeated");
}

#[tokio::test]
async fn key_reuse_after_the_replay_window_is_a_new_request() {
    let clock = Arc::new(ManualClock::new());
    let store = sqlite(Some(clock.clone())).await;
    let window = Duration::from_secs(3600);
    let policy = Policy::new()
        .with_replay_window(window)
        .with_reap_threshold(window * 3);
    let base = serve(tx_route(store.clone(), policy, 4)).await;
    assert_eq!(send(&base, Some("w"), "a", &json!({})).await.status, 201);
    clock.advance(window - Duration::from_secs(1));
    assert!(send(&base, Some("w"), "a", &json!({})).await.replayed());
    assert_eq!(rows(&store).await, 1);
    clock.advance(Duration::from_secs(2));
    let later = send(&base, Some("w"), "a", &json!({"changed": true})).await;
    assert_eq!(later.status, 201);
    assert!(!later.replayed());
    assert_eq!(rows(&store).await, 2);
}

/// A slow handler's heartbeat keeps its lease alive far past the lease length,
/// so a duplicate gets 409 in progress instead of taking over.
#[tokio::test]
async fn heartbeat_keeps_a_slow_handler_from_being_taken_over() {
    let runs = Runs::default();
    let store: Arc<dyn KeyStore> = Arc::new(SqliteStore::open(tempfile("hb")).await.unwrap());
    let layer = generic(store, Policy::new().with_lease(Duration::from_millis(300)))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                (StatusCode::CREATED, format!("run {n}"))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("slow"), "a", &json!({})).await }
    });
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let dup = send(&base, Some("slow"), "a", &json!({})).await;
        assert_eq!(dup.status, 409, "{dup:?}");
        assert_eq!(dup.code(), "idempotency_request_in_progress");
        assert!(dup.headers.get("retry-after").is_some());
    }
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = send(&base, Some("slow"), "a", &json!({})).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.get(), 1);
}

fn tempfile(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-tower-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("keys.db")
}

/// A holder whose lease was taken over cannot complete: it gets
/// `503 idempotency_lease_lost`, and every retry sees the new holder's response.
#[tokio::test]
async fn a_holder_that_lost_its_lease_cannot_complete() {
    let clock = Arc::new(ManualClock::new());
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let gate = Arc::new(tokio::sync::Notify::new());
    let runs = Runs::default();
    let layer = generic(store, Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post({
                let gate = gate.clone();
                move |State(runs): State<Runs>| async move {
                    let n = runs.next();
                    if n == 1 {
                        gate.notified().await; // A stalls (a GC pause, a stuck call …)
                    }
                    (StatusCode::CREATED, format!("holder {n}"))
                }
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let a = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("fence"), "a", &json!({})).await }
    });
    while runs.get() < 1 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clock.advance(Duration::from_secs(31)); // A's 30 s lease expires, no heartbeat landed
    let b = send(&base, Some("fence"), "a", &json!({})).await;
    assert_eq!((b.status, b.body.as_slice()), (201, b"holder 2".as_slice()));
    gate.notify_one();
    let a = a.await.unwrap();
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(a.code(), "idempotency_lease_lost");
    assert_eq!(a.json()["retryable"], true);
    let c = send(&base, Some("fence"), "a", &json!({})).await;
    assert!(c.replayed());
    assert_eq!(c.body, b"holder 2");
}

#[tokio::test]
async fn wait_mode_hands_duplicates_the_winners_response() {
    let runs = Runs::default();
    let layer = generic(
        memory(),
        Policy::new().with_in_flight(InFlightBehavior::Wait(Duration::from_secs(5))),
    )
    .build()
    .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, format!("run {n}"))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let empty = json!({});
    let started = std::time::Instant::now();
    let answers = futures::future::join_all((0..8).map(|_| async {
        let answer = send(&base, Some("wait"), "a", &empty).await;
        (answer, started.elapsed())
    }))
    .await;
    assert!(
        answers.iter().all(|(a, _)| a.status == 201 && a.body == b"run 1"),
        "{answers:?}"
    );
    assert_eq!(answers.iter().filter(|(a, _)| a.replayed()).count(), 7);
    assert_eq!(runs.get(), 1);
    // Every duplicate waited for the winner: none was answered before the
    // winner's 300 ms handler finished (a duplicate answered early would be a
    // 409 or a second run, but a wait that returns at once must not pass either).
    for (a, elapsed) in &answers {
        assert!(
            *elapsed >= Duration::from_millis(300),
            "answered after {elapsed:?}, before the winner finished: {a:?}"
        );
        assert!(
            *elapsed < Duration::from_secs(5),
            "within the wait bound: {elapsed:?}"
        );
    }
}

#[tokio::test]
async fn wait_mode_is_bounded_then_409() {
    let layer = generic(
        memory(),
        Policy::new().with_in_flight(InFlightBehavior::Wait(Duration::from_millis(200))),
    )
    .build()
    .unwrap();
    let app = Router::new().route(
        "/op",
        post(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            StatusCode::CREATED
        })
        .layer(layer),
    );
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("bounded"), "a", &json!({})).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let dup = send(&base, Some("bounded"), "a", &json!({})).await;
    let waited = started.elapsed();
    assert_eq!(dup.code(), "idempotency_request_in_progress");
    // It waited its whole bound (200 ms) for the holder, then gave up long
    // before the holder's 1.5 s handler finished.
    assert!(
        waited >= Duration::from_millis(200),
        "answered after {waited:?}, without waiting its 200 ms"
    );
    assert!(waited < Duration::from_millis(1200), "waited {waited:?}");
    assert_eq!(slow.await.unwrap().status, 201);
}

#[tokio::test]
async fn mismatch_status_is_configurable_to_422() {
    let layer = generic(
        memory(),
        Policy::new().with_mismatch_status(MismatchStatus::UnprocessableContent),
    )
    .build()
    .unwrap();
    let base = serve(counting(layer, Runs::default(), |_| {
        StatusCode::CREATED.into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("m"), "a", &json!({"n": 1})).await.status, 201);
    let other = send(&base, Some("m"), "a", &json!({"n": 2})).await;
    assert_eq!(
        (other.status, other.code().as_str()),
        (422, "idempotency_key_reused")
    );
}

#[tokio::test]
async fn key_can_come_from_a_json_body_field() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new())
        .key_json_field("/idempotencyKey")
        .build()
        .unwrap();
    let base = serve(counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("run {n}")).into_response()
    }))
    .await;
    let first = send(
        &base,
        None,
        "a",
        &json!({"idempotencyKey": "body-k", "x": 1, "y": 2}),
    )
    .await;
    assert_eq!(first.status, 201);
    let again = send(
        &base,
        None,
        "a",
        &json!({"y": 2, "x": 1, "idempotencyKey": "body-k"}),
    )
    .await;
    assert!(again.replayed());
    let changed = send(
        &base,
        None,
        "a",
        &json!({"idempotencyKey": "body-k", "x": 9, "y": 2}),
    )
    .await;
    assert_eq!(changed.code(), "idempotency_key_reused");
    assert_eq!(
        send(&base, None, "a", &json!({"x": 1})).await.code(),
        "idempotency_key_missing"
    );
    assert_eq!(
        send(&base, None, "a", &json!({"idempotencyKey": 7})).await.code(),
        "idempotency_key_invalid"
    );
    assert_eq!(
        send(&base, None, "a", &json!({"idempotencyKey": "a b"}))
            .await
            .code(),
        "idempotency_key_invalid"
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn five_hundreds_are_released_by_default_and_replayed_on_request() {
    // The defaults, untouched: `Policy::new()`, and a route of a configuration
    // file that says nothing about server errors.
    let config =
        idemkit_tower::config::IdemkitConfig::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"/op\"\n")
            .unwrap();
    let route = config.route("POST", "/op").unwrap();
    let layers = [
        ("Policy::new()", generic(memory(), Policy::new()), false),
        (
            "the default configuration",
            route.configure(generic(memory(), Policy::new())).unwrap(),
            false,
        ),
        (
            "ServerErrorPolicy::Replay",
            generic(
                memory(),
                Policy::new().with_server_error_policy(ServerErrorPolicy::Replay),
            ),
            true,
        ),
    ];
    for (what, builder, replays) in layers {
        let runs = Runs::default();
        let base = serve(counting(builder.build().unwrap(), runs.clone(), |_| {
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }))
        .await;
        assert_eq!(
            send(&base, Some("e"), "a", &json!({})).await.status,
            500,
            "{what}"
        );
        let second = send(&base, Some("e"), "a", &json!({})).await;
        assert_eq!(second.status, 500, "{what}");
        assert_eq!(second.replayed(), replays, "{what}");
        // Released: the retry ran the handler again; replayed: it did not.
        assert_eq!(runs.get(), if replays { 1 } else { 2 }, "{what}");
    }
}

#[tokio::test]
async fn handler_can_mark_an_outcome_retryable_or_final() {
    // Retryable: not stored, lease ended at once: the retry runs without a 409.
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let base = serve(counting(layer, runs.clone(), |n| {
        if n == 1 {
            (StatusCode::BAD_GATEWAY, Outcome::Retryable, "courier timed out").into_response()
        } else {
            (StatusCode::CREATED, "label").into_response()
        }
    }))
    .await;
    assert_eq!(send(&base, Some("r"), "a", &json!({})).await.status, 502);
    let second = send(&base, Some("r"), "a", &json!({})).await;
    assert_eq!((second.status, second.replayed()), (201, false));
    assert_eq!(runs.get(), 2);

    // Final: a 502 is stored and replayed.
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        (StatusCode::BAD_GATEWAY, Outcome::Final, "address rejected").into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("f"), "a", &json!({})).await.status, 502);
    let again = send(&base, Some("f"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (502, true));
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn replay_status_override_and_safe_methods_pass_through() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_replay_status(200))
        .build()
        .unwrap();
    let app = counting(layer.clone(), runs.clone(), |_| {
        (StatusCode::CREATED, "made").into_response()
    })
    .route("/read", get(|| async { "no key needed" }).layer(layer));
    let base = serve(app).await;
    assert_eq!(send(&base, Some("s"), "a", &json!({})).await.status, 201);
    let replay = send(&base, Some("s"), "a", &json!({})).await;
    assert_eq!((replay.status, replay.body.as_slice()), (200, b"made".as_slice()));
    let read = reqwest::get(format!("{base}/read")).await.unwrap();
    assert_eq!(read.status(), 200);
}

#[tokio::test]
async fn configuration_is_validated_and_unscoped_is_explicit() {
    let err = IdempotencyLayer::builder(memory()).build().unwrap_err();
    assert!(matches!(err, ConfigError::NoResolver), "{err}");
    let err = IdempotencyLayer::builder(memory())
        .unscoped()
        .policy(
            Policy::new()
                .with_replay_window(Duration::from_secs(60))
                .with_longest_retry_chain(Duration::from_secs(600)),
        )
        .build()
        .unwrap_err();
    assert!(matches!(err, ConfigError::Policy(_)), "{err}");
    assert!(
        IdempotencyLayer::builder(memory())
            .unscoped()
            .key_json_field("nope")
            .build()
            .is_err()
    );

    // Unscoped on purpose: two callers share one key space.
    let runs = Runs::default();
    let layer = IdempotencyLayer::builder(memory()).unscoped().build().unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        StatusCode::CREATED.into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("u"), "alice", &json!({})).await.status, 201);
    assert!(send(&base, Some("u"), "bob", &json!({})).await.replayed());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn json_extractor_rejections_are_problems() {
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        n: u32,
    }
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let app = Router::new().route(
        "/op",
        post(|Json(_b): Json<Body>| async { StatusCode::CREATED }).layer(layer),
    );
    let base = serve(app).await;
    let shape = send(&base, Some("j1"), "a", &json!({"n": "x"})).await;
    assert_eq!((shape.status, shape.code().as_str()), (400, "validation_failed"));
    assert_eq!(shape.headers["content-type"], "application/problem+json");
    // The validation error released the key: the fixed body may reuse it.
    assert_eq!(send(&base, Some("j1"), "a", &json!({"n": 1})).await.status, 201);
    let no_ct = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth("a")
        .header("idempotency-key", "j2")
        .body("{\"n\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(no_ct.status(), 415);
    assert_eq!(no_ct.headers()["content-type"], "application/problem+json");
}

/// 64 concurrent single-step requests through the layer on SQLite: one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn single_step_concurrency_gate_on_sqlite() {
    let store = sqlite(None).await;
    let base = serve(tx_route(store.clone(), Policy::new(), 8)).await;
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let answers = futures::future::join_all((0..64).map(|_| {
        let (base, barrier) = (base.clone(), barrier.clone());
        async move {
            barrier.wait().await;
            send(&base, Some("gate"), "a", &json!({"same": true})).await
        }
    }))
    .await;
    assert!(
        answers
            .iter()
            .all(|a| a.status == 201 || a.code() == "idempotency_request_in_progress")
    );
    assert_eq!(
        answers
            .iter()
            .filter(|a| a.status == 201 && !a.replayed())
            .count(),
        1
    );
    assert_eq!(rows(&store).await, 1);
}

/// The store's transactional extension is usable through `Arc<dyn …>` bounds too.
#[allow(dead_code)]
fn _tx_store_is_usable(s: Arc<SqliteStore>) -> Arc<dyn KeyStore> {
    fn takes<S: TransactionalStore>(_: &S) {}
    takes(&*s);
    let _: fn(StoreError) -> bool = |e| e.is_retryable();
    s
}

mod crash;
mod deadlines;
mod hardening;
mod metrics;
mod replay_cache;
mod roundtrips;

/// In-flight = accepted: a duplicate of a running request gets `202` with a status
/// URL; `GET` on it answers in progress, then the stored response.
#[tokio::test]
async fn accepted_mode_hands_out_a_status_url() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_in_flight(InFlightBehavior::Accepted))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(600)).await;
                (StatusCode::CREATED, format!("made {n}"))
            })
            .layer(layer.clone()),
        )
        .merge(layer.status_router())
        .with_state(runs.clone());
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("long/job#1"), "a", &json!({})).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dup = send(&base, Some("long/job#1"), "a", &json!({})).await;
    assert_eq!(dup.status, 202, "{dup:?}");
    let location = dup.headers["location"].to_str().unwrap().to_owned();
    assert_eq!(location, "/idempotency/requests/long%2Fjob%231");
    let status_url = format!("{base}{location}");
    let client = reqwest::Client::new();
    let pending = client.get(&status_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(pending.status(), 202);
    assert_eq!(pending.json::<Value>().await.unwrap()["status"], "in_progress");
    // Another account cannot see it.
    assert_eq!(
        client
            .get(&status_url)
            .bearer_auth("b")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(slow.await.unwrap().status, 201);
    let done = client.get(&status_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(done.status(), 201);
    assert!(done.headers().get("idempotent-replayed").is_some());
    assert_eq!(done.text().await.unwrap(), "made 1");
    assert_eq!(runs.get(), 1);
}

/// The reaper deletes what is past the threshold and keeps never-completed
/// requests in the store's review list, with where they got to.
#[tokio::test]
async fn reaper_deletes_old_records_and_keeps_unfinished_ones_for_review() {
    use idemkit_core::PhaseUpdate;
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
    let clock = Arc::new(ManualClock::new());
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));
    let done = scope("a", "old-done");
    let lease = must_claim(&*store, &claim_req(&done, "{}")).await;
    store
        .complete(&done, lease.token, &response(201, "x"))
        .await
        .unwrap();
    let stuck = scope("a", "old-stuck");
    let lease = must_claim(&*store, &claim_req(&stuck, "{}")).await;
    let update = PhaseUpdate {
        recovery_point: "insert".into(),
        step: None,
    };
    store.advance(&stuck, lease.token, &update).await.unwrap();
    store
        .abandon(&stuck, lease.token, "courier timed out")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(73 * 3600));
    let fresh = scope("a", "fresh");
    must_claim(&*store, &claim_req(&fresh, "{}")).await;

    let report = Reaper::new(store.clone(), &idemkit_core::Policy::new())
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.deleted, report.moved_to_review), (1, 1));
    assert!(store.get(&done).await.unwrap().is_none());
    let listed = store.get(&stuck).await.unwrap().expect("listed records stay");
    assert_eq!(
        listed.state,
        idemkit_core::RecordState::Parked,
        "and never run again"
    );
    assert!(
        store.get(&fresh).await.unwrap().is_some(),
        "recent records are kept"
    );
    let review = store.review(10).await.unwrap();
    assert_eq!(review.len(), 1);
    assert_eq!(review[0].scope, stuck);
    assert_eq!(review[0].recovery_point.as_deref(), Some("insert"));
    assert_eq!(review[0].last_error.as_deref(), Some("courier timed out"));
}
