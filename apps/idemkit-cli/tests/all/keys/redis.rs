//! `idemkit keys` on Redis.

use super::*;

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
        let store = idemkit_redis::RedisStore::connect_with(
            &cluster_url(urls),
            idemkit_redis::RedisConfig::default().with_prefix(prefix.clone()),
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
        let store = idemkit_redis::RedisStore::connect_with(
            &url,
            idemkit_redis::RedisConfig::default().with_prefix(prefix.clone()),
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
    let store = idemkit_redis::RedisStore::connect_with(
        &url,
        idemkit_redis::RedisConfig::default().with_prefix(prefix.clone()),
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
