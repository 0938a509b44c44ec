//! What the single-step layer adds to the PostgreSQL conversation of one first
//! request (nothing), counted, not timed: the quickstart's handler (one insert in its
//! transaction) bare and under the layer, sequential requests with fresh keys.
//! A relay between the pool and the server counts round trips: a client write
//! that arrives after the server's last answer ended with `ReadyForQuery`
//! (every simple query and every extended-protocol `Sync` ends with one) starts
//! a round trip; messages the client pipelines in one write (a queued
//! `ROLLBACK` sent with the next `Sync`) are one. The bare handler's own:
//! `BEGIN`, the insert, `COMMIT`, plus the pool's pings when the connection is
//! acquired and released. (SQLite's statements are counted by the peers harness, which may
//! use SQLite's C API: `bench/peers`.)
//!
//! `cargo test -p idemkit-tower --test all roundtrips -- --nocapture` prints the counts.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::routing::post;
use http::{Request, StatusCode};
use idemkit_postgres::{PgConfig, PgStore, PgTx};
use idemkit_tower::{BearerTokenAccount, IdempotencyContext, IdempotencyLayer, Json, Tx};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower::ServiceExt;

const REQUESTS: u64 = 40;

fn request(key: &str) -> Request<Body> {
    Request::post("/op")
        .header("authorization", "Bearer rt")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(Body::from(r#"{"sku":"RT-1","quantity":2}"#))
        .unwrap()
}

/// Sends `REQUESTS` sequential first requests (after a few to warm the pool)
/// and returns how far `counter` moved per request.
async fn per_request(app: &Router, counter: &AtomicU64, tag: &str) -> f64 {
    let send = |key: String| {
        let app = app.clone();
        async move {
            let res = app.oneshot(request(&key)).await.unwrap();
            assert_eq!(res.status(), StatusCode::CREATED, "{key}");
            axum::body::to_bytes(res.into_body(), usize::MAX).await.unwrap();
        }
    };
    for i in 0..5 {
        send(format!("{tag}-warm-{i}")).await;
    }
    // The pool's release (and its ping) runs in a task after each response.
    let settle = || tokio::time::sleep(std::time::Duration::from_millis(150));
    settle().await;
    let before = counter.load(Ordering::SeqCst);
    for i in 0..REQUESTS {
        send(format!("{tag}-{i}")).await;
        settle().await;
    }
    (counter.load(Ordering::SeqCst) - before) as f64 / REQUESTS as f64
}

fn created(id: i64) -> (StatusCode, axum::Json<Value>) {
    (StatusCode::CREATED, axum::Json(serde_json::json!({ "id": id })))
}

// PostgreSQL.

const PG_INSERT: &str = "INSERT INTO orders (account, sku, quantity) VALUES ($1, $2, $3) RETURNING id";

async fn pg_insert(conn: &mut sqlx::PgConnection, account: &str, o: &Value) -> i64 {
    sqlx::query_scalar(PG_INSERT)
        .bind(account)
        .bind(o["sku"].as_str())
        .bind(o["quantity"].as_i64())
        .fetch_one(conn)
        .await
        .unwrap()
}

/// A TCP relay to `upstream` that counts round trips (see the module docs).
async fn counting_relay(upstream: String) -> (String, Arc<AtomicU64>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let trips = Arc::new(AtomicU64::new(0));
    let counter = trips.clone();
    tokio::spawn(async move {
        loop {
            let Ok((client, _)) = listener.accept().await else {
                return;
            };
            let server = tokio::net::TcpStream::connect(&upstream).await.unwrap();
            let (mut client_read, mut client_write) = client.into_split();
            let (mut server_read, mut server_write) = server.into_split();
            // Whether the client is waiting for an answer.
            let awaiting = Arc::new(AtomicBool::new(false));
            let (counter, waiting) = (counter.clone(), awaiting.clone());
            tokio::spawn(async move {
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match client_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    if !waiting.swap(true, Ordering::SeqCst) {
                        counter.fetch_add(1, Ordering::SeqCst);
                    }
                    if server_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
            tokio::spawn(async move {
                // Backend messages: a type byte, a 4-byte length (counting itself), the body.
                let (mut header, mut skip) = (Vec::with_capacity(5), 0usize);
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = match server_read.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => n,
                    };
                    let mut at = 0;
                    while at < n {
                        if skip > 0 {
                            let take = skip.min(n - at);
                            skip -= take;
                            at += take;
                            continue;
                        }
                        header.push(buf[at]);
                        at += 1;
                        if header.len() == 5 {
                            if header[0] == b'Z' {
                                awaiting.store(false, Ordering::SeqCst);
                            }
                            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
                            skip = len as usize - 4;
                            header.clear();
                        }
                    }
                    // Marked answered before the client can see the answer and write again.
                    if client_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, trips)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_round_trips_per_first_request() {
    let url = match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_POSTGRES_URL is not set under CI"),
        _ => return eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping"),
    };
    let mut relayed = reqwest::Url::parse(&url).unwrap();
    let upstream = format!(
        "{}:{}",
        relayed.host_str().unwrap(),
        relayed.port().unwrap_or(5432)
    );
    let (addr, trips) = counting_relay(upstream).await;
    let (host, port) = addr.split_once(':').unwrap();
    relayed.set_host(Some(host)).unwrap();
    relayed.set_port(Some(port.parse().unwrap())).unwrap();
    // The relay parses plain protocol messages.
    relayed.query_pairs_mut().append_pair("sslmode", "disable");

    let config = PgConfig::default()
        .with_schema(format!("rt_{}", uuid::Uuid::new_v4().simple()))
        .with_max_connections(4);
    let store = Arc::new(PgStore::connect_with(relayed.as_str(), config).await.unwrap());
    sqlx::query("CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, account TEXT, sku TEXT, quantity BIGINT)")
        .execute(store.pool())
        .await
        .unwrap();

    let pool = store.pool().clone();
    let bare = Router::new().route(
        "/op",
        post(move |Json(o): Json<Value>| {
            let pool = pool.clone();
            async move {
                let mut tx = pool.begin().await.unwrap();
                let id = pg_insert(&mut tx, "rt", &o).await;
                tx.commit().await.unwrap();
                created(id)
            }
        }),
    );
    let layer = IdempotencyLayer::single_step(store.clone(), BearerTokenAccount::new("test-secret"))
        .build()
        .unwrap();
    let guarded = Router::new().route(
        "/op",
        post(
            |ctx: IdempotencyContext, mut tx: Tx<PgTx>, Json(o): Json<Value>| async move {
                created(pg_insert(&mut tx, ctx.scope.account.as_str(), &o).await)
            },
        )
        .layer(layer),
    );

    let own = per_request(&bare, &trips, "bare").await;
    let with = per_request(&guarded, &trips, "guarded").await;
    println!("PostgreSQL round trips per first request: handler alone {own:.2}, under the layer {with:.2}");
    assert!(
        own >= 3.0,
        "the relay counts at least the handler's own BEGIN, insert and COMMIT: {own}"
    );
    // The opening carries the lock and the absence check, the completion rides
    // with the COMMIT: the handler's own round trips, nothing more.
    assert!(
        with <= own + 0.05,
        "the layer adds no round trip to a first request: {own} -> {with}"
    );
}
