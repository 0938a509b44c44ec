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
//!
//! A second table is what the SQL alone costs the layer's single-step ratio:
//! pgbench (16 clients, prepared) runs the quickstart's order transaction bare
//! (`BEGIN`; insert; `COMMIT`), bare with two empty statements (`SELECT 1`),
//! and with the single-step layer's statements (the store's opening, a
//! function that takes the key's try-lock and checks that it has no record;
//! the insert; the completion function; `COMMIT`), each ÷ bare. The last two
//! send as many statements, so their quotient is the record's own cost in the
//! database. Then both as they are sent (simple protocol, `\;` joining
//! statements): bare, and the layer's opening (`BEGIN` and function call in
//! one round trip), insert, and completion with its `COMMIT`, three round
//! trips, the handler's own; the second ÷ the first is the most the layer's
//! single-step ratio can reach against this database with nothing but the
//! SQL it must send, no Rust, no HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse};
use idemkit_postgres::testing::{claim_and_complete_sql, single_step_sql};
use idemkit_postgres::{PgConfig, PgStore};
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
    let key = "'pgbench-' || :k";
    let claim = fill_claim(&claim, key, "7b7d");
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

/// `$n` in `sql` replaced by `values[n - 1]`, on one line.
fn fill(sql: &str, values: &[&str]) -> String {
    // From the highest index down, so `$1` never eats the start of `$10`.
    let mut sql = sql.to_owned();
    for (i, v) in values.iter().enumerate().rev() {
        sql = sql.replace(&format!("${}", i + 1), v);
    }
    sql.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The lease-mode claim's text with its parameters as literals: account
/// `bench`, key `key` (an SQL expression), a POST to `/orders` whose body is
/// `body_hex`, a 30 s lease, the database's clock, not a resume, no
/// recovery point, no attempt id.
fn fill_claim(claim: &str, key: &str, body_hex: &str) -> String {
    let body = format!("decode('{body_hex}', 'hex')");
    fill(
        claim,
        &[
            "'bench'",
            key,
            "decode(repeat('ab', 32), 'hex')",
            "NULL",
            "30000",
            "'POST'",
            "'/orders'",
            "'[]'",
            &body,
            "false",
            "NULL",
            // No attempt id: pgbench never re-reads a lost reply.
            "NULL",
        ],
    )
}

/// The quickstart's order insert, as its handler sends it.
const ORDER_INSERT: &str =
    "INSERT INTO orders (account, sku, quantity) VALUES ('bench', 'SKU-1', 2) RETURNING id";

/// The order transaction bare, bare with two empty statements, and with the
/// single-step layer's statements, one statement per line (pgbench's prepared
/// mode sends one per round trip; the layer sends the opening's `BEGIN` and
/// its try-lock and absence check together, and the completion with the
/// `COMMIT`: the handler's three round trips).
fn order_scripts(schema: &str) -> [(&'static str, String); 6] {
    // pgbench cannot compute the store's lock id per key; the script uses the
    // key's number itself, which is as cheap for the server.
    let key = "('ss-' || :k)";
    let begin = single_step_sql(None, 0, schema, &scope("bench", "PLACEHOLDER"))
        .replace("_open(0,", "_open(:k,")
        .replace("E'bench'", "'bench'")
        .replace("E'PLACEHOLDER'", key);
    let complete = format!(
        "SELECT {schema}.idemkit_insert_single_step_at_commit('bench'::text, {key}::text, \
         NULL::bigint, NULL::bigint, 30000::bigint, \
         decode(repeat('ab', 32), 'hex')::bytea, NULL::text, 'POST'::text, '/orders'::text, \
         '[]'::text, decode('7b22736b75223a22534b552d31222c227175616e74697479223a327d', 'hex')::bytea, \
         201::integer, '[[\"location\",\"/orders/1\"]]'::text, \
         decode('7b226964223a312c22736b75223a22534b552d31222c227175616e74697479223a327d', 'hex')::bytea)"
    );
    [
        (
            "bare (3 statements)",
            format!("BEGIN;\n{ORDER_INSERT};\nCOMMIT;\n"),
        ),
        (
            "bare + 2 empty (5)",
            format!("BEGIN;\nSELECT 1;\n{ORDER_INSERT};\nSELECT 1;\nCOMMIT;\n"),
        ),
        (
            "single-step layer (5)",
            format!(
                "\\set k random(1, 9000000000000000000)\n{};\n{ORDER_INSERT};\n{complete};\nCOMMIT;\n",
                begin.replace("; ", ";\n")
            ),
        ),
        // As sent: simple protocol (`\;` joins statements into one round
        // trip), so the round trips are the handler's own on both sides.
        (
            "bare, as sent (3 trips)",
            format!("BEGIN;\n{ORDER_INSERT};\nCOMMIT;\n"),
        ),
        (
            "layer, as sent (3 trips)",
            format!(
                "\\set k random(1, 9000000000000000000)\n{};\n{ORDER_INSERT};\n{complete} \\; COMMIT;\n",
                begin.replace("; ", " \\; ")
            ),
        ),
        // The reference: the leanest single-step form with the same guarantee
        // (see `MINIMAL_SCHEMA`): the same try-lock and absence check, the
        // order insert, one insert of a narrow completed record fused with
        // the `COMMIT`.
        (
            "minimal, as sent (3 trips)",
            format!(
                "\\set k random(1, 9000000000000000000)\n\
                 BEGIN \\; SELECT {schema}.minimal_open(:k, 'bench'::text, {key}::text);\n\
                 {ORDER_INSERT};\n\
                 INSERT INTO {schema}.minimal_keys VALUES ('bench', {key}, decode(repeat('ab', 32), 'hex'), \
                 'completed', 201, '[[\"location\",\"/orders/1\"]]', \
                 decode('7b226964223a312c22736b75223a22534b552d31222c227175616e74697479223a327d', 'hex')) \\; COMMIT;\n"
            ),
        ),
    ]
}

/// The minimal single-step form's tables: a record of what a replay needs
/// (account, key, fingerprint, state, status, headers, body) under its primary
/// key, and the opening that takes the key's transaction-scoped try-lock and
/// checks that no record exists, as the layer's `idemkit_single_step_open` does.
const MINIMAL_SCHEMA: &str =
    "CREATE TABLE {schema}.minimal_keys (account TEXT NOT NULL, idem_key TEXT NOT NULL, \
     fingerprint BYTEA NOT NULL, state TEXT NOT NULL, status INTEGER, headers TEXT, body BYTEA, \
     PRIMARY KEY (account, idem_key));
     CREATE FUNCTION {schema}.minimal_open(p_lock BIGINT, p_account TEXT, p_key TEXT) \
     RETURNS void LANGUAGE plpgsql AS $$ BEGIN \
       IF NOT pg_try_advisory_xact_lock(p_lock) THEN RAISE EXCEPTION 'busy' USING ERRCODE = '55P03'; END IF; \
       IF EXISTS (SELECT 1 FROM {schema}.minimal_keys WHERE account = p_account AND idem_key = p_key) THEN \
         RAISE EXCEPTION 'has a record' USING ERRCODE = 'IK003'; END IF; \
     END $$;";

/// The scripts of [`order_scripts`] from this index on run in pgbench's simple
/// protocol (the only one that sends several statements in one round trip),
/// and are divided by the first of them.
const AS_SENT: usize = 3;

fn pgbench(
    url: &str,
    schema: &str,
    script: &std::path::Path,
    clients: usize,
    secs: u64,
    simple: bool,
) -> f64 {
    let mode = if simple { "simple" } else { "prepared" };
    let out = std::process::Command::new("pgbench")
        .args(["-n", "-M", mode, "-c", &clients.to_string()])
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
        PgStore::connect_with(
            &url,
            PgConfig::default()
                .with_schema(schema.clone())
                .with_max_connections(20),
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
                (a, pgbench(&url, &schema, &file, clients, secs, false))
            } else {
                let b = pgbench(&url, &schema, &file, clients, secs, false);
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
    order_ceiling(&url, &schema, &pool, &dir, rounds, secs).await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
    drop(store);
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The second table: the order transaction's scripts under pgbench, each ÷ bare
/// (median of `rounds` alternating rounds at 16 clients).
async fn order_ceiling(
    url: &str,
    schema: &str,
    pool: &sqlx::PgPool,
    dir: &std::path::Path,
    rounds: usize,
    secs: u64,
) {
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE {schema}.orders (id BIGSERIAL PRIMARY KEY, account TEXT NOT NULL, \
         sku TEXT NOT NULL, quantity BIGINT NOT NULL)"
    )))
    .execute(pool)
    .await
    .unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(MINIMAL_SCHEMA.replace("{schema}", schema)))
        .execute(pool)
        .await
        .unwrap();
    let scripts: Vec<_> = order_scripts(schema)
        .into_iter()
        .enumerate()
        .map(|(i, (name, text))| {
            let file = dir.join(format!("order_{i}.sql"));
            std::fs::write(&file, text).unwrap();
            (name, file)
        })
        .collect();
    let clients = 16;
    let mut tps = vec![vec![]; scripts.len()];
    for round in 0..rounds {
        // Alternate the order between rounds, so no script always runs first.
        let order: Vec<usize> = if round % 2 == 0 {
            (0..scripts.len()).collect()
        } else {
            (0..scripts.len()).rev().collect()
        };
        for i in order {
            tps[i].push(pgbench(url, schema, &scripts[i].1, clients, secs, i >= AS_SENT));
        }
    }
    let (bare, bare_as_sent) = (median(tps[0].clone()), median(tps[AS_SENT].clone()));
    println!();
    println!(
        "the order transaction's SQL under pgbench alone ({clients} clients; prepared, one statement per round trip, \
         then as the layer sends it): ÷ bare of the same protocol"
    );
    println!("{:>28} {:>12} {:>8}", "", "tps", "ratio");
    for (i, ((name, _), runs)) in scripts.iter().zip(&tps).enumerate() {
        let t = median(runs.clone());
        let base = if i >= AS_SENT { bare_as_sent } else { bare };
        println!("{name:>28} {t:>12.0} {:>8.2}", t / base);
    }
    let (layer, minimal) = (median(tps[AS_SENT + 1].clone()), median(tps[AS_SENT + 2].clone()));
    println!(
        "{:>28} {:>12} {:>8.2}   (target 0.95{})",
        "layer ÷ minimal, as sent",
        "",
        layer / minimal,
        if layer / minimal >= 0.95 { "" } else { ": MISSED" }
    );
}
