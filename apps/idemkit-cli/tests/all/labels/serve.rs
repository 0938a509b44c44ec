//! The running service as a whole: `idemkit check` against it, its served
//! contract, body keys, API tokens, and the client waiting through an
//! in-progress answer.

use super::*;

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
