//! Many instances on one PostgreSQL database (issue: PostgreSQL key store).

use std::sync::Arc;

use crate::{Backend, Server, order, post_order};

/// Three quickstart processes on one database; 300 identical requests with one
/// key spread across them at once → exactly one order; repeated for 20 keys.
/// Every answer is the winner's 201 (original or replay) or
/// `409 idempotency_request_in_progress` with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_instances_300_requests_per_key_make_one_order_per_key() {
    let Some(backend) = Backend::postgres() else {
        return;
    };
    let servers = [
        Server::start_on(&backend, &[]).await,
        Server::start_on(&backend, &[]).await,
        Server::start_on(&backend, &[]).await,
    ];
    let bases: Vec<String> = servers.iter().map(|s| s.base.clone()).collect();
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(128)
        .build()
        .unwrap();
    let (mut originals, mut replays, mut in_progress) = (0, 0, 0);
    for k in 0..20 {
        let key = format!("multi-{k}");
        let barrier = Arc::new(tokio::sync::Barrier::new(300));
        let tasks: Vec<_> = (0..300)
            .map(|i| {
                let (client, base, key, barrier) =
                    (client.clone(), bases[i % 3].clone(), key.clone(), barrier.clone());
                tokio::spawn(async move {
                    barrier.wait().await;
                    post_order(&client, &base, "multi", &key, &order("MULTI", 1)).await
                })
            })
            .collect();
        let answers: Vec<_> = futures::future::join_all(tasks)
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        let created: Vec<_> = answers.iter().filter(|a| a.status == 201).collect();
        assert!(!created.is_empty(), "key {key}: nobody got the 201");
        for a in &answers {
            match a.status {
                201 if a.header("idempotent-replayed").is_some() => replays += 1,
                201 => originals += 1,
                409 => {
                    assert_eq!(a.code(), "idempotency_request_in_progress", "{a:?}");
                    assert!(a.header("retry-after").is_some());
                    in_progress += 1;
                }
                other => panic!("key {key}: unexpected status {other}: {a:?}"),
            }
            if a.status == 201 {
                assert_eq!(
                    a.body, created[0].body,
                    "key {key}: every 201 carries the same order"
                );
            }
        }
        assert_eq!(
            servers[k % 3].count("multi").await,
            k as i64 + 1,
            "after key {key}"
        );
    }
    assert_eq!(originals, 20, "one original 201 per key");
    eprintln!("20 keys × 300 requests: {originals} originals, {replays} replays, {in_progress} in-progress");
}
