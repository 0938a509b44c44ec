//! `idemkit proxy` as real processes: SIGKILL at its failpoints and the retry
//! on a restarted proxy, two proxies sharing PostgreSQL or Redis behind a
//! balancer, and the metrics a proxy process publishes.

use super::*;

/// An upstream that honours keys: one effect per key, its first answer replayed.
#[derive(Default)]
struct Honouring {
    effects: AtomicU64,
    answers: std::sync::Mutex<std::collections::HashMap<String, String>>,
}

async fn honouring(State(h): State<Arc<Honouring>>, headers: HeaderMap) -> impl IntoResponse {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let mut answers = h.answers.lock().unwrap();
    let body = answers
        .entry(key)
        .or_insert_with(|| format!(r#"{{"effect":{}}}"#, h.effects.fetch_add(1, Ordering::SeqCst) + 1))
        .clone();
    (StatusCode::CREATED, [("content-type", "application/json")], body)
}

/// `idemkit proxy` as a real process; its stdout lines arrive on the channel.
pub(super) struct ProxyProcess {
    pub(super) child: std::process::Child,
    pub(super) base: String,
    pub(super) lines: std::sync::mpsc::Receiver<String>,
}

impl ProxyProcess {
    /// `crash`: the failpoint (`IDEMKIT_CRASH_AT`) the process stops at, if any.
    pub(super) fn start(upstream: &str, db: &std::path::Path, honours: bool, crash: Option<&str>) -> Self {
        Self::start_on(
            upstream,
            &format!("sqlite://{}", db.display()),
            "test-secret",
            honours,
            crash,
        )
    }

    fn start_on(
        upstream: &str,
        database_url: &str,
        secret: &str,
        honours: bool,
        crash: Option<&str>,
    ) -> Self {
        Self::start_with(upstream, database_url, secret, honours, crash, &[])
    }

    /// [`ProxyProcess::start_on`] with more flags.
    pub(super) fn start_with(
        upstream: &str,
        database_url: &str,
        secret: &str,
        honours: bool,
        crash: Option<&str>,
        extra: &[&str],
    ) -> Self {
        use std::io::BufRead;
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_idemkit"));
        cmd.args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream]);
        if !extra.contains(&"--lease-ms") {
            cmd.args(["--lease-ms", "500"]);
        }
        cmd.arg("--database-url")
            .arg(database_url)
            .env("IDEMKIT_PROXY_SECRET", secret)
            .env_remove("RUST_LOG")
            .stdout(std::process::Stdio::piped());
        if honours {
            cmd.arg("--upstream-honours-keys");
        }
        cmd.args(extra);
        match crash {
            Some(point) => cmd.env("IDEMKIT_CRASH_AT", point),
            None => cmd.env_remove("IDEMKIT_CRASH_AT"),
        };
        let mut child = cmd.spawn().expect("spawn idemkit proxy");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let first = lines
            .recv_timeout(Duration::from_secs(30))
            .expect("the proxy starts");
        let base = first
            .strip_prefix("idemkit proxy listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first}"))
            .to_owned();
        Self { child, base, lines }
    }
}

impl Drop for ProxyProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// SIGKILL between forwarding and storing, then a retry on a restarted proxy.
/// Returns the retry's answer and the proxy's database.
async fn kill_after_forward(
    name: &str,
    upstream: &str,
    honours: bool,
) -> (reqwest::Response, std::path::PathBuf) {
    kill_at("idemkit::proxy::after_forward", name, upstream, honours).await
}

/// SIGKILL at failpoint `point` of a keyed request, then a retry on a
/// restarted proxy. Returns the retry's answer and the proxy's database.
async fn kill_at(
    point: &str,
    name: &str,
    upstream: &str,
    honours: bool,
) -> (reqwest::Response, std::path::PathBuf) {
    let db = std::env::temp_dir().join(format!("idemkit-proxy-kill-{name}-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&db);
    let http = reqwest::Client::new();
    let send = |base: String| {
        http.post(format!("{base}/orders"))
            .header("authorization", "Bearer a")
            .header("idempotency-key", "kill-1")
            .header("content-type", "application/json")
            .body(r#"{"sku":"K"}"#)
            .send()
    };
    let mut crashing = ProxyProcess::start(upstream, &db, honours, Some(point));
    let pending = tokio::spawn(send(crashing.base.clone()));
    let lines = std::mem::replace(&mut crashing.lines, std::sync::mpsc::channel().1);
    let line = tokio::task::spawn_blocking(move || lines.recv_timeout(Duration::from_secs(30)))
        .await
        .unwrap()
        .expect("the crash point is reached");
    assert_eq!(line, format!("CRASHPOINT {point}"));
    crashing.child.kill().unwrap(); // SIGKILL
    crashing.child.wait().unwrap();
    assert!(pending.await.unwrap().is_err(), "the caller lost its answer");
    let restarted = ProxyProcess::start(upstream, &db, honours, None);
    // The dead proxy's lease (500 ms) must run out before the retry may take over.
    let mut answer = send(restarted.base.clone()).await.unwrap();
    for _ in 0..50 {
        if answer.status() != 409 || answer.headers().get("retry-after").is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = send(restarted.base.clone()).await.unwrap();
    }
    (answer, db)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_forward_and_store_parks_the_request_of_a_key_ignoring_upstream() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let (answer, db) = kill_after_forward("naive", &upstream, false).await;
    assert_eq!(code(answer).await, (409, "idempotency_request_parked".into()));
    assert_eq!(
        naive.posts.load(Ordering::SeqCst),
        1,
        "the upstream saw one request"
    );
    let listed = crate::idemkit(vec![
        "keys".into(),
        "list".into(),
        "--state".into(),
        "parked".into(),
        "--database-url".into(),
        format!("sqlite://{}", db.display()),
        "--json".into(),
    ])
    .await;
    assert_eq!(listed.code, 0, "{listed:#?}");
    assert!(listed.stdout.contains("kill-1"), "{listed:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_forward_and_store_resends_the_same_key_to_a_key_honouring_upstream() {
    let honouring_upstream = Arc::new(Honouring::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(honouring))
            .with_state(honouring_upstream.clone()),
    )
    .await;
    let (answer, _db) = kill_after_forward("honours", &upstream, true).await;
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.text().await.unwrap(), r#"{"effect":1}"#);
    assert_eq!(honouring_upstream.effects.load(Ordering::SeqCst), 1, "one effect");
}

/// The intent is written by the claim, so a proxy killed after its claim and
/// before the forward leaves a record the retry cannot tell from one that was
/// forwarded: a key-ignoring upstream's request is parked, never sent at all
/// rather than possibly twice (the price `docs/proxy.md` states).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_claim_and_forward_parks_rather_than_risk_a_second_send() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let (answer, _db) = kill_at("idemkit::proxy::before_forward", "unsent", &upstream, false).await;
    assert_eq!(code(answer).await, (409, "idempotency_request_parked".into()));
    assert_eq!(naive.posts.load(Ordering::SeqCst), 0, "nothing was ever sent");
}

/// A TCP round-robin balancer in front of `backends` (`http://host:port`):
/// each connection goes to the next backend. Returns its base URL and the
/// connections each backend got.
async fn balancer(backends: Vec<String>) -> (String, Arc<Vec<AtomicU64>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let counts: Arc<Vec<AtomicU64>> = Arc::new(backends.iter().map(|_| AtomicU64::new(0)).collect());
    let addrs: Vec<String> = backends
        .iter()
        .map(|b| b.trim_start_matches("http://").to_owned())
        .collect();
    let seen = counts.clone();
    tokio::spawn(async move {
        for i in 0usize.. {
            let Ok((mut inbound, _)) = listener.accept().await else {
                return;
            };
            let n = i % addrs.len();
            seen[n].fetch_add(1, Ordering::SeqCst);
            let addr = addrs[n].clone();
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(addr).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    (base, counts)
}

/// The checker through two proxy processes sharing the key store at
/// `database_url`, behind a round-robin balancer (so concurrent duplicates
/// meet across processes), in front of the naive orders upstream; and the
/// negative control, the same upstream called directly.
async fn two_proxies_pass_every_gate(database_url: &str, tag: &str) {
    let upstream = orders_upstream().await;
    let naked = crate::idemkit(crate::check_args(&upstream, &["--json"])).await;
    assert_eq!(naked.code, 1, "negative control: {naked:#?}");
    let secret = fresh_secret(tag);
    let proxies = [
        ProxyProcess::start_on(&upstream, database_url, &secret, false, None),
        ProxyProcess::start_on(&upstream, database_url, &secret, false, None),
    ];
    let (front, counts) = balancer(proxies.iter().map(|p| p.base.clone()).collect()).await;
    let run = crate::idemkit(crate::check_args(&front, &["--json"])).await;
    let verdicts = run.verdicts();
    assert_eq!(verdicts.len(), 7, "{run:#?}");
    assert!(verdicts.iter().all(|(_, v)| v == "pass"), "{run:#?}");
    assert_eq!(run.code, 0, "{run:#?}");
    for (i, c) in counts.iter().enumerate() {
        assert!(c.load(Ordering::SeqCst) > 0, "proxy {i} served no connection");
    }
}

async fn orders_upstream() -> String {
    serve(
        Router::new()
            .route("/orders", post(order))
            .route("/orders/count", get(order_count))
            .with_state(Arc::new(Orders::default())),
    )
    .await
}

/// A secret of its own per run: the scopes (keyed hashes of the credentials)
/// never meet another run's in a shared store.
fn fresh_secret(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{}-{nanos}", std::process::id())
}

/// All 7 gates through two proxy processes sharing one PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemkit_check_passes_through_two_proxy_processes_sharing_postgres() {
    if let Some(url) = crate::keys::postgres_url() {
        two_proxies_pass_every_gate(&url, "pg").await;
    }
}

/// All 7 gates through two proxy processes sharing one Redis.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemkit_check_passes_through_two_proxy_processes_sharing_redis() {
    if let Some(url) = crate::labels::redis_url() {
        two_proxies_pass_every_gate(&url, "redis").await;
    }
}

/// The proxy process publishes the layer's series, counted per keyed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_process_publishes_request_outcomes() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let db = std::env::temp_dir().join(format!("idemkit-proxy-metrics-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&db);
    let proxy = ProxyProcess::start(&upstream, &db, false, None);
    let http = reqwest::Client::new();
    for _ in 0..2 {
        let res = http
            .post(format!("{}/orders", proxy.base))
            .header("authorization", "Bearer m")
            .header("idempotency-key", "m-1")
            .body("{}")
            .send()
            .await
            .unwrap();
        assert_eq!(res.status(), 201);
    }
    let missing = http
        .post(format!("{}/orders", proxy.base))
        .header("authorization", "Bearer m")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), 400);
    let text = http
        .get(format!("{}/_idemkit/metrics", proxy.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |outcome: &str| {
        text.lines()
            .find(|l| l.starts_with(&format!("idemkit_requests_total{{outcome=\"{outcome}\"}}")))
            .and_then(|l| l.rsplit(' ').next())
            .unwrap_or_else(|| panic!("no {outcome} series in:\n{text}"))
            .to_owned()
    };
    assert_eq!(value("executed"), "1");
    assert_eq!(value("replayed"), "1");
    assert_eq!(value("key_missing"), "1");
    assert_eq!(value("parked"), "0", "every outcome starts at zero");
    assert!(text.contains("idemkit_store_seconds_bucket"), "{text}");
    assert_eq!(naive.posts.load(Ordering::SeqCst), 1);
}
