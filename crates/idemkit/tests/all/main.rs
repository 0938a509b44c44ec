//! Black-box tests of the quickstart example over real HTTP: a real process on
//! loopback, its own SQLite file, real concurrent clients.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderValue};
use serde_json::{Value, json};

mod migrations;
mod multi_instance;
mod pg_restart;
mod quickstart;

/// A quickstart process on a free port with its own database; killed on drop.
pub(crate) struct Server {
    child: Child,
    pub(crate) base: String,
    _dir: TempDir,
}

pub(crate) struct TempDir(PathBuf);

impl TempDir {
    pub(crate) fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let p = std::env::temp_dir().join(format!("idemkit-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Which store a quickstart process runs on.
#[derive(Debug, Clone)]
pub(crate) enum Backend {
    /// Its own SQLite file.
    Sqlite,
    /// A PostgreSQL database URL and the schema to use in it.
    Postgres { url: String, schema: String },
    /// Keys in Redis under a fresh prefix, orders in the process's SQLite file.
    Redis { url: String, prefix: String },
}

impl Backend {
    /// A fresh key prefix on the test Redis; `None` outside CI when no Redis is
    /// configured (under CI a missing Redis is a failure).
    pub(crate) fn redis() -> Option<Self> {
        let url = match std::env::var("IDEMKIT_TEST_REDIS_URL") {
            Ok(url) if !url.is_empty() => url,
            _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_REDIS_URL is not set under CI"),
            _ => {
                eprintln!("IDEMKIT_TEST_REDIS_URL is not set: skipping");
                return None;
            }
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        Some(Self::Redis {
            url,
            prefix: format!("qs{}x{nanos}", std::process::id()),
        })
    }

    /// A fresh PostgreSQL schema on the test database; `None` outside CI when
    /// no database is configured (under CI a missing database is a failure).
    pub(crate) fn postgres() -> Option<Self> {
        let url = match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
            Ok(url) if !url.is_empty() => url,
            _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_POSTGRES_URL is not set under CI"),
            _ => {
                eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping");
                return None;
            }
        };
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        Some(Self::Postgres {
            url,
            schema: format!("q_{}_{nanos}", std::process::id()),
        })
    }
}

impl Server {
    pub(crate) async fn start() -> Self {
        Self::start_on(&Backend::Sqlite, &[]).await
    }

    /// Starts a quickstart process on `backend` with extra environment.
    pub(crate) async fn start_on(backend: &Backend, env: &[(&str, &str)]) -> Self {
        let dir = TempDir::new("quickstart");
        let port = free_port();
        let mut cmd = Command::new(idemkit_testkit::example_bin("quickstart"));
        match backend {
            Backend::Sqlite => {
                cmd.env("IDEMKIT_DB", dir.0.join("quickstart.db"))
                    .env_remove("DATABASE_URL");
            }
            Backend::Postgres { url, schema } => {
                cmd.env("DATABASE_URL", url).env("IDEMKIT_PG_SCHEMA", schema);
            }
            Backend::Redis { url, prefix } => {
                cmd.env("IDEMKIT_DB", dir.0.join("quickstart.db"))
                    .env_remove("DATABASE_URL")
                    .env("IDEMKIT_KEYSTORE", url)
                    .env("IDEMKIT_REDIS_PREFIX", prefix);
            }
        }
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .env("PORT", port.to_string())
            .env("ACCOUNT_SECRET", ACCOUNT_SECRET)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn quickstart");
        let server = Self {
            child,
            base: format!("http://127.0.0.1:{port}"),
            _dir: dir,
        };
        server.wait_ready().await;
        server
    }

    async fn wait_ready(&self) {
        let client = reqwest::Client::new();
        for _ in 0..400 {
            if client
                .get(format!("{}/orders/count", self.base))
                .bearer_auth("probe")
                .send()
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("quickstart did not start");
    }

    pub(crate) async fn count(&self, account: &str) -> i64 {
        let v: Value = reqwest::Client::new()
            .get(format!("{}/orders/count", self.base))
            .bearer_auth(account)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["count"].as_i64().expect("count")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The secret the quickstart derives accounts from bearer tokens with, in
/// these tests: its rows name `Account::keyed(ACCOUNT_SECRET, token)`.
pub(crate) const ACCOUNT_SECRET: &str = "quickstart test secret";

pub(crate) use idemkit_testkit::free_port;

/// One response, fully read.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Vec<u8>,
}

impl Answer {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }
    pub(crate) fn code(&self) -> String {
        self.json()["code"].as_str().unwrap_or_default().to_owned()
    }
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    pub(crate) fn is_problem(&self) -> bool {
        self.header("content-type") == Some("application/problem+json")
    }
}

/// POSTs raw bytes to `/orders` with the given headers.
pub(crate) async fn post_raw(
    client: &reqwest::Client,
    base: &str,
    headers: &[(&str, HeaderValue)],
    body: impl Into<reqwest::Body>,
) -> Answer {
    let mut req = client.post(format!("{base}/orders"));
    for (name, value) in headers {
        req = req.header(*name, value.clone());
    }
    let res = req.body(body).send().await.expect("send");
    let status = res.status().as_u16();
    let headers = res.headers().clone();
    let body = res.bytes().await.expect("body").to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

/// POSTs a JSON order with a bearer account and key.
pub(crate) async fn post_order(
    client: &reqwest::Client,
    base: &str,
    account: &str,
    key: &str,
    body: &Value,
) -> Answer {
    post_raw(
        client,
        base,
        &[
            (
                "authorization",
                HeaderValue::from_str(&format!("Bearer {account}")).unwrap(),
            ),
            ("idempotency-key", HeaderValue::from_str(key).unwrap()),
            ("content-type", HeaderValue::from_static("application/json")),
        ],
        body.to_string(),
    )
    .await
}

pub(crate) fn order(sku: &str, quantity: i64) -> Value {
    json!({ "sku": sku, "quantity": quantity })
}
