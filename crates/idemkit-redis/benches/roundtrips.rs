//! Round trips per request and throughput: the Redis store against the SQLite
//! store, same claim + complete loop, same run.
//!
//! `cargo bench -p idemkit-redis --bench roundtrips`
//!
//! Starts private `redis-server` processes on free loopback ports (so
//! `INFO commandstats` counts only this benchmark): no persistence, AOF with
//! `appendfsync everysec`, AOF with `appendfsync always`, and a primary with one
//! replica under `WAIT 1`. Without `redis-server` on the PATH it measures the
//! server at `IDEMKIT_TEST_REDIS_URL` instead (commands of other clients would
//! then be counted too). `IDEMKIT_BENCH_REQUESTS` sets requests per run (default 2000).

#[path = "../tests/all/harness.rs"]
mod harness;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_sqlite::SqliteStore;
use idemkit_testkit::suite::{claim_req, response, scope};

/// Commands the store's scripts run inside Redis (not round trips).
const IN_SCRIPT: &[&str] = &[
    "hmget", "hset", "hget", "hincrby", "hdel", "del", "pexpire", "publish", "spublish",
];
/// Commands a replica sends its primary (`WAIT` asks replicas for an ack).
const REPLICATION: &[&str] = &["replconf", "psync", "sync", "ping"];

fn commandstats(url: &str) -> BTreeMap<String, u64> {
    let client = redis::Client::open(url).expect("url");
    let mut conn = client.get_connection().expect("connect for INFO");
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query(&mut conn)
        .expect("INFO");
    info.lines()
        .filter_map(|l| {
            let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
            let calls = rest
                .split(',')
                .find_map(|kv| kv.strip_prefix("calls="))?
                .parse()
                .ok()?;
            Some((name.to_owned(), calls))
        })
        .collect()
}

/// Runs `n` claim + complete requests on `workers` concurrent tasks; returns requests/s.
async fn run(store: Arc<dyn KeyStore>, tag: &str, n: usize, workers: usize) -> f64 {
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for w in 0..workers {
        let store = store.clone();
        let tag = tag.to_owned();
        set.spawn(async move {
            let mut i = w;
            while i < n {
                let s = scope(&format!("acct-{}", i % 64), &format!("{tag}-{i}"));
                let req = claim_req(&s, r#"{"sku":"A","quantity":1}"#);
                let ClaimOutcome::Claimed(lease) = store.claim(&req).await.expect("claim") else {
                    panic!("fresh key not claimed");
                };
                store
                    .complete(&s, lease.token, &response(201, r#"{"id":1}"#))
                    .await
                    .expect("complete");
                i += workers;
            }
        });
    }
    while let Some(r) = set.join_next().await {
        r.expect("worker");
    }
    n as f64 / started.elapsed().as_secs_f64()
}

struct Row {
    name: String,
    per_request: Option<BTreeMap<String, f64>>,
    rps: Vec<f64>,
}

const CONCURRENCY: [usize; 2] = [1, 16];

async fn measure_redis(name: &str, url: &str, config: RedisConfig, n: usize) -> Row {
    let store: Arc<dyn KeyStore> = Arc::new(RedisStore::connect_with(url, config).await.expect("connect"));
    run(store.clone(), "warmup", 100, 4).await;
    let before = commandstats(url);
    run(store.clone(), "counted", n, 1).await;
    let after = commandstats(url);
    let mut per_request = BTreeMap::new();
    for (cmd, calls) in &after {
        let delta = calls - before.get(cmd).copied().unwrap_or(0);
        // One INFO is the measurement itself.
        let delta = if cmd == "info" {
            delta.saturating_sub(1)
        } else {
            delta
        };
        if delta > 0 {
            per_request.insert(cmd.clone(), delta as f64 / n as f64);
        }
    }
    let mut rps = Vec::new();
    for workers in CONCURRENCY {
        rps.push(run(store.clone(), &format!("tp{workers}"), n, workers).await);
    }
    Row {
        name: name.to_owned(),
        per_request: Some(per_request),
        rps,
    }
}

fn main() {
    let n: usize = std::env::var("IDEMKIT_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut rows = Vec::new();
        let prefix = format!("idemkit-bench:{}", std::process::id());

        // SQLite first: the reference every ratio is against.
        let dir = std::env::temp_dir().join(format!("idemkit-redis-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sqlite: Arc<dyn KeyStore> = Arc::new(SqliteStore::connect(dir.join("keys.db")).await.expect("sqlite"));
        run(sqlite.clone(), "warmup", 100, 4).await;
        let mut rps = Vec::new();
        for workers in CONCURRENCY {
            rps.push(run(sqlite.clone(), &format!("tp{workers}"), n, workers).await);
        }
        rows.push(Row {
            name: "SQLite (WAL, synchronous=NORMAL)".into(),
            per_request: None,
            rps,
        });

        let have_server = std::process::Command::new("redis-server")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success());
        if have_server {
            for (name, extra) in [
                ("Redis, no persistence", &["--appendonly", "no"][..]),
                ("Redis, AOF appendfsync everysec", &["--appendonly", "yes", "--appendfsync", "everysec"][..]),
                ("Redis, AOF appendfsync always", &["--appendonly", "yes", "--appendfsync", "always"][..]),
            ] {
                let server = harness::Standalone::start(extra);
                let config = RedisConfig::default().with_prefix(prefix.clone());
                rows.push(measure_redis(name, &server.url(), config, n).await);
            }
            let primary = harness::Standalone::start(&[]);
            let replica =
                harness::Standalone::start(&["--replicaof", "127.0.0.1", &primary.node.port.to_string()]);
            let start = Instant::now();
            while !harness::cli(replica.node.port, &["INFO", "replication"]).contains("master_link_status:up") {
                assert!(start.elapsed() < Duration::from_secs(20), "replica never synced");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let config = RedisConfig::default()
                .with_prefix(prefix.clone())
                .with_wait_replicas(1, Duration::from_secs(1));
            rows.push(measure_redis("Redis + 1 replica, WAIT 1", &primary.url(), config, n).await);
        } else {
            let url = std::env::var("IDEMKIT_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
            println!("note: redis-server not found; measuring {url} (other clients' commands count too)");
            let config = RedisConfig::default().with_prefix(prefix.clone());
            rows.push(measure_redis("Redis (as configured)", &url, config, n).await);
        }
        let _ = std::fs::remove_dir_all(&dir);

        println!();
        println!("Commands per request (claim + complete of a new key), from INFO commandstats deltas over {n} sequential requests");
        println!();
        println!("| store | round trips / request | client commands / request | run inside the scripts / request |");
        println!("|---|---:|---|---|");
        for row in &rows {
            let Some(per) = &row.per_request else { continue };
            let (inside, outside): (Vec<_>, Vec<_>) = per
                .iter()
                .filter(|(c, _)| !REPLICATION.contains(&c.as_str()))
                .partition(|(c, _)| IN_SCRIPT.contains(&c.as_str()));
            let fmt = |v: &[(&String, &f64)]| {
                v.iter()
                    .map(|(c, x)| format!("{} {x:.2}", c.to_uppercase()))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            // `WAIT` travels in the same pipeline as its script: one round trip for both.
            let round_trips: f64 = outside.iter().filter(|(c, _)| c.as_str() != "wait").map(|(_, x)| **x).sum();
            println!("| {} | {round_trips:.2} | {} | {} |", row.name, fmt(&outside), fmt(&inside));
        }
        let base = rows[0].rps.clone();
        println!();
        println!("Throughput, claim + complete per second ({n} requests per cell; ratio = this store / SQLite in the same run)");
        println!();
        let header: Vec<String> = CONCURRENCY.iter().map(|c| format!("{c} concurrent")).collect();
        println!("| store | {} |", header.join(" | "));
        println!("|---|{}", "---:|".repeat(CONCURRENCY.len()));
        for row in &rows {
            let cells: Vec<String> = row
                .rps
                .iter()
                .zip(&base)
                .map(|(r, b)| format!("{r:.0}/s (x{:.2})", r / b))
                .collect();
            println!("| {} | {} |", row.name, cells.join(" | "));
        }
    });
}
