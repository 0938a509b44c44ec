//! The labels contract over real HTTP, with real processes: `idemkit courier` and
//! `idemkit serve` are started from the built binary.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

pub(crate) struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(args: &[&str], env: &[(&str, &str)]) -> (Proc, std::sync::mpsc::Receiver<String>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idemkit"));
    cmd.args(args)
        .env("RUST_LOG", "error")
        .env_remove("IDEMKIT_TOKENS")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn idemkit");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    let first = rx.recv_timeout(Duration::from_secs(30)).expect("a first line");
    assert!(first.contains("listening on"), "{args:?}: {first}");
    (Proc(child), rx)
}

/// A courier and a label service on a fresh SQLite each.
pub(crate) struct Labels {
    pub(crate) base: String,
    pub(crate) courier: String,
    dir: std::path::PathBuf,
    pub(crate) service: Option<(Proc, std::sync::mpsc::Receiver<String>)>,
    _courier: Proc,
    pub(crate) port: u16,
    /// Run with the tests' short lease and courier deadline (the default), or
    /// with the service's own defaults.
    pub(crate) short_lease: bool,
    /// `--keys-url`: the keys in Redis (a fresh prefix), the labels rows in `db()`.
    pub(crate) keys_url: Option<String>,
    /// More `idemkit serve` arguments (`--grpc-listen …`).
    pub(crate) extra_args: Vec<String>,
}

impl Labels {
    pub(crate) fn start() -> Self {
        Self::start_with(&[])
    }

    /// A service with its own default lease and courier deadline.
    pub(crate) fn start_with_defaults() -> Self {
        let mut labels = Self::courier_only();
        labels.short_lease = false;
        labels.start_service(&[]);
        labels
    }

    pub(crate) fn start_with(env: &[(&str, &str)]) -> Self {
        let mut labels = Self::courier_only();
        labels.start_service(env);
        labels
    }

    pub(crate) fn courier_only() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("idemkit-labels-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cport = free_port();
        let (courier, _) = spawn(
            &[
                "courier",
                "--listen",
                &format!("127.0.0.1:{cport}"),
                "--database-url",
                dir.join("courier.db").to_str().unwrap(),
            ],
            &[],
        );
        Self {
            base: String::new(),
            courier: format!("http://127.0.0.1:{cport}"),
            dir,
            service: None,
            _courier: courier,
            port: free_port(),
            short_lease: true,
            keys_url: None,
            extra_args: Vec::new(),
        }
    }

    /// A courier and a label service whose keys live in the test Redis
    /// (`IDEMKIT_TEST_REDIS_URL`) under a fresh prefix, its labels rows in
    /// SQLite; `None` (skipped) without a test Redis outside CI.
    pub(crate) fn start_on_redis() -> Option<Self> {
        let url = redis_url()?;
        let mut labels = Self::courier_only();
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let sep = if url.contains('?') { '&' } else { '?' };
        labels.keys_url = Some(format!("{url}{sep}prefix=labels-{}-{nanos}", std::process::id()));
        labels.start_service(&[]);
        Some(labels)
    }

    /// The service's SQLite file (labels and key store).
    pub(crate) fn db(&self) -> std::path::PathBuf {
        self.dir.join("labels.db")
    }

    pub(crate) fn start_service(&mut self, env: &[(&str, &str)]) {
        let db = self.dir.join("labels.db");
        let listen = format!("127.0.0.1:{}", self.port);
        let mut args = vec![
            "serve",
            "--listen",
            &listen,
            "--database-url",
            db.to_str().unwrap(),
            "--courier-url",
            &self.courier,
        ];
        if self.short_lease {
            args.extend(["--lease-ms", "400", "--courier-deadline-ms", "1000"]);
        }
        if let Some(keys) = &self.keys_url {
            args.extend(["--keys-url", keys]);
        }
        args.extend(self.extra_args.iter().map(String::as_str));
        // The public demo tokens, unless the test configures its own.
        if !env.iter().any(|(k, _)| *k == "IDEMKIT_TOKENS") {
            args.push("--demo-tokens");
        }
        self.service = Some(spawn(&args, env));
        self.base = format!("http://{listen}");
    }

    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub(crate) fn wait_line(&self, prefix: &str) {
        let (_, rx) = self.service.as_ref().unwrap();
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("line from the service");
            if line.starts_with(prefix) {
                return;
            }
        }
    }

    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub(crate) fn kill9(&mut self) {
        if let Some((p, _)) = self.service.take() {
            let ok = Command::new("kill")
                .args(["-9", &p.0.id().to_string()])
                .status()
                .unwrap()
                .success();
            assert!(ok);
            drop(p);
        }
    }

    pub(crate) async fn stats(&self) -> Value {
        reqwest::get(format!("{}/_stats", self.courier))
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    pub(crate) async fn faults(&self, f: Value) {
        let res = reqwest::Client::new()
            .post(format!("{}/_faults", self.courier))
            .json(&f)
            .send()
            .await
            .unwrap();
        assert!(res.status().is_success(), "{}", res.status());
    }
}

impl Drop for Labels {
    fn drop(&mut self) {
        self.service.take();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The test Redis (`IDEMKIT_TEST_REDIS_URL`); unset is a skip, except under CI.
pub(crate) fn redis_url() -> Option<String> {
    match std::env::var("IDEMKIT_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => {
            panic!("IDEMKIT_TEST_REDIS_URL is not set; under CI a missing Redis is a failure")
        }
        _ => {
            eprintln!("IDEMKIT_TEST_REDIS_URL is not set: skipping Redis test");
            None
        }
    }
}

pub(crate) fn body(key: &str, country: &str) -> Value {
    json!({
        "idempotencyKey": key,
        "courier": "ups",
        "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
        "shipTo": {"name": "Ada", "line1": "10 Downing St", "line2": "Flat 1", "city": "London", "postalCode": "SW1A 2AA", "country": country},
        "parcel": {"weightGrams": 900, "lengthCm": 20.5, "widthCm": 10, "heightCm": 5}
    })
}

#[derive(Debug)]
pub(crate) struct Saw {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) content_type: String,
    pub(crate) body: Value,
    pub(crate) raw: Vec<u8>,
}

pub(crate) async fn post(base: &str, token: &str, body: &Value) -> Saw {
    let res = reqwest::Client::new()
        .post(format!("{base}/labels"))
        .bearer_auth(token)
        .json(body)
        .timeout(Duration::from_secs(15))
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let content_type = res
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let raw = res.bytes().await.unwrap().to_vec();
    Saw {
        status,
        replayed,
        content_type,
        body: serde_json::from_slice(&raw).unwrap_or(Value::Null),
        raw,
    }
}

pub(crate) const ACME: &str = "demo-token-acme";
const GLOBEX: &str = "demo-token-globex";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn created_then_replayed_as_200_with_one_shipment() {
    let labels = Labels::start();
    let first = post(&labels.base, ACME, &body("k-1", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let label = &first.body;
    assert_eq!(label["status"], "created");
    assert_eq!(label["courier"], "ups");
    assert!(label["id"].as_str().unwrap().starts_with("lbl_"));
    assert!(label["courierOrderNumber"].is_string() && label["courierTrackingNumber"].is_string());
    assert!(label["error"].is_null());
    let keys: Vec<&String> = label.as_object().unwrap().keys().collect();
    assert_eq!(keys.len(), 6, "exactly the contract's fields: {keys:?}");
    let again = post(&labels.base, ACME, &body("k-1", "GB")).await;
    assert_eq!((again.status, again.replayed), (200, true));
    assert_eq!(again.raw, first.raw, "identical body");
    assert_eq!(labels.stats().await["shipments"], 1);
    // Another method on the route is 405, before any idempotency check (a
    // spent deadline, a missing key): the layer guards POST only.
    let put = reqwest::Client::new()
        .put(format!("{}/labels", labels.base))
        .header("request-timeout", "0")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 405);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_comes_before_the_key_and_releases_it() {
    let labels = Labels::start();
    let bad = post(&labels.base, ACME, &body("k-v", "XX")).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.content_type, "application/problem+json");
    assert_eq!(bad.body["code"], "validation_failed");
    let mut unknown = body("k-v", "GB");
    unknown["extra"] = json!(1);
    assert_eq!(
        post(&labels.base, ACME, &unknown).await.status,
        400,
        "unknown fields are rejected"
    );
    let mut no_parcel = body("k-v", "GB");
    no_parcel["parcel"]["weightGrams"] = json!(0);
    assert_eq!(post(&labels.base, ACME, &no_parcel).await.status, 400);
    let mut bad_courier = body("k-v", "GB");
    bad_courier["courier"] = json!("fedex");
    assert_eq!(post(&labels.base, ACME, &bad_courier).await.status, 400);
    assert_eq!(labels.stats().await["shipments"], 0, "nothing created");
    // The corrected body may reuse the key.
    assert_eq!(post(&labels.base, ACME, &body("k-v", "GB")).await.status, 201);
    // Once the key is used, an invalid body is still 400, not a replay or conflict.
    assert_eq!(post(&labels.base, ACME, &body("k-v", "XX")).await.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_scope_mismatch_and_reads() {
    let labels = Labels::start();
    assert_eq!(post(&labels.base, "nope", &body("k-a", "GB")).await.status, 401);
    let no_token = reqwest::Client::new()
        .post(format!("{}/labels", labels.base))
        .json(&body("k-a", "GB"))
        .send()
        .await
        .unwrap();
    assert_eq!(no_token.status(), 401);
    let a = post(&labels.base, ACME, &body("shared", "GB")).await;
    let b = post(&labels.base, GLOBEX, &body("shared", "GB")).await;
    assert_eq!((a.status, b.status), (201, 201), "keys are scoped per account");
    assert_ne!(a.body["id"], b.body["id"]);
    let other = post(&labels.base, ACME, &body("shared", "FR")).await;
    assert_eq!(
        (other.status, other.body["code"].as_str()),
        (409, Some("idempotency_key_reused"))
    );

    let client = reqwest::Client::new();
    let id = a.body["id"].as_str().unwrap();
    let get = |path: String, token: &'static str| {
        let client = client.clone();
        async move { client.get(path).bearer_auth(token).send().await.unwrap() }
    };
    let mine = get(format!("{}/labels/{id}", labels.base), ACME).await;
    assert_eq!(mine.status(), 200);
    assert_eq!(mine.json::<Value>().await.unwrap(), a.body);
    assert_eq!(
        get(format!("{}/labels/{id}", labels.base), GLOBEX).await.status(),
        404,
        "another account's label"
    );
    let tracking = get(format!("{}/tracking/{id}", labels.base), ACME).await;
    assert_eq!(tracking.status(), 200);
    let t: Value = tracking.json().await.unwrap();
    assert_eq!(t["trackingNumber"], a.body["courierTrackingNumber"]);
    assert!(!t["events"].as_array().unwrap().is_empty());
    let by_number = get(
        format!(
            "{}/tracking/{}",
            labels.base,
            t["trackingNumber"].as_str().unwrap()
        ),
        ACME,
    )
    .await;
    assert_eq!(by_number.status(), 200);
    assert_eq!(
        get(format!("{}/tracking/{id}", labels.base), GLOBEX)
            .await
            .status(),
        404
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_outage_is_a_retryable_502_and_the_retry_keeps_the_label() {
    let labels = Labels::start();
    labels.faults(json!({"failNext": 100, "status": 503})).await;
    let failed = post(&labels.base, ACME, &body("k-out", "GB")).await;
    assert_eq!(failed.status, 502, "{failed:?}");
    assert_eq!(
        failed.content_type, "application/json",
        "the contract's label document, not a problem"
    );
    assert_eq!(failed.body["status"], "failed");
    assert_eq!(failed.body["error"]["retryable"], true);
    assert!(failed.body["error"]["code"].is_string() && failed.body["error"]["message"].is_string());
    let calls = labels.stats().await["calls"].as_i64().unwrap();
    assert!(
        calls >= 2,
        "the service's client retried the courier ({calls} calls)"
    );
    labels.faults(json!({"reset": true})).await;
    let retry = post(&labels.base, ACME, &body("k-out", "GB")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.body["id"], failed.body["id"], "same label id");
    assert_eq!(labels.stats().await["shipments"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_rejection_is_a_final_502_replayed() {
    let labels = Labels::start();
    labels.faults(json!({"rejectNext": 1})).await;
    let rejected = post(&labels.base, ACME, &body("k-rej", "GB")).await;
    assert_eq!(rejected.status, 502, "{rejected:?}");
    assert_eq!(rejected.body["error"]["retryable"], false);
    assert!(
        rejected.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("new idempotency key")
    );
    let calls = labels.stats().await["calls"].as_i64().unwrap();
    let again = post(&labels.base, ACME, &body("k-rej", "GB")).await;
    assert_eq!((again.status, again.replayed), (502, true));
    assert_eq!(again.raw, rejected.raw);
    assert_eq!(
        labels.stats().await["calls"].as_i64().unwrap(),
        calls,
        "no new courier call"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_make_one_label_and_one_shipment() {
    let labels = Labels::start();
    let b = Arc::new(body("k-storm", "GB"));
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (base, b, barrier) = (labels.base.clone(), b.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                post(&base, ACME, &b).await
            })
        })
        .collect();
    let answers: Vec<Saw> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let created: Vec<&Saw> = answers.iter().filter(|a| a.status == 201).collect();
    assert_eq!(created.len(), 1, "{answers:#?}");
    for a in &answers {
        match a.status {
            201 => {}
            200 => assert_eq!(a.body, created[0].body),
            409 => assert_eq!(a.body["code"], "idempotency_request_in_progress"),
            s => panic!("unexpected {s}: {a:?}"),
        }
    }
    assert_eq!(labels.stats().await["shipments"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openapi_describes_the_contract() {
    let labels = Labels::start();
    let doc: Value = reqwest::get(format!("{}/openapi.json", labels.base))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3.1"));
    let post = &doc["paths"]["/labels"]["post"];
    for status in ["200", "201", "400", "401", "409", "502"] {
        assert!(
            post["responses"][status].is_object(),
            "POST /labels documents {status}"
        );
    }
    assert!(doc["paths"]["/tracking/{id}"]["get"].is_object());
    assert!(doc["components"]["schemas"]["CreateLabel"]["properties"]["idempotencyKey"].is_object());
}

/// A label row of the service's database.
#[cfg(feature = "failpoints")]
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LabelRow {
    pub(crate) id: String,
    pub(crate) status: String,
    order: Option<String>,
    tracking: Option<String>,
    shipment: Option<i64>,
}

/// The label rows written for one idempotency key, oldest first.
#[cfg(feature = "failpoints")]
pub(crate) async fn label_rows(labels: &Labels, key: &str) -> Vec<LabelRow> {
    let url = format!("sqlite://{}?mode=ro", labels.db().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    type Raw = (String, String, Option<String>, Option<String>, Option<i64>);
    let rows: Vec<Raw> = sqlx::query_as(
        "SELECT id, status, courier_order, courier_tracking, courier_shipment FROM labels \
         WHERE json_extract(request, '$.idempotencyKey') = ?1 ORDER BY created_at, id",
    )
    .bind(key)
    .fetch_all(&pool)
    .await
    .unwrap();
    pool.close().await;
    rows.into_iter()
        .map(|(id, status, order, tracking, shipment)| LabelRow {
            id,
            status,
            order,
            tracking,
            shipment,
        })
        .collect()
}

/// The courier's `POST /shipments` calls so far.
#[cfg(feature = "failpoints")]
async fn calls_of(labels: &Labels) -> i64 {
    labels.stats().await["calls"].as_i64().unwrap()
}

/// The courier's shipment ids booked for one label (its `reference`).
#[cfg(feature = "failpoints")]
async fn courier_shipments(labels: &Labels, label_id: &str) -> Vec<i64> {
    let url = format!("sqlite://{}?mode=ro", labels.dir.join("courier.db").display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let ids: Vec<i64> =
        sqlx::query_scalar("SELECT id FROM courier_shipments WHERE reference = ?1 ORDER BY id")
            .bind(label_id)
            .fetch_all(&pool)
            .await
            .unwrap();
    pool.close().await;
    ids
}

/// SIGKILL at each phase boundary, then, from what the killed attempt
/// committed (read before any retry): exactly one label row for the key (the
/// committed one, when there is one), exactly one courier shipment for it,
/// exactly the courier calls the boundary implies (the courier honours keys: an
/// intent without a result is re-issued once with the same key, a duplicate the
/// courier suppresses; nothing else is called again), and an answer that is that
/// row with that shipment (a replay exactly when the killed attempt completed).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_at_each_boundary_keeps_one_label_and_one_shipment() {
    let mut labels = Labels::start();
    // (boundary, courier calls made by the killed attempt, calls in all,
    //  whether it committed the label row, whether it completed)
    let boundaries = [
        ("idemkit::after_claim", 0, 1, false, false),
        ("idemkit::after_phase", 0, 1, true, false),
        ("idemkit::after_intent", 0, 1, true, false),
        ("idemkit::after_call", 1, 2, true, false),
        ("idemkit::after_complete", 1, 1, true, true),
    ];
    let boundaries = boundaries.map(|(b, at, all, row, done)| (b, at, all, row, done, done));
    crash_at_boundaries(&mut labels, &boundaries).await;
}

/// One boundary of [`crash_at_boundaries`]: (failpoint, courier calls made by
/// the killed attempt, calls in all, whether it committed the label row,
/// whether that row was already `created`, whether the key was completed).
#[cfg(feature = "failpoints")]
type Boundary = (&'static str, i64, i64, bool, bool, bool);

/// SIGKILL at each of `boundaries` in turn, each with a fresh key (see
/// `crash_at_each_boundary_keeps_one_label_and_one_shipment`).
#[cfg(feature = "failpoints")]
async fn crash_at_boundaries(labels: &mut Labels, boundaries: &[Boundary]) {
    for (n, &(boundary, calls_at_crash, calls, row_committed, row_created, completed)) in
        boundaries.iter().enumerate()
    {
        let stats = labels.stats().await;
        let (calls_before, shipments_before) = (
            stats["calls"].as_i64().unwrap(),
            stats["shipments"].as_i64().unwrap(),
        );
        labels.kill9();
        labels.start_service(&[("IDEMKIT_CRASH_AT", boundary)]);
        let key = format!("crash-{n}");
        let first = tokio::spawn({
            let (base, b) = (labels.base.clone(), body(&key, "GB"));
            async move {
                reqwest::Client::new()
                    .post(format!("{base}/labels"))
                    .bearer_auth(ACME)
                    .json(&b)
                    .send()
                    .await
            }
        });
        labels.wait_line(&format!("CRASHPOINT {boundary}"));
        labels.kill9();
        assert!(
            first.await.unwrap().is_err(),
            "{boundary}: the killed attempt cannot answer"
        );
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls_at_crash,
            "{boundary}: courier calls of the killed attempt"
        );

        // What the killed attempt committed.
        let committed = label_rows(labels, &key).await;
        match committed.as_slice() {
            [] => assert!(!row_committed, "{boundary}: no label row committed"),
            [row] => {
                assert!(row_committed, "{boundary}: a label row before its phase: {row:?}");
                let done = row.status == "created";
                assert_eq!(done, row_created, "{boundary}: {row:?}");
                assert_eq!(row.tracking.is_some(), row_created, "{boundary}: {row:?}");
            }
            more => panic!(
                "{boundary}: the killed attempt wrote {} rows: {more:?}",
                more.len()
            ),
        }
        let booked_at_crash = match committed.first() {
            Some(row) => courier_shipments(labels, &row.id).await,
            None => vec![],
        };
        assert_eq!(
            booked_at_crash.len(),
            calls_at_crash as usize,
            "{boundary}: shipments booked by the killed attempt"
        );

        labels.start_service(&[]);
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let answer = loop {
            let a = post(&labels.base, ACME, &body(&key, "GB")).await;
            if a.status == 201 || a.status == 200 {
                break a;
            }
            assert!(std::time::Instant::now() < deadline, "{boundary}: {a:?}");
            tokio::time::sleep(Duration::from_millis(150)).await;
        };
        assert_eq!(
            (answer.status, answer.replayed),
            if completed { (200, true) } else { (201, false) },
            "{boundary}: created, or replayed exactly when the killed attempt completed: {answer:?}"
        );

        let rows = label_rows(labels, &key).await;
        assert_eq!(
            rows.len(),
            1,
            "{boundary}: exactly one label row for the key: {rows:?}"
        );
        let row = &rows[0];
        if let Some(c) = committed.first() {
            assert_eq!(row.id, c.id, "{boundary}: the retry reused the committed row");
            if row_created {
                assert_eq!(row, c, "{boundary}: a replay changes nothing");
            }
        }
        assert_eq!(row.status, "created", "{boundary}: {row:?}");
        let booked = courier_shipments(labels, &row.id).await;
        assert_eq!(
            booked.len(),
            1,
            "{boundary}: exactly one courier shipment for the label: {booked:?}"
        );
        if !booked_at_crash.is_empty() {
            assert_eq!(
                booked, booked_at_crash,
                "{boundary}: the shipment the killed attempt booked"
            );
        }
        assert_eq!(
            row.shipment,
            Some(booked[0]),
            "{boundary}: the row records that shipment"
        );
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls,
            "{boundary}: courier calls in all"
        );
        let stats = labels.stats().await;
        assert_eq!(
            stats["shipments"].as_i64().unwrap() - shipments_before,
            1,
            "{boundary}: one shipment per label"
        );
        // The answer is the row as committed.
        assert_eq!(answer.body["id"], json!(row.id), "{boundary}: {answer:?}");
        assert_eq!(answer.body["status"], "created", "{boundary}: {answer:?}");
        assert_eq!(
            answer.body["courierOrderNumber"],
            json!(row.order),
            "{boundary}: {answer:?}"
        );
        assert_eq!(
            answer.body["courierTrackingNumber"],
            json!(row.tracking),
            "{boundary}: {answer:?}"
        );
        assert!(answer.body["error"].is_null(), "{boundary}: {answer:?}");

        let again = post(&labels.base, ACME, &body(&key, "GB")).await;
        assert_eq!((again.status, again.replayed), (200, true), "{boundary}");
        assert_eq!(again.raw, answer.raw, "{boundary}: the same answer byte for byte");
        assert_eq!(
            calls_of(labels).await - calls_before,
            calls,
            "{boundary}: a replay calls nothing"
        );
        assert_eq!(
            label_rows(labels, &key).await,
            rows,
            "{boundary}: a replay writes nothing"
        );
    }
}

/// `idemkit check` against the labels service, effects counted by the courier's
/// shipments: every gate that one count can judge passes. The isolation gate needs a
/// count per account, which the service does not offer: with ids only it is
/// inconclusive, never a pass (issue 14).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemkit_check_passes_every_gate_on_the_labels_service() {
    let labels = Labels::start();
    let template = body("check", "GB");
    let mut alt = template.clone();
    alt["courier"] = json!("dhl");
    let base = labels.base.clone();
    let courier = labels.courier.clone();
    let run = |gates: &'static str, probe: [String; 4]| {
        let (base, template, alt) = (base.clone(), template.clone(), alt.clone());
        tokio::task::spawn_blocking(move || {
            Command::new(env!("CARGO_BIN_EXE_idemkit"))
                .args([
                    "check",
                    "--url",
                    &format!("{base}/labels"),
                    "--body",
                    &template.to_string(),
                    "--alt-body",
                    &alt.to_string(),
                    "--key-field",
                    "/idempotencyKey",
                    "--replay-status",
                    "200",
                    "-H",
                    "Authorization: Bearer demo-token-acme",
                    "--other-account-header",
                    "Authorization: Bearer demo-token-globex",
                    "--gates",
                    gates,
                ])
                .args(probe)
                .output()
                .unwrap()
        })
    };
    let count = [
        "--count-url".to_owned(),
        format!("{courier}/_stats"),
        "--count-pointer".to_owned(),
        "/shipments".to_owned(),
    ];
    let out = run("1,2,3,4,5,7", count).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("6 gate(s): 6 pass, 0 fail, 0 inconclusive"),
        "{stdout}"
    );
    let ids = [
        "--id-pointer".to_owned(),
        "/id".to_owned(),
        "-n".to_owned(),
        "2".to_owned(),
    ];
    let out = run("isolation", ids).await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(2), "{stdout}");
    assert!(
        stdout.contains("1 gate(s): 0 pass, 0 fail, 1 inconclusive"),
        "{stdout}"
    );
}

/// The published contract is generated from the configuration the service runs
/// with: change the configuration, and both the page and the behaviour change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn served_contract_matches_the_running_configuration() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let config = std::env::temp_dir().join(format!("idemkit-config-{}-{nanos}.toml", std::process::id()));
    std::fs::write(
        &config,
        "[defaults]\nreplay_window = \"2h\"\nreap_threshold = \"6h\"\nmismatch_status = 422\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/labels\"\nkey_field = \"/idempotencyKey\"\n",
    )
    .unwrap();
    let labels = Labels::start_with(&[("IDEMKIT_CONFIG", config.to_str().unwrap())]);
    let page = reqwest::get(format!("{}/docs/idempotency", labels.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(page.contains("replays for <strong>2 h</strong>"), "{page}");
    assert!(
        page.contains("lease of <strong>400ms</strong>"),
        "the --lease-ms the service runs with"
    );
    assert!(page.contains("422"));
    // Behaviour: a replay keeps its 201 (no replay status configured) and a
    // mismatch answers 422.
    let first = post(&labels.base, ACME, &body("cfg", "GB")).await;
    let again = post(&labels.base, ACME, &body("cfg", "GB")).await;
    assert_eq!((first.status, again.status, again.replayed), (201, 201, true));
    assert_eq!(post(&labels.base, ACME, &body("cfg", "FR")).await.status, 422);
    let _ = std::fs::remove_file(config);
}

/// Rows in the service's `labels` table and in its key store.
async fn rows(labels: &Labels) -> (i64, usize) {
    let url = format!("sqlite://{}?mode=ro", labels.db().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let (n,): (i64,) = sqlx::query_as("SELECT count(*) FROM labels")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    let db = labels.db().display().to_string();
    let run = crate::idemkit(vec![
        "keys".into(),
        "list".into(),
        "--database-url".into(),
        db,
        "--json".into(),
    ])
    .await;
    assert_eq!(run.code, 0, "{run:#?}");
    let records = run.report()["records"].as_array().unwrap().len();
    (n, records)
}

/// SPEC §1: a body without its key is `400 idempotency_key_missing` (a problem
/// document), answered before any lookup and with nothing written; a malformed
/// key is `idempotency_key_invalid`, whatever else is wrong with the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_or_malformed_body_key_is_refused_before_anything_is_written() {
    let labels = Labels::start();
    let mut missing = body("unused", "GB");
    missing.as_object_mut().unwrap().remove("idempotencyKey");
    let mut null = body("unused", "GB");
    null["idempotencyKey"] = Value::Null;
    let mut missing_and_invalid = missing.clone();
    missing_and_invalid["shipTo"]["country"] = json!("XX");
    for (what, req) in [
        ("no key field", &missing),
        ("a null key", &null),
        ("no key and a bad country", &missing_and_invalid),
        ("an empty object", &json!({})),
    ] {
        let saw = post(&labels.base, ACME, req).await;
        assert_eq!(saw.status, 400, "{what}: {saw:?}");
        assert_eq!(saw.content_type, "application/problem+json", "{what}: {saw:?}");
        assert_eq!(saw.body["code"], "idempotency_key_missing", "{what}: {saw:?}");
        assert_eq!(saw.body["status"], 400, "{what}: {saw:?}");
    }
    let mut numeric = body("unused", "GB");
    numeric["idempotencyKey"] = json!(42);
    for (what, req) in [
        ("a numeric key", numeric),
        ("a key with a space", body("has space", "GB")),
        ("an empty key", body("", "GB")),
        ("a 256-character key", body(&"k".repeat(256), "GB")),
    ] {
        let saw = post(&labels.base, ACME, &req).await;
        assert_eq!(saw.status, 400, "{what}: {saw:?}");
        assert_eq!(saw.body["code"], "idempotency_key_invalid", "{what}: {saw:?}");
    }
    assert_eq!(rows(&labels).await, (0, 0), "no label row and no key record");
    assert_eq!(labels.stats().await["shipments"], 0, "no courier call");
    // The service still works, and a valid body with a key is counted.
    assert_eq!(post(&labels.base, ACME, &body("k-m", "GB")).await.status, 201);
    assert_eq!(rows(&labels).await, (1, 1));
}

/// `idemkit serve` without tokens refuses to start, naming the ways to give them,
/// and touches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_without_tokens_refuses_to_start() {
    let dir = std::env::temp_dir().join(format!("idemkit-notokens-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let db = dir.join("labels.db");
    let listen = format!("127.0.0.1:{}", free_port());
    let out = tokio::task::spawn_blocking({
        let db = db.clone();
        move || {
            let mut child = Command::new(env!("CARGO_BIN_EXE_idemkit"))
                .args([
                    "serve",
                    "--listen",
                    &listen,
                    "--database-url",
                    db.to_str().unwrap(),
                ])
                .env_remove("IDEMKIT_TOKENS")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let started = std::time::Instant::now();
            while child.try_wait().unwrap().is_none() {
                if started.elapsed() > Duration::from_secs(20) {
                    let _ = child.kill();
                    panic!("`idemkit serve` without tokens is still running after 20 s");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            child.wait_with_output().unwrap()
        }
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for hint in ["no API tokens", "--tokens", "IDEMKIT_TOKENS", "--demo-tokens"] {
        assert!(stderr.contains(hint), "{hint}: {stderr}");
    }
    assert!(!db.exists(), "nothing created before refusing");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Configured tokens replace the demo ones, and a token may end in base64
/// padding: each entry splits at its last `=`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_tokens_may_contain_equals_signs_and_replace_the_demo_ones() {
    let labels = Labels::start_with(&[("IDEMKIT_TOKENS", "dG9rZW4==acme, YWJjZA===globex")]);
    let a = post(&labels.base, "dG9rZW4=", &body("k-t", "GB")).await;
    assert_eq!(a.status, 201, "{a:?}");
    let b = post(&labels.base, "YWJjZA==", &body("k-t", "GB")).await;
    assert_eq!(b.status, 201, "a second account: {b:?}");
    assert_ne!(a.body["id"], b.body["id"]);
    for refused in [ACME, "dG9rZW4", "dG9rZW4==acme"] {
        let saw = post(&labels.base, refused, &body("k-t", "GB")).await;
        assert_eq!(saw.status, 401, "{refused}: {saw:?}");
    }
}

/// The two halves agree (issue 13): with the service's default 30 s lease, a
/// duplicate of a running request is answered `409 in progress` with the
/// expected wait as its hint (at most a heartbeat interval, not the lease left),
/// so the real client with its default 30 s deadline waits and gets the result
/// instead of giving up at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_waits_through_an_in_progress_answer_to_the_result() {
    use idemkit_client::{RetryConfig, RetryMiddleware};
    let labels = Labels::start_with_defaults();
    let base = labels.base.clone();
    // Slow the courier so the first request is still running when the
    // duplicate arrives.
    labels.faults(json!({"latencyMs": 2500})).await;
    let first = tokio::spawn({
        let base = base.clone();
        async move { post(&base, ACME, &body("wait-for-me", "GB")).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;

    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryConfig::new()))
        .build();
    let began = std::time::Instant::now();
    let res = client
        .post(format!("{base}/labels"))
        .bearer_auth(ACME)
        .header("content-type", "application/json")
        .body(body("wait-for-me", "GB").to_string())
        .send()
        .await
        .expect("the client waits for the running request instead of giving up");
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let answer: Value = res.json().await.unwrap();
    let first = first.await.unwrap();
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!((status, replayed), (200, true), "{answer}");
    assert_eq!(answer, first.body, "the one label");
    assert!(
        began.elapsed() < Duration::from_secs(25),
        "took {:?}",
        began.elapsed()
    );
}

/// Keys on Redis, labels rows in SQLite (`serve --keys-url`): created, then
/// replayed byte for byte, with one courier shipment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_created_then_replayed_with_one_shipment() {
    let Some(labels) = Labels::start_on_redis() else {
        return;
    };
    let first = post(&labels.base, ACME, &body("k-1", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    assert_eq!(first.body["status"], "created");
    assert!(first.body["id"].as_str().unwrap().starts_with("lbl_"));
    assert!(first.body["courierTrackingNumber"].is_string());
    let again = post(&labels.base, ACME, &body("k-1", "GB")).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(again.raw, first.raw, "identical body");
    let other = post(&labels.base, ACME, &body("k-1", "FR")).await;
    assert_eq!(
        (other.status, other.body["code"].as_str()),
        (409, Some("idempotency_key_reused"))
    );
    let stats = labels.stats().await;
    assert_eq!(
        (stats["shipments"].as_i64(), stats["calls"].as_i64()),
        (Some(1), Some(1))
    );
    // The row is in SQLite, readable through the service.
    let id = first.body["id"].as_str().unwrap();
    let read = reqwest::Client::new()
        .get(format!("{}/labels/{id}", labels.base))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), 200);
    assert_eq!(read.json::<Value>().await.unwrap(), first.body);
}

/// `serve --database-url redis://…` alone: the keys in Redis, the labels rows
/// in `IDEMKIT_ROWS_DATABASE_URL` (SQLite here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_database_url_keeps_the_keys_in_redis_and_the_rows_in_sql() {
    let Some(url) = redis_url() else {
        return;
    };
    let mut labels = Labels::courier_only();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let sep = if url.contains('?') { '&' } else { '?' };
    let keys = format!("{url}{sep}prefix=labels-db-url-{}-{nanos}", std::process::id());
    let listen = format!("127.0.0.1:{}", labels.port);
    let rows = labels.db();
    labels.service = Some(spawn(
        &[
            "serve",
            "--listen",
            &listen,
            "--database-url",
            &keys,
            "--courier-url",
            &labels.courier,
            "--demo-tokens",
        ],
        &[("IDEMKIT_ROWS_DATABASE_URL", rows.to_str().unwrap())],
    ));
    labels.base = format!("http://{listen}");
    let first = post(&labels.base, ACME, &body("db-url", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(&labels.base, ACME, &body("db-url", "GB")).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(labels.stats().await["shipments"], 1);
    // The key is in Redis (idemkit keys shows it), the row in the SQLite file.
    let shown = crate::idemkit(vec![
        "keys".into(),
        "show".into(),
        "--database-url".into(),
        keys.clone(),
        "--account".into(),
        "acme".into(),
        "--key".into(),
        "db-url".into(),
        "--json".into(),
    ])
    .await;
    assert_eq!(shown.code, 0, "{shown:#?}");
    assert!(shown.stdout.contains("completed"), "{shown:#?}");
    let pool = sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=ro", rows.display()))
        .await
        .unwrap();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM labels")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(n, 1);
}

/// Keys on Redis: a courier outage is a retryable 502 and the retry keeps the
/// label and books one shipment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_courier_outage_retry_keeps_the_label() {
    let Some(labels) = Labels::start_on_redis() else {
        return;
    };
    labels.faults(json!({"failNext": 100, "status": 503})).await;
    let failed = post(&labels.base, ACME, &body("k-out", "GB")).await;
    assert_eq!(failed.status, 502, "{failed:?}");
    assert_eq!(failed.body["error"]["retryable"], true);
    labels.faults(json!({"reset": true})).await;
    let retry = post(&labels.base, ACME, &body("k-out", "GB")).await;
    assert_eq!(retry.status, 201, "{retry:?}");
    assert_eq!(retry.body["id"], failed.body["id"], "same label id");
    assert_eq!(labels.stats().await["shipments"], 1);
}

/// Keys on Redis: 50 concurrent duplicates make one label and one shipment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_fifty_concurrent_duplicates_make_one_label_and_one_shipment() {
    let Some(labels) = Labels::start_on_redis() else {
        return;
    };
    let b = Arc::new(body("k-storm", "GB"));
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let tasks: Vec<_> = (0..50)
        .map(|_| {
            let (base, b, barrier) = (labels.base.clone(), b.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                post(&base, ACME, &b).await
            })
        })
        .collect();
    let answers: Vec<Saw> = futures::future::join_all(tasks)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let created: Vec<&Saw> = answers.iter().filter(|a| a.status == 201).collect();
    assert_eq!(created.len(), 1, "{answers:#?}");
    for a in &answers {
        match a.status {
            201 => {}
            200 => assert_eq!(a.body, created[0].body),
            409 => assert_eq!(a.body["code"], "idempotency_request_in_progress"),
            s => panic!("unexpected {s}: {a:?}"),
        }
    }
    assert_eq!(labels.stats().await["shipments"], 1);
    let url = format!("sqlite://{}?mode=ro", labels.db().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM labels")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    assert_eq!(n, 1, "one label row");
}

/// Keys on Redis: SIGKILL at every phase boundary keeps one label and one
/// shipment. The layer completes the key after the handler's last SQL write
/// (no phase transaction to complete in), so the boundary before that is
/// `labels::after_finish_write`: the row is `created`, the key not completed,
/// and the retry re-runs the (idempotent) write and answers 201 with no new
/// courier call.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_crash_at_each_boundary_keeps_one_label_and_one_shipment() {
    let Some(mut labels) = Labels::start_on_redis() else {
        return;
    };
    crash_at_boundaries(
        &mut labels,
        &[
            ("idemkit::after_claim", 0, 1, false, false, false),
            ("idemkit::after_phase", 0, 1, true, false, false),
            ("idemkit::after_intent", 0, 1, true, false, false),
            ("idemkit::after_call", 1, 2, true, false, false),
            ("labels::after_finish_write", 1, 1, true, true, false),
        ],
    )
    .await;
}

/// Kills the service with keys on Redis right after its courier intent, for a
/// completer to finish; returns the key.
#[cfg(feature = "failpoints")]
pub(crate) async fn abandon_after_intent(labels: &mut Labels, key: &str) {
    labels.kill9();
    labels.start_service(&[("IDEMKIT_CRASH_AT", "idemkit::after_intent")]);
    let first = tokio::spawn({
        let (base, b) = (labels.base.clone(), body(key, "GB"));
        async move {
            reqwest::Client::new()
                .post(format!("{base}/labels"))
                .bearer_auth(ACME)
                .json(&b)
                .send()
                .await
        }
    });
    labels.wait_line("CRASHPOINT idemkit::after_intent");
    labels.kill9();
    assert!(first.await.unwrap().is_err(), "the killed attempt cannot answer");
    assert_eq!(calls_of(labels).await, 0, "no courier call yet");
    let rows = label_rows(labels, key).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].status, "pending", "{rows:?}");
}

/// After a finished completer: one created label with one shipment, and the
/// client's request is a replay that calls nothing.
#[cfg(feature = "failpoints")]
pub(crate) async fn finished_without_retry(labels: &Labels, key: &str) {
    let rows = label_rows(labels, key).await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    assert_eq!(rows[0].status, "created", "{rows:?}");
    let booked = courier_shipments(labels, &rows[0].id).await;
    assert_eq!(booked.len(), 1, "{booked:?}");
    assert_eq!(rows[0].shipment, Some(booked[0]));
    let calls = calls_of(labels).await;
    let answer = post(&labels.base, ACME, &body(key, "GB")).await;
    assert_eq!((answer.status, answer.replayed), (200, true), "{answer:?}");
    assert_eq!(answer.body["id"], json!(rows[0].id));
    assert_eq!(answer.body["courierTrackingNumber"], json!(rows[0].tracking));
    assert_eq!(calls_of(labels).await, calls, "a replay calls nothing");
    assert_eq!(labels.stats().await["shipments"], 1);
}

/// Keys on Redis: the service's own completer finishes a request abandoned
/// after its courier intent, with no client retry.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_completer_finishes_an_abandoned_request_with_no_retry() {
    let Some(mut labels) = Labels::start_on_redis() else {
        return;
    };
    abandon_after_intent(&mut labels, "k-abandoned").await;
    labels.start_service(&[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let rows = label_rows(&labels, "k-abandoned").await;
        if rows.first().is_some_and(|r| r.status == "created") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "not completed: {rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // With keys on Redis the row is written created just before the layer
    // completes the key; give the completion that instant.
    tokio::time::sleep(Duration::from_millis(300)).await;
    finished_without_retry(&labels, "k-abandoned").await;
}

/// Keys on Redis: one `idemkit keys complete` pass (service down) finishes a
/// request abandoned after its courier intent.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_complete_command_finishes_an_abandoned_request() {
    let Some(mut labels) = Labels::start_on_redis() else {
        return;
    };
    abandon_after_intent(&mut labels, "k-cli").await;
    tokio::time::sleep(Duration::from_millis(500)).await; // past the 400 ms lease
    let keys_url = labels.keys_url.clone().unwrap();
    let db = labels.db();
    let out = Command::new(env!("CARGO_BIN_EXE_idemkit"))
        .args([
            "keys",
            "complete",
            "--database-url",
            &keys_url,
            "--labels-database-url",
            db.to_str().unwrap(),
            "--courier-url",
            &labels.courier,
            "--min-age-ms",
            "0",
            "--lease-ms",
            "5000",
            "--json",
        ])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(
        (report["found"].as_u64(), report["completed"].as_u64()),
        (Some(1), Some(1)),
        "{report}"
    );
    labels.start_service(&[]);
    finished_without_retry(&labels, "k-cli").await;
}
