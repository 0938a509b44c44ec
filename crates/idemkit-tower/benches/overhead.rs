//! What the idempotency layer costs, as ratios measured in one run.
//!
//! `cargo bench -p idemkit-tower --bench overhead` prints, per configuration,
//! throughput with the layer ÷ without and the added microseconds per request,
//! and the replay p50 ÷ first-request p50. Requests go through the axum router
//! in process (no sockets), so the figures isolate the layer. Runs alternate
//! with/without in several rounds and report the median round, because single
//! absolute times on a shared machine are noise; only ratios are meaningful.
//!
//! Set `IDEMKIT_BENCH_REQUESTS` to change the requests per round (default 4000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::routing::post;
use http::{Request, StatusCode};
use idemkit_core::{KeyStore, Policy};
use idemkit_postgres::{PgConfig, PgStore, PgTx};
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::MemoryStore;
use idemkit_tower::{BearerTokenAccount, IdempotencyContext, IdempotencyLayer, Json, Tx};
use serde_json::Value;
use tower::ServiceExt;

const ROUNDS: usize = 5;
const CONCURRENCY: usize = 16;
const WORKERS: usize = 2;

fn requests() -> usize {
    std::env::var("IDEMKIT_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4000)
}

const BODY: &str = r#"{"sku":"BENCH-1","quantity":2,"note":"a typical small order body"}"#;

fn request(key: &str) -> Request<Body> {
    Request::post("/op")
        .header("authorization", "Bearer bench")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(
            r#"{"sku":"BENCH-1","quantity":2,"note":"a typical small order body"}"#,
        ))
        .unwrap()
}

async fn echo(Json(v): Json<Value>) -> impl IntoResponse {
    (StatusCode::CREATED, axum::Json(v))
}

/// How requests reach the router: in process (isolates the layer) or over
/// loopback HTTP with keep-alive connections (what a service really pays).
#[derive(Clone)]
enum Target {
    InProcess(Router),
    Http(String, reqwest::Client),
}

impl Target {
    async fn http(app: Router) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}/op", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(CONCURRENCY)
            .build()
            .unwrap();
        Self::Http(base, client)
    }

    async fn send(&self, key: &str) -> u16 {
        match self {
            Self::InProcess(app) => {
                let res = app.clone().oneshot(request(key)).await.unwrap();
                let status = res.status().as_u16();
                let _ = axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
                status
            }
            Self::Http(url, client) => {
                let res = client
                    .post(url)
                    .header("authorization", "Bearer bench")
                    .header("idempotency-key", key)
                    .header("content-type", "application/json")
                    .body(BODY)
                    .send()
                    .await
                    .unwrap();
                let status = res.status().as_u16();
                let _ = res.bytes().await.unwrap();
                status
            }
        }
    }
}

/// Sends `n` requests with fresh keys (prefix `tag`) from `CONCURRENCY` tasks;
/// returns the elapsed time.
async fn drive(target: &Target, n: usize, tag: &str) -> Duration {
    let started = Instant::now();
    let per_task = n / CONCURRENCY;
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|t| {
            let target = target.clone();
            let tag = tag.to_owned();
            tokio::spawn(async move {
                for i in 0..per_task {
                    assert_eq!(target.send(&format!("{tag}-{t}-{i}")).await, 201);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

/// Latencies of `n` sequential requests with the keys `key(i)`.
async fn latencies(target: &Target, n: usize, key: impl Fn(usize) -> String) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        target.send(&key(i)).await;
        out.push(started.elapsed());
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

struct Row {
    name: String,
    ratio: f64,
    added_us: f64,
    target: f64,
}

async fn compare(name: String, target: f64, n: usize, without: Target, with: Target) -> Row {
    // Warm both (connection pools, allocator, page cache).
    drive(&without, n / 4, "warm-a").await;
    drive(&with, n / 4, "warm-b").await;
    let mut ratios = Vec::new();
    let mut added = Vec::new();
    for round in 0..ROUNDS {
        let a = drive(&without, n, &format!("r{round}-a")).await;
        let b = drive(&with, n, &format!("r{round}-b")).await;
        ratios.push(a.as_secs_f64() / b.as_secs_f64());
        // Added service time per request: extra wall time at saturation × the
        // two worker threads serving it (≈ CPU µs the layer adds per request).
        added.push((b.as_secs_f64() - a.as_secs_f64()) / n as f64 * 1e6 * WORKERS as f64);
    }
    Row {
        name,
        ratio: median(ratios),
        added_us: median(added),
        target,
    }
}

fn tempdb(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idemkit-bench-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("bench.db")
}

async fn sqlite_store(tag: &str) -> Arc<SqliteStore> {
    let store = SqliteStore::connect(tempdb(tag)).await.unwrap();
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, sku TEXT NOT NULL, quantity INTEGER NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    Arc::new(store)
}

#[derive(serde::Deserialize)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

async fn insert(conn: &mut sqlx::SqliteConnection, account: &str, o: &NewOrder) -> i64 {
    sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id")
        .bind(account)
        .bind(&o.sku)
        .bind(o.quantity)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The quickstart's handler without idempotency: its own transaction, same insert.
fn sqlite_plain(store: Arc<SqliteStore>) -> Router {
    Router::new().route(
        "/op",
        post(move |Json(o): Json<NewOrder>| {
            let store = store.clone();
            async move {
                // The same writer queue the store uses, so only idempotency differs.
                let mut tx = store.begin().await.unwrap();
                let id = insert(&mut tx, "bench", &o).await;
                tx.commit().await.unwrap();
                (
                    StatusCode::CREATED,
                    axum::Json(serde_json::json!({"id": id, "sku": o.sku, "quantity": o.quantity})),
                )
            }
        }),
    )
}

/// The quickstart's handler under the single-step layer: the claim's transaction.
fn sqlite_idempotent(store: Arc<SqliteStore>) -> Router {
    let layer = IdempotencyLayer::single_step(store, BearerTokenAccount::new("test-secret"))
        .build()
        .unwrap();
    Router::new().route(
        "/op",
        post(
            |ctx: IdempotencyContext, mut tx: Tx<SqliteTx>, Json(o): Json<NewOrder>| async move {
                let id = insert(&mut tx, ctx.scope.account.as_str(), &o).await;
                (
                    StatusCode::CREATED,
                    axum::Json(serde_json::json!({"id": id, "sku": o.sku, "quantity": o.quantity})),
                )
            },
        )
        .layer(layer),
    )
}

async fn pg_store(url: &str, schema: &str) -> Arc<PgStore> {
    let config = PgConfig::default()
        .with_schema(schema.to_owned())
        .with_max_connections(8);
    let store = PgStore::connect_with(url, config).await.unwrap();
    sqlx::query("DROP TABLE IF EXISTS orders")
        .execute(store.pool())
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, sku TEXT NOT NULL, quantity BIGINT NOT NULL)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    sqlx::query("TRUNCATE idemkit_keys")
        .execute(store.pool())
        .await
        .unwrap();
    Arc::new(store)
}

async fn pg_insert(conn: &mut sqlx::PgConnection, account: &str, o: &NewOrder) -> i64 {
    sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES ($1, $2, $3) RETURNING id")
        .bind(account)
        .bind(&o.sku)
        .bind(o.quantity)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// The quickstart's PostgreSQL handler without idempotency (same pool, same insert).
fn pg_plain(store: Arc<PgStore>) -> Router {
    Router::new().route(
        "/op",
        post(move |Json(o): Json<NewOrder>| {
            let store = store.clone();
            async move {
                let mut tx = store.pool().begin().await.unwrap();
                let id = pg_insert(&mut tx, "bench", &o).await;
                tx.commit().await.unwrap();
                (
                    StatusCode::CREATED,
                    axum::Json(serde_json::json!({"id": id, "sku": o.sku, "quantity": o.quantity})),
                )
            }
        }),
    )
}

/// The same handler under the single-step layer; with `cache`, the layer keeps
/// that many stored answers in memory (`IdempotencyLayerBuilder::replay_cache`).
fn pg_idempotent(store: Arc<PgStore>, cache: Option<usize>) -> Router {
    let mut layer = IdempotencyLayer::single_step(store, BearerTokenAccount::new("test-secret"));
    if let Some(capacity) = cache {
        layer = layer.replay_cache(capacity);
    }
    let layer = layer.build().unwrap();
    Router::new().route(
        "/op",
        post(
            |ctx: IdempotencyContext, mut tx: Tx<PgTx>, Json(o): Json<NewOrder>| async move {
                let id = pg_insert(&mut tx, ctx.scope.account.as_str(), &o).await;
                (
                    StatusCode::CREATED,
                    axum::Json(serde_json::json!({"id": id, "sku": o.sku, "quantity": o.quantity})),
                )
            },
        )
        .layer(layer),
    )
}

/// Replay p50 ÷ first-request p50 on keys `{tag}-{i}`, sequential requests.
async fn replay_row(name: String, target: &Target, n: usize, tag: &str) -> Row {
    let m = (n / 4).max(50);
    let first = p50(latencies(target, m, |i| format!("{tag}-{i}")).await);
    let replay = p50(latencies(target, m, |i| format!("{tag}-{i}")).await);
    Row {
        name,
        ratio: replay.as_secs_f64() / first.as_secs_f64(),
        added_us: replay.as_secs_f64() * 1e6 - first.as_secs_f64() * 1e6,
        target: -0.5,
    }
}

/// The lease-mode layer on a fresh in-memory store.
fn memory_layer() -> IdempotencyLayer {
    let memory: Arc<dyn KeyStore> = Arc::new(MemoryStore::new());
    IdempotencyLayer::lease(memory, BearerTokenAccount::new("test-secret"))
        .policy(Policy::new())
        .build()
        .unwrap()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not and would
    // time a debug build, so it gets a small smoke pass instead.
    let full = std::env::args().any(|a| a == "--bench");
    let n = if full { requests() } else { 64 };
    if !full {
        println!("(smoke run: use `cargo bench` for figures)");
    }

    let mut rows = Vec::new();
    for http in [false, true] {
        let via = if http { "HTTP" } else { "in-process" };
        let wrap = |app: Router| async move {
            if http {
                Target::http(app).await
            } else {
                Target::InProcess(app)
            }
        };

        rows.push(
            compare(
                format!("memory store, JSON echo, lease mode ({via})"),
                0.80,
                n,
                wrap(Router::new().route("/op", post(echo))).await,
                wrap(Router::new().route("/op", post(echo).layer(memory_layer()))).await,
            )
            .await,
        );

        let plain = sqlite_store(&format!("plain-{http}")).await;
        let idem = sqlite_store(&format!("idem-{http}")).await;
        rows.push(
            compare(
                format!("SQLite single-step, quickstart insert ({via})"),
                0.85,
                n,
                wrap(sqlite_plain(plain)).await,
                wrap(sqlite_idempotent(idem.clone())).await,
            )
            .await,
        );

        // Replay vs original on SQLite single-step: sequential p50 latencies.
        let target = wrap(sqlite_idempotent(idem)).await;
        rows.push(
            replay_row(
                format!("SQLite replay p50 / first p50 ({via})"),
                &target,
                n,
                "replay",
            )
            .await,
        );

        if let Ok(url) = std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
            let plain = pg_store(&url, &format!("bench_plain_{http}")).await;
            let idem = pg_store(&url, &format!("bench_idem_{http}")).await;
            rows.push(
                compare(
                    format!("PostgreSQL single-step, quickstart insert ({via})"),
                    0.85,
                    n,
                    wrap(pg_plain(plain)).await,
                    wrap(pg_idempotent(idem.clone(), None)).await,
                )
                .await,
            );
            let target = wrap(pg_idempotent(idem.clone(), None)).await;
            rows.push(
                replay_row(
                    format!("PostgreSQL replay p50 / first p50 ({via})"),
                    &target,
                    n,
                    "replay",
                )
                .await,
            );
            let target = wrap(pg_idempotent(idem, Some(100_000))).await;
            rows.push(
                replay_row(
                    format!("PostgreSQL replay p50 / first p50, replay cache ({via})"),
                    &target,
                    n,
                    "cached",
                )
                .await,
            );
        }
    }
    if std::env::var("IDEMKIT_TEST_POSTGRES_URL").is_err() {
        println!("(set IDEMKIT_TEST_POSTGRES_URL to include PostgreSQL)");
    }

    // The same memory row with somebody listening: a tracing subscriber that
    // records every span and event at INFO (formatted into a sink) and a
    // metrics recorder that keeps every series. The rows above ran with neither
    // (a subscriber and a recorder can only be installed once, so they come last).
    tracing_subscriber::fmt()
        .with_writer(std::io::sink)
        .with_max_level(tracing::Level::INFO)
        .init();
    metrics_util::debugging::DebuggingRecorder::new()
        .install()
        .expect("no recorder installed yet");
    rows.push(
        compare(
            "memory store, lease mode, subscriber + recorder on (in-process)".to_owned(),
            0.80,
            n,
            Target::InProcess(Router::new().route("/op", post(echo))),
            Target::InProcess(Router::new().route("/op", post(echo).layer(memory_layer()))),
        )
        .await,
    );

    println!();
    println!(
        "{:<55} {:>8} {:>14} {:>8}",
        "configuration", "ratio", "added µs/req", "target"
    );
    for r in &rows {
        let (met, target) = if r.target < 0.0 {
            (r.ratio <= -r.target, format!("≤{}", -r.target))
        } else {
            (r.ratio >= r.target, format!("≥{}", r.target))
        };
        let verdict = if met { "ok" } else { "MISSED" };
        println!(
            "{:<55} {:>8.3} {:>14.1} {:>8} {verdict}",
            r.name, r.ratio, r.added_us, target
        );
    }
}
