//! The labels contract over real HTTP, with real processes: `idemkit courier` and
//! `idemkit serve` are started from the built binary.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};

#[cfg(feature = "failpoints")]
mod crash;
mod docs;
mod redis;
mod serve;

#[cfg(feature = "failpoints")]
pub(crate) use crash::label_rows;
#[cfg(feature = "failpoints")]
use crash::{calls_of, courier_shipments, crash_at_boundaries};
#[cfg(feature = "failpoints")]
pub(crate) use redis::{abandon_after_intent, finished_without_retry};

pub(crate) struct Proc(Child);

impl Proc {
    /// The process id.
    pub(crate) fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) use idemkit_testkit::free_port;

pub(crate) fn spawn(args: &[&str], env: &[(&str, &str)]) -> (Proc, std::sync::mpsc::Receiver<String>) {
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

    /// The courier's SQLite database (its shipments).
    pub(crate) fn courier_db(&self) -> std::path::PathBuf {
        self.dir.join("courier.db")
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
