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
    BearerTokenAccount, BuildError, IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, Json,
    Override, Reaper, Tx, Unscoped,
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
    IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret")).policy(policy)
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

async fn sqlite(clock: Option<Arc<ManualClock>>) -> Arc<SqliteStore> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-tower-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut store = SqliteStore::connect(dir.join("t.db")).await.unwrap();
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
    let layer = IdempotencyLayer::single_step(store, BearerTokenAccount::new("test-secret"))
        .policy(policy)
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

fn tempfile(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-tower-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("keys.db")
}

/// The store's transactional extension is usable through `Arc<dyn …>` bounds too.
#[allow(dead_code)]
fn _tx_store_is_usable(s: Arc<SqliteStore>) -> Arc<dyn KeyStore> {
    fn takes<S: TransactionalStore>(_: &S) {}
    takes(&*s);
    let _: fn(StoreError) -> bool = |e| e.is_retryable();
    s
}

mod answers;
mod conventions;
mod crash;
mod deadlines;
mod hardening;
mod leases;
mod metrics;
mod release;
mod released;
mod replay_cache;
mod request_body;
mod roundtrips;
mod single_step;
mod stuck;

/// The secret the tests' `BearerTokenAccount` derives accounts with.
pub(crate) const TEST_SECRET: &[u8] = b"test-secret";

/// The scope a request with `Authorization: Bearer <token>` and this key runs
/// under, as the tests' layers resolve it.
pub(crate) fn scope(token: &str, key: &str) -> idemkit_core::Scope {
    idemkit_core::Scope::new(
        idemkit_core::Account::keyed(TEST_SECRET, token.as_bytes()),
        idemkit_core::IdempotencyKey::parse(key).expect("a valid key"),
    )
}
