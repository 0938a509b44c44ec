//! `POST /labels` over real HTTP on loopback against the service in process,
//! with the keys on Redis (`LabelsConfig::keys`) or in the labels rows'
//! SQLite: a courier's permanent rejection is final on every create path
//! (issue 30, item 1): stored and replayed, never re-sent to the courier,
//! never booked later by the completer.

use std::time::Duration;

use idemkit_labels::service::{LabelsConfig, Service, build};
use idemkit_tower::Completer;
use serde_json::{Value, json};

use crate::{courier_stats, http, start_courier};

const ACME: &str = "demo-token-acme";

/// Where the keys live.
#[derive(Clone, Copy, Debug)]
enum Keys {
    /// Redis (`IDEMKIT_TEST_REDIS_URL`), the rows in SQLite.
    Redis,
    /// The labels rows' SQLite database.
    Sql,
}

/// The test Redis, with a fresh key prefix; `None` (skipped) when
/// `IDEMKIT_TEST_REDIS_URL` is unset outside CI.
fn redis_keys() -> Option<String> {
    match std::env::var("IDEMKIT_TEST_REDIS_URL") {
        Ok(url) if !url.is_empty() => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let sep = if url.contains('?') { '&' } else { '?' };
            Some(format!(
                "{url}{sep}prefix=labels-create-{}-{nanos}",
                std::process::id()
            ))
        }
        _ if std::env::var_os("CI").is_some() => {
            panic!("IDEMKIT_TEST_REDIS_URL is not set; under CI a missing Redis is a failure")
        }
        _ => {
            eprintln!("IDEMKIT_TEST_REDIS_URL is not set: skipping Redis test");
            None
        }
    }
}

/// The labels service on a free loopback port, with its own SQLite file.
struct Labels {
    base: String,
    service: Service,
    _dir: std::path::PathBuf,
}

impl Drop for Labels {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

async fn start_labels(keys: Keys, courier_url: String) -> Option<Labels> {
    let keys = match keys {
        Keys::Redis => Some(redis_keys()?),
        Keys::Sql => None,
    };
    let dir = std::env::temp_dir().join(format!(
        "labels-create-{}-{}",
        std::process::id(),
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let config = LabelsConfig {
        database: dir.join("labels.db").to_str().unwrap().to_owned(),
        keys,
        courier_url,
        lease: Duration::from_millis(400),
        tokens: LabelsConfig::demo_tokens(),
        courier_deadline: Duration::from_secs(2),
        idempotency: idemkit_labels::contract::default_config(),
        pg_schema: None,
    };
    let service = build(config).await.expect("build the labels service");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let router = service.router.clone();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Some(Labels {
        base,
        service,
        _dir: dir,
    })
}

fn body(key: &str) -> Value {
    json!({
        "idempotencyKey": key,
        "courier": "ups",
        "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
        "shipTo": {"name": "Ada", "line1": "10 Downing St", "city": "London", "postalCode": "SW1A 2AA", "country": "GB"},
        "parcel": {"weightGrams": 900, "lengthCm": 20.5, "widthCm": 10, "heightCm": 5}
    })
}

#[derive(Debug)]
struct Saw {
    status: u16,
    replayed: bool,
    body: Value,
    raw: Vec<u8>,
}

async fn post(base: &str, body: &Value) -> Saw {
    let res = http()
        .post(format!("{base}/labels"))
        .bearer_auth(ACME)
        .json(body)
        .send()
        .await
        .unwrap();
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    let raw = res.bytes().await.unwrap().to_vec();
    Saw {
        status,
        replayed,
        body: serde_json::from_slice(&raw).unwrap_or(Value::Null),
        raw,
    }
}

async fn set_faults(courier: &str, faults: Value) {
    let res = http()
        .post(format!("{courier}/_faults"))
        .json(&faults)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
}

/// The courier rejects the label for good (once: a second call would book
/// it). The `502` is final: its retry (when `retry`) replays it without
/// calling the courier, the completer finds nothing to finish, and the client
/// that follows the answer's advice (a new key) ends with one shipment, not two.
async fn a_rejection_is_final_and_never_booked_later(keys: Keys, retry: bool) {
    let courier = start_courier().await;
    let Some(labels) = start_labels(keys, courier.url()).await else {
        return;
    };
    set_faults(&courier.url(), json!({"rejectNext": 1})).await;
    let rejected = post(&labels.base, &body("k-rejected")).await;
    assert_eq!(rejected.status, 502, "{rejected:?}");
    assert_eq!(rejected.body["status"], "failed");
    assert_eq!(rejected.body["error"]["retryable"], false, "{rejected:?}");
    let calls = courier_stats(&courier.url()).await.calls;

    if retry {
        // The client retries with the same key: the stored answer, no courier call.
        let again = post(&labels.base, &body("k-rejected")).await;
        assert_eq!(
            (again.status, again.replayed),
            (502, true),
            "{keys:?}: the rejection is stored and replayed: {again:?}"
        );
        assert_eq!(again.raw, rejected.raw, "byte for byte");
    }

    // Past the lease, the completer has nothing to finish.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = Completer::new(labels.service.keys.clone(), labels.service.router.clone())
        .min_age(Duration::ZERO)
        .run_once()
        .await
        .unwrap();
    assert_eq!(report.found, 0, "{keys:?}: nothing abandoned: {report:?}");
    let stats = courier_stats(&courier.url()).await;
    assert_eq!(
        (stats.calls, stats.shipments),
        (calls, 0),
        "{keys:?}: the courier was not called again and booked nothing"
    );

    // The answer said: correct it and send it with a new key.
    let corrected = post(&labels.base, &body("k-corrected")).await;
    assert_eq!(corrected.status, 201, "{corrected:?}");
    assert_eq!(
        courier_stats(&courier.url()).await.shipments,
        1,
        "{keys:?}: one shipment for the one label created"
    );
    let read = http()
        .get(format!(
            "{}/labels/{}",
            labels.base,
            rejected.body["id"].as_str().unwrap()
        ))
        .bearer_auth(ACME)
        .send()
        .await
        .unwrap();
    let row: Value = read.json().await.unwrap();
    assert_eq!(
        row["status"], "failed",
        "{keys:?}: the rejected label stays failed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_a_courier_rejection_is_replayed_to_the_retry() {
    a_rejection_is_final_and_never_booked_later(Keys::Redis, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_a_courier_rejection_is_not_booked_by_the_completer() {
    a_rejection_is_final_and_never_booked_later(Keys::Redis, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_keys_a_courier_rejection_is_replayed_to_the_retry() {
    a_rejection_is_final_and_never_booked_later(Keys::Sql, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_keys_a_courier_rejection_is_not_booked_by_the_completer() {
    a_rejection_is_final_and_never_booked_later(Keys::Sql, false).await;
}
