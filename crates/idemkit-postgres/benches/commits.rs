//! Lease mode costs phases + 1 commits per request, measured from
//! `pg_stat_database.xact_commit` on a database created for the run.
//!
//! `IDEMKIT_TEST_POSTGRES_URL=postgres://… cargo bench -p idemkit-postgres --bench commits`
//!
//! Each request: a lease-mode claim (its own commit), then P phases, each one
//! fenced transaction writing a business row; the last phase also stores the
//! response. Commits are read after the pool closes (a backend flushes its
//! statistics when it exits), for two run lengths, so the constant cost of
//! connecting and migrating cancels out: commits/request = Δcommits ÷ Δrequests.

use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, StoredResponse, TransactionalStore};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_testkit::suite::{claim_req, scope};
use sqlx::Connection;

async fn commits(admin_url: &str, db: &str) -> i64 {
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut admin = sqlx::PgConnection::connect(admin_url).await.unwrap();
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut admin)
        .await
        .unwrap();
    sqlx::query_scalar("SELECT xact_commit FROM pg_stat_database WHERE datname = $1")
        .bind(db)
        .fetch_one(&mut admin)
        .await
        .unwrap()
}

async fn run(url: &str, phases: usize, requests: usize, tag: &str) {
    let store = PgStore::connect_with(url, PgConfig::default().with_schema("bench"))
        .await
        .unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS biz (tag TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    for i in 0..requests {
        let s = scope("bench", &format!("{tag}-{i}"));
        let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, "{}")).await.unwrap() else {
            panic!()
        };
        for p in 0..phases {
            let mut tx = store.begin_fenced(&s, lease.token).await.unwrap();
            sqlx::query("INSERT INTO biz (tag) VALUES ('x')")
                .execute(&mut *tx)
                .await
                .unwrap();
            if p + 1 == phases {
                let response = StoredResponse {
                    status: 201,
                    headers: vec![],
                    body: b"ok".to_vec(),
                };
                store
                    .complete_in_tx(tx, &s, lease.token, &response)
                    .await
                    .unwrap();
            } else {
                tx.commit().await.unwrap();
            }
        }
    }
    // Dropping the store stops its notification listener, whose connection the
    // pool would otherwise wait for.
    let pool = store.pool().clone();
    drop(store);
    pool.close().await;
}

#[tokio::main]
async fn main() {
    let Ok(base) = std::env::var("IDEMKIT_TEST_POSTGRES_URL") else {
        println!("set IDEMKIT_TEST_POSTGRES_URL to run this benchmark");
        return;
    };
    let full = std::env::args().any(|a| a == "--bench");
    let (short, long) = if full { (100, 600) } else { (5, 25) };
    let db = format!("idemkit_commits_{}", std::process::id());
    let mut admin = sqlx::PgConnection::connect(&base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let (prefix, _) = base.rsplit_once('/').unwrap();
    let url = format!("{prefix}/{db}");

    // The first run creates the schema and runs the migrations: not counted.
    run(&url, 1, 1, "warm-up").await;
    println!("{:<8} {:>18} {:>10}", "phases", "commits/request", "expected");
    let mut ok = true;
    for phases in 1..=3 {
        let c0 = commits(&base, &db).await;
        run(&url, phases, short, &format!("s{phases}")).await;
        let c1 = commits(&base, &db).await;
        run(&url, phases, long, &format!("l{phases}")).await;
        let c2 = commits(&base, &db).await;
        let per_request = ((c2 - c1) - (c1 - c0)) as f64 / (long - short) as f64;
        let expected = phases as f64 + 1.0;
        ok &= (per_request - expected).abs() < 0.05;
        println!("{phases:<8} {per_request:>18.3} {expected:>10}");
    }
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {db} WITH (FORCE)")))
        .execute(&mut admin)
        .await
        .unwrap();
    println!(
        "{}",
        if ok {
            "commits per request = phases + 1: ok"
        } else {
            "commits per request: MISSED"
        }
    );
}
