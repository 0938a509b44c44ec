//! Fencing under a real pause (Kleppmann's scenario). A child process claims with
//! a 300 ms lease, advances a phase, and blocks at a failpoint before completing.
//! The test SIGSTOPs it, waits past the lease, takes over and completes, then
//! SIGCONTs it: the child's completion must be refused with `Fenced` and the
//! stored response must be the test's.
//!
//! The child is this test binary re-executed on the ignored test
//! `fencing::holder_child_process`, which does nothing unless `HOLDER_DIR` is set.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore, RecordState, StoreError};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::suite::{claim_req, response, scope};

use crate::common::{URL_VAR, redis_url, unique_prefix};

const HOLDER_DIR: &str = "IDEMKIT_REDIS_HOLDER_DIR";
const HOLDER_PREFIX: &str = "IDEMKIT_REDIS_HOLDER_PREFIX";
const CHILD_LEASE: Duration = Duration::from_millis(300);
const BODY: &str = r#"{"sku":"fence"}"#;

fn write_atomically(dir: &Path, name: &str, text: &str) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).unwrap();
    std::fs::rename(tmp, dir.join(name)).unwrap();
}

fn wait_for_file(path: &Path, timeout: Duration) -> Option<String> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if let Ok(text) = std::fs::read_to_string(path) {
            return Some(text);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

/// The holder. Runs only when re-executed by the test below.
#[tokio::test]
#[ignore = "child process of `sigstopped_holder_cannot_complete_after_takeover`"]
async fn holder_child_process() {
    let Some(dir) = std::env::var_os(HOLDER_DIR).map(PathBuf::from) else {
        return;
    };
    let url = std::env::var(URL_VAR).expect("url");
    let prefix = std::env::var(HOLDER_PREFIX).expect("prefix");
    let store = RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
        .await
        .expect("connect");
    let s = scope("acct-fence", "k-fence");
    let mut req = claim_req(&s, BODY);
    req.lease = CHILD_LEASE;
    let ClaimOutcome::Claimed(lease) = store.claim(&req).await.expect("claim") else {
        panic!("child did not win the claim");
    };
    // First write of the holder: a phase (the courier was called).
    store
        .record_phase(&s, lease.token, "courier-called", None)
        .await
        .expect("phase");
    write_atomically(&dir, "ready", &lease.token.0.to_string());
    // Failpoint: blocked here between two writes. The test stops the whole
    // process (SIGSTOP) while it is here, then lets it go.
    wait_for_file(&dir.join("go"), Duration::from_secs(60)).expect("go");
    let result = match store.complete(&s, lease.token, &response(201, "stale")).await {
        Ok(()) => "completed".to_owned(),
        Err(StoreError::Fenced) => "fenced".to_owned(),
        Err(e) => format!("error: {e}"),
    };
    write_atomically(&dir, "result", &result);
}

/// Kills the child if the test fails half-way.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            signal(self.0.id(), "CONT");
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(pid: u32, sig: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{sig} {pid}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigstopped_holder_cannot_complete_after_takeover() {
    let Some(url) = redis_url() else { return };
    let prefix = unique_prefix("fence");
    let dir = std::env::temp_dir().join(format!("idemkit-redis-fence-{}", prefix.replace(':', "_")));
    std::fs::create_dir_all(&dir).unwrap();
    let log = std::fs::File::create(dir.join("child.log")).unwrap();
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "fencing::holder_child_process",
            "--ignored",
            "--nocapture",
        ])
        .env(HOLDER_DIR, &dir)
        .env(HOLDER_PREFIX, &prefix)
        .env(URL_VAR, &url)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawn the holder");
    let mut child = ChildGuard(child);
    let pid = child.0.id();
    let child_log = || std::fs::read_to_string(dir.join("child.log")).unwrap_or_default();

    let child_token: i64 = wait_for_file(&dir.join("ready"), Duration::from_secs(60))
        .unwrap_or_else(|| panic!("holder never reached its failpoint:\n{}", child_log()))
        .parse()
        .unwrap();

    // The real pause: the holder's process is frozen between its writes.
    signal(pid, "STOP");
    tokio::time::sleep(CHILD_LEASE * 2).await;

    let store = RedisStore::connect_with(&url, RedisConfig::default().with_prefix(prefix))
        .await
        .unwrap();
    let s = scope("acct-fence", "k-fence");
    let ClaimOutcome::Claimed(ours) = store.claim(&claim_req(&s, BODY)).await.unwrap() else {
        panic!("takeover after the holder's lease expired failed");
    };
    assert!(ours.token.0 > child_token);
    assert_eq!(ours.resumed_from.as_deref(), Some("courier-called"));
    store
        .complete(&s, ours.token, &response(201, "fresh"))
        .await
        .unwrap();

    write_atomically(&dir, "go", "");
    signal(pid, "CONT");
    let result = wait_for_file(&dir.join("result"), Duration::from_secs(30))
        .unwrap_or_else(|| panic!("holder did not finish:\n{}", child_log()));
    let status = child.0.wait().unwrap();
    assert_eq!(result, "fenced", "child log:\n{}", child_log());
    assert!(status.success(), "child log:\n{}", child_log());

    let rec = store.get(&s).await.unwrap().unwrap();
    assert_eq!(rec.state, RecordState::Completed);
    assert_eq!(rec.fencing_token, ours.token);
    assert_eq!(rec.response, Some(response(201, "fresh")));
    assert_eq!(
        store.claim(&claim_req(&s, BODY)).await.unwrap(),
        ClaimOutcome::Replay(response(201, "fresh"))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
