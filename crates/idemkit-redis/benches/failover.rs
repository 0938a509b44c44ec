//! What a Redis Cluster failover loses, with and without `WAIT`.
//!
//! `cargo bench -p idemkit-redis --bench failover`
//!
//! For each mode (no `WAIT`; `WAIT 1` replica) and each scenario, a fresh
//! cluster (three primaries, one replica each, on loopback) takes claim +
//! complete load from 16 concurrent workers. Mid-run one primary is SIGKILLed
//! and its replica promoted at once with `CLUSTER FAILOVER TAKEOVER` (no waiting
//! for failure detection). Afterwards every *acknowledged* claim (the store
//! answered `Claimed`) and completion (`complete` returned `Ok`) is read back.
//!
//! One second after the takeover the dead node is restarted (empty) and rejoins
//! as the new primary's replica, as an orchestrator would do.
//!
//! Scenarios:
//! - `kill`: the primary dies with replication healthy (loss limited to what was
//!   in flight on the replication link);
//! - `lagging replica`: the replica is frozen (SIGSTOP, as a stalled link would)
//!   for 500 ms before the primary dies; whatever the primary acknowledged in
//!   that time never reached the replica that takes over.

#[path = "../tests/all/harness.rs"]
mod harness;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::Cluster;
use idemkit_core::{ClaimOutcome, KeyStore, RecordState, Scope, StoreError};
use idemkit_redis::{RedisConfig, RedisStore};
use idemkit_testkit::suite::{claim_req, response, scope};

const WORKERS: usize = 16;
const BEFORE_FAULT: Duration = Duration::from_millis(1500);
const AFTER_FAULT: Duration = Duration::from_millis(4000);
const LAG: Duration = Duration::from_millis(500);
const RESTART_AFTER: Duration = Duration::from_millis(1000);

#[derive(Default)]
struct Acked {
    claims: Vec<(Scope, i64)>,
    completions: Vec<(Scope, i64, String)>,
    /// When each completion was acknowledged, since the run started.
    done_at: Vec<Duration>,
}

#[derive(Default)]
struct Counters {
    unavailable: AtomicU64,
    fenced: AtomicU64,
    other_errors: AtomicU64,
    /// Slowest single store call, in ms.
    slowest_ms: AtomicU64,
}

struct Result {
    mode: &'static str,
    scenario: &'static str,
    claims: usize,
    completions: usize,
    unavailable: u64,
    fenced: u64,
    other_errors: u64,
    slowest_ms: u64,
    rate_before: f64,
    rate_last: f64,
    lost_claims: usize,
    lost_completions: usize,
}

async fn worker(
    store: Arc<RedisStore>,
    w: usize,
    start: Instant,
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Acked>>,
    counters: Arc<Counters>,
) {
    let timed = |t: Instant| {
        let ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
        counters.slowest_ms.fetch_max(ms, Ordering::Relaxed);
    };
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let s = scope(&format!("acct-{}", (w * 7919 + i) % 256), &format!("w{w}-{i}"));
        let body = format!("w{w}-{i}");
        let t = Instant::now();
        let claimed = store.claim(&claim_req(&s, "{}")).await;
        timed(t);
        let err = match claimed {
            Ok(ClaimOutcome::Claimed(lease)) => {
                acked.lock().unwrap().claims.push((s.clone(), lease.token.0));
                let t = Instant::now();
                let completed = store.complete(&s, lease.token, &response(201, &body)).await;
                timed(t);
                match completed {
                    Ok(()) => {
                        let mut a = acked.lock().unwrap();
                        a.completions.push((s, lease.token.0, body));
                        a.done_at.push(start.elapsed());
                        None
                    }
                    Err(e) => Some(e),
                }
            }
            Ok(other) => panic!("fresh key answered {other:?}"),
            Err(e) => Some(e),
        };
        match err {
            None => {}
            Some(StoreError::Unavailable(_)) => {
                counters.unavailable.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The claim was lost with the old primary: the new one refuses the
            // completion instead of writing it.
            Some(StoreError::Fenced) => {
                counters.fenced.fetch_add(1, Ordering::Relaxed);
            }
            Some(e) => {
                counters.other_errors.fetch_add(1, Ordering::Relaxed);
                eprintln!("error: {e}");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }
}

async fn scenario(
    mode: &'static str,
    wait: Option<(u32, Duration)>,
    name: &'static str,
    lagging: bool,
) -> Result {
    let mut cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let urls = cluster.urls();
    let url = cluster_url(&urls);
    let mut config = RedisConfig::default()
        .with_prefix("failover")
        .with_operation_timeout(Duration::from_secs(3));
    if let Some((n, t)) = wait {
        config = config.with_wait_replicas(n, t);
    }
    let store = Arc::new(
        RedisStore::connect_with(&url, config.clone())
            .await
            .expect("connect"),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let acked = Arc::new(Mutex::new(Acked::default()));
    let counters = Arc::new(Counters::default());
    let mut set = tokio::task::JoinSet::new();
    let start = Instant::now();
    for w in 0..WORKERS {
        set.spawn(worker(
            store.clone(),
            w,
            start,
            stop.clone(),
            acked.clone(),
            counters.clone(),
        ));
    }

    tokio::time::sleep(BEFORE_FAULT).await;
    let (primary, replica) = cluster.pairs()[0];
    if lagging {
        cluster.node(replica).signal("STOP");
        tokio::time::sleep(LAG).await;
    }
    cluster.node_mut(primary).kill();
    if lagging {
        cluster.node(replica).signal("CONT");
    }
    let out = harness::cli(replica, &["CLUSTER", "FAILOVER", "TAKEOVER"]);
    assert!(out.trim() == "OK", "takeover refused: {out}");
    // The orchestrator restarts the dead node (empty: no persistence here); it
    // rejoins as the new primary's replica, so `WAIT 1` can be met again.
    tokio::time::sleep(RESTART_AFTER).await;
    tokio::task::block_in_place(|| cluster.node_mut(primary).restart());
    tokio::time::sleep(AFTER_FAULT - RESTART_AFTER).await;
    stop.store(true, Ordering::Relaxed);
    while let Some(r) = set.join_next().await {
        r.expect("worker");
    }

    let cluster = tokio::task::spawn_blocking(move || {
        cluster.wait_serving(Duration::from_secs(30));
        cluster
    })
    .await
    .unwrap();
    // Read back with a fresh client (no WAIT needed for reads).
    let reader = RedisStore::connect_with(
        &cluster_url(&cluster.urls()),
        RedisConfig::default().with_prefix("failover"),
    )
    .await
    .expect("connect reader");
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    let mut lost_claims = 0;
    for (s, token) in &acked.claims {
        match reader.get(s).await.expect("read back") {
            Some(r) if r.fencing_token.0 >= *token => {}
            _ => lost_claims += 1,
        }
    }
    let mut lost_completions = 0;
    for (s, token, body) in &acked.completions {
        match reader.get(s).await.expect("read back") {
            Some(r)
                if r.state == RecordState::Completed
                    && r.fencing_token.0 == *token
                    && r.response.as_ref().is_some_and(|x| x.body == body.as_bytes()) => {}
            _ => lost_completions += 1,
        }
    }
    drop(cluster);
    let in_window = |from: Duration, to: Duration| {
        acked.done_at.iter().filter(|t| **t >= from && **t < to).count() as f64 / (to - from).as_secs_f64()
    };
    let end = BEFORE_FAULT + AFTER_FAULT + if lagging { LAG } else { Duration::ZERO };
    Result {
        mode,
        scenario: name,
        claims: acked.claims.len(),
        completions: acked.completions.len(),
        unavailable: counters.unavailable.load(Ordering::Relaxed),
        fenced: counters.fenced.load(Ordering::Relaxed),
        other_errors: counters.other_errors.load(Ordering::Relaxed),
        slowest_ms: counters.slowest_ms.load(Ordering::Relaxed),
        rate_before: in_window(BEFORE_FAULT - Duration::from_secs(1), BEFORE_FAULT),
        rate_last: in_window(end - Duration::from_secs(1), end),
        lost_claims,
        lost_completions,
    }
}

fn main() {
    let have = |b: &str| {
        std::process::Command::new(b)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if !(have("redis-server") && have("redis-cli")) {
        println!("redis-server/redis-cli not found: nothing to measure");
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let started = Instant::now();
    let wait = Some((1, Duration::from_millis(200)));
    let results = rt.block_on(async {
        vec![
            scenario("no WAIT", None, "kill", false).await,
            scenario("WAIT 1 (200 ms)", wait, "kill", false).await,
            scenario("no WAIT", None, "lagging replica", true).await,
            scenario("WAIT 1 (200 ms)", wait, "lagging replica", true).await,
        ]
    });
    println!();
    println!(
        "Failover under load: {WORKERS} workers of claim + complete; one primary SIGKILLed after {BEFORE_FAULT:?}, \
         its replica promoted with CLUSTER FAILOVER TAKEOVER, the dead node restarted {RESTART_AFTER:?} later \
         (it rejoins as a replica); load continues {AFTER_FAULT:?} after the kill"
    );
    println!();
    println!(
        "| mode | scenario | claims acked | completions acked | 503 | fenced | other errors | slowest call | req/s before → last second | acked claims lost | acked completions lost |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &results {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} ms | {:.0} → {:.0} | {} | {} |",
            r.mode,
            r.scenario,
            r.claims,
            r.completions,
            r.unavailable,
            r.fenced,
            r.other_errors,
            r.slowest_ms,
            r.rate_before,
            r.rate_last,
            r.lost_claims,
            r.lost_completions
        );
    }
    println!();
    println!("total time {:?}", started.elapsed());
}

/// The `redis+cluster://` URL of a cluster's seed nodes (`redis://host:port` each).
fn cluster_url(urls: &[String]) -> String {
    let nodes: Vec<&str> = urls
        .iter()
        .map(|u| u.trim_start_matches("redis://").trim_end_matches('/'))
        .collect();
    format!("redis+cluster://{}", nodes.join(","))
}
