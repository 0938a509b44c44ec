//! The README's example is a complete program: the README shows exactly
//! `crates/idemkit/examples/readme.rs`, and that program, run as a process,
//! creates its table, answers an order, replays it, and maps a failed insert to a
//! problem response instead of panicking. Its custom resolver is the facade's
//! crate-level doctest, so it compiles too.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

const README: &str = include_str!("../../../../README.md");
const EXAMPLE: &str = include_str!("../../../../crates/idemkit/examples/readme.rs");
const FACADE: &str = include_str!("../../../../crates/idemkit/src/lib.rs");

/// The fenced code blocks of a Markdown text, in order: (info string, body).
fn fenced(text: &str) -> Vec<(String, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in text.lines() {
        match (line.strip_prefix("```"), open.take()) {
            (Some(info), None) => open = Some((info.trim().to_owned(), String::new())),
            (Some(_), Some(block)) => blocks.push(block),
            (None, Some((info, mut body))) => {
                body.push_str(line);
                body.push('\n');
                open = Some((info, body));
            }
            (None, None) => {}
        }
    }
    blocks
}

#[test]
fn the_readme_resolver_is_the_facade_doctest() {
    let readme: Vec<String> = fenced(README)
        .into_iter()
        .filter(|(info, _)| info.starts_with("rust"))
        .map(|(_, body)| body)
        .collect();
    let resolver = readme.get(1).expect("a second Rust block: the custom resolver");
    // The facade's crate docs as rustdoc renders them: `//! ` stripped, the
    // doctests' hidden lines (`# ...`) dropped.
    let docs: String = FACADE
        .lines()
        .filter_map(|l| l.strip_prefix("//!"))
        .map(|l| format!("{}\n", l.strip_prefix(' ').unwrap_or(l)))
        .collect();
    let shown: Vec<String> = fenced(&docs)
        .into_iter()
        .map(|(_, body)| {
            body.lines()
                .filter(|l| !(l.starts_with("# ") || *l == "#"))
                .map(|l| format!("{l}\n"))
                .collect()
        })
        .collect();
    assert!(
        shown.iter().any(|b| b == resolver),
        "the README's custom resolver must be one of the idemkit crate's doc examples, verbatim:\n{resolver}"
    );
    assert!(
        resolver.contains("IdempotencyLayer::single_step(store, accounts)"),
        "{resolver}"
    );
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn the_readme_shows_the_example_program() {
    let start = README.find("```rust").expect("a Rust block in the README");
    let body = &README[start..];
    let body = &body[body.find('\n').unwrap() + 1..];
    let code = &body[..body.find("```").unwrap()];
    assert_eq!(
        code.trim_end(),
        EXAMPLE.trim_end(),
        "the README's first Rust block must be crates/idemkit/examples/readme.rs verbatim"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_example_serves_replays_and_maps_errors() {
    let bin = tokio::task::spawn_blocking(|| idemkit_testkit::example_bin("readme"))
        .await
        .unwrap();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-readme-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let _server = Proc(
        Command::new(bin)
            .current_dir(&dir)
            .env("ADDR", format!("127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the README example"),
    );
    let client = reqwest::Client::new();
    let order = |key: &'static str| {
        client
            .post(format!("http://127.0.0.1:{port}/orders"))
            .bearer_auth("alice")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(r#"{"sku":"BOOK-1","quantity":2}"#)
            .timeout(Duration::from_secs(10))
            .send()
    };
    let mut first = None;
    for _ in 0..400 {
        match order("order-1").await {
            Ok(res) => {
                first = Some(res);
                break;
            }
            Err(e) if e.is_connect() => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("the first request failed (the example panicked?): {e}"),
        }
    }
    let first = first.expect("the README example did not start");
    assert_eq!(first.status(), 201);
    let again = order("order-1").await.expect("the replay");
    assert_eq!(again.status(), 201);
    assert_eq!(again.headers()["idempotent-replayed"], "true");

    let db = format!("sqlite://{}", dir.join("app.db").display());
    let pool = sqlx::SqlitePool::connect(&db).await.unwrap();
    let count = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    assert_eq!(count().await, 1, "one order for two requests with one key");

    // A failed insert is a 500 problem document, not a panic, and the key is free.
    sqlx::query("ALTER TABLE orders RENAME TO orders_away")
        .execute(&pool)
        .await
        .unwrap();
    let failed = order("order-2").await.expect("an answer, not a reset connection");
    assert_eq!(failed.status(), 500);
    assert_eq!(failed.headers()["content-type"], "application/problem+json");
    let problem: serde_json::Value = failed.json().await.unwrap();
    assert_eq!(problem["code"], "internal_error", "{problem}");
    sqlx::query("ALTER TABLE orders_away RENAME TO orders")
        .execute(&pool)
        .await
        .unwrap();
    let retried = order("order-2").await.expect("the retry");
    assert_eq!(retried.status(), 201, "the failed attempt stored nothing");
    assert!(retried.headers().get("idempotent-replayed").is_none());
    assert_eq!(count().await, 2);
    pool.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
