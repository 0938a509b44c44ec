//! The single-step SQL beside its floor, on SQLite, through the same driver.
//!
//! `cargo bench -p idemkit-sqlite --bench floor [-- --smoke]`
//!
//! Three forms of the quickstart's order write, each one transaction on the
//! store's own pool and writer slot ([`SqliteStore::begin`]: `BEGIN IMMEDIATE`),
//! run by 16 tasks at once, in alternating rounds, the median of each printed:
//!
//! - **bare**: the order insert and `COMMIT`;
//! - **minimal**: the leanest single-step form with the same guarantee: a read
//!   that the key has no record (SQLite's write lock, taken by `BEGIN
//!   IMMEDIATE`, makes it the claim), the order insert, one insert of a narrow
//!   completed record (account, key, fingerprint, state, status, headers,
//!   body) and `COMMIT`;
//! - **layer**: the store's single-step claim as the layer makes it
//!   (`claim_in_tx`), the order insert in that transaction, and
//!   `complete_in_tx` (the record written with the commit).
//!
//! It prints each form's transactions per second, its ratio to bare, and
//! layer ÷ minimal against the 0.95 target of the performance issue.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idemkit_core::{TransactionalStore, TxClaim};
use idemkit_sqlite::SqliteStore;
use idemkit_testkit::suite::{claim_req, response, scope};

const TASKS: usize = 16;
const BODY: &str = r#"{"sku":"SKU-1","quantity":2}"#;

#[derive(Clone, Copy, Debug)]
enum Form {
    Bare,
    Minimal,
    Layer,
}

impl Form {
    const ALL: [Form; 3] = [Form::Bare, Form::Minimal, Form::Layer];

    fn name(self) -> &'static str {
        match self {
            Form::Bare => "bare",
            Form::Minimal => "minimal",
            Form::Layer => "layer (claim_in_tx + complete_in_tx)",
        }
    }
}

async fn order_insert(conn: &mut sqlx::SqliteConnection, key: &str) {
    sqlx::query("INSERT INTO orders (sku, quantity, idem) VALUES ('SKU-1', 2, ?1)")
        .bind(key)
        .execute(conn)
        .await
        .expect("order insert");
}

/// One transaction of `form` under a fresh key.
async fn once(store: &SqliteStore, form: Form, key: &str) {
    match form {
        Form::Bare => {
            let mut tx = store.begin().await.expect("begin");
            order_insert(&mut tx, key).await;
            tx.commit().await.expect("commit");
        }
        Form::Minimal => {
            let mut tx = store.begin().await.expect("begin");
            let held: Option<i64> =
                sqlx::query_scalar("SELECT 1 FROM minimal_keys WHERE account = ?1 AND idem_key = ?2")
                    .bind("bench")
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await
                    .expect("absence check");
            assert!(held.is_none(), "a fresh key has no record");
            order_insert(&mut tx, key).await;
            sqlx::query(
                "INSERT INTO minimal_keys (account, idem_key, fingerprint, state, status, headers, body) \
                 VALUES ('bench', ?1, ?2, 'completed', 201, '[[\"location\",\"/orders/1\"]]', ?3)",
            )
            .bind(key)
            .bind([0xab_u8; 32].as_slice())
            .bind(BODY.as_bytes())
            .execute(&mut *tx)
            .await
            .expect("record insert");
            tx.commit().await.expect("commit");
        }
        Form::Layer => {
            let s = scope("bench", key);
            let TxClaim::Claimed { mut tx, lease } =
                store.claim_in_tx(&claim_req(&s, BODY)).await.expect("claim")
            else {
                panic!("a fresh key is claimed")
            };
            order_insert(&mut tx, key).await;
            store
                .complete_in_tx(tx, &s, lease.token, &response(201, BODY))
                .await
                .expect("complete");
        }
    }
}

/// Transactions per second of `form` over `per_task` transactions by each of
/// [`TASKS`] tasks.
async fn round(store: &Arc<SqliteStore>, form: Form, round: usize, per_task: usize) -> f64 {
    let started = Instant::now();
    let tasks: Vec<_> = (0..TASKS)
        .map(|t| {
            let store = store.clone();
            tokio::spawn(async move {
                for i in 0..per_task {
                    once(&store, form, &format!("{form:?}-{round}-{t}-{i}")).await;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    (TASKS * per_task) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let smoke = std::env::args().any(|a| a == "--smoke");
    let (rounds, per_task) = if smoke { (3, 25) } else { (5, 250) };
    let dir = std::env::temp_dir().join(format!("idemkit-sqlite-floor-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("bench dir");
    let store = Arc::new(
        SqliteStore::connect(dir.join("keys.db"))
            .await
            .expect("open sqlite"),
    );
    sqlx::raw_sql(
        "CREATE TABLE orders (id INTEGER PRIMARY KEY, sku TEXT NOT NULL, quantity INTEGER NOT NULL, \
         idem TEXT NOT NULL);
         CREATE TABLE minimal_keys (account TEXT NOT NULL, idem_key TEXT NOT NULL, \
         fingerprint BLOB NOT NULL, state TEXT NOT NULL, status INTEGER, headers TEXT, body BLOB, \
         PRIMARY KEY (account, idem_key)) WITHOUT ROWID;",
    )
    .execute(store.pool())
    .await
    .expect("bench schema");
    // Warm the pool and the files before the first measured round.
    for form in Form::ALL {
        round(&store, form, usize::MAX, 2).await;
    }
    let mut tps = vec![Vec::new(); Form::ALL.len()];
    for r in 0..rounds {
        // Alternate the order so neither form always runs on a colder file.
        let order: Vec<usize> = if r % 2 == 0 { vec![0, 1, 2] } else { vec![2, 1, 0] };
        for i in order {
            tps[i].push(round(&store, Form::ALL[i], r, per_task).await);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let medians: Vec<f64> = tps.into_iter().map(median).collect();
    println!(
        "SQLite single-step floor: {TASKS} tasks, {rounds} alternating rounds of {} transactions, medians",
        TASKS * per_task
    );
    println!("{:>40} {:>10} {:>8}", "form", "tx/s", "÷ bare");
    for (form, t) in Form::ALL.iter().zip(&medians) {
        println!("{:>40} {t:>10.0} {:>8.2}", form.name(), t / medians[0]);
    }
    let ratio = medians[2] / medians[1];
    println!(
        "{:>40} {:>10} {ratio:>8.2}   (target 0.95{})",
        "layer ÷ minimal",
        "",
        if ratio >= 0.95 { "" } else { ": MISSED" }
    );
    let _ = std::fs::remove_dir_all(&dir);
}
