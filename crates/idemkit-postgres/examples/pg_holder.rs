//! A lease holder for the fencing test: claims a key in lease mode, opens its
//! completing transaction (`begin_fenced`) and writes a business row in it, then
//! stops at a failpoint (waits for a line on stdin) with that transaction open,
//! and finally tries to complete in it.
//!
//! `pg_holder URL SCHEMA KEY LEASE_MS` prints `claimed <token>`, then
//! `in-tx <backend pid>` at the failpoint, then after the line `completed`
//! (exit 0) or `fenced` (exit 3).

use std::io::{BufRead, Write};
use std::time::Duration;

use idemkit_core::{Account, ClaimOutcome, ClaimRequest, Fingerprinter, IdempotencyKey, KeyStore, Scope};
use idemkit_core::{StoreError, StoredRequest, StoredResponse, TransactionalStore};
use idemkit_postgres::{PgConfig, PgStore};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, schema, key, lease_ms] = &args[..] else {
        eprintln!("usage: pg_holder URL SCHEMA KEY LEASE_MS");
        std::process::exit(2);
    };
    let store = PgStore::connect_with(url, PgConfig::default().with_schema(schema.clone()))
        .await
        .unwrap();
    let scope = Scope::new(Account::new("holder"), IdempotencyKey::parse(key).unwrap());
    let req = ClaimRequest {
        scope: scope.clone(),
        fingerprint: Fingerprinter::new().compute("POST", "/op", b"{}"),
        request: StoredRequest {
            method: "POST".into(),
            path: "/op".into(),
            headers: vec![],
            body: b"{}".to_vec(),
        },
        lease: Duration::from_millis(lease_ms.parse().unwrap()),
        replay_window: Duration::from_secs(3600),
        lock_wait: Duration::ZERO,
        resume: None,
        recovery_point: None,
    };
    let ClaimOutcome::Claimed(lease) = store.claim(&req).await.unwrap() else {
        eprintln!("not claimed");
        std::process::exit(2);
    };
    println!("claimed {}", lease.token.0);
    std::io::stdout().flush().unwrap();

    // The holder's completing transaction: fenced open, business write made.
    let mut tx = match store.begin_fenced(&scope, lease.token).await {
        Ok(tx) => tx,
        Err(e) => {
            println!("error {e}");
            std::process::exit(4);
        }
    };
    sqlx::query("INSERT INTO biz (tag) VALUES ('holder-a')")
        .execute(&mut *tx)
        .await
        .unwrap();
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    println!("in-tx {pid}");
    std::io::stdout().flush().unwrap();

    // Failpoint: the test stops this process here (SIGSTOP) past its lease,
    // with the transaction open and its business write uncommitted.
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).unwrap();

    let response = StoredResponse {
        status: 201,
        headers: vec![],
        body: b"A".to_vec(),
    };
    match store.complete_in_tx(tx, &scope, lease.token, &response).await {
        Ok(()) => println!("completed"),
        Err(StoreError::Fenced) => {
            println!("fenced");
            std::process::exit(3);
        }
        Err(e) => {
            println!("error {e}");
            std::process::exit(4);
        }
    }
}
