//! Side-by-side load harness: idemkit, the bare handler, and the Rust peers.
//!
//! One load generator drives the quickstart's order write (`POST /orders`, body
//! `{"sku", "quantity"}`, `201` with the order as JSON) over loopback HTTP in
//! every setup, in one run:
//!
//! | setup                         | what wraps the handler                                  |
//! |-------------------------------|---------------------------------------------------------|
//! | bare SQLite                   | nothing: the handler's own transaction, same insert      |
//! | idemkit single-step SQLite    | `IdempotencyLayer::single_step`, insert in the claim's tx   |
//! | bare PostgreSQL               | nothing (only with `IDEMKIT_TEST_POSTGRES_URL`)          |
//! | idemkit single-step PostgreSQL| `IdempotencyLayer::single_step` (same)                   |
//! | bare memory                   | nothing: echo with an id from an `AtomicU64`             |
//! | idemkit lease, MemoryStore    | `IdempotencyLayer::lease(MemoryStore)` (lease mode)      |
//! | lean floor, memory            | the leanest layer of the same guarantee (`lean.rs`)     |
//! | idempotent, memory backend    | `idempotent::middleware::IdempotencyLayer`               |
//! | axum-idempotent, moka session | `axum_idempotent::IdempotentLayer` inside a ruts session |
//!
//! Every request carries a fresh `Idempotency-Key` and `Authorization: Bearer bench`.
//! 16 client tasks share a keep-alive connection pool; the servers run on their own
//! runtime with 2 worker threads. Each round drives every setup once (the order is
//! rotated per round), then sends the idempotent setups the same keys again (replay).
//! Only ratios between setups measured in the same round are meaningful.
//!
//! `IDEMKIT_BENCH_REQUESTS`: requests per setup per round (default 3000).
//! `IDEMKIT_BENCH_ONLY`: run only the setups whose name contains it (e.g. `PostgreSQL`).
//! `IDEMKIT_TEST_POSTGRES_URL`: adds the PostgreSQL pair (fresh schemas, dropped at the end).

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idemkit_core::{ErrorCode, KeyStore, Policy};
use idemkit_postgres::{PgConfig, PgStore, PgTx};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::MemoryStore;
use idemkit_tower::{BearerTokenAccount, IdempotencyContext, IdempotencyLayer, Json, ProblemResponse, Tx};
use serde::{Deserialize, Serialize};
use tokio::runtime::Handle;

mod handlers;
mod lean;
mod load;
mod setups;

use handlers::*;
use setups::*;

const ROUNDS: usize = 3;
/// Passes over the setups per round (see the rounds in `run`).
const SLICES: usize = 6;
/// The memory setups answer ten times faster than the SQL ones: they get ten
/// times the requests, so that each of their slices lasts long enough to
/// measure (a few hundred requests at 30k/s take ~15 ms, within scheduling noise).
const MEMORY_SCALE: usize = 10;

/// How many times `n` a setup's warm-up, slices and rounds send.
fn scale(setup: &Setup) -> usize {
    if setup.family == Family::Memory {
        MEMORY_SCALE
    } else {
        1
    }
}
const CONCURRENCY: usize = 16;
const SERVER_WORKERS: usize = 2;
const CLIENT_WORKERS: usize = 1;
/// Threads of the load generator's process (as `wrk -t2`).
const LOAD_WORKERS: usize = 2;
const BODY: &str = r#"{"sku":"BENCH-1","quantity":2}"#;

fn requests() -> usize {
    std::env::var("IDEMKIT_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= CONCURRENCY * SLICES)
        .unwrap_or(3000)
}

/// Handler 5 behind idemkit's lease-mode layer on `store` (setups 6 and 6b).
fn lease_router(store: Arc<dyn KeyStore>, ids: Arc<AtomicU64>) -> Router {
    let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new("test-secret"))
        .policy(Policy::new())
        .build()
        .unwrap_or_else(|e| layer_err(e));
    Router::new()
        .route("/orders", post(create_order_memory).layer(layer))
        .with_state(ids)
}

/// Sends `n` requests with the keys `{tag}-{connection}-{i}` over `CONCURRENCY`
/// keep-alive connections, from a load generator in a child process (see
/// `load.rs`); every answer must be `201` and carry the setup's replay marker
/// exactly when `replay`. Returns requests per second, as the generator timed them.
async fn drive(setup: &Setup, n: usize, tag: &str, replay: bool) -> f64 {
    let res = drive_with(setup, n, tag, replay, CONCURRENCY).await;
    n as f64 / res.seconds
}

/// [`drive`] over `connections` connections; the generator's whole result
/// (rate, latency percentiles, statuses), after the same checks.
async fn drive_with(setup: &Setup, n: usize, tag: &str, replay: bool, connections: usize) -> load::LoadResult {
    let addr = setup
        .url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "load", "--addr", &addr, "--path", "/orders", "--body", BODY, "--tag", tag,
    ]);
    cmd.args([
        "--connections",
        &connections.to_string(),
        "--requests",
        &n.to_string(),
    ]);
    if let Some(m) = setup.replay_marker {
        cmd.args(["--marker", m]);
    }
    for c in &setup.cookies {
        cmd.args(["--cookie", c]);
    }
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}: the load generator failed: {}",
        setup.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let res = load::LoadResult::parse(String::from_utf8_lossy(&out.stdout).trim());
    assert_eq!(res.count(201), n, "{}: statuses {:?}", setup.name, res.statuses);
    if setup.replay_marker.is_some() {
        assert_eq!(
            res.replayed,
            if replay { n } else { 0 },
            "{}: replay markers on {tag} (replay: {replay})",
            setup.name
        );
    }
    res
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.len() % 2 == 1 {
        v[v.len() / 2]
    } else {
        (v[v.len() / 2 - 1] + v[v.len() / 2]) / 2.0
    }
}

fn per_round(v: &[f64]) -> String {
    v.iter()
        .map(|x| format!("{x:.0}"))
        .collect::<Vec<_>>()
        .join(" / ")
}

async fn run(server: Handle, serve: bool, latency: bool) {
    let n = requests();
    let warm = (n / 4).max(CONCURRENCY);
    let pg_url = std::env::var("IDEMKIT_TEST_POSTGRES_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let redis_url = std::env::var("IDEMKIT_TEST_REDIS_URL")
        .ok()
        .filter(|u| !u.is_empty());
    let stamp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs();
    let run_id = format!("{stamp}_{}", std::process::id());
    let dir = std::env::temp_dir().join(format!("idemkit-bench-peers-{run_id}"));
    std::fs::create_dir_all(&dir).unwrap();

    println!("idemkit-bench-peers: the quickstart's order write over loopback HTTP");
    println!(
        "  {n} requests per setup per round ({MEMORY_SCALE}x for the memory setups) in {SLICES} interleaved slices \
         (+{warm} warm-up), {ROUNDS} rounds, \
         {CONCURRENCY} keep-alive connections from a load generator in its own process ({LOAD_WORKERS} threads), \
         servers on {SERVER_WORKERS} worker threads"
    );

    let mut setups = Vec::new();

    // (1), (2) SQLite: one file each.
    let (store, statements) = sqlite_store(&server, dir.join("bare.db")).await;
    let s = store.clone();
    setups.push(
        setup(
            &server,
            "bare SQLite",
            Family::Sqlite,
            None,
            Runs::Sqlite(store),
            Box::pin(async move {
                Router::new()
                    .route("/orders", post(create_order_sqlite_bare))
                    .with_state(s)
            }),
        )
        .await,
    );
    setups.last_mut().unwrap().statements = Some(statements);
    let (store, statements) = sqlite_store(&server, dir.join("idem.db")).await;
    let s = store.clone();
    setups.push(
        setup(
            &server,
            "idemkit single-step SQLite",
            Family::Sqlite,
            Some("idempotent-replayed"),
            Runs::Sqlite(store),
            Box::pin(async move {
                let layer = IdempotencyLayer::single_step(s, BearerTokenAccount::new("test-secret"))
                    .build()
                    .unwrap_or_else(|e| layer_err(e));
                Router::new().route("/orders", post(create_order_sqlite).layer(layer))
            }),
        )
        .await,
    );
    setups.last_mut().unwrap().statements = Some(statements);

    // (3), (4) PostgreSQL: fresh schemas for this run.
    let mut schemas = Vec::new();
    if let Some(url) = &pg_url {
        let schema = format!("bench_peers_{run_id}_bare");
        schemas.push(schema.clone());
        let store = pg_store(&server, url.clone(), schema).await;
        let s = store.clone();
        setups.push(
            setup(
                &server,
                "bare PostgreSQL",
                Family::Pg,
                None,
                Runs::Pg(store),
                Box::pin(async move {
                    Router::new()
                        .route("/orders", post(create_order_pg_bare))
                        .with_state(s)
                }),
            )
            .await,
        );
        let schema = format!("bench_peers_{run_id}_idem");
        schemas.push(schema.clone());
        let store = pg_store(&server, url.clone(), schema).await;
        let s = store.clone();
        setups.push(
            setup(
                &server,
                "idemkit single-step PostgreSQL",
                Family::Pg,
                Some("idempotent-replayed"),
                Runs::Pg(store),
                Box::pin(async move {
                    let layer = IdempotencyLayer::single_step(s, BearerTokenAccount::new("test-secret"))
                        .build()
                        .unwrap_or_else(|e| layer_err(e));
                    Router::new().route("/orders", post(create_order_pg).layer(layer))
                }),
            )
            .await,
        );
    }

    // (5) bare in-memory handler.
    let ids = Arc::new(AtomicU64::new(0));
    let s = ids.clone();
    setups.push(
        setup(
            &server,
            "bare memory",
            Family::Memory,
            None,
            Runs::Memory(ids),
            Box::pin(async move {
                Router::new()
                    .route("/orders", post(create_order_memory))
                    .with_state(s)
            }),
        )
        .await,
    );

    // (6) idemkit lease mode on the in-memory store.
    let ids = Arc::new(AtomicU64::new(0));
    let s = ids.clone();
    setups.push(
        setup(
            &server,
            "idemkit lease, MemoryStore",
            Family::Memory,
            Some("idempotent-replayed"),
            Runs::Memory(ids),
            Box::pin(async move { lease_router(Arc::new(MemoryStore::new()), s) }),
        )
        .await,
    );

    // (6a) the leanest layer of the same guarantee in one process (see
    // `lean.rs`): the floor the MemoryStore setup is measured against.
    let ids = Arc::new(AtomicU64::new(0));
    let s = ids.clone();
    setups.push(
        setup(
            &server,
            "lean floor, memory",
            Family::Memory,
            Some("idempotent-replayed"),
            Runs::Memory(ids),
            Box::pin(async move {
                let store = Arc::new(lean::LeanStore::default());
                Router::new()
                    .route(
                        "/orders",
                        post(create_order_memory)
                            .layer(axum::middleware::from_fn_with_state(store, lean::lean_layer)),
                    )
                    .with_state(s)
            }),
        )
        .await,
    );

    // (6b) idemkit lease mode on Redis (a fresh key prefix for this run).
    let redis_prefix = format!("bench_peers_{run_id}:");
    if let Some(url) = redis_url.clone() {
        let ids = Arc::new(AtomicU64::new(0));
        let s = ids.clone();
        let prefix = redis_prefix.clone();
        setups.push(
            setup(
                &server,
                "idemkit lease, Redis",
                Family::Memory,
                Some("idempotent-replayed"),
                Runs::Memory(ids),
                Box::pin(async move {
                    let store = RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
                        .await
                        .unwrap();
                    lease_router(Arc::new(store), s)
                }),
            )
            .await,
        );
    }

    // (7) `idempotent` 2.x: its Tower layer on its in-memory store, keys scoped by
    // the bearer token (as idemkit scopes them by account).
    let ids = Arc::new(AtomicU64::new(0));
    let s = ids.clone();
    setups.push(
        setup(
            &server,
            "idempotent 2.x, memory store",
            Family::Memory,
            Some("idempotent-replayed"),
            Runs::Memory(ids),
            Box::pin(async move {
                // try_build spawns the store's actor on the current (server) runtime.
                let store = idempotent::memory::MemoryStore::builder().try_build().unwrap();
                let layer = idempotent::middleware::IdempotencyLayer::new(store)
                    .scope(|parts| idemkit_tower::bearer_token(parts).map(str::to_owned));
                Router::new()
                    .route("/orders", post(create_order_memory).layer(layer))
                    .with_state(s)
            }),
        )
        .await,
    );

    // (8) `axum-idempotent` 0.6: direct-key mode (the Idempotency-Key header is the
    // cache key), responses kept in a ruts session on an in-memory moka store.
    let ids = Arc::new(AtomicU64::new(0));
    let s = ids.clone();
    let mut ai = setup(
        &server,
        "axum-idempotent 0.6, moka session",
        Family::Memory,
        Some("idempotency-replayed"),
        Runs::Memory(ids),
        Box::pin(async move {
            let sessions = Arc::new(ruts::store::moka::MokaStore::builder().build());
            let options = axum_idempotent::IdempotentOptions::default()
                .use_idempotency_key_header(Some("Idempotency-Key"), true)
                .expire_after(3600);
            Router::new()
                .route(
                    "/orders",
                    post(create_order_memory).layer(axum_idempotent::IdempotentLayer::<
                        ruts::store::moka::MokaStore,
                    >::new(options)),
                )
                .route("/login", post(login))
                .layer(
                    ruts::SessionLayer::new(sessions).with_cookie_options(
                        ruts::CookieOptions::build()
                            .name("session")
                            .max_age(3600)
                            .path("/"),
                    ),
                )
                .layer(tower_cookies::CookieManagerLayer::new())
                .with_state(s)
        }),
    )
    .await;
    sessions_for(&mut ai).await;
    setups.push(ai);

    // `IDEMKIT_BENCH_ONLY=PostgreSQL` keeps the setups whose name contains it
    // (a family's bare setup included), for a quicker look at one store.
    if let Some(only) = std::env::var("IDEMKIT_BENCH_ONLY").ok().filter(|o| !o.is_empty()) {
        setups.retain(|s| s.name.contains(&only));
        assert!(!setups.is_empty(), "IDEMKIT_BENCH_ONLY={only} matches no setup");
    }

    // `serve`: only serve the setups, for an independent load generator (`wrk`,
    // see `wrk-check.sh`), until standard input closes; then clean up.
    if serve {
        for s in &setups {
            println!("serve\t{}\t{}", s.name, s.url);
        }
        println!("ready");
        tokio::task::spawn_blocking(|| std::io::copy(&mut std::io::stdin(), &mut std::io::sink()))
            .await
            .unwrap()
            .unwrap();
        cleanup(&server, pg_url, schemas, redis_url, redis_prefix, &dir).await;
        return;
    }

    // `latency`: p50 and p99 of first requests and of replays, at one and at
    // sixteen connections, beside the bare handler; then clean up.
    if latency {
        for s in &setups {
            drive(s, warm * scale(s), "warm", false).await;
        }
        println!("| setup | connections | first p50 µs | first p99 µs | replay p50 µs | replay p99 µs |");
        println!("|---|---|---|---|---|---|");
        for connections in [1, CONCURRENCY] {
            for s in &setups {
                // A fixed number per setup and concurrency: enough samples
                // for a p99 (at least 1,000 answers), short on the SQL stores.
                let m = (if connections == 1 { 1000 } else { 4000 }) * scale(s).min(2);
                let tag = format!("lat{connections}");
                let first = drive_with(s, m, &tag, false, connections).await;
                let replay = if s.replay_marker.is_some() {
                    let r = drive_with(s, m, &tag, true, connections).await;
                    (r.p50_us.to_string(), r.p99_us.to_string())
                } else {
                    ("–".to_owned(), "–".to_owned())
                };
                println!(
                    "| {} | {connections} | {} | {} | {} | {} |",
                    s.name, first.p50_us, first.p99_us, replay.0, replay.1
                );
            }
        }
        cleanup(&server, pg_url, schemas, redis_url, redis_prefix, &dir).await;
        return;
    }

    // Warm every setup (connection pools, allocator, page cache), replays included.
    for s in &setups {
        drive(s, warm * scale(s), "warm", false).await;
        if s.replay_marker.is_some() {
            drive(s, warm * scale(s), "warm", true).await;
        }
    }

    // rps[setup][round], replay[setup][round]. A round is SLICES passes over
    // the setups, n / SLICES requests each, so every setup and its baseline
    // are measured a few seconds apart all through the round: a change of the
    // machine's speed mid-round weighs on both instead of on whichever setup
    // ran then. A setup's rate in a round is its requests ÷ its summed time.
    let slice = n / SLICES;
    let mut rps = vec![Vec::new(); setups.len()];
    let mut replay = vec![Vec::new(); setups.len()];
    for round in 0..ROUNDS {
        let mut time = vec![0.0; setups.len()];
        let mut replay_time = vec![0.0; setups.len()];
        for pass in 0..SLICES {
            let mut order: Vec<usize> = (0..setups.len()).collect();
            order.rotate_left((round * SLICES + pass) % setups.len());
            for i in order {
                let s = &setups[i];
                let tag = format!("r{round}p{pass}");
                let m = slice * scale(s);
                time[i] += m as f64 / drive(s, m, &tag, false).await;
                if s.replay_marker.is_some() {
                    replay_time[i] += m as f64 / drive(s, m, &tag, true).await;
                }
            }
        }
        for (i, s) in setups.iter().enumerate() {
            let sent = (slice * SLICES * scale(s)) as f64;
            rps[i].push(sent / time[i]);
            if s.replay_marker.is_some() {
                replay[i].push(sent / replay_time[i]);
            }
        }
        eprintln!("  round {} of {ROUNDS} done", round + 1);
    }

    // Baseline of each family: its bare setup.
    let bare = |family: Family| {
        setups
            .iter()
            .position(|s| s.family == family && s.replay_marker.is_none())
            .unwrap()
    };
    // Ratio = median over rounds of (setup ÷ its bare baseline in the same round).
    let ratio = |v: &[f64], base: &[f64]| median(&v.iter().zip(base).map(|(a, b)| a / b).collect::<Vec<_>>());

    println!();
    println!("first requests (fresh key each): requests/s, median of {ROUNDS} rounds;");
    println!("ratio = median over rounds of (setup ÷ its bare baseline measured in the same round)");
    println!(
        "{:<36} {:>9} {:>24} {:>9}  ÷ baseline",
        "setup", "req/s", "per round", "ratio"
    );
    for (i, s) in setups.iter().enumerate() {
        let b = bare(s.family);
        println!(
            "{:<36} {:>9.0} {:>24} {:>9.3}  {}",
            s.name,
            median(&rps[i]),
            per_round(&rps[i]),
            ratio(&rps[i], &rps[b]),
            setups[b].name
        );
    }

    println!();
    println!(
        "replays (the same keys sent again): requests/s; ratio = replay ÷ bare first requests, same round"
    );
    println!(
        "{:<36} {:>9} {:>24} {:>9}  ÷ baseline",
        "setup", "req/s", "per round", "ratio"
    );
    for (i, s) in setups
        .iter()
        .enumerate()
        .filter(|(_, s)| s.replay_marker.is_some())
    {
        let b = bare(s.family);
        println!(
            "{:<36} {:>9.0} {:>24} {:>9.3}  {} (first requests)",
            s.name,
            median(&replay[i]),
            per_round(&replay[i]),
            ratio(&replay[i], &rps[b]),
            setups[b].name
        );
    }

    // What each SQLite first request costs SQLite, counted: fresh keys again.
    println!();
    println!("statements SQLite runs per first request (sqlite3_trace_v2; BEGIN and COMMIT count)");
    let counted = 400;
    for s in setups.iter().filter(|s| s.statements.is_some()) {
        let counter = s.statements.unwrap();
        let before = counter.load(Ordering::Relaxed);
        drive(s, counted, "counted", false).await;
        let per = (counter.load(Ordering::Relaxed) - before) as f64 / counted as f64;
        println!("{:<36} {per:>9.2}", s.name);
    }

    // Every setup ran its handler once per distinct key: replays never reached it.
    println!();
    let expected = warm + ROUNDS * SLICES * (n / SLICES);
    let expected_for =
        |s: &Setup| (expected * scale(s)) as i64 + if s.statements.is_some() { counted as i64 } else { 0 };
    let mut all_ok = true;
    for s in &setups {
        let got = s.runs.count(&server).await;
        let expected = expected_for(s);
        let ok = got == expected;
        all_ok &= ok;
        println!(
            "handler runs, {:<36} {got:>7} (expected {expected}) {}",
            s.name,
            if ok { "ok" } else { "MISMATCH" }
        );
    }
    if redis_url.is_none() {
        println!("(set IDEMKIT_TEST_REDIS_URL to include idemkit on Redis)");
    }
    if pg_url.is_none() {
        println!("(set IDEMKIT_TEST_POSTGRES_URL to include the PostgreSQL pair)");
    }
    println!("only the ratios compare: absolute req/s depend on this machine and its load");

    cleanup(&server, pg_url, schemas, redis_url, redis_prefix, &dir).await;
    assert!(
        all_ok,
        "a setup ran its handler more or less often than once per key"
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    if args.next().as_deref() == Some("load") {
        let load = load::LoadArgs::parse(args);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(LOAD_WORKERS)
            .enable_all()
            .build()
            .unwrap();
        println!("{}", rt.block_on(load::run(load)).line());
        return;
    }
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(SERVER_WORKERS)
        .thread_name("server")
        .enable_all()
        .build()
        .unwrap();
    let client = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(CLIENT_WORKERS)
        .thread_name("client")
        .enable_all()
        .build()
        .unwrap();
    let mode = std::env::args().nth(1);
    let serve = mode.as_deref() == Some("serve");
    let latency = mode.as_deref() == Some("latency");
    client.block_on(run(server.handle().clone(), serve, latency));
    drop(client);
    server.shutdown_timeout(Duration::from_secs(2));
}

/// Drops this run's PostgreSQL schemas, Redis keys and SQLite files.
async fn cleanup(
    server: &Handle,
    pg_url: Option<String>,
    schemas: Vec<String>,
    redis_url: Option<String>,
    redis_prefix: String,
    dir: &std::path::Path,
) {
    if let Some(url) = pg_url {
        let dropped = schemas;
        server
            .spawn(async move {
                let pool = sqlx::PgPool::connect(&url).await.unwrap();
                for schema in dropped {
                    // The name is ours: digits and underscores.
                    sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"
                    )))
                    .execute(&pool)
                    .await
                    .unwrap();
                }
                pool.close().await;
            })
            .await
            .unwrap();
    }
    if let Some(url) = redis_url {
        let pattern = format!("{redis_prefix}*");
        server
            .spawn(async move {
                let client = redis::Client::open(url).unwrap();
                let mut conn = client.get_multiplexed_async_connection().await.unwrap();
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg(&pattern)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                for chunk in keys.chunks(1000) {
                    let _: () = redis::cmd("DEL").arg(chunk).query_async(&mut conn).await.unwrap();
                }
            })
            .await
            .unwrap();
    }
    let _ = std::fs::remove_dir_all(dir);
}
