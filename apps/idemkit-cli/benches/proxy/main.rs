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
//! Beside the Redis rows, rows `lean` and `lean/pg-up` put the leanest proxy
//! that keeps the guarantee (`lean.rs`: one `SET NX` before the forward, one
//! `SET` of the answer after it) in the same place: the ceiling any proxy on
//! Redis keys reaches on this machine.
//!
//! Single absolute times on a shared machine are noise; compare the ratios.
//! `IDEMKIT_BENCH_REQUESTS` sets the requests per round (default 2000).
//! `IDEMKIT_BENCH_ONLY` runs only the rows it names, comma-separated (for
//! example `pass,redis/pg-up,memory`; without `pass` the bounds print `-`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse};
use idemkit_proxy::{ProxyOptions, SqliteSync};
use idemkit_sqlite::SqliteStore;

mod lean;
mod memory;

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

/// The same order write committed durably to PostgreSQL (its own
/// transaction, `synchronous_commit` as the server has it, on by default).
async fn create_pg(
    State(pg): State<Arc<(sqlx::PgPool, String)>>,
    axum::Json(o): axum::Json<NewOrder>,
) -> Result<axum::response::Response, StatusCode> {
    if o.sku.trim().is_empty() || o.sku.len() > 100 || o.quantity < 1 {
        return Err(StatusCode::UNPROCESSABLE_ENTITY);
    }
    let (pool, table) = &*pg;
    let mut tx = pool.begin().await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
    let id: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (account, sku, quantity) VALUES ($1, $2, $3) RETURNING id"
    )))
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
    Ok((StatusCode::CREATED, axum::Json(order)).into_response())
}

async fn sink(body: axum::body::Bytes) -> (StatusCode, String) {
    (StatusCode::CREATED, body.len().to_string())
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

async fn upstream(pg: Option<Arc<(sqlx::PgPool, String)>>) -> String {
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
    let mut app = Router::new();
    if let Some(pg) = pg {
        app = app.route("/pg-orders", post(create_pg).with_state(pg));
    }
    serve(
        app.route("/orders", post(create))
            // The same write on a route the `pass` row's proxy does not key.
            .route("/plain", post(create))
            // Takes any body, for the memory row.
            .route("/sink", post(sink))
            .with_state(Arc::new(db)),
    )
    .await
}

/// The base URL a spawned proxy prints on its first line (`PREFIX URL`).
fn listening_on(child: &mut std::process::Child, prefix: &str) -> String {
    use std::io::BufRead;
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().expect("a piped stdout"))
        .read_line(&mut first)
        .unwrap();
    first.trim().trim_start_matches(prefix).to_owned()
}

/// The lean proxy (`lean.rs`): this bench's executable run again as
/// `--lean-proxy UPSTREAM REDIS_URL PREFIX`, a process of its own.
fn lean_proxy(upstream: &str, redis_url: &str) -> ProxyProcess {
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--lean-proxy",
            upstream,
            redis_url,
            &format!("{}-{}", LEAN_PREFIX, std::process::id()),
        ])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the lean proxy");
    let base = listening_on(&mut child, "lean proxy listening on ");
    ProxyProcess { child, base }
}

/// A real `idemkit proxy` process (out of this process, so the load
/// generator and the upstream here do not share its runtime), killed on drop.
struct ProxyProcess {
    child: std::process::Child,
    base: String,
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `idemkit proxy` in front of `upstream` on `database_url`, and the key store
/// opened as the proxy opens it (a second handle on the same store), to time
/// the store's own claim and completion.
async fn proxy(
    upstream: &str,
    database_url: String,
    sqlite_synchronous: &str,
    config: Option<std::path::PathBuf>,
) -> (ProxyProcess, Arc<dyn KeyStore>) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemkit"));
    cmd.args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
        .args(["--database-url", &database_url])
        .args(["--sqlite-synchronous", sqlite_synchronous])
        .env("IDEMKIT_PROXY_SECRET", format!("bench-{}", std::process::id()))
        .env_remove("RUST_LOG")
        .stdout(std::process::Stdio::piped());
    if let Some(config) = &config {
        cmd.arg("--config").arg(config);
    }
    let mut child = cmd.spawn().expect("spawn idemkit proxy");
    let base = listening_on(&mut child, "idemkit proxy listening on ");
    let mut options = ProxyOptions::new(upstream, &database_url, "bench");
    options.sqlite_synchronous = match sqlite_synchronous {
        "full" => SqliteSync::Full,
        "normal" => SqliteSync::Normal,
        _ => SqliteSync::Claims,
    };
    let (url, open) = options.store_target().unwrap();
    let store = idemkit::open_store(&url, &open).await.unwrap().key_store();
    (ProxyProcess { child, base }, store)
}

#[derive(Clone)]
struct Target {
    url: String,
    http: reqwest::Client,
    /// The proxy process behind it, whose CPU time per request is reported.
    pid: Option<u32>,
}

/// User + system CPU time of process `pid` so far, in clock ticks (1/100 s).
fn cpu_ticks(pid: Option<u32>) -> u64 {
    pid.and_then(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .and_then(|stat| {
            // The fields after the command name (which may hold spaces):
            // utime and stime are the 14th and 15th of the whole line.
            let rest = &stat[stat.rfind(')')? + 2..];
            let f: Vec<&str> = rest.split_whitespace().collect();
            Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
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
            pid: None,
        }
    }

    /// `path` on proxy process `proxy`.
    fn on(proxy: &ProxyProcess, path: &str) -> Self {
        Self {
            pid: Some(proxy.child.id()),
            ..Self::at(&proxy.base, path)
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

/// The bound of the issue's target on a keyed row: 1.25 × (the `pass`
/// row's added p50 + the store's own claim-and-complete pair p50).
fn bound(pass_added: f64, pair: f64) -> f64 {
    1.25 * (pass_added + pair)
}

/// Measures one row and prints it: its added p50 (µs), its throughput ratio,
/// and the store pair's p50 when a store is given.
async fn measure(
    name: &str,
    direct: &Target,
    proxied: &Target,
    store: Option<&dyn KeyStore>,
    n: usize,
    pass_added: Option<f64>,
) -> (f64, f64, Option<f64>) {
    let run = format!("{name}-{}", std::process::id());
    drive(direct, n / 4, &format!("{run}-warm-a")).await;
    drive(proxied, n / 4, &format!("{run}-warm-b")).await;
    let mut ratios = Vec::new();
    let (mut d50, mut d99, mut p50, mut p99) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut s50 = Vec::new();
    let mut ticks = 0;
    for round in 0..ROUNDS {
        // Throughput in interleaved slices: a change of the machine's speed
        // mid-round weighs on both sides.
        let (mut a, mut b) = (Duration::ZERO, Duration::ZERO);
        for slice in 0..SLICES {
            a += drive(direct, n / SLICES, &format!("{run}-r{round}s{slice}-a")).await;
            let before = cpu_ticks(proxied.pid);
            b += drive(proxied, n / SLICES, &format!("{run}-r{round}s{slice}-b")).await;
            ticks += cpu_ticks(proxied.pid) - before;
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
    let pair = (!s50.is_empty()).then(|| median(s50));
    let added = p50 - d50;
    let store = match pair {
        None => format!("{:>9} {:>10}", "-", "-"),
        Some(s50) => format!("{s50:>9.0} {:>10.2}", s50 / d50),
    };
    let target = match (pass_added, pair) {
        (Some(pass), Some(pair)) => {
            let b = bound(pass, pair);
            format!("{b:>9.0} {:>5}", if added <= b { "met" } else { "OVER" })
        }
        _ => format!("{:>9} {:>5}", "-", "-"),
    };
    let thr = median(ratios);
    // The proxy's own CPU per proxied request in the throughput slices.
    let cpu = match proxied.pid {
        Some(_) => format!(
            "{:>8.0}",
            ticks as f64 * 1e4 / (ROUNDS * (n / SLICES / CONCURRENCY) * CONCURRENCY * SLICES) as f64
        ),
        None => format!("{:>8}", "-"),
    };
    println!(
        "{name:<11} {thr:>9.2} {d50:>9.0} {p50:>9.0} {d99:>9.0} {p99:>9.0} {added:>9.0} {:>12.2} {store} {target} {cpu}",
        (p99 - d99) / d99,
    );
    (added, thr, pair)
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// The key prefix of this run's proxies on Redis (`?prefix=`), and of the lean
/// proxy's keys, so that the run can delete what it wrote.
const REDIS_PREFIX: &str = "idemkit-bench-proxy";
const LEAN_PREFIX: &str = "idemkit-bench-lean";

/// `IDEMKIT_TEST_REDIS_URL` with this run's key prefix.
fn redis_url() -> Option<String> {
    env("IDEMKIT_TEST_REDIS_URL").map(|url| {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}prefix={REDIS_PREFIX}-{}", std::process::id())
    })
}

/// Deletes every key this run wrote to Redis (its proxies' records and
/// tokens, the lean proxy's keys): a later run, or a test suite's reaper
/// scanning the server, does not pay for them.
async fn delete_redis_keys() {
    let Some(url) = env("IDEMKIT_TEST_REDIS_URL") else {
        return;
    };
    let Ok(mut conn) = redis::Client::open(url).and_then(|c| c.get_connection()) else {
        return;
    };
    for prefix in [REDIS_PREFIX, LEAN_PREFIX] {
        let pattern = format!("{prefix}-{}*", std::process::id());
        let keys: Vec<String> = match redis::cmd("KEYS").arg(&pattern).query(&mut conn) {
            Ok(keys) => keys,
            Err(_) => continue,
        };
        for chunk in keys.chunks(1000) {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(chunk).query(&mut conn);
        }
    }
}

/// Whether row `name` runs (`IDEMKIT_BENCH_ONLY`, comma-separated; all by default).
fn selected(name: &str) -> bool {
    env("IDEMKIT_BENCH_ONLY").is_none_or(|only| only.split(',').any(|row| row.trim() == name))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    if let [_, flag, upstream, redis_url, prefix] = &args[..]
        && flag == "--lean-proxy"
    {
        return lean::run(upstream.clone(), redis_url.clone(), prefix.clone()).await;
    }
    let n = requests();
    // The durable upstream: the order write committed to PostgreSQL.
    let pg = match env("IDEMKIT_TEST_POSTGRES_URL") {
        Some(url) => {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(CONCURRENCY as u32)
                .connect(&url)
                .await
                .unwrap();
            let table = format!("idemkit_bench_proxy_orders_{}", std::process::id());
            // The table's name is made of this process's id only.
            sqlx::query(sqlx::AssertSqlSafe(format!(
                "CREATE TABLE {table} (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, sku TEXT NOT NULL, \
                 quantity BIGINT NOT NULL)"
            )))
            .execute(&pool)
            .await
            .unwrap();
            Some(Arc::new((pool, table)))
        }
        None => None,
    };
    let upstream = upstream(pg.clone()).await;
    let direct = Target::new(&upstream);
    println!(
        "idemkit proxy (its own process) in front of the quickstart's order write (SQLite transaction), loopback HTTP, \
         {n} requests per round, {CONCURRENCY} concurrent callers, median of {ROUNDS} rounds of {SLICES} alternating slices"
    );
    println!(
        "{:<11} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>12} {:>9} {:>10} {:>9} {:>5} {:>8}",
        "store",
        "thr ratio",
        "p50 dir",
        "p50 prx",
        "p99 dir",
        "p99 prx",
        "added50",
        "added/own99",
        "store p50",
        "store/own50",
        "bound50",
        "target",
        "cpu/req"
    );
    // The proxy's forwarding alone: a route it does not key, so no store is
    // touched. What the keyed rows add beyond it is their store's two writes.
    let pass_added = if selected("pass") {
        let dir = tempdir("pass");
        let config = dir.join("idemkit.toml");
        std::fs::write(&config, "[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\n").unwrap();
        let sqlite = format!("sqlite://{}", dir.join("keys.db").display());
        let (proxy, _) = proxy(&upstream, sqlite, "claims", Some(config)).await;
        let (direct, proxied) = (Target::at(&upstream, "/plain"), Target::on(&proxy, "/plain"));
        Some(measure("pass", &direct, &proxied, None, n, None).await.0)
    } else {
        None
    };
    for (name, sync) in [
        ("sqlite", "claims"),
        ("sqlite-full", "full"),
        ("sqlite-nrm", "normal"),
    ] {
        if !selected(name) {
            continue;
        }
        let sqlite = format!("sqlite://{}", tempdir(name).join("keys.db").display());
        let (proxy, store) = proxy(&upstream, sqlite, sync, None).await;
        measure(
            name,
            &direct,
            &Target::on(&proxy, "/orders"),
            Some(&*store),
            n,
            pass_added,
        )
        .await;
    }
    for (name, var) in [
        ("postgres", "IDEMKIT_TEST_POSTGRES_URL"),
        ("redis", "IDEMKIT_TEST_REDIS_URL"),
    ] {
        let url = if name == "redis" { redis_url() } else { env(var) };
        if let Some(url) = url.filter(|_| selected(name)) {
            let (proxy, store) = proxy(&upstream, url, "claims", None).await;
            measure(
                name,
                &direct,
                &Target::on(&proxy, "/orders"),
                Some(&*store),
                n,
                pass_added,
            )
            .await;
        }
    }
    if let (Some(url), true) = (env("IDEMKIT_TEST_REDIS_URL"), selected("lean")) {
        let lean = lean_proxy(&upstream, &url);
        measure("lean", &direct, &Target::on(&lean, "/orders"), None, n, None).await;
    }
    // The issue's throughput target: an upstream whose write commits durably
    // to PostgreSQL, through the proxy on Redis keys, ≥ 0.8 of direct.
    if let (Some(pg), Some(url), true) = (&pg, redis_url(), selected("redis/pg-up")) {
        let (proxy, store) = proxy(&upstream, url.clone(), "claims", None).await;
        let (_, thr, _) = measure(
            "redis/pg-up",
            &Target::at(&upstream, "/pg-orders"),
            &Target::on(&proxy, "/pg-orders"),
            Some(&*store),
            n,
            pass_added,
        )
        .await;
        println!(
            "redis keys in front of the PostgreSQL upstream: throughput through the proxy {thr:.2} of direct (target ≥ 0.8: {})",
            if thr >= 0.8 { "met" } else { "NOT met" }
        );
        if selected("lean/pg-up") {
            let lean = lean_proxy(&upstream, &env("IDEMKIT_TEST_REDIS_URL").unwrap());
            let (_, floor, _) = measure(
                "lean/pg-up",
                &Target::at(&upstream, "/pg-orders"),
                &Target::on(&lean, "/pg-orders"),
                None,
                n,
                None,
            )
            .await;
            println!(
                "the leanest proxy on Redis keys in front of the same upstream: {floor:.2} of direct; idemkit proxy ÷ lean = {:.2}",
                thr / floor
            );
        }
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {}", pg.1)))
            .execute(&pg.0)
            .await;
    }
    if selected("memory") {
        memory::peak_memory(&upstream, 300, 1 << 20).await;
    }
    delete_redis_keys().await;
    println!(
        "thr ratio = throughput through the proxy ÷ direct; p50/p99 in µs of sequential requests; added50 = p50 prx − p50 dir; \
         added/own99 = (p99 prx − p99 dir) ÷ p99 dir; store p50 = a claim and its completion on the proxy's store, sequential, \
         in this process (store/own50: ÷ p50 dir); bound50 = 1.25 × (pass's added50 + store p50), the issue's target for \
         added50 on each keyed row; cpu/req = the proxy process's CPU time (user + system) per proxied request in the \
         throughput slices, µs"
    );
}
