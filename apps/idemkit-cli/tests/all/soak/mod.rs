//! The chaos soak over real processes (issue 33, item 6): three `idemkit
//! serve` instances on one PostgreSQL database, each with its completer,
//! behind a TCP relay that spreads connections over the live instances and
//! drops some of them (before anything is forwarded) and some replies (after
//! the request reached an instance); the courier behind a relay of its own
//! that does the same. Client tasks send label requests through the real
//! `idemkit-client` retry policy while a chaos task SIGKILLs (and restarts) and
//! SIGSTOPs (and resumes) random instances and now and then restarts the
//! PostgreSQL server (an immediate shutdown, then crash recovery: a server of
//! the soak's own, see [`server`]) or terminates every backend of the database.
//! Then the chaos stops, the completers get time to finish what was left, and
//! the checker looks at what the processes left behind:
//!
//! - at most one label row per idempotency key (the labels table);
//! - at most one courier shipment per label (the courier's database);
//! - every success answered for a key has the same bytes;
//! - a last request per key, after the chaos, answers its stored outcome: not
//!   "in progress", not "unavailable", not a hang.
//!
//! `IDEMKIT_SOAK_SECONDS` sets the chaos phase (default 12); `bash .ci/soak
//! MINUTES` runs it for longer. Needs PostgreSQL's server binaries (`initdb`,
//! `pg_ctl`); without them it runs on `IDEMKIT_TEST_POSTGRES_URL`'s server with
//! connection cuts in place of restarts, and without either it skips (both
//! are failures under CI).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idemkit_client::{Backoff, RetryConfig, RetryMiddleware, RetryPolicy};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};

use crate::labels::{ACME, Labels, Proc, body, free_port, spawn};

/// A small deterministic generator (xorshift64*), seeded per run.
struct Rng(AtomicU64);

impl Rng {
    fn next(&self) -> u64 {
        let mut x = self.0.load(Ordering::Relaxed);
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0.store(x, Ordering::Relaxed);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// What the relays did.
#[derive(Default)]
struct RelayFaults {
    on: AtomicBool,
    dropped_connections: AtomicU64,
    dropped_replies: AtomicU64,
}

/// A TCP relay on a port of its own to whichever of `targets` is up (a
/// random one per connection); with faults on, 3 % of connections are closed
/// before anything is forwarded and 5 % lose their reply (the request goes
/// through, the connection closes when the answer's first byte comes back).
async fn relay(targets: Arc<Mutex<Vec<u16>>>, faults: Arc<RelayFaults>, rng: Arc<Rng>) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let (targets, faults, rng) = (targets.clone(), faults.clone(), rng.clone());
            tokio::spawn(async move {
                let ports = targets.lock().unwrap().clone();
                if ports.is_empty() {
                    return;
                }
                let start = rng.below(ports.len() as u64) as usize;
                let mut out = None;
                for i in 0..ports.len() {
                    let p = ports[(start + i) % ports.len()];
                    if let Ok(Ok(s)) =
                        tokio::time::timeout(Duration::from_millis(300), TcpStream::connect(("127.0.0.1", p)))
                            .await
                    {
                        out = Some(s);
                        break;
                    }
                }
                let Some(mut out) = out else { return };
                let on = faults.on.load(Ordering::Relaxed);
                if on && rng.chance(0.03) {
                    faults.dropped_connections.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                if on && rng.chance(0.05) {
                    faults.dropped_replies.fetch_add(1, Ordering::Relaxed);
                    let (mut ri, _wi) = inbound.split();
                    let (mut ro, mut wo) = out.split();
                    let mut first = [0u8; 1];
                    tokio::select! {
                        _ = tokio::io::copy(&mut ri, &mut wo) => {}
                        _ = ro.read(&mut first) => {}
                    }
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    });
    port
}

/// One `idemkit serve` slot: its port and, while it runs, its process.
struct Instance {
    port: u16,
    proc: Option<Proc>,
}

fn signal(pid: u32, sig: &str) {
    let _ = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status();
}

fn start(port: u16, database: &str, courier: &str) -> Proc {
    let listen = format!("127.0.0.1:{port}");
    let (proc, _lines) = spawn(
        &[
            "serve",
            "--demo-tokens",
            "--listen",
            &listen,
            "--database-url",
            database,
            "--courier-url",
            courier,
            "--lease-ms",
            "1000",
            "--courier-deadline-ms",
            "1500",
        ],
        &[],
    );
    proc
}

/// A fresh database on the test server, and its URL.
async fn fresh_database(base: &str) -> (String, String) {
    let name = format!(
        "idemkit_soak_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros()
    );
    let pool = sqlx::PgPool::connect(base).await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    let (server, _) = base.rsplit_once('/').expect("a database URL");
    (name.clone(), format!("{server}/{name}"))
}

/// An answer a client saw: its status and bytes (0: no answer).
type Seen = (u16, Vec<u8>);

async fn send(client: &reqwest_middleware::ClientWithMiddleware, base: &str, key: &str) -> Seen {
    let sent = client
        .post(format!("{base}/labels"))
        .bearer_auth(ACME)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(&body(key, "GB")).expect("JSON"))
        .send()
        .await;
    match sent {
        Ok(res) => {
            let status = res.status().as_u16();
            (status, res.bytes().await.map(|b| b.to_vec()).unwrap_or_default())
        }
        Err(_) => (0, Vec::new()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chaos_soak_keeps_one_label_and_one_shipment_per_key() {
    let ci = std::env::var_os("CI").is_some();
    // A server of the soak's own (not the shared one), so its restarts touch
    // no other test; fsync off: an immediate shutdown keeps the page cache.
    let own = idemkit_testkit::PgServer::start(&["fsync=off"]);
    assert!(
        own.is_some() || !ci,
        "PostgreSQL's server binaries (initdb, pg_ctl) are not installed: under CI the soak restarts a server of its own"
    );
    let pg = match &own {
        Some(server) => server.url("postgres"),
        None => match std::env::var("IDEMKIT_TEST_POSTGRES_URL") {
            Ok(url) => {
                eprintln!("soak: no PostgreSQL binaries: connection cuts in place of server restarts");
                url
            }
            Err(_) => {
                eprintln!(
                    "no PostgreSQL binaries and IDEMKIT_TEST_POSTGRES_URL is not set: skipping the chaos soak"
                );
                return;
            }
        },
    };
    let seconds: f64 = std::env::var("IDEMKIT_SOAK_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12.0);
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
        | 1;
    eprintln!("soak: seed {seed}, {seconds} s of chaos");
    let rng = Arc::new(Rng(AtomicU64::new(seed)));
    let (dbname, database) = fresh_database(&pg).await;

    // The courier (on SQLite, never killed) behind a relay of its own.
    let courier = Labels::courier_only();
    let courier_port: u16 = courier.courier.rsplit(':').next().unwrap().parse().unwrap();
    let courier_faults = Arc::new(RelayFaults::default());
    let courier_relay = relay(
        Arc::new(Mutex::new(vec![courier_port])),
        courier_faults.clone(),
        rng.clone(),
    )
    .await;
    let courier_url = format!("http://127.0.0.1:{courier_relay}");

    // Three instances on one database; the first one migrates alone.
    let mut instances: Vec<Instance> = (0..3)
        .map(|_| Instance {
            port: free_port(),
            proc: None,
        })
        .collect();
    for inst in &mut instances {
        inst.proc = Some(start(inst.port, &database, &courier_url));
    }
    let live = Arc::new(Mutex::new(instances.iter().map(|i| i.port).collect::<Vec<_>>()));
    let service_faults = Arc::new(RelayFaults::default());
    let front = relay(live.clone(), service_faults.clone(), rng.clone()).await;
    let base = format!("http://127.0.0.1:{front}");
    service_faults.on.store(true, Ordering::Relaxed);
    courier_faults.on.store(true, Ordering::Relaxed);

    // Clients: each sends label requests one after another, through the real
    // retry policy (its key in the header, as the body's: a caller's key).
    let answers: Arc<Mutex<BTreeMap<String, Vec<Seen>>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    for t in 0..6 {
        let (answers, stop, base) = (answers.clone(), stop.clone(), base.clone());
        clients.push(tokio::spawn(async move {
            let config = RetryConfig::new()
                .with_max_attempts(8)
                .with_deadline(Duration::from_secs(30))
                .with_attempt_timeout(Duration::from_secs(5))
                .with_backoff(Backoff::full_jitter(
                    Duration::from_millis(50),
                    Duration::from_secs(1),
                ));
            // A connection per request: the relay's faults (and a killed
            // instance's resets) fall on requests, not on a pooled few.
            let http = reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .unwrap();
            let client = reqwest_middleware::ClientBuilder::new(http)
                .with(RetryMiddleware::new(RetryPolicy::new(config)))
                .build();
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("soak-{t}-{n}");
                n += 1;
                let seen = send(&client, &base, &key).await;
                answers.lock().unwrap().entry(key).or_default().push(seen);
            }
        }));
    }

    // Chaos.
    let pg_pool = sqlx::PgPool::connect(&database).await.unwrap();
    let (mut kills, mut stops, mut courier_faults_set) = (0, 0, 0);
    let (mut pg_restarts, mut pg_cuts) = (0, 0);
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let halfway = Duration::from_secs_f64(seconds / 2.0);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(300 + rng.below(1200))).await;
        let i = rng.below(3) as usize;
        // At least one server restart in every run, however short.
        let must_restart = own.is_some() && pg_restarts == 0 && until - Instant::now() < halfway;
        match if must_restart { 11 } else { rng.below(12) } {
            0..=3 => {
                if let Some(p) = instances[i].proc.take() {
                    live.lock().unwrap().retain(|port| *port != instances[i].port);
                    signal(p.pid(), "-9");
                    drop(p);
                    kills += 1;
                    tokio::time::sleep(Duration::from_millis(200 + rng.below(800))).await;
                    instances[i].proc = Some(start(instances[i].port, &database, &courier_url));
                    live.lock().unwrap().push(instances[i].port);
                }
            }
            4..=7 => {
                if let Some(pid) = instances[i].proc.as_ref().map(Proc::pid) {
                    signal(pid, "-STOP");
                    stops += 1;
                    tokio::time::sleep(Duration::from_millis(200 + rng.below(2000))).await;
                    signal(pid, "-CONT");
                }
            }
            8..=10 => {
                // The courier commits a shipment and loses its answer, or
                // fails the next call without creating anything.
                let fault = if rng.chance(0.6) {
                    serde_json::json!({ "dropResponseAfterCommit": 2 })
                } else {
                    serde_json::json!({ "failNext": 1, "status": 503 })
                };
                courier.faults(fault).await;
                courier_faults_set += 1;
            }
            _ if own.is_some() && (must_restart || rng.chance(0.6)) => {
                // The server goes down at once and comes back after crash
                // recovery; every instance's connections fail meanwhile.
                let started = Instant::now();
                tokio::task::block_in_place(|| own.as_ref().unwrap().restart());
                eprintln!("soak: PostgreSQL restarted in {:?}", started.elapsed());
                pg_restarts += 1;
            }
            _ => {
                // Every connection of the soak's database is cut (what a
                // restart does to its clients, without the downtime).
                let _ = sqlx::query(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                     WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .execute(&pg_pool)
                .await;
                pg_cuts += 1;
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    courier.faults(serde_json::json!({ "reset": true })).await;
    service_faults.on.store(false, Ordering::Relaxed);
    courier_faults.on.store(false, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    // The completers (every 2 s, records abandoned for a lease) finish what
    // the chaos left.
    tokio::time::sleep(Duration::from_secs(6)).await;

    let mut answers = answers.lock().unwrap().clone();
    let plain = reqwest_middleware::ClientBuilder::new(
        reqwest::Client::builder()
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap(),
    )
    .build();
    let mut stuck = Vec::new();
    for (key, seen) in answers.iter_mut() {
        let last = send(&plain, &base, key).await;
        if last.0 == 0 || last.0 == 503 || String::from_utf8_lossy(&last.1).contains("in_progress") {
            stuck.push(format!("{key}: {} {}", last.0, String::from_utf8_lossy(&last.1)));
        }
        seen.push(last);
    }
    let requests = answers.len();
    let mut statuses: BTreeMap<u16, usize> = BTreeMap::new();
    for seen in answers.values() {
        *statuses.entry(seen[0].0).or_default() += 1;
    }
    eprintln!("soak: the clients' answers by status (0: none): {statuses:?}");
    let dropped = (
        service_faults.dropped_connections.load(Ordering::Relaxed),
        service_faults.dropped_replies.load(Ordering::Relaxed),
        courier_faults.dropped_connections.load(Ordering::Relaxed),
        courier_faults.dropped_replies.load(Ordering::Relaxed),
    );
    eprintln!(
        "soak: {requests} requests; {kills} SIGKILLs, {stops} SIGSTOPs, {pg_restarts} PostgreSQL restarts, {pg_cuts} connection cuts, \
         {courier_faults_set} courier faults; relay in front: {} connections and {} replies dropped; courier relay: {} and {}",
        dropped.0, dropped.1, dropped.2, dropped.3
    );

    // What the processes left behind.
    let doubled: Vec<(Option<String>, i64)> = sqlx::query_as(
        "SELECT request::json->>'idempotencyKey', COUNT(*) FROM labels.labels GROUP BY 1 HAVING COUNT(*) > 1",
    )
    .fetch_all(&pg_pool)
    .await
    .unwrap();
    let labels: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM labels.labels")
        .fetch_one(&pg_pool)
        .await
        .unwrap();
    pg_pool.close().await;
    let courier_pool =
        sqlx::SqlitePool::connect(&format!("sqlite://{}?mode=ro", courier.courier_db().display()))
            .await
            .unwrap();
    let shipped: Vec<(String, i64)> = sqlx::query_as(
        "SELECT reference, COUNT(*) FROM courier_shipments WHERE reference IS NOT NULL \
         GROUP BY reference HAVING COUNT(*) > 1",
    )
    .fetch_all(&courier_pool)
    .await
    .unwrap();
    courier_pool.close().await;
    let mut differing = Vec::new();
    for (key, seen) in &answers {
        let ok: Vec<&Vec<u8>> = seen
            .iter()
            .filter(|(s, _)| (200..300).contains(s))
            .map(|(_, b)| b)
            .collect();
        if ok.windows(2).any(|w| w[0] != w[1]) {
            differing.push(key.clone());
        }
    }
    for inst in &mut instances {
        inst.proc.take();
    }
    let admin = sqlx::PgPool::connect(&pg).await.unwrap();
    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {dbname} WITH (FORCE)"
    )))
    .execute(&admin)
    .await;
    admin.close().await;

    assert!(requests > 10, "the clients got {requests} requests through");
    assert!(labels > 0, "labels were created");
    assert!(kills + stops > 0, "the chaos did something");
    assert!(own.is_none() || pg_restarts > 0, "the server was restarted");
    assert!(doubled.is_empty(), "two label rows for one key: {doubled:?}");
    assert!(
        shipped.is_empty(),
        "two courier shipments for one label: {shipped:?}"
    );
    assert!(
        differing.is_empty(),
        "different successes for one key: {differing:?}"
    );
    assert!(stuck.is_empty(), "keys that did not settle: {stuck:?}");
}
