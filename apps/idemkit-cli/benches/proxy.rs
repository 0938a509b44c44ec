//! What `idemkit proxy` adds in front of an upstream, measured in one run.
//!
//! `cargo bench -p idemkit-cli --bench proxy` starts, in this process and over
//! loopback HTTP, the quickstart's order write as the upstream (`POST /orders`:
//! parse and validate the JSON order, insert it in its own SQLite transaction,
//! answer `201` with it; it ignores idempotency keys), and `idemkit proxy`'s
//! router in front of it on a SQLite key store (three times: as the proxy opens
//! it by default, syncing each claim; with `--sqlite-synchronous full`, row
//! `sqlite-full`; with `normal`, row `sqlite-nrm`), and on PostgreSQL and Redis when
//! `IDEMKIT_TEST_POSTGRES_URL` / `IDEMKIT_TEST_REDIS_URL` are set. It then
//! measures direct and through the proxy side by side, with a fresh key per
//! request, and prints per store (first, row `pass`: the same write on a
//! route the proxy does not key, so the proxy only forwards it: the floor the
//! keyed rows add their store's claim and completion to):
//!
//! - throughput through the proxy ÷ direct (median of 3 rounds, each of 5
//!   slices alternating direct and proxied; 16 concurrent callers), and
//! - latency p50 and p99 of sequential requests, one direct and one through
//!   the proxy in turn, and the proxy's added p50 ÷ the upstream's own p50 (the
//!   issue's target: below 1, the proxy adds less than the upstream's own
//!   request costs), and
//! - the store's share: the p50 of a claim and its completion, sequential,
//!   on a second handle of the proxy's store opened as the proxy opens it,
//!   and that ÷ the upstream's own p50. What a keyed row adds is roughly the
//!   `pass` row's forwarding plus this pair.
//!
//! Single absolute times on a shared machine are noise; compare the ratios.
//! `IDEMKIT_BENCH_REQUESTS` sets the requests per round (default 2000).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse};
use idemkit_proxy::{ProxyOptions, SqliteSync, router};
use idemkit_sqlite::SqliteStore;

const ROUNDS: usize = 3;
/// Slices per round, alternating direct and through the proxy.
const SLICES: usize = 5;
const CONCURRENCY: usize = 16;
const BODY: &str = r#"{"sku":"BENCH-1","quantity":2}"#;

fn requests() -> usize {
    std::env::var("IDEMKIT_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000)
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NewOrder {
    sku: String,
    quantity: i64,
}

#[derive(serde::Serialize)]
struct Order {
    id: i64,
    sku: String,
    quantity: i64,
}

/// The upstream: the quickstart's order write without idempotency (as the
/// quickstart's Redis variant and the peers harness's bare setup run it):
/// validate, `BEGIN IMMEDIATE` through the store's writer queue, one
/// `INSERT … RETURNING id`, `COMMIT`, `201` with the order and a `Location`.
async fn create(
    State(db): State<Arc<SqliteStore>>,
    axum::Json(o): axum::Json<NewOrder>,
) -> Result<axum::response::Response, StatusCode> {
    if o.sku.trim().is_empty() || o.sku.len() > 100 || o.quantity < 1 {
        return Err(StatusCode::UNPROCESSABLE_ENTITY);
    }
    let mut tx = db.begin().await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    let id: i64 =
        sqlx::query_scalar("INSERT INTO orders (account, sku, quantity) VALUES (?1, ?2, ?3) RETURNING id")
            .bind("bench")
            .bind(&o.sku)
            .bind(o.quantity)
            .fetch_one(&mut *tx)
            .await
            .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    tx.commit().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
    let order = Order {
        id,
        sku: o.sku,
        quantity: o.quantity,
    };
    Ok((
        StatusCode::CREATED,
        [(http::header::LOCATION, format!("/orders/{id}"))],
        axum::Json(order),
    )
        .into_response())
}

async fn sink(body: axum::body::Bytes) -> (StatusCode, String) {
    (StatusCode::CREATED, body.len().to_string())
}

/// Peak memory of a real `idemkit proxy` process under `concurrent` keyed
/// requests of `size` bytes each, all at once: its `VmHWM` before and after.
async fn peak_memory(upstream: &str, concurrent: usize, size: usize) {
    use std::io::BufRead;
    let dir = tempdir("memory");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemkit"))
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
        .arg("--database-url")
        .arg(format!("sqlite://{}", dir.join("keys.db").display()))
        .args(["--max-request-body", &(size + 1024).to_string()])
        .env("IDEMKIT_PROXY_SECRET", "bench")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    let base = first
        .trim()
        .trim_start_matches("idemkit proxy listening on ")
        .to_owned();
    let hwm = |pid: u32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    };
    let before = hwm(child.id());
    let body = axum::body::Bytes::from(vec![b'x'; size]);
    let http = reqwest::Client::new();
    let answers = futures::future::join_all((0..concurrent).map(|i| {
        let (http, url, body) = (http.clone(), format!("{base}/sink"), body.clone());
        async move {
            http.post(url)
                .header("authorization", "Bearer bench")
                .header("idempotency-key", format!("mem-{i}"))
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    }))
    .await;
    let after = hwm(child.id());
    let _ = child.kill();
    let _ = child.wait();
    let ok = answers.iter().filter(|s| **s == 201).count();
    let refused = answers.iter().filter(|s| **s == 503).count();
    let other = answers.len() - ok - refused;
    println!(
        "memory: {concurrent} concurrent {} KiB keyed requests: peak RSS {} MB (idle {} MB); {ok} stored, {refused} answered 503 \
         by the in-flight body budget (--max-inflight-body-bytes, default 64 MiB), {other} cut off while still sending",
        size >> 10,
        after >> 10,
        before >> 10
    );
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idemkit-bench-proxy-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    // As `idemkit proxy` serves.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    base
}

async fn upstream() -> String {
    let db = SqliteStore::connect(tempdir("upstream").join("orders.db"))
        .await
        .unwrap();
    sqlx::query(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY AUTOINCREMENT, account TEXT NOT NULL, sku TEXT NOT NULL, \
         quantity INTEGER NOT NULL)",
    )
    .execute(db.pool())
    .await
    .unwrap();
    serve(
        Router::new()
            .route("/orders", post(create))
            // The same write on a route the `pass` row's proxy does not key.
            .route("/plain", post(create))
            // Takes any body, for the memory row.
            .route("/sink", post(sink))
            .with_state(Arc::new(db)),
    )
    .await
}

/// The proxy's router served on loopback: its base URL, and the key store
/// opened as the proxy opens it (a second handle on the same store), to time
/// the store's own claim and completion.
async fn proxy(
    upstream: &str,
    database_url: String,
    sqlite_synchronous: SqliteSync,
    config: Option<std::path::PathBuf>,
) -> (String, Arc<dyn KeyStore>) {
    let mut args = ProxyOptions::new(upstream, &database_url, &format!("bench-{}", std::process::id()));
    args.config = config;
    args.sqlite_synchronous = sqlite_synchronous;
    let store = idemkit::open_store(&args.database_url, &args.open_options())
        .await
        .unwrap()
        .key_store();
    (serve(router(args).await.unwrap()).await, store)
}

#[derive(Clone)]
struct Target {
    url: String,
    http: reqwest::Client,
}

impl Target {
    fn new(base: &str) -> Self {
        Self::at(base, "/orders")
    }

    fn at(base: &str, path: &str) -> Self {
        Self {
            url: format!("{base}{path}"),
            http: reqwest::Client::builder()
                .pool_max_idle_per_host(CONCURRENCY)
                .build()
                .unwrap(),
        }
    }

    async fn send(&self, key: &str) {
        let res = self
            .http
            .post(&self.url)
            .header("authorization", "Bearer bench")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(BODY)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201, "{:?}", res.text().await);
        let _ = res.bytes().await;
    }
}

async fn drive(target: &Target, n: usize, tag: &str) -> Duration {
    let started = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|t| {
            let target = target.clone();
            let tag = tag.to_owned();
            tokio::spawn(async move {
                for i in 0..n / CONCURRENCY {
                    target.send(&format!("{tag}-{t}-{i}")).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    started.elapsed()
}

/// `n` sequential requests to each target, alternating one by one, so each pair
/// of samples is taken under the same machine conditions. Sorted latencies of
/// `a` and of `b`.
async fn latencies(a: &Target, b: &Target, n: usize, tag: &str) -> (Vec<Duration>, Vec<Duration>) {
    let (mut la, mut lb) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n {
        for (target, out, side) in [(a, &mut la, "a"), (b, &mut lb, "b")] {
            let started = Instant::now();
            target.send(&format!("{tag}-{side}-{i}")).await;
            out.push(started.elapsed());
        }
    }
    la.sort();
    lb.sort();
    (la, lb)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `n` sequential claims of a fresh key, each completed at once, on the store
/// the proxy uses (the claim with the proxy's intent, as the proxy's is): the
/// sorted time of each claim + completion pair.
async fn store_pairs(store: &dyn KeyStore, n: usize, tag: &str) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut req = idemkit_testkit::suite::claim_req(
            &idemkit_testkit::suite::scope("bench", &format!("{tag}-{i}")),
            BODY,
        );
        req.recovery_point = Some("forwarded".into());
        let started = Instant::now();
        let ClaimOutcome::Claimed(lease) = store.claim(&req).await.unwrap() else {
            panic!("a fresh key is claimed");
        };
        let response = StoredResponse {
            status: 201,
            headers: vec![],
            body: br#"{"id":1,"sku":"BENCH-1","quantity":2}"#.to_vec(),
        };
        store.complete(&req.scope, lease.token, &response).await.unwrap();
        out.push(started.elapsed());
    }
    out.sort();
    out
}

async fn measure(name: &str, direct: &Target, proxied: &Target, store: Option<&dyn KeyStore>, n: usize) {
    let run = format!("{name}-{}", std::process::id());
    drive(direct, n / 4, &format!("{run}-warm-a")).await;
    drive(proxied, n / 4, &format!("{run}-warm-b")).await;
    let mut ratios = Vec::new();
    let (mut d50, mut d99, mut p50, mut p99) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut s50 = Vec::new();
    for round in 0..ROUNDS {
        // Throughput in interleaved slices: a change of the machine's speed
        // mid-round weighs on both sides.
        let (mut a, mut b) = (Duration::ZERO, Duration::ZERO);
        for slice in 0..SLICES {
            a += drive(direct, n / SLICES, &format!("{run}-r{round}s{slice}-a")).await;
            b += drive(proxied, n / SLICES, &format!("{run}-r{round}s{slice}-b")).await;
        }
        ratios.push(a.as_secs_f64() / b.as_secs_f64());
        let (la, lb) = latencies(direct, proxied, n / 8, &format!("{run}-l{round}")).await;
        d50.push(us(pct(&la, 0.5)));
        d99.push(us(pct(&la, 0.99)));
        p50.push(us(pct(&lb, 0.5)));
        p99.push(us(pct(&lb, 0.99)));
        if let Some(store) = store {
            s50.push(us(pct(
                &store_pairs(store, n / 8, &format!("{run}-s{round}")).await,
                0.5,
            )));
        }
    }
    let (d50, d99, p50, p99) = (median(d50), median(d99), median(p50), median(p99));
    let store = if s50.is_empty() {
        format!("{:>9} {:>10}", "-", "-")
    } else {
        let s50 = median(s50);
        format!("{s50:>9.0} {:>10.2}", s50 / d50)
    };
    println!(
        "{name:<11} {:>9.2} {:>9.0} {:>9.0} {:>9.0} {:>9.0} {:>12.2} {:>12.2} {store}",
        median(ratios),
        d50,
        p50,
        d99,
        p99,
        (p50 - d50) / d50,
        (p99 - d99) / d99,
    );
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let n = requests();
    let upstream = upstream().await;
    let direct = Target::new(&upstream);
    println!(
        "idemkit proxy in front of the quickstart's order write (SQLite transaction), loopback HTTP, {n} requests per round, \
         {CONCURRENCY} concurrent callers, median of {ROUNDS} rounds of {SLICES} alternating slices"
    );
    println!(
        "{:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>12} {:>9} {:>10}",
        "store",
        "thr ratio",
        "p50 dir",
        "p50 prx",
        "p99 dir",
        "p99 prx",
        "added/own50",
        "added/own99",
        "store p50",
        "store/own50"
    );
    // The proxy's forwarding alone: a route it does not key, so no store is
    // touched. What the keyed rows add beyond it is their store's two writes.
    {
        let dir = tempdir("pass");
        let config = dir.join("idemkit.toml");
        std::fs::write(&config, "[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\n").unwrap();
        let sqlite = format!("sqlite://{}", dir.join("keys.db").display());
        let (base, _) = proxy(&upstream, sqlite, SqliteSync::Claims, Some(config)).await;
        let (direct, proxied) = (Target::at(&upstream, "/plain"), Target::at(&base, "/plain"));
        measure("pass", &direct, &proxied, None, n).await;
    }
    for (name, sync) in [
        ("sqlite", SqliteSync::Claims),
        ("sqlite-full", SqliteSync::Full),
        ("sqlite-nrm", SqliteSync::Normal),
    ] {
        let sqlite = format!("sqlite://{}", tempdir(name).join("keys.db").display());
        let (base, store) = proxy(&upstream, sqlite, sync, None).await;
        measure(name, &direct, &Target::new(&base), Some(&*store), n).await;
    }
    for (name, var) in [
        ("postgres", "IDEMKIT_TEST_POSTGRES_URL"),
        ("redis", "IDEMKIT_TEST_REDIS_URL"),
    ] {
        if let Some(url) = env(var) {
            let (base, store) = proxy(&upstream, url, SqliteSync::Claims, None).await;
            measure(name, &direct, &Target::new(&base), Some(&*store), n).await;
        }
    }
    peak_memory(&upstream, 300, 1 << 20).await;
    println!(
        "thr ratio = throughput through the proxy ÷ direct; p50/p99 in µs of sequential requests; \
         added/own = (proxy − direct) ÷ direct: below 1, the proxy adds less than the upstream's own request costs; \
         store p50 = a claim and its completion on the proxy's store, sequential, in process (store/own: ÷ p50 dir)"
    );
}
