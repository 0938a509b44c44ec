//! The store's lease-mode claim + completion rate against `pgbench` running the
//! same two statements, at 1, 4 and 16 clients, in one run.
//!
//! `IDEMKIT_TEST_POSTGRES_URL=postgres://… cargo bench -p idemkit-postgres --bench pgbench`
//!
//! Each operation is what a lease-mode request costs the store outside its
//! handler: `KeyStore::claim` of a fresh key (one autocommitted statement) and
//! `KeyStore::complete` (one fenced, notifying update). `pgbench -M prepared`
//! runs the very SQL text the store sends (`claim_and_complete_sql`), with the
//! values as literals and the claim's token read back as the session's
//! `currval` of the token sequence, so the ratio is what sqlx, the pool, retries and the store's own
//! code cost on top of the database. Rounds alternate idemkit and pgbench; the
//! median round's ratio is printed (target ≥ 0.8). `IDEMKIT_BENCH_SECONDS` sets
//! each measurement's length (default 4).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse};
use idemkit_postgres::{PgConfig, PgStore, claim_and_complete_sql};
use idemkit_testkit::suite::{claim_req, scope};

const ROUNDS: usize = 3;
const CLIENTS: [usize; 3] = [1, 4, 16];

fn seconds() -> u64 {
    std::env::var("IDEMKIT_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4)
}

/// Claims and completes fresh keys from `clients` tasks for `secs`; ops/s.
async fn idemkit(store: &Arc<PgStore>, clients: usize, secs: u64, round: usize) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + Duration::from_secs(secs);
    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"{}".to_vec(),
    };
    // The request is built once (pgbench does not hash bodies either); each
    // operation only changes the key.
    let template = claim_req(&scope("bench", "template"), "{}");
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let (store, done, response) = (store.clone(), done.clone(), response.clone());
            let mut req = template.clone();
            tokio::spawn(async move {
                let mut i = 0u64;
                while Instant::now() < until {
                    req.scope = scope("bench", &format!("r{round}-c{clients}-t{c}-{i}"));
                    let ClaimOutcome::Claimed(lease) = store.claim(&req).await.unwrap() else {
                        panic!("a fresh key is claimed")
                    };
                    store.complete(&req.scope, lease.token, &response).await.unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let started = Instant::now();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
}

/// The store's statements with `$n` replaced by literals, as a pgbench script.
fn script() -> String {
    let (claim, complete) = claim_and_complete_sql();
    let fill = |sql: &str, values: &[&str]| {
        // From the highest index down, so `$1` never eats the start of `$10`.
        let mut sql = sql.to_owned();
        for (i, v) in values.iter().enumerate().rev() {
            sql = sql.replace(&format!("${}", i + 1), v);
        }
        sql.split_whitespace().collect::<Vec<_>>().join(" ")
    };
    let key = "'pgbench-' || :k";
    let claim = fill(
        &claim,
        &[
            "'bench'",
            key,
            "decode(repeat('ab', 32), 'hex')",
            "NULL",
            "30000",
            "'POST'",
            "'/orders'",
            "'[]'",
            "decode('7b7d', 'hex')",
            "false",
        ],
    );
    let complete = fill(
        &complete,
        // The claim's token: the session's last value of the token sequence.
        &[
            "'bench'",
            key,
            "currval('idemkit_fencing_seq')",
            "NULL",
            "201",
            "'[]'",
            "decode('7b7d', 'hex')",
        ],
    );
    format!(
        "\\set k random(1, 9000000000000000000)\n\
         {claim};\n\
         {complete};\n"
    )
}

fn pgbench(url: &str, schema: &str, script: &std::path::Path, clients: usize, secs: u64) -> f64 {
    let out = std::process::Command::new("pgbench")
        .args(["-n", "-M", "prepared", "-c", &clients.to_string()])
        .args(["-j", &clients.min(2).to_string(), "-T", &secs.to_string(), "-f"])
        .arg(script)
        .arg(url)
        .env("PGOPTIONS", format!("-c search_path={schema}"))
        .output()
        .expect("run pgbench");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "pgbench failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text.lines()
        .find_map(|l| l.strip_prefix("tps = "))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no tps in pgbench's output: {text}"))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let Ok(url) = std::env::var("IDEMKIT_TEST_POSTGRES_URL") else {
        return eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: nothing to measure");
    };
    if std::process::Command::new("pgbench")
        .arg("--version")
        .output()
        .is_err()
    {
        return eprintln!("pgbench is not installed (Debian: postgresql-client): nothing to compare with");
    }
    // `cargo test --benches` runs this too: a short smoke pass there.
    let full = std::env::args().any(|a| a == "--bench");
    let (rounds, secs) = if full { (ROUNDS, seconds()) } else { (1, 1) };
    let schema = format!("pgbench_{}", std::process::id());
    let store = Arc::new(
        PgStore::connect(
            &url,
            PgConfig {
                schema: schema.clone(),
                max_connections: 20,
                ..PgConfig::default()
            },
        )
        .await
        .unwrap(),
    );
    let dir = std::env::temp_dir().join(format!("idemkit-pgbench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("claim_complete.sql");
    std::fs::write(&file, script()).unwrap();

    println!("lease-mode claim + completion of a fresh key: idemkit's PgStore ÷ pgbench, same SQL");
    println!(
        "{:>8} {:>14} {:>14} {:>8}   per round",
        "clients", "idemkit ops/s", "pgbench tps", "ratio"
    );
    for clients in CLIENTS {
        let (mut ours, mut theirs, mut ratios) = (vec![], vec![], vec![]);
        for round in 0..rounds {
            let (a, b) = if round % 2 == 0 {
                let a = idemkit(&store, clients, secs, round).await;
                (a, pgbench(&url, &schema, &file, clients, secs))
            } else {
                let b = pgbench(&url, &schema, &file, clients, secs);
                (idemkit(&store, clients, secs, round).await, b)
            };
            ours.push(a);
            theirs.push(b);
            ratios.push(a / b);
        }
        let rounds_text = ratios
            .iter()
            .map(|r| format!("{r:.2}"))
            .collect::<Vec<_>>()
            .join(" / ");
        let ratio = median(ratios);
        println!(
            "{clients:>8} {:>14.0} {:>14.0} {ratio:>8.2}   {rounds_text}{}",
            median(ours),
            median(theirs),
            if ratio >= 0.8 {
                ""
            } else {
                "   (target 0.8 MISSED)"
            }
        );
    }
    let pool = store.pool().clone();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
    drop(store);
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
