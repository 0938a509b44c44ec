//! Exactly two round trips per request (claim, complete), and one more per
//! phase boundary of a multi-step request (the advance), counted by the
//! server: every client command `MONITOR` shows on a private `redis-server`
//! (so only this test's commands count), over sequential claim + complete
//! requests.
//! With `WAIT 1` the `WAIT` rides in the same pipeline as its script: the
//! scripts still number two, plus one `WAIT` each.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idemkit_core::{ClaimOutcome, KeyStore};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::suite::{claim_req, response, scope};

use crate::common::{have_redis_binaries, unique_prefix};
use crate::harness::{Standalone, cli};

/// Commands a replica sends its primary.
const REPLICATION: &[&str] = &["replconf", "psync", "sync", "ping"];

/// Client commands per command name over `n` requests of `store`, as
/// `MONITOR` on the private server shows them: commands the scripts run
/// inside Redis (shown as `[0 lua]`) are not round trips and are left out.
async fn client_commands(store: &RedisStore, port: u16, tag: &str, n: u64) -> BTreeMap<String, u64> {
    client_commands_phased(store, port, tag, n, 0).await
}

/// [`client_commands`] for requests that advance `phases` recovery points
/// between claim and completion.
async fn client_commands_phased(
    store: &RedisStore,
    port: u16,
    tag: &str,
    n: u64,
    phases: u64,
) -> BTreeMap<String, u64> {
    // Warm up: connections, script loading.
    requests(store, &format!("{tag}-warm"), 5, phases).await;
    let mut monitor = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "monitor"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .expect("redis-cli monitor");
    let mut out = BufReader::new(monitor.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "OK", "MONITOR attached");
    let reader = std::thread::spawn(move || out.lines().map_while(Result::ok).collect::<Vec<_>>());
    requests(store, tag, n, phases).await;
    // A marker through another connection: once MONITOR shows it, it has shown
    // every command before it.
    let marker = format!("{tag}-end-of-run");
    cli(port, &["ECHO", &marker]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    monitor.kill().unwrap();
    monitor.wait().unwrap();
    let lines = reader.join().unwrap();
    assert!(
        lines.iter().any(|l| l.contains(&marker)),
        "MONITOR saw the whole run"
    );
    let mut counts = BTreeMap::new();
    for l in lines.iter().filter(|l| !l.contains(&marker)) {
        // `1700000000.123456 [0 127.0.0.1:50000] "evalsha" "…" …`
        let Some((_, rest)) = l.split_once(" [") else {
            continue;
        };
        let Some((source, command)) = rest.split_once("] ") else {
            continue;
        };
        if source.ends_with(" lua") {
            continue;
        }
        let name = command.split('"').nth(1).unwrap_or_default().to_ascii_lowercase();
        if !REPLICATION.contains(&name.as_str()) {
            *counts.entry(name).or_insert(0) += 1;
        }
    }
    counts
}

async fn requests(store: &RedisStore, tag: &str, n: u64, phases: u64) {
    for i in 0..n {
        let s = scope(&format!("acct-{}", i % 7), &format!("{tag}-{i}"));
        let ClaimOutcome::Claimed(lease) = store.claim(&claim_req(&s, "{}")).await.expect("claim") else {
            panic!("a fresh key is claimed");
        };
        for p in 0..phases {
            let update = idemkit_core::PhaseUpdate {
                recovery_point: format!("phase-{p}"),
                step: Some((format!("step-{p}"), serde_json::json!({"out": p}))),
            };
            store.advance(&s, lease.token, &update).await.expect("advance");
        }
        store
            .complete(&s, lease.token, &response(201, "ok"))
            .await
            .expect("complete");
    }
}

/// Scripts are sent as `EVALSHA` (or `EVAL` the first time): both are one round trip.
fn scripts(counts: &BTreeMap<String, u64>) -> u64 {
    counts.get("evalsha").copied().unwrap_or(0) + counts.get("eval").copied().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_round_trips_per_request() {
    if !have_redis_binaries() {
        return;
    }
    const N: u64 = 200;
    let server = Standalone::start(&["--appendonly", "no"]);
    let store = RedisStore::connect_with(
        &server.url(),
        RedisConfig::default().with_prefix(unique_prefix("rt")),
    )
    .await
    .expect("connect");
    let counts = client_commands(&store, server.node.port, "plain", N).await;
    assert_eq!(scripts(&counts), 2 * N, "{counts:?}");
    assert_eq!(
        counts.values().sum::<u64>(),
        2 * N,
        "nothing but the two scripts per request: {counts:?}"
    );

    // Multi-step: one more script per phase boundary (the fenced advance of
    // the recovery point with its step output), nothing else.
    for phases in [1, 3] {
        let counts =
            client_commands_phased(&store, server.node.port, &format!("phased-{phases}"), N, phases).await;
        assert_eq!(scripts(&counts), (2 + phases) * N, "{counts:?}");
        assert_eq!(counts.values().sum::<u64>(), (2 + phases) * N, "{counts:?}");
    }

    // A primary with one replica under `WAIT 1`: one `WAIT` per write, in the
    // same pipeline as its script.
    let primary = Standalone::start(&["--appendonly", "no"]);
    let replica = Standalone::start(&["--replicaof", "127.0.0.1", &primary.node.port.to_string()]);
    let started = Instant::now();
    while !cli(replica.node.port, &["INFO", "replication"]).contains("master_link_status:up") {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "replica never synced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let durable = RedisStore::connect_with(
        &primary.url(),
        RedisConfig::default()
            .with_prefix(unique_prefix("rt-wait"))
            .with_wait_replicas(1, Duration::from_secs(2)),
    )
    .await
    .expect("connect");
    let counts = client_commands(&durable, primary.node.port, "wait", N).await;
    assert_eq!(scripts(&counts), 2 * N, "{counts:?}");
    assert_eq!(counts.get("wait").copied(), Some(2 * N), "{counts:?}");
    assert_eq!(counts.values().sum::<u64>(), 4 * N, "{counts:?}");
}
