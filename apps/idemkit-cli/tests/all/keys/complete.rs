//! `keys complete`: a label request killed after recording its courier intent
//! is finished by one completer pass, with one shipment.

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

use idemkit_testkit::free_port;

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
    let store = SqliteStore::connect(&path).await.unwrap();
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
    assert!(
        !super::postgres::schema_exists(&pool, &missing).await,
        "nothing created"
    );
    pool.close().await;
}
