//! Gate 8, claimed idempotency: methods that only claim to be idempotent are caught,
//! methods that are idempotent pass. In-process fixtures, like `fixtures.rs`, each on
//! its own loopback port, with no idempotency keys at all:
//!
//! - `PUT /lists/{id}/items` **appends** its body to a list (broken);
//! - `PUT /lists/{id}` **replaces** the list (correct);
//! - `DELETE /counters/{id}` **decrements** a counter (broken);
//! - `DELETE /items/{id}` removes an item and answers `204` when it is already
//!   gone (correct, absent-tolerant);
//! - `GET /lists/{id}`, `GET /counters/{id}`, `GET /items`: the state, each with an
//!   `updatedAt` that changes on every read (a volatile member);
//! - `GET /items/count`: `{"count": n}`.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use serde_json::{Value, json};

use crate::{expect, idemkit};

#[derive(Default)]
struct App {
    lists: Mutex<HashMap<String, Vec<Value>>>,
    counters: Mutex<HashMap<String, i64>>,
    items: Mutex<BTreeSet<String>>,
    clock: AtomicU64,
}

impl App {
    fn now(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }
}

struct Claims {
    base: String,
}

impl Claims {
    async fn start() -> Self {
        let app = Arc::new(App::default());
        app.counters.lock().unwrap().insert("c1".into(), 10);
        app.items
            .lock()
            .unwrap()
            .extend(["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        let router = Router::new()
            .route("/lists/{id}", put(replace_list).get(read_list))
            .route("/lists/{id}/items", put(append_item))
            .route("/counters/{id}", get(read_counter).delete(decrement))
            .route("/items", get(read_items))
            .route("/items/count", get(count_items))
            .route("/items/{id}", axum::routing::delete(delete_item))
            .with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        Self { base }
    }
}

type Shared = State<Arc<App>>;

async fn replace_list(State(app): Shared, Path(id): Path<String>, body: axum::Json<Value>) -> Response {
    let items = body
        .0
        .get("items")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    app.lists.lock().unwrap().insert(id, items.clone());
    axum::Json(json!({ "items": items })).into_response()
}

async fn append_item(State(app): Shared, Path(id): Path<String>, body: axum::Json<Value>) -> Response {
    let mut lists = app.lists.lock().unwrap();
    let list = lists.entry(id).or_default();
    list.push(body.0);
    axum::Json(json!({ "items": list.clone() })).into_response()
}

async fn read_list(State(app): Shared, Path(id): Path<String>) -> Response {
    let items = app.lists.lock().unwrap().get(&id).cloned().unwrap_or_default();
    axum::Json(json!({ "items": items, "updatedAt": app.now() })).into_response()
}

async fn decrement(State(app): Shared, Path(id): Path<String>) -> Response {
    let mut counters = app.counters.lock().unwrap();
    let value = counters.entry(id).or_default();
    *value -= 1;
    axum::Json(json!({ "value": *value })).into_response()
}

async fn read_counter(State(app): Shared, Path(id): Path<String>) -> Response {
    let value = app.counters.lock().unwrap().get(&id).copied().unwrap_or_default();
    axum::Json(json!({ "value": value, "updatedAt": app.now() })).into_response()
}

async fn delete_item(State(app): Shared, Path(id): Path<String>) -> Response {
    app.items.lock().unwrap().remove(&id);
    StatusCode::NO_CONTENT.into_response()
}

async fn read_items(State(app): Shared) -> Response {
    let items: Vec<String> = app.items.lock().unwrap().iter().cloned().collect();
    axum::Json(json!({ "items": items, "updatedAt": app.now() })).into_response()
}

async fn count_items(State(app): Shared) -> Response {
    axum::Json(json!({ "count": app.items.lock().unwrap().len() })).into_response()
}

async fn check(args: &[&str]) -> crate::Run {
    let mut all = vec!["check".to_owned()];
    all.extend(args.iter().map(|s| s.to_string()));
    all.push("--json".into());
    idemkit(all).await
}

/// A PUT that appends: the second identical PUT adds a second element.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_appends_fails() {
    let f = Claims::start().await;
    let url = format!("{}/lists/l1/items", f.base);
    let state = format!("{}/lists/l1", f.base);
    let run = check(&[
        "--url",
        &url,
        "-X",
        "PUT",
        "--body",
        r#"{"sku":"BOOK-1"}"#,
        "--gates",
        "claimed-idempotent",
        "--state-url",
        &state,
        "--volatile",
        "/updatedAt",
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "fail")]),
        "{run:#?}"
    );
    assert_eq!(run.code, 1);
    let evidence = run.evidence("claimed-idempotent");
    assert!(
        evidence.contains(
            "a second identical PUT changed the state again (at `/items` 1 element(s) → 2 element(s))"
        ),
        "{evidence}"
    );
}

/// A PUT that replaces passes; without removing the volatile member it could not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_put_that_replaces_passes() {
    let f = Claims::start().await;
    let url = format!("{}/lists/l2", f.base);
    let state = format!("{}/lists/l2", f.base);
    let args = [
        "--url",
        &url,
        "-X",
        "PUT",
        "--body",
        r#"{"items":["x","y"]}"#,
        "--gates",
        "8",
        "--state-url",
        &state,
    ];
    let mut with_volatile = args.to_vec();
    with_volatile.extend(["--volatile", "/updatedAt"]);
    let run = check(&with_volatile).await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "pass")]),
        "{run:#?}"
    );
    assert_eq!(run.code, 0);
    let run = check(&args).await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "fail")]),
        "{run:#?}"
    );
    assert!(
        run.evidence("claimed-idempotent").contains("at `/updatedAt`"),
        "{run:#?}"
    );
}

/// A DELETE that decrements a counter: each repeat takes one more off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_that_decrements_fails() {
    let f = Claims::start().await;
    let url = format!("{}/counters/c1", f.base);
    let run = check(&[
        "--url",
        &url,
        "-X",
        "DELETE",
        "--gates",
        "claimed-idempotent",
        "--state-url",
        &url,
        "--volatile",
        "/updatedAt",
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "fail")]),
        "{run:#?}"
    );
    let evidence = run.evidence("claimed-idempotent");
    assert!(evidence.contains("at `/value` 9 → 8"), "{evidence}");
    assert!(evidence.contains("a second identical DELETE"), "{evidence}");
}

/// A DELETE that tolerates an absent resource passes, judged by the state or by a
/// count probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_absent_tolerant_delete_passes() {
    let f = Claims::start().await;
    let run = check(&[
        "--url",
        &format!("{}/items/a", f.base),
        "-X",
        "DELETE",
        "--gates",
        "claimed-idempotent",
        "--state-url",
        "/items",
        "--volatile",
        "/updatedAt",
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "pass")]),
        "{run:#?}"
    );
    let run = check(&[
        "--url",
        &format!("{}/items/b", f.base),
        "-X",
        "DELETE",
        "--gates",
        "claimed-idempotent",
        "--count-url",
        "/items/count",
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "pass")]),
        "{run:#?}"
    );
    assert!(
        run.evidence("claimed-idempotent")
            .contains("state count 2 → count 1 → count 1"),
        "{run:#?}"
    );
    // No probe: inconclusive, never a pass.
    let run = check(&[
        "--url",
        &format!("{}/items/c", f.base),
        "-X",
        "DELETE",
        "--gates",
        "8",
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[("claimed-idempotent", "inconclusive")]),
        "{run:#?}"
    );
    assert_eq!(run.code, 2);
}

/// The gate runs by default for PUT, PATCH and DELETE, after the seven keyed gates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_runs_by_default_for_a_put() {
    let f = Claims::start().await;
    let url = format!("{}/lists/l3/items", f.base);
    let run = check(&[
        "--url",
        &url,
        "-X",
        "PUT",
        "--body",
        r#"{"sku":"BOOK-1"}"#,
        "--state-url",
        &format!("{}/lists/l3", f.base),
        "--volatile",
        "/updatedAt",
        "-n",
        "2",
    ])
    .await;
    let verdicts = run.verdicts();
    assert_eq!(verdicts.len(), 8, "{run:#?}");
    assert_eq!(
        verdicts[7],
        ("claimed-idempotent".to_owned(), "fail".to_owned()),
        "{run:#?}"
    );
}
