//! The labels service with its keys on Redis (`serve --keys-url`) and its rows
//! in SQL.

use super::*;

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
