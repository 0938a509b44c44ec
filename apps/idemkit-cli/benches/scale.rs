//! How a store's cost grows with the records it holds, and whether the reaper
//! keeps up.
//!
//! ```text
//! cargo bench -p idemkit-cli --bench scale [-- --smoke] [--records 1000000,10000000]
//!     [--stores sqlite,postgres,redis] [--level-seconds 600]
//! ```
//!
//! For each store and each size N, on a fresh store (a new SQLite file, a new
//! PostgreSQL schema, a new Redis key prefix):
//!
//! 1. **Empty**: K sequential first requests, each the store's part of a
//!    lease-mode first request (the claim of a fresh key and its completion),
//!    timed one by one: p50 and p99.
//! 2. **Fill**: N records written through the same two calls by 16 tasks: the
//!    sustained insert rate.
//! 3. **Full**: the same K first requests with N records in the store; p50 and
//!    p99 ÷ the empty store's (target: at most 1.2).
//! 4. Redis: bytes per stored record (`used_memory` before and after ÷ N).
//! 5. **Reap**: one reaper pass that deletes all N (every record completed
//!    before now); deletions per second ÷ the insert rate (target: at least 5).
//!    Then Redis refills N records and deletes them the leanest way (`SCAN` +
//!    `UNLINK`, no state check, no script): the floor of the reaper's rate.
//!
//! Then, from an empty store, **sustained load** for `--level-seconds` (600 by
//! default) by 16 tasks, with a reaper pass every `keep / 4` deleting what was
//! completed more than `keep` (a fifth of the run) ago; the store's size
//! (SQLite: the database file and its WAL; PostgreSQL: the key table with its
//! indexes and TOAST, `pg_total_relation_size`, with autovacuum, or, where
//! the server has it off, a `VACUUM` of the table after each reaper pass;
//! Redis: `used_memory`) is sampled twenty times. It **levels off** when the
//! largest sample of the last quarter is within 15 % of the largest of the
//! second quarter.
//!
//! `--smoke` (what CI runs, to show the command works; its figures are
//! noise): 10,000 records, 300 timed requests, 10 s of sustained load. PostgreSQL
//! and Redis read `IDEMKIT_TEST_POSTGRES_URL` and `IDEMKIT_TEST_REDIS_URL`; a
//! store whose URL is unset is skipped with a line that says so, except under
//! `CI=true`, where it fails.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore, Millis};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_sqlite::SqliteStore;
use idemkit_testkit::suite::{claim_req, response, scope};

const TASKS: usize = 16;
const BODY: &str = r#"{"sku":"SKU-1","quantity":2}"#;

/// A store under test, with what the bench needs beside the trait: its size
/// and its cleanup.
enum Backend {
    Sqlite { store: SqliteStore, dir: PathBuf },
    Postgres { store: PgStore, schema: String },
    Redis { store: RedisStore, url: String },
}

impl Backend {
    /// A fresh store of `kind`, or `None` (with the reason) when its URL is unset.
    async fn open(kind: &str, tag: &str) -> Result<Self, String> {
        let unique = format!("{tag}_{}", std::process::id());
        match kind {
            "sqlite" => {
                let dir = std::env::temp_dir().join(format!("idemkit-bench-scale-{unique}"));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
                let store = SqliteStore::connect(dir.join("keys.db"))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Self::Sqlite { store, dir })
            }
            "postgres" => {
                let url = std::env::var("IDEMKIT_TEST_POSTGRES_URL")
                    .map_err(|_| "IDEMKIT_TEST_POSTGRES_URL is not set".to_owned())?;
                let schema = format!("idemkit_scale_{unique}");
                let config = PgConfig::default()
                    .with_schema(schema.clone())
                    .with_max_connections(TASKS as u32);
                let store = PgStore::connect_with(&url, config)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Self::Postgres { store, schema })
            }
            "redis" => {
                let url = std::env::var("IDEMKIT_TEST_REDIS_URL")
                    .map_err(|_| "IDEMKIT_TEST_REDIS_URL is not set".to_owned())?;
                let prefix = format!("idemkit-scale:{unique}:");
                let store = RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(Self::Redis { store, url })
            }
            other => Err(format!("no store named {other}")),
        }
    }

    fn store(&self) -> Arc<dyn KeyStore> {
        match self {
            Self::Sqlite { store, .. } => Arc::new(store.clone()),
            Self::Postgres { store, .. } => Arc::new(store.clone()),
            Self::Redis { store, .. } => Arc::new(store.clone()),
        }
    }

    /// What the store occupies now, in bytes (see the module documentation).
    async fn size(&self) -> u64 {
        match self {
            Self::Sqlite { dir, .. } => ["keys.db", "keys.db-wal"]
                .iter()
                .filter_map(|f| std::fs::metadata(dir.join(f)).ok())
                .map(|m| m.len())
                .sum(),
            Self::Postgres { store, schema } => sqlx::query_scalar::<_, i64>(
                "SELECT pg_total_relation_size(format('%I.idemkit_keys', $1::text)::regclass)",
            )
            .bind(schema)
            .fetch_one(store.pool())
            .await
            .expect("table size") as u64,
            Self::Redis { url, .. } => {
                let mut c = redis_conn(url).await;
                let info: String = redis::cmd("INFO")
                    .arg("memory")
                    .query_async(&mut c)
                    .await
                    .expect("INFO");
                info.lines()
                    .find_map(|l| l.strip_prefix("used_memory:"))
                    .and_then(|v| v.trim().parse().ok())
                    .expect("used_memory")
            }
        }
    }

    /// PostgreSQL with autovacuum off on the server (the server's setting):
    /// the pool and table the sustained run vacuums after each reaper pass, as
    /// autovacuum would; `None` otherwise.
    async fn vacuum_for_autovacuum(&self) -> Option<(sqlx::PgPool, String)> {
        let Self::Postgres { store, schema } = self else {
            return None;
        };
        let on: String = sqlx::query_scalar("SHOW autovacuum")
            .fetch_one(store.pool())
            .await
            .expect("SHOW autovacuum");
        (on != "on").then(|| (store.pool().clone(), format!("{schema}.idemkit_keys")))
    }

    async fn cleanup(self) {
        match self {
            Self::Sqlite { dir, .. } => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Self::Postgres { store, schema } => {
                // The schema name is ours (`idemkit_scale_<tag>_<pid>`), not input.
                let sql = sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
                let _ = sqlx::query(sql).execute(store.pool()).await;
            }
            Self::Redis { store, .. } => {
                store.clear_prefix().await.expect("clear the bench's prefix");
            }
        }
    }
}

async fn redis_conn(url: &str) -> redis::aio::MultiplexedConnection {
    redis::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis connection")
}

/// The store's part of one first request under `key`: claim, complete.
async fn first_request(store: &dyn KeyStore, key: &str) {
    let s = scope("scale", key);
    let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, BODY)).await.expect("claim") else {
        panic!("a fresh key is claimed")
    };
    store
        .complete(&s, lease.token, &response(201, BODY))
        .await
        .expect("complete");
}

/// p50 and p99 of `k` sequential first requests, in microseconds.
async fn latency(store: &dyn KeyStore, tag: &str, k: usize) -> (f64, f64) {
    let mut us = Vec::with_capacity(k);
    for i in 0..k {
        let started = Instant::now();
        first_request(store, &format!("{tag}-{i}")).await;
        us.push(started.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    (us[k / 2], us[(k * 99 / 100).min(k - 1)])
}

/// Runs first requests by [`TASKS`] tasks until `stop` (or `n` of them when
/// `n` is given); returns how many ran and their rate per second.
async fn load(store: Arc<dyn KeyStore>, tag: &str, n: Option<u64>, stop: Arc<AtomicBool>) -> (u64, f64) {
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let (store, next, stop, tag) = (store.clone(), next.clone(), stop.clone(), tag.to_owned());
            tokio::spawn(async move {
                while !stop.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if n.is_some_and(|n| i >= n) {
                        break;
                    }
                    first_request(store.as_ref(), &format!("{tag}-{i}")).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("load task");
    }
    // Every index drawn was run to its end (a task checks `stop` before it draws).
    let done = n.unwrap_or_else(|| next.load(Ordering::Relaxed));
    (done, done as f64 / started.elapsed().as_secs_f64())
}

struct Args {
    records: Vec<u64>,
    stores: Vec<String>,
    level: Duration,
    samples: usize,
}

fn args() -> Args {
    let argv: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        argv.iter()
            .position(|a| a == flag)
            .and_then(|i| argv.get(i + 1))
            .cloned()
    };
    let smoke = argv.iter().any(|a| a == "--smoke");
    let records = value("--records")
        .map(|v| {
            v.split(',')
                .map(|n| n.trim().parse().expect("--records N[,N]"))
                .collect()
        })
        .unwrap_or_else(|| {
            if smoke {
                vec![10_000]
            } else {
                vec![1_000_000, 10_000_000]
            }
        });
    let stores = value("--stores")
        .map(|v| v.split(',').map(str::to_owned).collect())
        .unwrap_or_else(|| vec!["sqlite".into(), "postgres".into(), "redis".into()]);
    let level = Duration::from_secs(
        value("--level-seconds")
            .map(|v| v.parse().expect("--level-seconds S"))
            .unwrap_or(if smoke { 10 } else { 600 }),
    );
    Args {
        records,
        stores,
        level,
        samples: if smoke { 300 } else { 2_000 },
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args = args();
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    println!(
        "scale: stores {:?}, sizes {:?}, {} timed first requests each, {} s of sustained load",
        args.stores,
        args.records,
        args.samples,
        args.level.as_secs()
    );
    for kind in &args.stores {
        for &n in &args.records {
            let backend = match Backend::open(kind, &format!("n{n}")).await {
                Ok(b) => b,
                Err(e) if !ci => {
                    println!("{kind}: skipped ({e})");
                    break;
                }
                Err(e) => panic!("{kind}: {e}"),
            };
            grows(kind, &backend, n, args.samples).await;
            backend.cleanup().await;
        }
        if let Ok(backend) = Backend::open(kind, "level").await {
            levels(kind, &backend, args.level).await;
            backend.cleanup().await;
        }
    }
}

/// Steps 1–5 of the module documentation for `n` records.
async fn grows(kind: &str, backend: &Backend, n: u64, samples: usize) {
    let store = backend.store();
    let (e50, e99) = latency(store.as_ref(), "empty", samples).await;
    let bytes_before = backend.size().await;
    let (_, insert_rate) = load(store.clone(), "fill", Some(n), Arc::new(AtomicBool::new(false))).await;
    let bytes_after = backend.size().await;
    let (f50, f99) = latency(store.as_ref(), "full", samples).await;
    let started = Instant::now();
    let reaped = store.reap(Millis(store.now().0 + 1)).await.expect("reap");
    let delete_rate = reaped.deleted as f64 / started.elapsed().as_secs_f64();
    println!("{kind}, {n} records:");
    println!("  first request, empty store: p50 {e50:.0} µs, p99 {e99:.0} µs");
    println!(
        "  first request, {n} records: p50 {f50:.0} µs ({:.2}×), p99 {f99:.0} µs ({:.2}×)   (target ≤ 1.2×{})",
        f50 / e50,
        f99 / e99,
        if f50 / e50 <= 1.2 && f99 / e99 <= 1.2 {
            ""
        } else {
            ": MISSED"
        }
    );
    println!(
        "  {} {} per record",
        if kind == "redis" { "memory" } else { "size" },
        human((bytes_after.saturating_sub(bytes_before)) / n.max(1))
    );
    println!(
        "  insert rate {insert_rate:.0}/s ({TASKS} tasks); reaper deleted {} at {delete_rate:.0}/s: {:.1}× the insert rate   (target ≥ 5×{})",
        reaped.deleted,
        delete_rate / insert_rate,
        if delete_rate >= 5.0 * insert_rate {
            ""
        } else {
            ": MISSED"
        }
    );
    if let Backend::Redis { store: redis, .. } = backend {
        // The leanest deletion of the same records on the same server, the
        // floor the reaper's rate is judged against: a `SCAN` of the prefix
        // and `UNLINK` of every key in batches, with no state check and no
        // script (`RedisStore::clear_prefix`).
        load(store.clone(), "refill", Some(n), Arc::new(AtomicBool::new(false))).await;
        let started = Instant::now();
        redis.clear_prefix().await.expect("clear the bench's prefix");
        let floor = n as f64 / started.elapsed().as_secs_f64();
        println!(
            "  leanest deletion of the same {n} records (SCAN + UNLINK, no state check): {floor:.0}/s, {:.1}× the insert rate; the reaper runs at {:.2} of it",
            floor / insert_rate,
            delete_rate / floor
        );
    }
}

/// The sustained-load run of the module documentation.
async fn levels(kind: &str, backend: &Backend, run: Duration) {
    let store = backend.store();
    let keep = run / 5;
    let stop = Arc::new(AtomicBool::new(false));
    let loader = tokio::spawn(load(store.clone(), "level", None, stop.clone()));
    let vacuum = backend.vacuum_for_autovacuum().await;
    if vacuum.is_some() {
        println!(
            "{kind}: autovacuum is off on this server: the run vacuums the key table after each reaper pass"
        );
    }
    let reaper = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut deleted = 0;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep(keep / 4).await;
                let before = Millis(store.now().0 - keep.as_millis() as i64);
                deleted += store.reap(before).await.expect("reap").deleted;
                if let Some((pool, table)) = &vacuum {
                    // The table name is ours (`idemkit_scale_<tag>_<pid>`), not input.
                    let sql = sqlx::AssertSqlSafe(format!("VACUUM {table}"));
                    sqlx::query(sql).execute(pool).await.expect("VACUUM");
                }
            }
            deleted
        })
    };
    let mut sizes = Vec::new();
    for _ in 0..20 {
        tokio::time::sleep(run / 20).await;
        sizes.push(backend.size().await);
    }
    stop.store(true, Ordering::Relaxed);
    let (written, rate) = loader.await.expect("loader");
    let deleted = reaper.await.expect("reaper");
    let second = sizes[5..10].iter().copied().max().unwrap_or(0);
    let last = sizes[15..20].iter().copied().max().unwrap_or(0);
    println!(
        "{kind}, sustained load for {} s: {written} written ({rate:.0}/s), {deleted} reaped (kept {} s); size {}",
        run.as_secs(),
        keep.as_secs(),
        sizes.iter().map(|b| human(*b)).collect::<Vec<_>>().join(" ")
    );
    println!(
        "  last quarter's peak {} ÷ second quarter's {}: {:.2}   ({})",
        human(last),
        human(second),
        last as f64 / second.max(1) as f64,
        if last as f64 <= 1.15 * second as f64 {
            "levels off"
        } else {
            "STILL GROWING"
        }
    );
}

fn human(bytes: u64) -> String {
    if bytes >= 10 << 20 {
        format!("{} MB", bytes >> 20)
    } else if bytes >= 10 << 10 {
        format!("{} KB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}
