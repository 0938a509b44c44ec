//! The courier simulator over real HTTP: idempotent shipments, every fault, the
//! tracking and stats endpoints.

use std::time::{Duration, Instant};

use futures::future::join_all;
use idemkit_labels::courier::{
    Courier, CourierConfig, FaultUpdate, Faults, ShipmentCreated, Stats, TrackingEvents,
};
use serde_json::{Value, json};

use crate::{courier_stats, http, label_request, start_courier};

/// One `POST /shipments` answer.
#[derive(Debug)]
struct Answer {
    status: u16,
    replayed: bool,
    content_type: String,
    body: String,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:#?}"))
    }

    fn created(&self) -> ShipmentCreated {
        assert_eq!(self.status, 201, "{self:#?}");
        serde_json::from_str(&self.body).unwrap()
    }
}

async fn post_shipment(client: &reqwest::Client, base: &str, key: Option<&str>, body: &Value) -> Answer {
    try_post_shipment(client, base, key, body)
        .await
        .expect("POST /shipments")
}

async fn try_post_shipment(
    client: &reqwest::Client,
    base: &str,
    key: Option<&str>,
    body: &Value,
) -> reqwest::Result<Answer> {
    let mut req = client.post(format!("{base}/shipments")).json(body);
    if let Some(key) = key {
        req = req.header("Idempotency-Key", key);
    }
    let res = req.send().await?;
    let status = res.status().as_u16();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    let content_type = res
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = res.text().await?;
    Ok(Answer {
        status,
        replayed,
        content_type,
        body,
    })
}

async fn set_faults(base: &str, update: &FaultUpdate) -> Faults {
    let res = http()
        .post(format!("{base}/_faults"))
        .json(update)
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    res.json().await.unwrap()
}

fn stats(shipments: u64, calls: u64, duplicates_suppressed: u64) -> Stats {
    Stats {
        shipments,
        calls,
        duplicates_suppressed,
    }
}

#[tokio::test]
async fn the_same_key_twice_creates_one_shipment_and_replays_it() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    let body = label_request("label-1");
    let first = post_shipment(&client, &base, Some("k-1"), &body).await;
    assert_eq!(first.status, 201);
    assert!(!first.replayed);
    assert!(first.content_type.starts_with("application/json"));
    assert_eq!(
        first.created(),
        ShipmentCreated {
            order_number: "ORD-000001".into(),
            tracking_number: "TRK0000000001".into(),
            shipment: 1,
        }
    );
    let second = post_shipment(&client, &base, Some("k-1"), &body).await;
    assert_eq!(second.status, 201);
    assert!(second.replayed, "{second:#?}");
    assert_eq!(second.body, first.body, "a replay is byte-identical");
    assert_eq!(courier_stats(&base).await, stats(1, 2, 1));
    assert_eq!(courier.courier().stats().await.unwrap(), stats(1, 2, 1));
}

#[tokio::test]
async fn different_keys_create_different_shipments() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    let body = label_request("label-1");
    let a = post_shipment(&client, &base, Some("k-a"), &body).await.created();
    let b = post_shipment(&client, &base, Some("k-b"), &body).await.created();
    assert_eq!((a.shipment, b.shipment), (1, 2));
    assert_ne!(a.order_number, b.order_number);
    assert_ne!(a.tracking_number, b.tracking_number);
    assert_eq!(courier_stats(&base).await, stats(2, 2, 0));
}

#[tokio::test]
async fn a_missing_key_is_a_400_problem_and_creates_nothing() {
    let courier = start_courier().await;
    let base = courier.url();
    let answer = post_shipment(&http(), &base, None, &label_request("label-1")).await;
    assert_eq!(answer.status, 400);
    assert_eq!(answer.content_type, "application/problem+json");
    assert_eq!(answer.json()["code"], "idempotency_key_missing");
    assert_eq!(courier_stats(&base).await, stats(0, 1, 0));
}

#[tokio::test]
async fn the_same_key_with_another_body_is_refused_not_replayed() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    post_shipment(&client, &base, Some("k"), &label_request("label-1"))
        .await
        .created();
    let other = post_shipment(&client, &base, Some("k"), &label_request("label-2")).await;
    assert_eq!(other.status, 409);
    assert_eq!(other.json()["code"], "idempotency_key_reused");
    assert_eq!(courier_stats(&base).await, stats(1, 2, 0));
}

#[tokio::test]
async fn any_json_object_is_accepted_and_anything_else_releases_the_key() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    let not_object = post_shipment(&client, &base, Some("k"), &json!([1, 2])).await;
    assert_eq!(not_object.status, 400);
    assert_eq!(not_object.json()["code"], "validation_failed");
    // The validation failure was not stored: the corrected request reuses the key.
    let fixed = post_shipment(&client, &base, Some("k"), &json!({"anything": true})).await;
    assert_eq!(fixed.created().shipment, 1);
    assert_eq!(courier_stats(&base).await, stats(1, 2, 0));
}

#[tokio::test]
async fn fail_next_answers_the_status_then_succeeds_and_counts_every_call() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    let faults = set_faults(&base, &FaultUpdate::fail_next(2, 503)).await;
    assert_eq!(faults.fail_next, 2);
    assert_eq!(faults.status, 503);
    let body = label_request("label-1");
    for _ in 0..2 {
        let failed = post_shipment(&client, &base, Some("k"), &body).await;
        assert_eq!(failed.status, 503);
        assert_eq!(failed.content_type, "application/problem+json");
        let problem = failed.json();
        assert_eq!(problem["code"], "courier_unavailable");
        assert_eq!(problem["retryable"], true);
        assert_eq!(problem["status"], 503);
        assert_eq!(courier_stats(&base).await.shipments, 0);
    }
    let ok = post_shipment(&client, &base, Some("k"), &body).await;
    assert!(!ok.replayed);
    assert_eq!(ok.created().shipment, 1);
    assert_eq!(courier_stats(&base).await, stats(1, 3, 0));
    assert_eq!(courier.courier().faults(), Faults::default());
}

#[tokio::test]
async fn fail_next_uses_the_status_given_and_503_by_default() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    set_faults(&base, &FaultUpdate::fail_next(1, 502)).await;
    let failed = post_shipment(&client, &base, Some("k"), &json!({})).await;
    assert_eq!(failed.status, 502);
    set_faults(&base, &FaultUpdate::reset()).await;
    let faults = set_faults(
        &base,
        &FaultUpdate {
            fail_next: Some(1),
            ..FaultUpdate::default()
        },
    )
    .await;
    assert_eq!(faults.status, 503);
    let failed = post_shipment(&client, &base, Some("k"), &json!({})).await;
    assert_eq!(failed.status, 503);
}

#[tokio::test]
async fn reject_next_is_a_permanent_422_and_creates_nothing() {
    let courier = start_courier().await;
    let base = courier.url();
    let client = http();
    set_faults(&base, &FaultUpdate::reject_next(1)).await;
    let rejected = post_shipment(&client, &base, Some("k"), &label_request("label-1")).await;
    assert_eq!(rejected.status, 422);
    assert_eq!(rejected.content_type, "application/problem+json");
    let problem = rejected.json();
    assert_eq!(problem["code"], "address_rejected");
    assert_eq!(problem["retryable"], false);
    assert_eq!(problem["type"], "urn:idemkit:problem:address_rejected");
    assert_eq!(courier_stats(&base).await, stats(0, 1, 0));
    // Only the next call was rejected.
    let next = post_shipment(&client, &base, Some("k-2"), &label_request("label-2")).await;
    assert_eq!(next.status, 201);
}

#[tokio::test]
async fn concurrent_duplicates_under_latency_wait_for_the_first_and_get_its_answer() {
    let courier = start_courier().await;
    let base = courier.url();
    set_faults(&base, &FaultUpdate::latency_ms(400)).await;
    let body = label_request("label-1");
    let started = Instant::now();
    let answers = join_all((0..5).map(|_| {
        let base = base.clone();
        let body = body.clone();
        async move {
            // One connection each: the duplicates really are concurrent.
            post_shipment(&http(), &base, Some("same-key"), &body).await
        }
    }))
    .await;
    assert!(started.elapsed() >= Duration::from_millis(400));
    let first = answers.iter().find(|a| !a.replayed).expect("one original");
    assert_eq!(first.created().shipment, 1);
    for a in &answers {
        assert_eq!(a.status, 201, "{a:#?}");
        assert_eq!(a.body, first.body);
    }
    assert_eq!(answers.iter().filter(|a| a.replayed).count(), 4);
    assert_eq!(courier_stats(&base).await, stats(1, 5, 4));
}

#[tokio::test]
async fn latency_is_spent_before_the_commit() {
    let courier = start_courier().await;
    let base = courier.url();
    set_faults(&base, &FaultUpdate::latency_ms(500)).await;
    let call = {
        let base = base.clone();
        tokio::spawn(async move { post_shipment(&http(), &base, Some("k"), &json!({})).await })
    };
    // Once the call has arrived, its commit is still 500 ms away.
    let deadline = Instant::now() + Duration::from_secs(10);
    while courier_stats(&base).await.calls == 0 {
        assert!(Instant::now() < deadline, "the call never arrived");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(courier_stats(&base).await, stats(0, 1, 0), "not committed yet");
    assert_eq!(call.await.unwrap().status, 201);
    assert_eq!(courier_stats(&base).await.shipments, 1);
}

#[tokio::test]
async fn a_call_whose_client_gave_up_still_commits_and_the_retry_replays_it() {
    let courier = start_courier().await;
    let base = courier.url();
    set_faults(&base, &FaultUpdate::latency_ms(400)).await;
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(100))
        .build()
        .unwrap();
    let body = label_request("label-1");
    let err = try_post_shipment(&impatient, &base, Some("k"), &body)
        .await
        .expect_err("the client times out");
    assert!(err.is_timeout(), "{err:?}");
    // The retry arrives while the first call is still in flight: it waits for it.
    let retry = post_shipment(&http(), &base, Some("k"), &body).await;
    assert!(retry.replayed, "{retry:#?}");
    assert_eq!(retry.created().shipment, 1);
    assert_eq!(courier_stats(&base).await, stats(1, 2, 1));
}

#[tokio::test]
async fn drop_response_after_commit_commits_closes_the_connection_and_the_retry_replays() {
    let courier = start_courier().await;
    let base = courier.url();
    set_faults(&base, &FaultUpdate::drop_response_after_commit(1)).await;
    let body = label_request("label-1");
    let err = try_post_shipment(&http(), &base, Some("k"), &body)
        .await
        .expect_err("no answer");
    assert!(
        !err.is_timeout(),
        "the connection is closed, not left hanging: {err:?}"
    );
    assert!(err.is_request() || err.is_connect() || err.is_body(), "{err:?}");
    assert_eq!(courier_stats(&base).await, stats(1, 1, 0), "committed anyway");
    let retry = post_shipment(&http(), &base, Some("k"), &body).await;
    assert!(retry.replayed, "{retry:#?}");
    assert_eq!(retry.created().shipment, 1);
    assert_eq!(courier_stats(&base).await, stats(1, 2, 1));
    assert_eq!(courier.courier().faults().drop_response_after_commit, 0);
}

#[tokio::test]
async fn drop_response_after_commit_spares_failures_and_counts_successes_only() {
    let courier = start_courier().await;
    let base = courier.url();
    set_faults(&base, &FaultUpdate::drop_response_after_commit(1)).await;
    // A call the layer refuses (no key) commits nothing and is answered.
    let refused = post_shipment(&http(), &base, None, &json!({})).await;
    assert_eq!(refused.status, 400);
    assert_eq!(courier.courier().faults().drop_response_after_commit, 1);
    assert!(
        try_post_shipment(&http(), &base, Some("k"), &json!({}))
            .await
            .is_err()
    );
    assert_eq!(courier_stats(&base).await.shipments, 1);
}

#[tokio::test]
async fn reset_clears_every_fault() {
    let courier = start_courier().await;
    let base = courier.url();
    let all = FaultUpdate {
        fail_next: Some(5),
        status: Some(504),
        latency_ms: Some(5_000),
        drop_response_after_commit: Some(3),
        reject_next: Some(2),
        reset: false,
    };
    let set = set_faults(&base, &all).await;
    assert_eq!(
        set,
        Faults {
            fail_next: 5,
            status: 504,
            latency_ms: 5_000,
            drop_response_after_commit: 3,
            reject_next: 2,
        }
    );
    let cleared = set_faults(&base, &FaultUpdate::reset()).await;
    assert_eq!(cleared, Faults::default());
    let shown: Faults = http()
        .get(format!("{base}/_faults"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(shown, Faults::default());
    let started = Instant::now();
    let ok = post_shipment(&http(), &base, Some("k"), &json!({})).await;
    assert_eq!(ok.status, 201);
    assert!(!ok.replayed);
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn bad_fault_updates_are_refused_and_change_nothing() {
    let courier = start_courier().await;
    let base = courier.url();
    for bad in [
        r#"{"failnext":1}"#,
        r#"{"failNext":-1}"#,
        r#"{"failNext":1,"status":404}"#,
        "not json",
    ] {
        let res = http()
            .post(format!("{base}/_faults"))
            .header("content-type", "application/json")
            .body(bad)
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 400, "{bad}");
        let problem: Value = res.json().await.unwrap();
        assert_eq!(problem["code"], "validation_failed", "{bad}");
    }
    assert_eq!(courier.courier().faults(), Faults::default());
}

#[tokio::test]
async fn events_list_the_shipments_tracking_and_unknown_ones_are_404() {
    let courier = start_courier().await;
    let base = courier.url();
    let created = post_shipment(&http(), &base, Some("k"), &label_request("label-1"))
        .await
        .created();
    let res = http()
        .get(format!("{base}/shipments/{}/events", created.shipment))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let events: TrackingEvents = res.json().await.unwrap();
    assert_eq!(events.shipment, created.shipment);
    assert_eq!(events.tracking_number, created.tracking_number);
    assert!((1..=3).contains(&events.events.len()), "{events:#?}");
    let first = &events.events[0];
    assert_eq!(first.status, "label_created");
    assert!(!first.description.is_empty());
    // RFC 3339 in UTC: 2024-05-01T12:00:00.000Z
    let at = first.at.as_bytes();
    assert_eq!(at.len(), 24, "{}", first.at);
    assert_eq!(
        (at[4], at[7], at[10], at[13], at[16], at[19], at[23]),
        (b'-', b'-', b'T', b':', b':', b'.', b'Z')
    );
    for missing in ["2", "0", "-1", "abc"] {
        let res = http()
            .get(format!("{base}/shipments/{missing}/events"))
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 404, "{missing}");
        assert_eq!(
            res.headers()["content-type"],
            "application/problem+json",
            "{missing}"
        );
    }
}

#[tokio::test]
async fn stats_answer_exactly_the_three_counters() {
    let courier = start_courier().await;
    let base = courier.url();
    let raw: Value = http()
        .get(format!("{base}/_stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        raw,
        json!({"shipments": 0, "calls": 0, "duplicatesSuppressed": 0})
    );
    let client = http();
    post_shipment(&client, &base, Some("a"), &json!({})).await;
    post_shipment(&client, &base, Some("a"), &json!({})).await;
    post_shipment(&client, &base, Some("b"), &json!({})).await;
    post_shipment(&client, &base, None, &json!({})).await;
    assert_eq!(courier_stats(&base).await, stats(2, 4, 1));
}

#[tokio::test]
async fn unknown_routes_and_methods_are_problems() {
    let courier = start_courier().await;
    let base = courier.url();
    let res = http().get(format!("{base}/nope")).send().await.unwrap();
    assert_eq!(res.status(), 404);
    assert_eq!(res.headers()["content-type"], "application/problem+json");
    let res = http().get(format!("{base}/shipments")).send().await.unwrap();
    assert_eq!(res.status(), 405);
    assert_eq!(courier_stats(&base).await.calls, 0);
}

#[tokio::test]
async fn shipments_survive_a_restart_on_the_same_file_and_keys_still_replay() {
    let dir = std::env::temp_dir().join(format!(
        "idemkit-courier-test-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("courier.db");
    let config = CourierConfig::default().with_database_url(file.to_string_lossy());
    let body = label_request("label-1");
    let first = {
        let courier = idemkit_labels::courier::start(config.clone()).await.unwrap();
        let answer = post_shipment(&http(), &courier.url(), Some("k"), &body).await;
        courier.shutdown().await;
        answer
    };
    let courier = idemkit_labels::courier::start(config).await.unwrap();
    let again = post_shipment(&http(), &courier.url(), Some("k"), &body).await;
    assert!(again.replayed);
    assert_eq!(again.body, first.body);
    assert_eq!(courier_stats(&courier.url()).await, stats(1, 1, 1));
    courier.shutdown().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn the_default_database_is_temporary_and_removed_on_shutdown() {
    let courier = Courier::open(CourierConfig::default()).await.unwrap();
    let described = courier.database().to_owned();
    let path = described
        .strip_prefix("SQLite ")
        .and_then(|rest| rest.strip_suffix(" (temporary, removed on exit)"))
        .unwrap_or_else(|| panic!("{described}"));
    let dir = std::path::Path::new(path).parent().unwrap().to_owned();
    assert!(dir.exists());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let running = courier.spawn(listener).unwrap();
    post_shipment(&http(), &running.url(), Some("k"), &json!({})).await;
    running.shutdown().await;
    assert!(!dir.exists(), "{} is left behind", dir.display());
}

/// PostgreSQL (`IDEMKIT_TEST_POSTGRES_URL`): a fresh schema; duplicates, concurrent
/// duplicates under latency (they block on the first's uncommitted claim) and a
/// dropped answer.
#[tokio::test]
async fn postgres_backend_keeps_one_shipment_per_key() {
    let url = match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => url,
        _ if std::env::var_os("CI").is_some() => panic!("IDEMKIT_TEST_POSTGRES_URL is not set under CI"),
        _ => {
            eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping");
            return;
        }
    };
    let schema = format!(
        "courier_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos()
    );
    let courier = idemkit_labels::courier::start(
        CourierConfig::default()
            .with_database_url(url)
            .with_pg_schema(&schema),
    )
    .await
    .unwrap();
    let base = courier.url();
    let body = label_request("label-1");
    let client = http();
    let a = post_shipment(&client, &base, Some("a"), &body).await;
    let a_again = post_shipment(&client, &base, Some("a"), &body).await;
    assert_eq!(a.created().order_number, "ORD-000001");
    assert!(a_again.replayed);
    assert_eq!(a_again.body, a.body);

    set_faults(&base, &FaultUpdate::latency_ms(300)).await;
    let answers = join_all((0..4).map(|_| {
        let base = base.clone();
        let body = body.clone();
        async move { post_shipment(&http(), &base, Some("b"), &body).await }
    }))
    .await;
    for answer in &answers {
        assert_eq!(answer.body, answers[0].body, "{answer:#?}");
    }
    assert_eq!(answers.iter().filter(|a| a.replayed).count(), 3);
    set_faults(&base, &FaultUpdate::reset()).await;

    set_faults(&base, &FaultUpdate::drop_response_after_commit(1)).await;
    assert!(try_post_shipment(&http(), &base, Some("c"), &body).await.is_err());
    let c = post_shipment(&http(), &base, Some("c"), &body).await;
    assert!(c.replayed);
    assert_eq!(courier_stats(&base).await, stats(3, 8, 5));

    let check = courier.courier().stats().await.unwrap();
    assert_eq!(check.shipments, 3);
    courier.shutdown().await;
}
