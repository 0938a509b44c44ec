//! `idemkit courier`: the real binary on loopback starts, announces its address,
//! answers idempotently, and stops cleanly on SIGTERM.

use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// An `idemkit courier` process; killed on drop.
struct CourierProcess {
    child: Child,
    base: String,
    /// Kept open: the process may still write to it.
    _stdout: BufReader<ChildStdout>,
}

impl CourierProcess {
    /// Starts `idemkit courier --listen 127.0.0.1:0 <extra>` and waits for its
    /// `courier listening on http://ADDR` line.
    async fn start(extra: &[String]) -> Self {
        let mut args = vec!["courier".to_owned(), "--listen".into(), "127.0.0.1:0".into()];
        args.extend_from_slice(extra);
        tokio::task::spawn_blocking(move || {
            let mut child = Command::new(env!("CARGO_BIN_EXE_idemkit"))
                .args(&args)
                .env_remove("RUST_LOG")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn idemkit courier");
            let mut stdout = BufReader::new(child.stdout.take().unwrap());
            let mut line = String::new();
            stdout.read_line(&mut line).expect("read the first line");
            let base = line
                .trim_end()
                .strip_prefix("courier listening on ")
                .unwrap_or_else(|| {
                    let _ = child.kill();
                    let mut err = String::new();
                    let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                    panic!("unexpected first line {line:?}; stderr: {err}")
                })
                .to_owned();
            assert!(base.starts_with("http://127.0.0.1:"), "{base}");
            Self {
                child,
                base,
                _stdout: stdout,
            }
        })
        .await
        .unwrap()
    }

    /// Sends SIGTERM and returns the exit code and stderr.
    async fn terminate(mut self) -> (Option<i32>, String) {
        let pid = self.child.id().to_string();
        let mut stderr = self.child.stderr.take().unwrap();
        let (status, err) = tokio::task::spawn_blocking(move || {
            let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
            assert!(sent.success());
            let mut err = String::new();
            stderr.read_to_string(&mut err).unwrap();
            (self.child.wait().unwrap(), err)
        })
        .await
        .unwrap();
        (status.code(), err)
    }
}

impl Drop for CourierProcess {
    /// SIGTERM first, so the process removes its temporary database; SIGKILL if
    /// it has not exited within 5 s.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        let pid = self.child.id().to_string();
        let _ = Command::new("kill").args(["-TERM", &pid]).status();
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn temp_dir() -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("idemkit-courier-cli-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn post(base: &str, key: &str, body: &Value) -> (u16, bool, Value) {
    let res = reqwest::Client::new()
        .post(format!("{base}/shipments"))
        .header("Idempotency-Key", key)
        .json(body)
        .timeout(Duration::from_secs(30))
        .send()
        .await
        .expect("POST /shipments");
    let status = res.status().as_u16();
    let replayed = res.headers().get("idempotent-replayed").is_some();
    (status, replayed, res.json().await.unwrap())
}

async fn get(base: &str, path: &str) -> (u16, Value) {
    let res = reqwest::get(format!("{base}{path}")).await.expect("GET");
    (res.status().as_u16(), res.json().await.unwrap())
}

#[cfg(unix)]
#[tokio::test]
async fn the_courier_binary_answers_idempotently_and_keeps_its_file_across_restarts() {
    let dir = temp_dir();
    let file = dir.join("courier.db");
    let args = vec!["--database-url".to_owned(), file.to_string_lossy().into_owned()];
    let body = json!({"reference": "label-1", "shipTo": {}, "shipFrom": {}, "parcel": {}});

    let courier = CourierProcess::start(&args).await;
    let base = courier.base.clone();
    let (status, replayed, created) = post(&base, "k-1", &body).await;
    assert_eq!((status, replayed), (201, false), "{created}");
    assert_eq!(
        created,
        json!({"orderNumber": "ORD-000001", "trackingNumber": "TRK0000000001", "shipment": 1})
    );
    let (status, replayed, again) = post(&base, "k-1", &body).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, created);
    let (status, faults) = {
        let res = reqwest::Client::new()
            .post(format!("{base}/_faults"))
            .json(&json!({"failNext": 1, "status": 503}))
            .send()
            .await
            .unwrap();
        (res.status().as_u16(), res.json::<Value>().await.unwrap())
    };
    assert_eq!((status, &faults["failNext"]), (200, &json!(1)));
    let (status, _, problem) = post(&base, "k-2", &body).await;
    assert_eq!((status, &problem["code"]), (503, &json!("courier_unavailable")));
    let (status, events) = get(&base, "/shipments/1/events").await;
    assert_eq!(status, 200);
    assert_eq!(events["trackingNumber"], "TRK0000000001");
    assert_eq!(events["events"][0]["status"], "label_created");
    let (_, stats) = get(&base, "/_stats").await;
    assert_eq!(
        stats,
        json!({"shipments": 1, "calls": 3, "duplicatesSuppressed": 1})
    );

    let (code, stderr) = courier.terminate().await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(file.exists(), "an explicit database is kept");

    // A new process on the same file still replays the first shipment.
    let courier = CourierProcess::start(&args).await;
    let (status, replayed, again) = post(&courier.base, "k-1", &body).await;
    assert_eq!((status, replayed), (201, true));
    assert_eq!(again, created);
    drop(courier);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[cfg(unix)]
#[tokio::test]
async fn the_default_database_is_a_temporary_file_removed_on_exit() {
    let courier = CourierProcess::start(&[]).await;
    let (status, _, _) = post(&courier.base, "k", &json!({})).await;
    assert_eq!(status, 201);
    let (code, stderr) = courier.terminate().await;
    assert_eq!(code, Some(0), "{stderr}");
    let path = stderr
        .lines()
        .find_map(|l| l.strip_prefix("courier: shipments and keys in SQLite "))
        .and_then(|rest| rest.strip_suffix(" (temporary, removed on exit)"))
        .unwrap_or_else(|| panic!("no database line in {stderr:?}"));
    let dir = std::path::Path::new(path).parent().unwrap();
    assert!(!dir.exists(), "{} is left behind", dir.display());
}

#[tokio::test]
async fn an_unusable_listen_address_exits_2_with_a_message() {
    let run = crate::idemkit(vec!["courier".into(), "--listen".into(), "256.0.0.1:80".into()]).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("error: binding 256.0.0.1:80"), "{run:#?}");
    assert!(run.stdout.is_empty(), "{run:#?}");
    let run = crate::idemkit(vec!["courier".into()]).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("--listen"), "{run:#?}");
}

/// `idemkit check` against the courier (no accounts, so no isolation gate;
/// `latencyMs` makes duplicates overlap).
async fn check_courier(probe: &[&str]) -> crate::Run {
    let courier = CourierProcess::start(&[]).await;
    let res = reqwest::Client::new()
        .post(format!("{}/_faults", courier.base))
        .json(&json!({"latencyMs": 300}))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    let url = format!("{}/shipments", courier.base);
    let mut args = vec![
        "check",
        "--url",
        &url,
        "--body",
        r#"{"reference":"label-1","shipTo":{},"shipFrom":{},"parcel":{"weightGrams":100}}"#,
        "--gates",
        "concurrency,replay,mismatch,in-progress,bad-keys,fresh-key",
        "--concurrency",
        "8",
        "--json",
    ];
    args.extend_from_slice(probe);
    crate::idemkit(args.iter().map(|s| s.to_string()).collect()).await
}

/// The courier is itself an idempotent API: with a count probe (its `/_stats`
/// shipments), every gate passes.
#[tokio::test]
async fn idemkit_check_passes_against_the_courier() {
    let run = check_courier(&["--count-url", "/_stats", "--count-pointer", "/shipments"]).await;
    assert_eq!(
        run.verdicts(),
        crate::expect(&[
            ("concurrency", "pass"),
            ("replay", "pass"),
            ("mismatch", "pass"),
            ("in-progress", "pass"),
            ("bad-keys", "pass"),
            ("fresh-key", "pass"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.code, 0, "{run:#?}");
    assert!(run.evidence("concurrency").contains("count 0 → 1"), "{run:#?}");
}

/// With ids only (`--id-pointer`), an effect behind a replay, a conflict or a
/// refusal is invisible: every gate that counts effects is inconclusive, never a
/// pass (issue 14). The in-progress gate judges answers only and still passes.
#[tokio::test]
async fn ids_alone_leave_the_effect_gates_inconclusive() {
    let run = check_courier(&["--id-pointer", "/shipment"]).await;
    assert_eq!(
        run.verdicts(),
        crate::expect(&[
            ("concurrency", "inconclusive"),
            ("replay", "inconclusive"),
            ("mismatch", "inconclusive"),
            ("in-progress", "pass"),
            ("bad-keys", "inconclusive"),
            ("fresh-key", "inconclusive"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.evidence("replay")
            .contains("--id-pointer alone cannot see an effect"),
        "{run:#?}"
    );
    // No probe at all: the same, never a pass.
    let run = check_courier(&[]).await;
    let verdicts = run.verdicts();
    assert!(
        verdicts
            .iter()
            .all(|(g, v)| v == "inconclusive" || g == "in-progress"),
        "{run:#?}"
    );
    assert_eq!(run.code, 2, "{run:#?}");
}
