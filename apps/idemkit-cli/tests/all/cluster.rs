//! `idemkit keys` and the labels service with their keys on a real Redis
//! Cluster (three primaries, one replica each, started from `redis-server` on
//! loopback ports and killed on drop). One cluster serves every case; each
//! case has its own key prefix.

use crate::keys::{Db, cluster_url, exercise, release_paths, unique};
use crate::labels::{ACME, Labels, body, post};
use crate::redis_harness::Cluster;

/// Whether `redis-server` and `redis-cli` are here: a failure under CI (the CI
/// script installs them), a notice and a skip elsewhere.
fn have_redis_binaries() -> bool {
    let have = |bin: &str| {
        std::process::Command::new(bin)
            .arg("--version")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if have("redis-server") && have("redis-cli") {
        return true;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "redis-server/redis-cli are not installed under CI"
    );
    eprintln!("notice: redis-server/redis-cli not found; skipping the cluster tests");
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_labels_on_a_redis_cluster() {
    if !have_redis_binaries() {
        return;
    }
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let urls = cluster.urls();
    assert_eq!(cluster.pairs().len(), 3, "three primaries, each with a replica");

    // Every `idemkit keys` command, as on a single node: list, show, release,
    // complete, reap, review.
    exercise(Db::redis_cluster(&urls).await).await;
    release_paths(Db::redis_cluster(&urls).await).await;

    // The labels service with its keys on the cluster, rows in SQLite.
    let mut labels = Labels::courier_only();
    labels.keys_url = Some(format!(
        "{}?prefix={}",
        cluster_url(&urls),
        unique("labels-cluster")
    ));
    labels.start_service(&[]);
    let first = post(&labels.base, ACME, &body("c-1", "GB")).await;
    assert_eq!(first.status, 201, "{first:?}");
    let again = post(&labels.base, ACME, &body("c-1", "GB")).await;
    assert_eq!((again.status, again.replayed), (200, true), "{again:?}");
    assert_eq!(again.raw, first.raw);
    let storm_body = body("c-storm", "GB");
    let storm = futures::future::join_all((0..20).map(|_| post(&labels.base, ACME, &storm_body))).await;
    assert_eq!(storm.iter().filter(|s| s.status == 201).count(), 1, "{storm:#?}");
    assert_eq!(labels.stats().await["shipments"], 2, "one shipment per key");

    drop(labels);

    // SIGKILL after the courier intent; the restarted service's completer
    // finishes the request with no client retry (a courier of its own, so its
    // calls count only this request).
    #[cfg(feature = "failpoints")]
    {
        let mut labels = Labels::courier_only();
        labels.keys_url = Some(format!(
            "{}?prefix={}",
            cluster_url(&urls),
            unique("labels-crash")
        ));
        crate::labels::abandon_after_intent(&mut labels, "c-abandoned").await;
        labels.start_service(&[]);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let rows = crate::labels::label_rows(&labels, "c-abandoned").await;
            if rows.first().is_some_and(|r| r.status == "created") {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "not completed: {rows:?}");
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        crate::labels::finished_without_retry(&labels, "c-abandoned").await;
    }
    drop(cluster);
}
