//! SPEC §9 crash-recovery gate, for real: a server process runs claim → insert →
//! external call (to a counting courier stub that honours keys) → finalise; the
//! harness SIGKILLs it at each phase boundary, restarts it and retries.
//!
//! At every boundary, before any retry, the harness reads what the killed
//! attempt committed (its label row, the courier calls it made); after the
//! retries it checks, for that key: exactly one label row, the row the first
//! attempt committed if it committed one; exactly one courier shipment, and
//! exactly the courier calls the boundary implies (a recorded intent with no
//! result is re-issued once with the same key; nothing else is called again);
//! and an answer derived from that state (`{"id": <the committed row>,
//! "shipment": <the courier's shipment for the key>}`, a replay when the first
//! attempt completed), which every later retry gets byte for byte. With a
//! courier declared as ignoring keys, the boundaries with an intent and no
//! result end parked (`409 idempotency_request_parked`) with no call made again.
//!
//! `IDEMKIT_CRASH_REPEAT` sets the runs per boundary (default 3); the soak in
//! `docs/operations.md` runs 20.

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use http::HeaderMap;

const BOUNDARIES: [&str; 5] = [
    "idemkit::after_claim",
    "idemkit::after_phase",
    "idemkit::after_intent",
    "idemkit::after_call",
    "idemkit::after_complete",
];

#[derive(Default)]
struct CourierState {
    calls: usize,
    /// Shipment number by the downstream key that created it.
    shipments: HashMap<String, i64>,
}

/// The courier stub: honours `Idempotency-Key` (a repeated key gets the same
/// shipment) and counts every call.
#[derive(Clone, Default)]
struct Courier(Arc<Mutex<CourierState>>);

impl Courier {
    async fn start() -> (Self, String) {
        let courier = Self::default();
        let app = Router::new()
            .route(
                "/shipments",
                post(|State(c): State<Courier>, headers: HeaderMap| async move {
                    let key = headers
                        .get("idempotency-key")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned();
                    let mut s = c.0.lock().unwrap();
                    s.calls += 1;
                    let next = s.shipments.len() as i64 + 1000;
                    let n = *s.shipments.entry(key).or_insert(next);
                    axum::Json(serde_json::json!({ "shipment": n }))
                }),
            )
            .with_state(courier.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (courier, base)
    }

    fn shipments(&self) -> usize {
        self.0.lock().unwrap().shipments.len()
    }

    fn calls(&self) -> usize {
        self.0.lock().unwrap().calls
    }

    /// The one shipment this courier made, if it made exactly one.
    fn only_shipment(&self) -> Option<i64> {
        let s = self.0.lock().unwrap();
        match s.shipments.values().collect::<Vec<_>>().as_slice() {
            [one] => Some(**one),
            _ => None,
        }
    }
}

/// Where the server keeps its keys and labels.
#[derive(Clone)]
enum Db {
    Sqlite(std::path::PathBuf),
    Postgres { url: String, schema: String },
}

impl Db {
    fn sqlite(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("idemkit-crash-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Self::Sqlite(dir.join("crash.db"))
    }

    fn postgres() -> Option<Self> {
        let url = match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
            Ok(u) if !u.is_empty() => u,
            _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_POSTGRES_URL is not set under CI"),
            _ => return None,
        };
        Some(Self::Postgres {
            url,
            schema: format!("crash_{}", uuid::Uuid::new_v4().simple()),
        })
    }
}

/// A crash_server process; killed on drop.
struct Server {
    child: Child,
    base: String,
    lines: mpsc::Receiver<String>,
}

impl Server {
    fn start(db: &Db, courier: &str, env: &[(&str, &str)]) -> Self {
        let bin = idemkit_testkit::example_bin("crash_server");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut cmd = Command::new(bin);
        cmd.env("PORT", port.to_string())
            .env("COURIER_URL", courier)
            .env("RUST_LOG", "error");
        match db {
            Db::Sqlite(path) => {
                cmd.env("IDEMKIT_DB", path).env_remove("DATABASE_URL");
            }
            Db::Postgres { url, schema } => {
                cmd.env("DATABASE_URL", url).env("IDEMKIT_PG_SCHEMA", schema);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn crash_server");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            lines,
        };
        server.expect_line("READY", Duration::from_secs(30));
        server
    }

    fn expect_line(&self, prefix: &str, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return,
                Ok(_) => {}
                Err(e) => panic!("no `{prefix}` line from crash_server: {e}"),
            }
        }
    }

    /// SIGKILL, for real.
    fn kill9(mut self) {
        let ok = Command::new("kill")
            .args(["-9", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok);
        let _ = self.child.wait();
    }

    /// The label rows of `key` as `(id, shipment)`, oldest first.
    async fn rows(&self, key: &str) -> Vec<(i64, Option<i64>)> {
        let v: serde_json::Value = reqwest::get(format!("{}/labels/by-key/{key}", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["rows"]
            .as_array()
            .unwrap_or_else(|| panic!("rows of {key}: {v}"))
            .iter()
            .map(|r| (r["id"].as_i64().unwrap(), r["shipment"].as_i64()))
            .collect()
    }

    async fn count(&self) -> i64 {
        let v: serde_json::Value = reqwest::get(format!("{}/labels/count", self.base))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["count"].as_i64().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

struct Answer {
    status: u16,
    replayed: bool,
    code: String,
    body: Vec<u8>,
}

async fn post_label(base: &str, key: &str) -> Result<Answer, reqwest::Error> {
    let res = reqwest::Client::new()
        .post(format!("{base}/labels"))
        .bearer_auth("crash-account")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(r#"{"parcel":"box"}"#)
        .timeout(Duration::from_secs(10))
        .send()
        .await?;
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let body = res.bytes().await?.to_vec();
    let code = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["code"].as_str().map(str::to_owned))
        .unwrap_or_default();
    Ok(Answer {
        status,
        replayed,
        code,
        body,
    })
}

/// Retries like a client following SPEC §8 until a final answer.
async fn retry_until_final(base: &str, key: &str) -> Answer {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok(a) = post_label(base, key).await
            && !(a.status == 409 && a.code == "idempotency_request_in_progress")
            && a.status < 500
        {
            return a;
        }
        assert!(Instant::now() < deadline, "key {key} never got a final answer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn repeat() -> usize {
    std::env::var("IDEMKIT_CRASH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
}

/// What the courier stub does with keys, as the server is told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CourierKeys {
    Honoured,
    Ignored,
}

/// What a crash at `boundary` implies, from what the killed attempt committed.
struct Expected {
    /// Courier calls made before the kill.
    calls_at_crash: usize,
    /// Whether the killed attempt committed its label row.
    row_committed: bool,
    /// Whether it completed (the response is stored).
    completed: bool,
    /// Courier calls in all, after the retries.
    calls: usize,
    /// Whether the retries end parked instead of answering 201.
    parked: bool,
}

fn expected(boundary: &str, keys: CourierKeys) -> Expected {
    let honoured = keys == CourierKeys::Honoured;
    let (calls_at_crash, row_committed, completed, calls, parked) = match boundary {
        // Nothing committed but the claim: the retry runs everything once.
        "idemkit::after_claim" => (0, false, false, 1, false),
        // The row is committed; the retry reuses it and calls once.
        "idemkit::after_phase" => (0, true, false, 1, false),
        // An intent with no result (no call was made, but nobody can know):
        // re-issued once with the same key, or parked without calling.
        "idemkit::after_intent" if honoured => (0, true, false, 1, false),
        "idemkit::after_intent" => (0, true, false, 0, true),
        // The call was made and its result lost: re-issued once with the same
        // key (the courier answers with the same shipment), or parked.
        "idemkit::after_call" if honoured => (1, true, false, 2, false),
        "idemkit::after_call" => (1, true, false, 1, true),
        // Completed: every retry is a replay, nothing runs again.
        "idemkit::after_complete" => (1, true, true, 1, false),
        other => panic!("no expectations for {other}"),
    };
    Expected {
        calls_at_crash,
        row_committed,
        completed,
        calls,
        parked,
    }
}

/// Kills the server at `boundary` during the first attempt, reads what that
/// attempt committed, restarts the server, retries, and checks the key's rows,
/// the courier's calls and the answers against what that state implies.
async fn crash_at(db: &Db, boundary: &str, run: usize, keys: CourierKeys) {
    let (courier, courier_url) = Courier::start().await;
    let key = format!("crash-{}-{run}", boundary.replace("::", "-"));
    let want = expected(boundary, keys);
    let mut env = vec![];
    if keys == CourierKeys::Ignored {
        env.push(("IDEMKIT_COURIER_HONOURS_KEYS", "0"));
    }
    let crash: Vec<(&str, &str)> = env
        .iter()
        .copied()
        .chain([("IDEMKIT_CRASH_AT", boundary)])
        .collect();
    let server = Server::start(db, &courier_url, &crash);
    let base = server.base.clone();
    let first = tokio::spawn({
        let key = key.clone();
        async move { post_label(&base, &key).await }
    });
    server.expect_line(&format!("CRASHPOINT {boundary}"), Duration::from_secs(20));
    server.kill9();
    assert!(
        first.await.unwrap().is_err(),
        "{boundary}: the killed attempt cannot have answered"
    );
    assert_eq!(
        courier.calls(),
        want.calls_at_crash,
        "{boundary}: courier calls made by the killed attempt"
    );

    // What the killed attempt committed, read before any retry.
    let server = Server::start(db, &courier_url, &env);
    let committed = server.rows(&key).await;
    let committed_id = match committed.as_slice() {
        [] => {
            assert!(
                !want.row_committed,
                "{boundary}: the killed attempt committed no row"
            );
            None
        }
        [(id, shipment)] => {
            assert!(
                want.row_committed,
                "{boundary}: a row committed before the claim's phase: {committed:?}"
            );
            assert_eq!(
                shipment.is_some(),
                want.completed,
                "{boundary}: the shipment is recorded with the completion only"
            );
            Some(*id)
        }
        more => panic!(
            "{boundary}: the killed attempt wrote {} rows: {more:?}",
            more.len()
        ),
    };
    let shipment_at_crash = courier.only_shipment();

    let answer = retry_until_final(&server.base, &key).await;
    let rows = server.rows(&key).await;
    assert_eq!(
        rows.len(),
        1,
        "{boundary}: exactly one label row for the key: {rows:?}"
    );
    let (id, recorded_shipment) = rows[0];
    if let Some(committed_id) = committed_id {
        assert_eq!(id, committed_id, "{boundary}: the retry reused the committed row");
    }
    assert_eq!(courier.calls(), want.calls, "{boundary}: courier calls in all");
    if want.parked {
        assert_eq!(
            (answer.status, answer.code.as_str()),
            (409, "idempotency_request_parked"),
            "{boundary}: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(
            recorded_shipment, None,
            "{boundary}: a parked request records no shipment"
        );
        assert_eq!(
            courier.shipments(),
            want.calls,
            "{boundary}: no shipment beyond the first call's"
        );
    } else {
        assert_eq!(
            (answer.status, answer.replayed),
            (201, want.completed),
            "{boundary}: created, and a replay exactly when the first attempt completed: {}",
            String::from_utf8_lossy(&answer.body)
        );
        assert_eq!(courier.shipments(), 1, "{boundary}: one courier shipment per key");
        let shipment = courier.only_shipment().unwrap();
        if let Some(at_crash) = shipment_at_crash {
            assert_eq!(
                shipment, at_crash,
                "{boundary}: the shipment the killed attempt booked"
            );
        }
        assert_eq!(
            recorded_shipment,
            Some(shipment),
            "{boundary}: the row records the shipment"
        );
        let body: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(
            body,
            serde_json::json!({ "id": id, "shipment": shipment }),
            "{boundary}: the answer is the committed row and the courier's shipment"
        );
    }
    for _ in 0..2 {
        let again = post_label(&server.base, &key).await.unwrap();
        if want.parked {
            assert_eq!(
                (again.status, again.code.as_str()),
                (409, "idempotency_request_parked"),
                "{boundary}: stays parked"
            );
        } else {
            assert_eq!(
                (again.status, again.replayed),
                (201, true),
                "{boundary}: retries replay"
            );
            assert_eq!(
                again.body, answer.body,
                "{boundary}: every retry gets the same response"
            );
        }
    }
    assert_eq!(courier.calls(), want.calls, "{boundary}: retries call nothing");
    assert_eq!(server.rows(&key).await, rows, "{boundary}: retries write nothing");
    assert_eq!(
        server.count().await,
        run as i64 + 1,
        "{boundary}: one label per request (runs so far on this database)"
    );
}

async fn crash_gate(db: Db, keys: CourierKeys) {
    for boundary in BOUNDARIES {
        let db = match &db {
            Db::Sqlite(_) => Db::sqlite("gate"),
            Db::Postgres { url, .. } => Db::Postgres {
                url: url.clone(),
                schema: format!("crash_{}", uuid::Uuid::new_v4().simple()),
            },
        };
        for run in 0..repeat() {
            crash_at(&db, boundary, run, keys).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_recovery_gate_on_sqlite() {
    crash_gate(Db::sqlite("gate"), CourierKeys::Honoured).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_recovery_gate_on_postgres() {
    let Some(db) = Db::postgres() else { return };
    crash_gate(db, CourierKeys::Honoured).await;
}

/// The same gate with the courier declared as ignoring keys: every boundary
/// with an intent and no result parks, with no second call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_recovery_gate_with_a_key_ignoring_courier_on_sqlite() {
    crash_gate(Db::sqlite("ignoring"), CourierKeys::Ignored).await;
}

/// The same harness with idempotency switched off sees the duplicates: proof that
/// it can.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_idempotency_duplicates() {
    let db = Db::sqlite("naive");
    let (courier, courier_url) = Courier::start().await;
    let off = [("IDEMKIT_IDEMPOTENCY", "off")];
    let crash = [
        ("IDEMKIT_IDEMPOTENCY", "off"),
        ("IDEMKIT_CRASH_AT", "naive::after_call"),
    ];
    let server = Server::start(&db, &courier_url, &crash);
    let base = server.base.clone();
    let first = tokio::spawn(async move { post_label(&base, "naive-key").await });
    server.expect_line("CRASHPOINT naive::after_call", Duration::from_secs(20));
    server.kill9();
    let _ = first.await;
    let server = Server::start(&db, &courier_url, &off);
    assert_eq!(retry_until_final(&server.base, "naive-key").await.status, 201);
    assert_eq!(
        courier.shipments(),
        2,
        "without idempotency the retry ships again"
    );
    assert_eq!(
        server.count().await,
        2,
        "without idempotency the retry writes again"
    );
    assert_eq!(
        server.rows("naive-key").await.len(),
        2,
        "the per-key row count sees the duplicate"
    );
}

/// The completer finishes an abandoned request with no client retry at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completer_finishes_an_abandoned_request_without_a_retry() {
    let db = Db::sqlite("completer");
    let (courier, courier_url) = Courier::start().await;
    let server = Server::start(
        &db,
        &courier_url,
        &[("IDEMKIT_CRASH_AT", "idemkit::after_intent")],
    );
    let base = server.base.clone();
    let first = tokio::spawn(async move { post_label(&base, "abandoned").await });
    server.expect_line("CRASHPOINT idemkit::after_intent", Duration::from_secs(20));
    server.kill9();
    let _ = first.await;
    assert_eq!(courier.calls(), 0, "killed after the intent, before the call");

    let server = Server::start(&db, &courier_url, &[("IDEMKIT_COMPLETER_MS", "100")]);
    let deadline = Instant::now() + Duration::from_secs(20);
    while courier.shipments() == 0 || server.count().await != 1 {
        assert!(
            Instant::now() < deadline,
            "the completer did not finish the request"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Give the completer's final phase time to commit, then the client's first
    // retry is a replay: the request was already complete.
    let answer = retry_until_final(&server.base, "abandoned").await;
    assert_eq!((answer.status, answer.replayed), (201, true));
    assert_eq!(courier.shipments(), 1);
}

/// A step whose downstream ignores keys, with an intent but no result, ends
/// parked for review with zero re-calls.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_result_at_a_key_ignoring_downstream_parks_the_request() {
    let db = Db::sqlite("parked");
    let (courier, courier_url) = Courier::start().await;
    let ignores = ("IDEMKIT_COURIER_HONOURS_KEYS", "0");
    let server = Server::start(
        &db,
        &courier_url,
        &[ignores, ("IDEMKIT_CRASH_AT", "idemkit::after_call")],
    );
    let base = server.base.clone();
    let first = tokio::spawn(async move { post_label(&base, "unknown").await });
    server.expect_line("CRASHPOINT idemkit::after_call", Duration::from_secs(20));
    server.kill9();
    let _ = first.await;
    assert_eq!(courier.calls(), 1);

    let server = Server::start(&db, &courier_url, &[ignores]);
    let answer = retry_until_final(&server.base, "unknown").await;
    assert_eq!(
        (answer.status, answer.code.as_str()),
        (409, "idempotency_request_parked")
    );
    let again = post_label(&server.base, "unknown").await.unwrap();
    assert_eq!(again.code, "idempotency_request_parked");
    assert_eq!(courier.calls(), 1, "zero re-calls");
    assert_eq!(server.count().await, 1);
}
