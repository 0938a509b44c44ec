//! `idemkit keys` against real SQLite and PostgreSQL stores: the database is
//! prepared through the store API, then the real binary inspects and repairs it.
//!
//! PostgreSQL tests read `IDEMKIT_TEST_POSTGRES_URL`. Under `CI` a missing URL is
//! a failure; elsewhere the tests say so and return. Each uses a fresh schema.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use idemkit_core::{ClaimOutcome, KeyStore, RecordState};
use idemkit_postgres::{PgConfig, PgStore};
use idemkit_sqlite::SqliteStore;
use idemkit_testkit::lifecycle::phase;
use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
use serde_json::{Value, json};

use crate::Run;

/// A key store the test prepared, and how the binary reaches it.
pub(crate) struct Db {
    store: Arc<dyn KeyStore>,
    url: String,
    /// PostgreSQL: the fresh schema (passed as `IDEMKIT_PG_SCHEMA`).
    schema: Option<String>,
    dir: Option<PathBuf>,
}

impl Drop for Db {
    fn drop(&mut self) {
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

pub(crate) fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

pub(crate) fn postgres_url() -> Option<String> {
    match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
        Ok(url) if !url.is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => {
            panic!("IDEMKIT_TEST_POSTGRES_URL is not set; under CI a missing database is a failure")
        }
        _ => {
            eprintln!("IDEMKIT_TEST_POSTGRES_URL is not set: skipping PostgreSQL test");
            None
        }
    }
}

impl Db {
    fn temp_dir() -> PathBuf {
        let dir = std::env::temp_dir().join(unique("idemkit-keys"));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    async fn sqlite() -> Self {
        let dir = Self::temp_dir();
        let path = dir.join("keys.db");
        let store = SqliteStore::open(&path).await.expect("open SQLite");
        Self {
            store: Arc::new(store),
            url: path.to_str().unwrap().to_owned(),
            schema: None,
            dir: Some(dir),
        }
    }

    async fn postgres() -> Option<Self> {
        let url = postgres_url()?;
        let schema = unique("t_keys");
        let store = PgStore::connect(
            &url,
            PgConfig {
                schema: schema.clone(),
                max_connections: 2,
                ..PgConfig::default()
            },
        )
        .await
        .expect("connect to PostgreSQL");
        Some(Self {
            store: Arc::new(store),
            url,
            schema: Some(schema),
            dir: Some(Self::temp_dir()),
        })
    }

    /// `keys <args> --database-url …` (and the schema on PostgreSQL).
    fn args(&self, args: &[&str]) -> Vec<String> {
        let mut all: Vec<String> = ["keys"].iter().chain(args).map(|s| s.to_string()).collect();
        all.extend(["--database-url".to_owned(), self.url.clone()]);
        if let Some(schema) = &self.schema {
            all.extend(["--pg-schema".to_owned(), schema.clone()]);
        }
        all
    }

    /// Runs `idemkit keys <args> --database-url …` (and the schema on PostgreSQL).
    async fn keys(&self, args: &[&str]) -> Run {
        run(self.args(args), self.env()).await
    }

    fn env(&self) -> Vec<(String, String)> {
        self.schema
            .iter()
            .map(|s| ("IDEMKIT_PG_SCHEMA".to_owned(), s.clone()))
            .collect()
    }
}

/// Runs the real binary off the runtime's threads.
async fn run(args: Vec<String>, env: Vec<(String, String)>) -> Run {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(env!("CARGO_BIN_EXE_idemkit"))
            .args(&args)
            .env_remove("IDEMKIT_PG_SCHEMA")
            .envs(env)
            .env_remove("RUST_LOG")
            .output()
            .expect("run idemkit");
        Run {
            code: out.status.code().expect("exit code"),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    })
    .await
    .unwrap()
}

fn ok(run: &Run) -> &Run {
    assert_eq!(run.code, 0, "{run:#?}");
    run
}

/// The data rows of a table (after the header and its rule, before the blank line).
fn rows(run: &Run) -> Vec<Vec<String>> {
    let lines: Vec<&str> = run.stdout.lines().collect();
    assert!(lines.len() >= 2 && lines[1].starts_with("---"), "{run:#?}");
    lines[2..]
        .iter()
        .take_while(|l| !l.is_empty())
        .map(|l| {
            l.split("  ")
                .filter(|c| !c.is_empty())
                .map(|c| c.trim().to_owned())
                .collect()
        })
        .collect()
}

fn keys_of(v: &Value, field: &str) -> Vec<String> {
    v[field]
        .as_array()
        .unwrap_or_else(|| panic!("no {field}: {v}"))
        .iter()
        .map(|r| {
            format!(
                "{}/{}",
                r["account"].as_str().unwrap(),
                r["key"].as_str().unwrap()
            )
        })
        .collect()
}

/// Five records, claimed a few milliseconds apart (oldest first): a completed
/// one, a parked one with a recorded intent, one abandoned by a retryable
/// outcome, one held by a live lease, and another parked one.
async fn prepare(store: &dyn KeyStore) {
    let gap = Duration::from_millis(15);
    let done = scope("acct-a", "k-done");
    let l = must_claim(store, &claim_req(&done, r#"{"sku":"done"}"#)).await;
    store
        .complete(&done, l.token, &response(201, r#"{"id":"order-1"}"#))
        .await
        .unwrap();
    tokio::time::sleep(gap).await;

    let parked = scope("acct-a", "k-parked");
    let l = must_claim(store, &claim_req(&parked, r#"{"sku":"parked"}"#)).await;
    store
        .advance(
            &parked,
            l.token,
            &phase("courier-intent", Some(("courier", json!({"intent": "dk-1"})))),
        )
        .await
        .unwrap();
    store
        .park(&parked, l.token, "courier outcome unknown; it ignores keys")
        .await
        .unwrap();
    tokio::time::sleep(gap).await;

    let stuck = scope("acct-a", "k-stuck");
    let l = must_claim(store, &claim_req(&stuck, r#"{"sku":"stuck"}"#)).await;
    store
        .advance(
            &stuck,
            l.token,
            &phase("label", Some(("label", json!({"done": "lbl_1"})))),
        )
        .await
        .unwrap();
    store.abandon(&stuck, l.token, "courier timeout").await.unwrap();
    tokio::time::sleep(gap).await;

    let live = scope("acct-b", "k-live");
    must_claim(store, &claim_req(&live, r#"{"sku":"live"}"#)).await;
    tokio::time::sleep(gap).await;

    let parked2 = scope("acct-b", "k-parked-2");
    let l = must_claim(store, &claim_req(&parked2, r#"{"sku":"parked-2"}"#)).await;
    store.park(&parked2, l.token, "needs a human").await.unwrap();
}

/// Every subcommand but `complete` on one prepared store.
pub(crate) async fn exercise(db: Db) {
    prepare(&*db.store).await;

    // list: a table, newest first.
    let all = db.keys(&["list"]).await;
    let table = rows(ok(&all));
    let listed: Vec<(&str, &str, &str)> = table
        .iter()
        .map(|r| (r[0].as_str(), r[1].as_str(), r[2].as_str()))
        .collect();
    assert_eq!(
        listed,
        [
            ("acct-b", "k-parked-2", "parked"),
            ("acct-b", "k-live", "in_flight"),
            ("acct-a", "k-stuck", "in_flight"),
            ("acct-a", "k-parked", "parked"),
            ("acct-a", "k-done", "completed"),
        ],
        "{}",
        all.stdout
    );
    assert!(all.stdout.starts_with("account"), "{}", all.stdout);
    for column in [
        "created",
        "lease/completed",
        "token",
        "recovery point",
        "last error",
    ] {
        assert!(
            all.stdout.lines().next().unwrap().contains(column),
            "{column}: {}",
            all.stdout
        );
    }
    let stuck_row = table.iter().find(|r| r[1] == "k-stuck").unwrap();
    assert!(stuck_row[4].starts_with("expired "), "{stuck_row:?}");
    assert!(stuck_row.contains(&"label".to_owned()), "{stuck_row:?}");
    assert!(stuck_row.contains(&"courier timeout".to_owned()), "{stuck_row:?}");
    let live_row = table.iter().find(|r| r[1] == "k-live").unwrap();
    assert!(live_row[4].starts_with("held until 20"), "{live_row:?}");
    let done_row = table.iter().find(|r| r[1] == "k-done").unwrap();
    assert!(
        done_row[3].ends_with('Z') && done_row[3].contains('T'),
        "RFC 3339: {done_row:?}"
    );
    assert!(done_row[4].starts_with("completed 20"), "{done_row:?}");
    assert!(all.stdout.contains("\n5 record(s)"), "{}", all.stdout);

    // list --state parked: requests awaiting review.
    let parked = db.keys(&["list", "--state", "parked"]).await;
    let table = rows(ok(&parked));
    assert_eq!(
        table.iter().map(|r| r[1].as_str()).collect::<Vec<_>>(),
        ["k-parked-2", "k-parked"],
        "{}",
        parked.stdout
    );
    let parked_row = table.iter().find(|r| r[1] == "k-parked").unwrap();
    assert!(
        parked_row.contains(&"courier-intent".to_owned()),
        "{parked_row:?}"
    );
    assert!(
        parked_row.contains(&"courier outcome unknown; it ignores keys".to_owned()),
        "{parked_row:?}"
    );
    let parked_json = db.keys(&["list", "--state", "parked", "--json"]).await.report();
    assert_eq!(
        keys_of(&parked_json, "records"),
        ["acct-b/k-parked-2", "acct-a/k-parked"]
    );
    let first = &parked_json["records"][1];
    assert_eq!(first["state"], "parked");
    assert_eq!(first["recovery_point"], "courier-intent");
    assert_eq!(first["last_error"], "courier outcome unknown; it ignores keys");
    // Parking takes a fresh token (a stale takeover cannot undo it): above the claim's.
    assert!(first["fencing_token"].as_u64().unwrap() > 1, "{first}");
    assert_eq!(first["request"], json!({"method": "POST", "path": "/orders"}));
    assert!(first["created_at"].as_str().unwrap().ends_with('Z'));

    let filtered = db
        .keys(&["list", "--account", "acct-b", "--state", "in_flight", "--json"])
        .await
        .report();
    assert_eq!(keys_of(&filtered, "records"), ["acct-b/k-live"]);
    assert_eq!(filtered["records"][0]["lease_live"], true);
    let limited = db.keys(&["list", "--limit", "2", "--json"]).await.report();
    assert_eq!(
        keys_of(&limited, "records"),
        ["acct-b/k-parked-2", "acct-b/k-live"]
    );

    // show: recovery point, step outputs, request and response.
    let shown = db
        .keys(&["show", "--account", "acct-a", "--key", "k-parked"])
        .await;
    let text = &ok(&shown).stdout;
    for expected in [
        "state           parked",
        "recovery point  courier-intent",
        "last error      courier outcome unknown; it ignores keys",
        r#"courier: {"intent":"dk-1"}"#,
        "request         POST /orders",
        "content-type: application/json",
        r#"body (16 bytes): {"sku":"parked"}"#,
        "response        -",
    ] {
        assert!(text.contains(expected), "{expected:?} in\n{text}");
    }
    let done = db
        .keys(&["show", "--account", "acct-a", "--key", "k-done", "--json"])
        .await
        .report();
    let record = &done["record"];
    assert_eq!(record["state"], "completed");
    assert_eq!(record["response"]["status"], 201);
    assert_eq!(record["response"]["body"], r#"{"id":"order-1"}"#);
    assert_eq!(record["request"]["body"], r#"{"sku":"done"}"#);
    assert_eq!(record["fingerprint"].as_str().unwrap().len(), 64);
    let stuck = db
        .keys(&["show", "--account", "acct-a", "--key", "k-stuck", "--json"])
        .await
        .report();
    assert_eq!(
        stuck["record"]["step_outputs"],
        json!({"label": {"done": "lbl_1"}})
    );
    assert_eq!(stuck["record"]["lease_live"], false);
    let missing = db.keys(&["show", "--account", "acct-a", "--key", "nope"]).await;
    assert_eq!(missing.code, 1, "{missing:#?}");

    // release: refused for live leases and completed records, done for parked ones.
    let live = db
        .keys(&["release", "--account", "acct-b", "--key", "k-live"])
        .await;
    assert_eq!(live.code, 1, "{live:#?}");
    assert!(live.stdout.contains("live lease"), "{}", live.stdout);
    let completed = db
        .keys(&["release", "--account", "acct-a", "--key", "k-done", "--json"])
        .await;
    assert_eq!(completed.code, 1, "{completed:#?}");
    assert_eq!(completed.report()["released"], false);
    // A parked record with a recorded intent: the release keeps the intent, so
    // the rerun resumes (and parks again at a key-ignoring downstream) instead
    // of calling it a second time.
    let parked_scope = scope("acct-a", "k-parked");
    let parked_before = db.store.get(&parked_scope).await.unwrap().unwrap();
    let released = db
        .keys(&["release", "--account", "acct-a", "--key", "k-parked"])
        .await;
    let text = &ok(&released).stdout;
    for expected in [
        "acct-a k-parked: released to resume",
        "recovery point `courier-intent`",
        "the call of courier has an intent and no result",
        "--downstream-did-nothing",
    ] {
        assert!(text.contains(expected), "{expected:?} in {text}");
    }
    let rec = db.store.get(&parked_scope).await.unwrap().unwrap();
    assert_eq!(
        rec.state,
        RecordState::InFlight,
        "resumable, not released: {rec:?}"
    );
    assert!(rec.lease_expires_at <= db.store.now(), "lease ended: {rec:?}");
    assert!(rec.fencing_token > parked_before.fencing_token, "{rec:?}");
    assert_eq!(rec.last_error.as_deref(), Some(idemkit_core::FORCE_RELEASED));
    assert_eq!(rec.recovery_point.as_deref(), Some("courier-intent"));
    assert_eq!(
        json!(rec.step_outputs),
        json!({"courier": {"intent": "dk-1"}}),
        "the intent survives the release"
    );
    assert_eq!(
        rec.request.body, parked_before.request.body,
        "the request is kept for the rerun"
    );
    // The key is taken over as a resume from the recovery point, with a higher token.
    let parked_req = claim_req(&parked_scope, r#"{"sku":"parked"}"#);
    let again = match db.store.claim(&parked_req).await.unwrap() {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("expected the released key to be resumable: {other:?}"),
    };
    assert!(again.token > rec.fencing_token, "{again:?} after {rec:?}");
    assert_eq!(again.resumed_from.as_deref(), Some("courier-intent"));
    db.store
        .complete(&parked_req.scope, again.token, &response(201, "second"))
        .await
        .unwrap();

    // reap --older-than-hours 0: completed records go, unfinished ones move to review.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let reaped = db
        .keys(&[
            "reap",
            "--older-than-hours",
            "0",
            "--replay-window-hours",
            "0",
            "--json",
        ])
        .await
        .report();
    assert_eq!(reaped["deleted"], 2, "{reaped}");
    assert_eq!(reaped["moved_to_review"], 2, "{reaped}");
    // What fences stays: the live lease, and the two moved to review as parked
    // records (never claimable again as new requests).
    let left = db.keys(&["list", "--json"]).await.report();
    let mut kept = keys_of(&left, "records");
    kept.sort();
    assert_eq!(
        kept,
        ["acct-a/k-stuck", "acct-b/k-live", "acct-b/k-parked-2"],
        "{left}"
    );
    for r in left["records"].as_array().unwrap() {
        if r["key"] == "k-live" {
            assert_eq!(r["state"], "in_flight", "live leases stay: {r}");
        } else {
            assert_eq!(r["state"], "parked", "{r}");
            assert_eq!(r["last_error"], idemkit_core::MOVED_TO_REVIEW, "{r}");
        }
    }
    let again = ok(&db
        .keys(&["reap", "--older-than-hours", "0", "--replay-window-hours", "0"])
        .await)
    .stdout
    .clone();
    assert!(
        again.contains("deleted 0") && again.contains("moved 0"),
        "{again}"
    );
    let default = db.keys(&["reap", "--json"]).await.report();
    assert_eq!(
        (default["deleted"].as_u64(), default["moved_to_review"].as_u64()),
        (Some(0), Some(0))
    );

    // review: the unfinished requests, oldest first.
    let review = db.keys(&["review"]).await;
    let table = rows(ok(&review));
    assert_eq!(
        table
            .iter()
            .map(|r| (r[1].as_str(), r[2].as_str()))
            .collect::<Vec<_>>(),
        [("k-stuck", "in_flight"), ("k-parked-2", "parked")],
        "{}",
        review.stdout
    );
    assert!(table[0].contains(&"POST /orders".to_owned()), "{:?}", table[0]);
    assert!(table[0].contains(&"courier timeout".to_owned()), "{:?}", table[0]);
    let review = db.keys(&["review", "--json"]).await.report();
    assert_eq!(
        keys_of(&review, "entries"),
        ["acct-a/k-stuck", "acct-b/k-parked-2"]
    );
    assert_eq!(review["entries"][0]["recovery_point"], "label");
    assert_eq!(
        review["entries"][0]["step_outputs"],
        json!({"label": {"done": "lbl_1"}})
    );
    assert_eq!(review["entries"][1]["last_error"], "needs a human");
    assert_eq!(
        keys_of(
            &db.keys(&["review", "--limit", "1", "--json"]).await.report(),
            "entries"
        )
        .len(),
        1
    );
}

/// `keys release` on each kind of record nobody holds: progress is kept unless
/// the operator says the downstream did nothing (then it is discarded); a record
/// without progress is released as a first attempt with or without the flag.
pub(crate) async fn release_paths(db: Db) {
    prepare(&*db.store).await;
    let store = &*db.store;
    let get = |account: &'static str, key: &'static str| async move {
        store.get(&scope(account, key)).await.unwrap().unwrap()
    };

    let before = get("acct-a", "k-parked").await;
    // Without the flag, JSON: kept progress, the pending intent named.
    let kept = db
        .keys(&["release", "--account", "acct-a", "--key", "k-parked", "--json"])
        .await;
    let report = ok(&kept).report();
    assert_eq!(report["released"], true, "{report}");
    assert_eq!(report["state"], "in_flight", "{report}");
    assert_eq!(report["kept_progress"], true, "{report}");
    assert_eq!(report["recovery_point"], "courier-intent", "{report}");
    assert_eq!(report["pending_intents"], json!(["courier"]), "{report}");
    assert!(
        report["fencing_token"].as_i64().unwrap() > before.fencing_token.0,
        "{report}"
    );
    let kept = get("acct-a", "k-parked").await;
    assert_eq!(
        kept.step_outputs, before.step_outputs,
        "the intent survives the release"
    );

    // The operator says the downstream did nothing: the progress is discarded
    // and the key reruns as a first attempt.
    let stuck_before = get("acct-a", "k-stuck").await;
    assert!(!stuck_before.step_outputs.is_empty());
    let discarded = db
        .keys(&[
            "release",
            "--account",
            "acct-a",
            "--key",
            "k-stuck",
            "--downstream-did-nothing",
            "--json",
        ])
        .await;
    let report = ok(&discarded).report();
    assert_eq!(
        (&report["released"], &report["state"], &report["kept_progress"]),
        (&json!(true), &json!("released"), &json!(false)),
        "{report}"
    );
    let stuck = get("acct-a", "k-stuck").await;
    assert_eq!(stuck.state, RecordState::Released);
    assert!(stuck.step_outputs.is_empty() && stuck.recovery_point.is_none());
    assert!(stuck.fencing_token > stuck_before.fencing_token);

    // A parked record without progress, with the flag: released as before, and
    // its key reruns as a first attempt.
    let none = db
        .keys(&[
            "release",
            "--account",
            "acct-b",
            "--key",
            "k-parked-2",
            "--downstream-did-nothing",
            "--json",
        ])
        .await;
    let report = ok(&none).report();
    assert_eq!(
        (&report["released"], &report["state"], &report["kept_progress"]),
        (&json!(true), &json!("released"), &json!(false)),
        "{report}"
    );
    assert_eq!(
        report["reason"],
        "released: the next request with this key runs as a first attempt"
    );
    let rec = get("acct-b", "k-parked-2").await;
    assert_eq!(rec.state, RecordState::Released);
    assert_eq!(rec.last_error.as_deref(), Some(idemkit_core::FORCE_RELEASED));
    let req = claim_req(&scope("acct-b", "k-parked-2"), r#"{"sku":"parked-2"}"#);
    match db.store.claim(&req).await.unwrap() {
        ClaimOutcome::Claimed(lease) => {
            assert_eq!(lease.resumed_from, None, "a first attempt");
            assert!(lease.token > rec.fencing_token);
        }
        other => panic!("expected a first attempt: {other:?}"),
    }
    // Released records and missing ones are refused (exit 1), flag or not.
    let missing = db
        .keys(&[
            "release",
            "--account",
            "acct-a",
            "--key",
            "k-none",
            "--downstream-did-nothing",
        ])
        .await;
    assert_eq!(missing.code, 1, "{missing:#?}");
    assert!(missing.stdout.contains("no record"), "{}", missing.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_release_keeps_progress_on_sqlite() {
    release_paths(Db::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_release_keeps_progress_on_postgres() {
    let Some(db) = Db::postgres().await else {
        return;
    };
    release_paths(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_sqlite() {
    exercise(Db::sqlite().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_postgres() {
    let Some(db) = Db::postgres().await else {
        return;
    };
    exercise(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_refuses_a_missing_database_and_arguments() {
    let missing = run(
        vec![
            "keys".into(),
            "list".into(),
            "--database-url".into(),
            "/nonexistent/keys.db".into(),
        ],
        vec![],
    )
    .await;
    assert_eq!(missing.code, 2, "{missing:#?}");
    assert!(
        missing.stderr.contains("no SQLite database"),
        "{}",
        missing.stderr
    );
    let no_url = run(vec!["keys".into(), "list".into()], vec![]).await;
    assert_eq!(no_url.code, 2, "{no_url:#?}");
    assert!(no_url.stderr.contains("--database-url"), "{}", no_url.stderr);
    let redis = run(
        vec![
            "keys".into(),
            "list".into(),
            "--database-url".into(),
            // Redis is supported (issue 19); a server nobody runs is an error.
            "redis://127.0.0.1:1".into(),
        ],
        vec![],
    )
    .await;
    assert_eq!(redis.code, 2, "{redis:#?}");
    assert!(
        redis.stderr.contains("connecting to the Redis key store"),
        "{}",
        redis.stderr
    );
    let db = Db::sqlite().await;
    let bad_state = db.keys(&["list", "--state", "stuck"]).await;
    assert_eq!(bad_state.code, 2, "{bad_state:#?}");
}

/// `idemkit keys … | head`: a closed stdout never changes the exit code, in
/// tables and JSON alike (0 for a listing, 1 for `show` of a missing record).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_keeps_the_exit_code() {
    let db = Db::sqlite().await;
    prepare(&*db.store).await;
    db.keys(&["reap", "--older-than-hours", "0", "--replay-window-hours", "0"])
        .await;
    for (args, want) in [
        (&["review", "--json"][..], 0),
        (&["review"][..], 0),
        (&["list", "--json"][..], 0),
        (&["list"][..], 0),
        (
            &["show", "--account", "acct-a", "--key", "k-none", "--json"][..],
            1,
        ),
        (&["show", "--account", "acct-a", "--key", "k-none"][..], 1),
    ] {
        let (code, stderr) = crate::cli::with_closed_stdout(db.args(args), db.env()).await;
        assert_eq!(code, Some(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("Broken pipe"), "{args:?}: {stderr}");
    }
}

/// `keys complete`: a label request killed after recording its courier intent
/// is finished by one completer pass, with one shipment.
#[cfg(feature = "failpoints")]
mod complete {
    use std::io::{BufRead, BufReader};
    use std::process::{Child, Stdio};

    use super::*;

    struct Proc(Child);

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

    /// Starts `idemkit <args>`; returns it and its stdout lines after the
    /// `listening on` line.
    fn spawn(args: &[&str], env: &[(String, String)]) -> (Proc, std::sync::mpsc::Receiver<String>) {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkit"))
            .args(args)
            .envs(env.iter().cloned())
            .env("RUST_LOG", "error")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn idemkit");
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

    fn label(key: &str) -> Value {
        json!({
            "idempotencyKey": key,
            "courier": "ups",
            "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
            "shipTo": {"name": "Ada", "line1": "10 Downing St", "city": "London", "postalCode": "SW1A 2AA", "country": "GB"},
            "parcel": {"weightGrams": 900, "lengthCm": 20, "widthCm": 10, "heightCm": 5}
        })
    }

    async fn completes_an_abandoned_label(db: Db) {
        let dir = db.dir.clone().unwrap();
        let cport = free_port();
        let (_courier, _) = spawn(
            &[
                "courier",
                "--listen",
                &format!("127.0.0.1:{cport}"),
                "--database-url",
                dir.join("courier.db").to_str().unwrap(),
            ],
            &[],
        );
        let courier = format!("http://127.0.0.1:{cport}");
        let port = free_port();
        let listen = format!("127.0.0.1:{port}");
        let mut env = db.env();
        env.push(("IDEMKIT_CRASH_AT".into(), "idemkit::after_intent".into()));
        let (service, lines) = spawn(
            &[
                "serve",
                "--demo-tokens",
                "--listen",
                &listen,
                "--database-url",
                &db.url,
                "--courier-url",
                &courier,
                "--lease-ms",
                "300",
            ],
            &env,
        );
        let attempt = tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("http://{listen}/labels"))
                .bearer_auth("demo-token-acme")
                .json(&label("kc-1"))
                .timeout(Duration::from_secs(20))
                .send()
                .await
        });
        loop {
            let line = lines
                .recv_timeout(Duration::from_secs(20))
                .expect("the crash point");
            if line.starts_with("CRASHPOINT idemkit::after_intent") {
                break;
            }
        }
        let ok_kill = Command::new("kill")
            .args(["-9", &service.0.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok_kill);
        drop(service);
        assert!(
            attempt.await.unwrap().is_err(),
            "the killed attempt cannot answer"
        );
        // Let the dead holder's lease run out.
        tokio::time::sleep(Duration::from_millis(600)).await;

        let stuck = db
            .keys(&["list", "--state", "in_flight", "--json"])
            .await
            .report();
        assert_eq!(keys_of(&stuck, "records"), ["acme/kc-1"]);
        assert_eq!(stuck["records"][0]["lease_live"], false);
        assert_eq!(stuck["records"][0]["recovery_point"], "label", "{stuck}");
        let before = db
            .keys(&["show", "--account", "acme", "--key", "kc-1", "--json"])
            .await
            .report();
        assert!(
            before["record"]["step_outputs"]["courier"]["intent"].is_string(),
            "the courier intent is recorded: {before}"
        );
        let stats = |courier: String| async move {
            reqwest::get(format!("{courier}/_stats"))
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        };
        assert_eq!(stats(courier.clone()).await["shipments"], 0);

        let pass = db
            .keys(&["complete", "--courier-url", &courier, "--min-age-ms", "0"])
            .await;
        assert!(
            ok(&pass)
                .stdout
                .contains("found 1, completed 1, parked 0, unfinished 0"),
            "{pass:#?}"
        );
        let shown = db
            .keys(&["show", "--account", "acme", "--key", "kc-1", "--json"])
            .await
            .report();
        assert_eq!(shown["record"]["state"], "completed", "{shown}");
        assert_eq!(shown["record"]["response"]["status"], 201, "{shown}");
        let text = ok(&db.keys(&["show", "--account", "acme", "--key", "kc-1"]).await)
            .stdout
            .clone();
        assert!(text.contains("state           completed"), "{text}");
        assert!(text.contains("response        201"), "{text}");
        assert_eq!(stats(courier.clone()).await["shipments"], 1, "one shipment");

        // Nothing left: a second pass finds nothing.
        let again = db
            .keys(&[
                "complete",
                "--courier-url",
                &courier,
                "--min-age-ms",
                "0",
                "--json",
            ])
            .await;
        assert_eq!(
            ok(&again).report(),
            json!({"found": 0, "completed": 0, "parked": 0, "unfinished": []})
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_complete_on_sqlite() {
        // The labels service creates its own tables; start from an empty file.
        let dir = Db::temp_dir();
        let path = dir.join("labels.db");
        let store = SqliteStore::open(&path).await.unwrap();
        let db = Db {
            store: Arc::new(store),
            url: path.to_str().unwrap().to_owned(),
            schema: None,
            dir: Some(dir),
        };
        completes_an_abandoned_label(db).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_complete_on_postgres() {
        let Some(db) = Db::postgres().await else {
            return;
        };
        completes_an_abandoned_label(db).await;
    }

    /// `keys complete` works on the schema `--pg-schema` names, and like every
    /// `keys` command refuses one without a key store instead of creating it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn keys_complete_refuses_a_schema_without_a_key_store() {
        let Some(db) = Db::postgres().await else {
            return;
        };
        let missing = unique("t_nostore");
        let out = run(
            vec![
                "keys".into(),
                "complete".into(),
                "--database-url".into(),
                db.url.clone(),
                "--pg-schema".into(),
                missing.clone(),
            ],
            vec![],
        )
        .await;
        assert_eq!(out.code, 2, "{out:#?}");
        assert!(
            out.stderr
                .contains(&format!("no idemkit key store in schema `{missing}`")),
            "{}",
            out.stderr
        );
        let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
        assert!(!super::schema_exists(&pool, &missing).await, "nothing created");
        pool.close().await;
    }
}

async fn schema_exists(pool: &sqlx::PgPool, name: &str) -> bool {
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)")
        .bind(name)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// `url` with its database replaced by `name`.
fn with_database(url: &str, name: &str) -> String {
    let (base, query) = url
        .split_once('?')
        .map_or((url, String::new()), |(b, q)| (b, format!("?{q}")));
    let (server, _) = base.rsplit_once('/').expect("a database in the URL");
    format!("{server}/{name}{query}")
}

/// On PostgreSQL, a schema without a key store is a clear error naming the
/// schemas that have one, and nothing is created; read commands (list, show,
/// review) refuse a store that needs a migration instead of running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_postgres_never_create_a_store_and_reads_never_migrate() {
    let Some(db) = Db::postgres().await else {
        return;
    };
    prepare(&*db.store).await;
    let schema = db.schema.clone().unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();

    let missing = unique("t_nostore");
    let show = ["show", "--account", "acct-a", "--key", "k-done"];
    let release = ["release", "--account", "acct-a", "--key", "k-parked"];
    for command in [&["list"][..], &["review"], &show, &["reap"], &release] {
        let mut args: Vec<String> = ["keys"].iter().chain(command).map(|s| s.to_string()).collect();
        args.extend([
            "--database-url".into(),
            db.url.clone(),
            "--pg-schema".into(),
            missing.clone(),
        ]);
        let out = run(args, vec![]).await;
        assert_eq!(out.code, 2, "{command:?}: {out:#?}");
        assert!(
            out.stderr
                .contains(&format!("no idemkit key store in schema `{missing}`")),
            "{command:?}: {}",
            out.stderr
        );
        assert!(
            out.stderr.contains(&format!("`{schema}`")),
            "{command:?}: the schemas found are named: {}",
            out.stderr
        );
        assert!(
            !schema_exists(&pool, &missing).await,
            "{command:?} created the schema"
        );
    }

    // Undo the record of the last migration: a read must refuse, not re-run it.
    let last = idemkit_postgres::MIGRATOR
        .iter()
        .map(|m| m.version)
        .max()
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DELETE FROM {schema}._sqlx_migrations WHERE version = $1"
    )))
    .bind(last)
    .execute(&pool)
    .await
    .unwrap();
    for command in [&["list"][..], &["review"], &show] {
        let out = db.keys(command).await;
        assert_eq!(out.code, 2, "{command:?}: {out:#?}");
        assert!(
            out.stderr.contains("lacks migration") && out.stderr.contains("never migrate"),
            "{command:?}: {}",
            out.stderr
        );
        let recorded: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {schema}._sqlx_migrations WHERE version = $1"
        )))
        .bind(last)
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(recorded, 0, "{command:?} ran the migration");
    }
    pool.close().await;
}

/// Without `--pg-schema` or `IDEMKIT_PG_SCHEMA`, `keys` reads the library's
/// default schema, `idemkit` (on a database of its own, so no other test's
/// store is in the way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_reads_the_library_default_schema_on_postgres() {
    let Some(url) = postgres_url() else {
        return;
    };
    let admin = sqlx::PgPool::connect(&url).await.unwrap();
    let name = unique("idemkit_keys_default");
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&admin)
        .await
        .unwrap();
    let db_url = with_database(&url, &name);
    let list = || {
        run(
            vec![
                "keys".into(),
                "list".into(),
                "--database-url".into(),
                db_url.clone(),
                "--json".into(),
            ],
            vec![],
        )
    };

    let empty = list().await;
    assert_eq!(empty.code, 2, "{empty:#?}");
    assert!(
        empty.stderr.contains("schema `idemkit`")
            && empty.stderr.contains("no idemkit key store in any schema"),
        "{}",
        empty.stderr
    );
    let pool = sqlx::PgPool::connect(&db_url).await.unwrap();
    assert!(
        !schema_exists(&pool, "idemkit").await,
        "a read created the schema"
    );
    pool.close().await;

    let store = PgStore::connect(&db_url, PgConfig::default()).await.unwrap();
    let done = scope("acct-a", "k-default");
    let l = must_claim(&store, &claim_req(&done, r#"{"sku":"x"}"#)).await;
    store
        .complete(&done, l.token, &response(201, "{}"))
        .await
        .unwrap();
    let found = list().await;
    assert_eq!(found.code, 0, "{found:#?}");
    assert_eq!(keys_of(&found.report(), "records"), ["acct-a/k-default"]);
    // The store's listener holds a connection until the store is dropped; FORCE
    // ends whatever is left.
    drop(store);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)")))
        .execute(&admin)
        .await
        .unwrap();
    admin.close().await;
}

/// The Redis URL of the test server (`IDEMKIT_TEST_REDIS_URL`): a failure
/// under `CI` when missing, a notice and a skip elsewhere.
fn redis_url() -> Option<String> {
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

impl Db {
    /// A store on a Redis Cluster (`urls`: its nodes) under a fresh prefix;
    /// the binary gets `redis+cluster://node,node,…?prefix=…`.
    pub(crate) async fn redis_cluster(urls: &[String]) -> Self {
        let prefix = unique("idemkit-keys-cluster");
        let store = idemkit_redis::RedisStore::connect(
            idemkit_redis::RedisConfig::cluster(urls.to_vec()).with_prefix(prefix.clone()),
        )
        .await
        .expect("connect to the cluster");
        Self {
            store: Arc::new(store),
            url: format!("{}?prefix={prefix}", cluster_url(urls)),
            schema: None,
            dir: None,
        }
    }

    /// A Redis key store under a fresh prefix, which the binary is given as
    /// the URL's `prefix` parameter.
    async fn redis() -> Option<Self> {
        let url = redis_url()?;
        let prefix = unique("idemkit-keys");
        let store = idemkit_redis::RedisStore::connect(
            idemkit_redis::RedisConfig::new(url.clone()).with_prefix(prefix.clone()),
        )
        .await
        .expect("connect to Redis");
        let sep = if url.contains('?') { '&' } else { '?' };
        Some(Self {
            store: Arc::new(store),
            url: format!("{url}{sep}prefix={prefix}"),
            schema: None,
            dir: None,
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_redis() {
    let Some(db) = Db::redis().await else {
        return;
    };
    exercise(db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_release_keeps_progress_on_redis() {
    let Some(db) = Db::redis().await else {
        return;
    };
    release_paths(db).await;
}

/// The prefix may also come from `IDEMKIT_REDIS_PREFIX` (as the services read
/// it); a store under another prefix is not seen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_on_redis_reads_the_prefix_from_the_environment() {
    let Some(url) = redis_url() else {
        return;
    };
    let prefix = unique("idemkit-keys-env");
    let store = idemkit_redis::RedisStore::connect(
        idemkit_redis::RedisConfig::new(url.clone()).with_prefix(prefix.clone()),
    )
    .await
    .unwrap();
    let s = scope("acct-env", "k-env");
    let l = must_claim(&store, &claim_req(&s, "{}")).await;
    store.park(&s, l.token, "needs a human").await.unwrap();
    let args = |extra: &[&str]| -> Vec<String> {
        ["keys", "list", "--json", "--database-url", url.as_str()]
            .iter()
            .chain(extra)
            .map(|s| s.to_string())
            .collect()
    };
    let seen = ok(&run(args(&[]), vec![("IDEMKIT_REDIS_PREFIX".into(), prefix.clone())]).await).report();
    assert_eq!(keys_of(&seen, "records"), ["acct-env/k-env"]);
    let other = ok(&run(
        args(&[]),
        vec![("IDEMKIT_REDIS_PREFIX".into(), format!("{prefix}-other"))],
    )
    .await)
    .report();
    assert!(keys_of(&other, "records").is_empty(), "{other}");
}

/// `redis+cluster://host:port,host:port,…` for `redis://host:port` node URLs.
pub(crate) fn cluster_url(urls: &[String]) -> String {
    let nodes: Vec<&str> = urls.iter().map(|u| u.trim_start_matches("redis://")).collect();
    format!("redis+cluster://{}", nodes.join(","))
}
