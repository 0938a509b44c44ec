//! Shared test plumbing: the Redis URL (a missing service fails under CI and is
//! skipped with a notice elsewhere) and stores isolated by a unique key prefix.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::ManualClock;

pub(crate) const URL_VAR: &str = "IDEMKIT_TEST_REDIS_URL";

/// The single-node URL, or `None` (with a notice) when the test should be skipped.
pub(crate) fn redis_url() -> Option<String> {
    match std::env::var(URL_VAR) {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var_os("CI").is_some() => {
            panic!("{URL_VAR} is not set under CI: Redis is a required service, not an optional one")
        }
        _ => {
            eprintln!("notice: {URL_VAR} is not set; skipping this Redis test");
            None
        }
    }
}

/// A key prefix no other test (or run) uses, so tests share one server safely.
pub(crate) fn unique_prefix(tag: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "idemkit-test:{tag}:{}-{}-{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

/// The settings of a fresh, isolated store (a unique prefix).
pub(crate) fn single_config(tag: &str) -> RedisConfig {
    RedisConfig::default().with_prefix(unique_prefix(tag))
}

/// A store with `config` on the shared single node.
pub(crate) async fn connect_single(config: RedisConfig) -> idemkit_core::StoreResult<RedisStore> {
    RedisStore::connect_with(&redis_url().expect("redis url"), config).await
}

/// The `redis+cluster://` URL of a cluster's seed nodes (`redis://host:port` each).
pub(crate) fn cluster_url(urls: &[String]) -> String {
    let nodes: Vec<&str> = urls
        .iter()
        .map(|u| u.trim_start_matches("redis://").trim_end_matches('/'))
        .collect();
    format!("redis+cluster://{}", nodes.join(","))
}

/// Factory for the conformance suite: a fresh store on the shared server, or
/// `None` when Redis tests are skipped (see [`redis_url`]).
pub(crate) async fn fresh_single(clock: Arc<ManualClock>) -> Option<Arc<RedisStore>> {
    redis_url()?;
    let store = connect_single(single_config("conformance"))
        .await
        .expect("connect to redis");
    Some(Arc::new(store.with_test_clock(clock)))
}

/// Whether a binary is on the PATH (`redis-server`, `redis-cli`).
pub(crate) fn have(binary: &str) -> bool {
    std::process::Command::new(binary)
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `redis-server` and `redis-cli` are needed (tests that start their own servers):
/// missing under CI is a failure, elsewhere a notice and a skip.
pub(crate) fn have_redis_binaries() -> bool {
    if have("redis-server") && have("redis-cli") {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("redis-server/redis-cli are not installed under CI");
    }
    eprintln!("notice: redis-server/redis-cli not found; skipping this test");
    false
}
