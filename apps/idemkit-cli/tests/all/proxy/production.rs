//! Issue 34, over real processes: `idemkit proxy` in front of small upstreams
//! that behave like real ones (a 5xx after commit, their own "in progress",
//! short keep-alives), a key store that goes away, signals, slow clients,
//! forwarding headers and path spellings.

use super::processes::ProxyProcess;
use super::*;
use axum::routing::any;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn temp_db(name: &str) -> std::path::PathBuf {
    let db = std::env::temp_dir().join(format!("idemkit-proxy-prod-{name}-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&db);
    db
}

fn sqlite(db: &std::path::Path) -> String {
    format!("sqlite://{}", db.display())
}

fn write_config(name: &str, toml: &str) -> String {
    let path = std::env::temp_dir().join(format!("idemkit-proxy-prod-{name}-{}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    path.display().to_string()
}

/// One raw HTTP/1.1 exchange (the request as written, `Connection: close`
/// expected in it): the response's status and the whole response text.
async fn raw(base: &str, request: &str) -> (u16, String) {
    let addr = base.trim_start_matches("http://");
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(request.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tcp.read_to_end(&mut out))
        .await
        .expect("an answer")
        .unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    (status, text)
}

async fn send(http: &reqwest::Client, url: String, key: &str, body: &str) -> reqwest::Response {
    http.post(url)
        .header("authorization", "Bearer a")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
}

/// An upstream that commits and then answers `503` (a sidecar's reset
/// before headers, a 500 after commit).
async fn committed_then_503(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::SERVICE_UNAVAILABLE,
        "committed, then the sidecar reset",
    )
}

async fn count_everything(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, "done")
}

async fn not_found(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (StatusCode::NOT_FOUND, "no such route")
}

// Item 1 ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answered_5xx_of_a_key_ignoring_upstream_is_replayed_never_run_again() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/commit", post(committed_then_503))
            .with_state(naive.clone()),
    )
    .await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("5xx"), false, None);
    let http = reqwest::Client::new();
    let mut replayed = 0;
    for _ in 0..3 {
        let res = send(&http, format!("{}/commit", proxy.base), "five-1", "{}").await;
        assert_eq!(res.status(), 503);
        if res.headers().get("idempotent-replayed").is_some() {
            replayed += 1;
        }
        assert_eq!(res.text().await.unwrap(), "committed, then the sidecar reset");
    }
    assert_eq!(naive.posts.load(Ordering::SeqCst), 1, "the write ran once");
    assert_eq!(replayed, 2, "the retries are replays");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_declared_not_executed_frees_the_key_on_that_route_only() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/busy", post(committed_then_503))
            .route("/commit", post(committed_then_503))
            .with_state(naive.clone()),
    )
    .await;
    let config = write_config(
        "not-executed",
        "[[routes]]\nmethod = \"POST\"\npath = \"/busy\"\nnot_executed = [503]\n\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/commit\"\n",
    );
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("not-executed")),
        "test-secret",
        false,
        None,
        &["--config", &config],
    );
    let http = reqwest::Client::new();
    for _ in 0..3 {
        let res = send(&http, format!("{}/busy", proxy.base), "busy-1", "{}").await;
        assert_eq!(res.status(), 503);
        assert!(res.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(
        naive.posts.load(Ordering::SeqCst),
        3,
        "declared not executed: sent again"
    );
    for _ in 0..2 {
        assert_eq!(
            send(&http, format!("{}/commit", proxy.base), "commit-1", "{}")
                .await
                .status(),
            503
        );
    }
    assert_eq!(naive.posts.load(Ordering::SeqCst), 4, "not declared: replayed");
    // The contract says so, in plain words.
    let doc = crate::idemkit(vec![
        "docs".into(),
        "--proxy".into(),
        "--config".into(),
        config.clone(),
    ])
    .await;
    assert_eq!(doc.code, 0, "{doc:#?}");
    assert!(doc.stdout.contains("`503` on `POST /busy`"), "{}", doc.stdout);
    assert!(doc.stdout.contains("**stored and replayed**"), "{}", doc.stdout);
    assert!(
        !doc.stdout.contains("not stored: retry with the same key"),
        "{}",
        doc.stdout
    );
}

// Item 2 ---------------------------------------------------------------------

/// A key-honouring upstream that takes 1 s and answers its own `409 in
/// progress` (with `Retry-After`) to a second send of a key it still runs.
#[derive(Default)]
struct Slow {
    effects: AtomicU64,
    keys: std::sync::Mutex<std::collections::HashMap<String, Option<String>>>,
}

async fn slow_honouring(State(s): State<Arc<Slow>>, headers: HeaderMap) -> axum::response::Response {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let seen = s.keys.lock().unwrap().get(&key).cloned();
    match seen {
        Some(Some(body)) => (StatusCode::CREATED, body).into_response(),
        Some(None) => (
            StatusCode::CONFLICT,
            [("content-type", "application/problem+json"), ("retry-after", "1")],
            r#"{"code":"idempotency_request_in_progress","status":409}"#,
        )
            .into_response(),
        None => {
            s.keys.lock().unwrap().insert(key.clone(), None);
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let body = format!(r#"{{"effect":{}}}"#, s.effects.fetch_add(1, Ordering::SeqCst) + 1);
            s.keys.lock().unwrap().insert(key, Some(body.clone()));
            (StatusCode::CREATED, body).into_response()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstreams_own_in_progress_answer_is_never_stored() {
    let slow = Arc::new(Slow::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(slow_honouring))
            .with_state(slow.clone()),
    )
    .await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("in-progress")),
        "test-secret",
        true,
        None,
        &["--upstream-timeout-ms", "300"],
    );
    let http = reqwest::Client::new();
    let url = format!("{}/orders", proxy.base);
    let first = send(&http, url.clone(), "ip-1", "{}").await;
    assert_eq!(first.status(), 504);
    assert!(first.headers().contains_key("retry-after"));
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    let answer = loop {
        let res = send(&http, url.clone(), "ip-1", "{}").await;
        if res.status() != 409 {
            break res;
        }
        assert!(res.headers().contains_key("retry-after"), "{res:?}");
        assert!(
            std::time::Instant::now() < deadline,
            "still 409 after 6 s: {}",
            res.text().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.text().await.unwrap(), r#"{"effect":1}"#);
    assert_eq!(slow.effects.load(Ordering::SeqCst), 1);
}

// Item 3 ---------------------------------------------------------------------

/// A TCP relay to the key store that the test can cut (every connection
/// dropped, new ones refused) and restore.
struct Relay {
    addr: String,
    open: Arc<std::sync::atomic::AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Relay {
    async fn to(target: String) -> Arc<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let relay = Arc::new(Self {
            addr: listener.local_addr().unwrap().to_string(),
            open: Arc::new(true.into()),
            conns: Arc::default(),
        });
        let (open, conns) = (relay.open.clone(), relay.conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !open.load(Ordering::SeqCst) {
                    continue; // dropped: the store is "down"
                }
                let target = target.clone();
                conns.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                }));
            }
        });
        relay
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

async fn answer_then_cut_the_store(State(r): State<Arc<(Arc<Relay>, AtomicU64)>>) -> impl IntoResponse {
    r.1.fetch_add(1, Ordering::SeqCst);
    r.0.cut();
    (StatusCode::CREATED, "written upstream")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_after_the_upstream_answered_still_answers_and_stores_later() {
    let Some(redis) = crate::labels::redis_url() else {
        return;
    };
    let target = redis
        .trim_start_matches("redis://")
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let relay = Relay::to(target).await;
    let state = Arc::new((relay.clone(), AtomicU64::new(0)));
    let upstream = serve(
        Router::new()
            .route("/orders", post(answer_then_cut_the_store))
            .with_state(state.clone()),
    )
    .await;
    let secret = format!("outage-{}-{:?}", std::process::id(), std::time::SystemTime::now());
    let proxy = ProxyProcess::start_with(
        &upstream,
        &format!("redis://{}", relay.addr),
        &secret,
        false,
        None,
        &["--lease-ms", "60000"],
    );
    let http = reqwest::Client::new();
    let url = format!("{}/orders", proxy.base);
    let first = send(&http, url.clone(), "outage-1", "{}").await;
    assert_eq!(first.status(), 201, "the caller gets the upstream's answer");
    assert_eq!(first.text().await.unwrap(), "written upstream");
    let ready = http
        .get(format!("{}/_idemkit/ready", proxy.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "not ready while the store is down");
    relay.restore();
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    loop {
        let res = send(&http, url.clone(), "outage-1", "{}").await;
        let status = res.status();
        if status == 201 {
            assert_eq!(res.headers()["idempotent-replayed"], "true");
            assert_eq!(res.text().await.unwrap(), "written upstream");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{status}: {}",
            res.text().await.unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(state.1.load(Ordering::SeqCst), 1, "forwarded once");
    let ready = http
        .get(format!("{}/_idemkit/ready", proxy.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
}

// Item 4 ---------------------------------------------------------------------

/// The proxy drops an idle upstream connection before a common keep-alive
/// (5 s) would close it under a request being written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_upstream_connections_are_closed_before_common_keep_alives() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    let (closed_tx, mut closed) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            let closed_tx = closed_tx.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let mut seen = Vec::new();
                loop {
                    let n = tcp.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        let _ = closed_tx.send(std::time::Instant::now());
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(4).any(|w| w == b"\r\n\r\n") {
                        seen.clear();
                        let _ = tcp
                            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                            .await;
                    }
                }
            });
        }
    });
    let proxy = ProxyProcess::start(&upstream, &temp_db("idle"), false, None);
    let res = reqwest::get(format!("{}/anything", proxy.base)).await.unwrap();
    assert_eq!(res.text().await.unwrap(), "ok");
    let idle_since = std::time::Instant::now();
    let at = tokio::time::timeout(Duration::from_secs(7), closed.recv())
        .await
        .expect("the proxy closes its idle upstream connection within 7 s")
        .unwrap();
    assert!(
        at - idle_since < Duration::from_millis(4900),
        "{:?}",
        at - idle_since
    );
}

// Item 11 --------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_header_naming_the_credential_or_the_key_is_refused() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("connection"), false, None);
    for (i, named) in ["Authorization", "keep-alive, Idempotency-Key"]
        .iter()
        .enumerate()
    {
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: conn-{i}\r\n\
             Connection: close, {named}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        let (status, text) = raw(&proxy.base, &request).await;
        assert_eq!(status, 400, "{text}");
        assert!(text.contains("\"validation_failed\""), "{text}");
    }
    assert_eq!(naive.posts.load(Ordering::SeqCst), 0, "never forwarded");
}

// Item 13 --------------------------------------------------------------------

#[tokio::test]
async fn startup_errors_redact_the_database_password() {
    let run = crate::idemkit(
        [
            "proxy",
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://127.0.0.1:1",
            "--database-url",
            "postgres://app:s3cret-pw@127.0.0.1:1/db",
            "--scope-secret",
            "s",
        ]
        .map(String::from)
        .to_vec(),
    )
    .await;
    assert_ne!(run.code, 0, "{run:#?}");
    assert!(!run.stderr.contains("s3cret-pw"), "{}", run.stderr);
    assert!(
        run.stderr.contains("postgres://app:***@127.0.0.1:1/db"),
        "{}",
        run.stderr
    );
}

// Item 10 --------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_of_routes_the_upstream_lacks_are_not_stored() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/count", get(count))
            .fallback(not_found)
            .with_state(naive.clone()),
    )
    .await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("404"), false, None);
    let http = reqwest::Client::new();
    for body in [r#"{"a":1}"#, r#"{"a":2}"#] {
        let res = send(&http, format!("{}/nowhere", proxy.base), "nf-1", body).await;
        assert_eq!(res.status(), 404, "{:?}", res.text().await);
        let res = send(&http, format!("{}/count", proxy.base), "na-1", body).await;
        assert_eq!(res.status(), 405, "{:?}", res.text().await);
    }
    assert_eq!(naive.posts.load(Ordering::SeqCst), 2, "each 404 was forwarded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_runs_the_reaper() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let config = write_config(
        "reaper",
        "[defaults]\nreplay_window = \"1s\"\nreap_threshold = \"1s\"\nlease = \"200ms\"\n\n[[routes]]\nmethod = \"POST\"\npath = \"/orders\"\n",
    );
    let db = temp_db("reaper");
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&db),
        "test-secret",
        false,
        None,
        &["--config", &config, "--reap-interval-ms", "200"],
    );
    let http = reqwest::Client::new();
    assert_eq!(
        send(&http, format!("{}/orders", proxy.base), "reap-1", "{}")
            .await
            .status(),
        201
    );
    let list = || {
        crate::idemkit(vec![
            "keys".into(),
            "list".into(),
            "--database-url".into(),
            sqlite(&db),
            "--json".into(),
        ])
    };
    assert!(list().await.stdout.contains("reap-1"), "stored first");
    let deadline = std::time::Instant::now() + Duration::from_secs(6);
    loop {
        let listed = list().await;
        if !listed.stdout.contains("reap-1") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "never reaped: {listed:#?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

// Item 15 --------------------------------------------------------------------

async fn upstream_healthz() -> &'static str {
    "upstream-healthy"
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_is_the_upstreams_and_the_proxy_answers_live_and_ready() {
    let upstream = serve(Router::new().route("/healthz", get(upstream_healthz))).await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("health"), false, None);
    let get = |path: &str| reqwest::get(format!("{}{path}", proxy.base));
    assert_eq!(
        get("/healthz").await.unwrap().text().await.unwrap(),
        "upstream-healthy"
    );
    assert_eq!(get("/_idemkit/live").await.unwrap().status(), 200);
    assert_eq!(get("/_idemkit/ready").await.unwrap().status(), 200);
    assert_eq!(get("/_idemkit/other").await.unwrap().status(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_can_be_served_on_their_own_listener() {
    let upstream = serve(Router::new().route("/healthz", get(upstream_healthz))).await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("metrics-listen")),
        "test-secret",
        false,
        None,
        &["--metrics-listen", "127.0.0.1:0"],
    );
    let line = proxy.lines.recv_timeout(Duration::from_secs(10)).unwrap();
    let metrics = line
        .strip_prefix("idemkit proxy metrics on ")
        .unwrap_or_else(|| panic!("{line}"))
        .to_owned();
    let text = reqwest::get(format!("{metrics}/_idemkit/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("idemkit_requests_total"), "{text}");
    let public = reqwest::get(format!("{}/_idemkit/metrics", proxy.base))
        .await
        .unwrap();
    assert_eq!(public.status(), 404, "not on the public listener");
}

// Item 7 ---------------------------------------------------------------------

async fn slow_write(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    (StatusCode::CREATED, "done")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_forwards_finish_and_store() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(slow_write))
            .with_state(naive.clone()),
    )
    .await;
    let db = temp_db("sigterm");
    let mut proxy = ProxyProcess::start(&upstream, &db, false, None);
    let http = reqwest::Client::new();
    let pending = tokio::spawn({
        let (http, url) = (http.clone(), format!("{}/orders", proxy.base));
        async move { send(&http, url, "term-1", "{}").await }
    });
    while naive.posts.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &proxy.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let answer = pending.await.unwrap();
    assert_eq!(answer.status(), 201);
    assert_eq!(answer.text().await.unwrap(), "done");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = proxy.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running 10 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status:?}");
    let restarted = ProxyProcess::start(&upstream, &db, false, None);
    let replay = send(&http, format!("{}/orders", restarted.base), "term-1", "{}").await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(naive.posts.load(Ordering::SeqCst), 1);
}

// Item 8 ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let upstream = serve(Router::new().route("/healthz", get(upstream_healthz))).await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("slowloris")),
        "test-secret",
        false,
        None,
        &["--header-read-timeout-ms", "300"],
    );
    let mut slow = Vec::new();
    for _ in 0..20 {
        let mut tcp = tokio::net::TcpStream::connect(proxy.base.trim_start_matches("http://"))
            .await
            .unwrap();
        tcp.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        slow.push(tcp);
    }
    for mut tcp in slow {
        let mut out = Vec::new();
        tokio::time::timeout(Duration::from_secs(3), tcp.read_to_end(&mut out))
            .await
            .expect("closed by the proxy within 3 s")
            .ok();
    }
    // An idle keep-alive connection is closed by the same timer.
    let mut idle = tokio::net::TcpStream::connect(proxy.base.trim_start_matches("http://"))
        .await
        .unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), idle.read_to_end(&mut out))
        .await
        .expect("an idle keep-alive connection is closed within 3 s")
        .ok();
    assert!(
        String::from_utf8_lossy(&out).contains("upstream-healthy"),
        "answered first: {out:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_wait() {
    let upstream = serve(Router::new().route("/healthz", get(upstream_healthz))).await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("cap")),
        "test-secret",
        false,
        None,
        &["--max-connections", "1"],
    );
    let held = tokio::net::TcpStream::connect(proxy.base.trim_start_matches("http://"))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    assert!(
        http.get(format!("{}/healthz", proxy.base)).send().await.is_err(),
        "a second connection is not served while the first is open"
    );
    drop(held);
    let http = reqwest::Client::new();
    let res = http.get(format!("{}/healthz", proxy.base)).send().await.unwrap();
    assert_eq!(res.text().await.unwrap(), "upstream-healthy");
}

/// A connection's read buffer is bounded (64 KiB): a request head larger
/// than that is refused `431` before anything reaches the upstream, and one
/// well inside it is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_beyond_the_read_buffer_is_refused_431() {
    let upstream = serve(Router::new().route("/healthz", get(upstream_healthz))).await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("head"), false, None);
    let head = |pad: usize| {
        format!(
            "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: {}\r\nConnection: close\r\n\r\n",
            "p".repeat(pad)
        )
    };
    let (status, text) = raw(&proxy.base, &head(40 << 10)).await;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("upstream-healthy"), "{text}");
    let (status, text) = raw(&proxy.base, &head(70 << 10)).await;
    assert_eq!(status, 431, "{text}");
    assert!(!text.contains("upstream-healthy"), "{text}");
}

// Item 12 --------------------------------------------------------------------

async fn echo_forwarding(headers: HeaderMap) -> String {
    let h = |n: &str| {
        headers
            .get_all(n)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect::<Vec<_>>()
            .join(", ")
    };
    format!(
        "{}|{}|{}",
        h("x-forwarded-for"),
        h("forwarded"),
        h("x-forwarded-host")
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwarding_headers_carry_the_real_client_address() {
    let upstream = serve(Router::new().route("/echo", get(echo_forwarding))).await;
    let send = |base: String| async move {
        reqwest::Client::new()
            .get(format!("{base}/echo"))
            .header("x-forwarded-for", "6.6.6.6")
            .header("forwarded", "for=6.6.6.6")
            .header("x-forwarded-host", "evil.example")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    };
    let untrusting = ProxyProcess::start(&upstream, &temp_db("xff"), false, None);
    let host = untrusting.base.trim_start_matches("http://").to_owned();
    assert_eq!(
        send(untrusting.base.clone()).await,
        format!("127.0.0.1|for=127.0.0.1;host=\"{host}\";proto=http|{host}")
    );
    let trusting = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("xff-trust")),
        "test-secret",
        false,
        None,
        &["--trust-forwarded-headers"],
    );
    let host = trusting.base.trim_start_matches("http://").to_owned();
    assert_eq!(
        send(trusting.base.clone()).await,
        format!("6.6.6.6, 127.0.0.1|for=6.6.6.6, for=127.0.0.1;host=\"{host}\";proto=http|evil.example")
    );
}

// Item 14 --------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_spellings_of_a_keyed_path_are_refused() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .fallback(any(count_everything))
            .with_state(naive.clone()),
    )
    .await;
    let config = write_config(
        "paths",
        "[[routes]]\nmethod = \"POST\"\npath = \"/orders/{id}/confirm\"\n",
    );
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("paths")),
        "test-secret",
        false,
        None,
        &["--config", &config],
    );
    let variants = [
        "/orders/7/confirm/",
        "/orders/7/%63onfirm",
        "/orders//7/confirm",
        "/orders/7/./confirm",
        "/orders/7/confirm;x=1",
        "/Orders/7/confirm",
    ];
    for (i, path) in variants.iter().enumerate() {
        let request = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: path-{i}\r\n\
             Connection: close\r\nContent-Length: 2\r\n\r\n{{}}"
        );
        let (status, text) = raw(&proxy.base, &request).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("\"validation_failed\""), "{path}: {text}");
    }
    assert_eq!(
        naive.posts.load(Ordering::SeqCst),
        0,
        "no spelling reached the upstream"
    );
    let request = "POST /orders/7/confirm HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\n\
                   Idempotency-Key: path-ok\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}";
    for _ in 0..2 {
        assert_eq!(raw(&proxy.base, request).await.0, 201);
    }
    assert_eq!(
        naive.posts.load(Ordering::SeqCst),
        1,
        "the route's own spelling is keyed"
    );
}

// Item 5 ---------------------------------------------------------------------

/// Compresses when asked to (a fake gzip body is enough: it must never be
/// replayed to a caller as if it were the document).
async fn maybe_compressed(headers: HeaderMap) -> axum::response::Response {
    let gzip = headers
        .get("accept-encoding")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("gzip"));
    if gzip {
        (
            [("content-encoding", "gzip"), ("etag", "\"v1\"")],
            vec![0x1f_u8, 0x8b, 8, 0, 0, 0, 0, 0],
        )
            .into_response()
    } else {
        ([("etag", "\"v1\"")], "plain-body").into_response()
    }
}

fn keyed_request(path: &str, key: &str, extra: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: {key}\r\n{extra}\
         Connection: close\r\nContent-Length: 2\r\n\r\n{{}}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_answers_are_stored_uncompressed_and_replay_decodably() {
    let upstream = serve(Router::new().route("/doc", post(maybe_compressed))).await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("gzip"), false, None);
    for i in 0..2 {
        let (status, text) = raw(
            &proxy.base,
            &keyed_request("/doc", "gz-1", "Accept-Encoding: gzip\r\n"),
        )
        .await;
        assert_eq!(status, 200, "{text}");
        assert!(text.ends_with("\r\n\r\nplain-body"), "attempt {i}: {text:?}");
        assert!(!text.to_ascii_lowercase().contains("content-encoding"), "{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_may_replay_more_headers() {
    let upstream = serve(
        Router::new()
            .route("/doc", post(maybe_compressed))
            .route("/plain", post(maybe_compressed)),
    )
    .await;
    let config = write_config(
        "replayed-headers",
        "[[routes]]\nmethod = \"POST\"\npath = \"/doc\"\nreplayed_headers = [\"ETag\"]\n\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/plain\"\n",
    );
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("replayed-headers")),
        "test-secret",
        false,
        None,
        &["--config", &config],
    );
    for (path, etag) in [("/doc", true), ("/plain", false)] {
        let key = format!("rh{}", path.replace('/', "-"));
        raw(&proxy.base, &keyed_request(path, &key, "")).await;
        let (_, replay) = raw(&proxy.base, &keyed_request(path, &key, "")).await;
        let replay = replay.to_ascii_lowercase();
        assert!(replay.contains("idempotent-replayed: true"), "{replay}");
        assert_eq!(replay.contains("etag: \"v1\""), etag, "{path}: {replay}");
    }
    let doc = crate::idemkit(vec!["docs".into(), "--proxy".into(), "--config".into(), config]).await;
    assert!(doc.stdout.contains("`etag` on `POST /doc`"), "{}", doc.stdout);
    assert!(
        doc.stdout.contains("`Accept-Encoding: identity`"),
        "{}",
        doc.stdout
    );
}

// Item 9 ---------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_bodies_beyond_the_in_flight_budget_are_answered_503() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(slow_write))
            .with_state(naive.clone()),
    )
    .await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("budget")),
        "test-secret",
        false,
        None,
        &["--max-inflight-body-bytes", "1000000"],
    );
    let http = reqwest::Client::new();
    let body = format!(r#"{{"pad":"{}"}}"#, "x".repeat(600_000));
    let first = tokio::spawn({
        let (http, url, body) = (http.clone(), format!("{}/orders", proxy.base), body.clone());
        async move { send(&http, url, "budget-1", &body).await.status() }
    });
    while naive.posts.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let over = send(&http, format!("{}/orders", proxy.base), "budget-2", &body).await;
    assert_eq!(over.status(), 503);
    assert!(over.headers().contains_key("retry-after"));
    assert_eq!(first.await.unwrap(), 201);
    let after = send(&http, format!("{}/orders", proxy.base), "budget-3", &body).await;
    assert_eq!(after.status(), 201, "the budget is given back");
    assert_eq!(naive.posts.load(Ordering::SeqCst), 2);
}

// Item 16 --------------------------------------------------------------------

async fn hang() -> &'static str {
    tokio::time::sleep(Duration::from_secs(5)).await;
    "late"
}

async fn version(req: axum::extract::Request) -> String {
    format!("{:?}", req.version())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pass_through_request_has_a_timeout() {
    let upstream = serve(Router::new().route("/hang", get(hang))).await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("passthrough-timeout")),
        "test-secret",
        false,
        None,
        &["--passthrough-timeout-ms", "300"],
    );
    let started = std::time::Instant::now();
    let res = reqwest::get(format!("{}/hang", proxy.base)).await.unwrap();
    assert_eq!(res.status(), 504);
    assert!(started.elapsed() < Duration::from_secs(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_may_speak_http2() {
    let upstream = serve(Router::new().route("/version", get(version))).await;
    let proxy = ProxyProcess::start_with(
        &upstream,
        &sqlite(&temp_db("h2")),
        "test-secret",
        false,
        None,
        &["--upstream-http2"],
    );
    let body = reqwest::get(format!("{}/version", proxy.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(body, "HTTP/2.0");
}

/// A WebSocket handshake on an unkeyed route switches protocols end to end:
/// bytes flow both ways through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_websocket_upgrade_passes_through() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if tcp.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).to_ascii_lowercase();
                if !head.contains("upgrade: websocket") {
                    let _ = tcp
                        .write_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
                        .await;
                    return;
                }
                let _ = tcp
                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
                    .await;
                let mut buf = [0u8; 64];
                while let Ok(n) = tcp.read(&mut buf).await {
                    if n == 0 || tcp.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    let proxy = ProxyProcess::start(&upstream, &temp_db("ws"), false, None);
    let mut tcp = tokio::net::TcpStream::connect(proxy.base.trim_start_matches("http://"))
        .await
        .unwrap();
    tcp.write_all(b"GET /ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), tcp.read(&mut byte))
            .await
            .expect("a handshake answer")
            .unwrap();
        assert_ne!(n, 0, "closed: {}", String::from_utf8_lossy(&head));
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).into_owned();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    tcp.write_all(b"ping").await.unwrap();
    let mut echo = [0u8; 4];
    tokio::time::timeout(Duration::from_secs(5), tcp.read_exact(&mut echo))
        .await
        .expect("the echo comes back through the proxy")
        .unwrap();
    assert_eq!(&echo, b"ping");
}

// Item 6 ---------------------------------------------------------------------

/// Three server-sent events, 300 ms apart.
async fn events() -> impl IntoResponse {
    use futures::StreamExt;
    let chunks = futures::stream::iter(1..=3).then(|i| async move {
        if i > 1 {
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        Ok::<_, std::io::Error>(format!("data: {i}\n\n"))
    });
    (
        [("content-type", "text/event-stream")],
        axum::body::Body::from_stream(chunks),
    )
}

/// A keyed stream reaches the caller as it is produced (not buffered to its
/// end), and the retry replays all of it, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_event_stream_streams_and_replays_whole() {
    let upstream = serve(Router::new().route("/events", post(events))).await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("sse"), false, None);
    let http = reqwest::Client::new();
    let started = std::time::Instant::now();
    let mut res = send(&http, format!("{}/events", proxy.base), "sse-1", "{}").await;
    assert_eq!(res.status(), 200);
    let first = res.chunk().await.unwrap().unwrap();
    let first_at = started.elapsed();
    assert_eq!(&first[..], b"data: 1\n\n");
    assert!(
        first_at < Duration::from_millis(450),
        "the first event came after {first_at:?}"
    );
    let mut all = first.to_vec();
    while let Some(c) = res.chunk().await.unwrap() {
        all.extend_from_slice(&c);
    }
    assert_eq!(all, b"data: 1\n\ndata: 2\n\ndata: 3\n\n");
    // The record is stored once the stream has ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let replay = loop {
        let res = send(&http, format!("{}/events", proxy.base), "sse-1", "{}").await;
        if res.status() != 409 {
            break res;
        }
        assert!(std::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(replay.status(), 200);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.headers()["content-type"], "text/event-stream");
    assert_eq!(
        &replay.bytes().await.unwrap()[..],
        b"data: 1\n\ndata: 2\n\ndata: 3\n\n"
    );
}

// Issue 32 item 17 -----------------------------------------------------------

/// The proxy on Redis keeps its records under the URL's `?prefix=`, so
/// `idemkit keys list` with the proxy's own URL lists them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxy_on_redis_uses_the_urls_prefix_as_idemkit_keys_does() {
    let Some(redis) = crate::labels::redis_url() else {
        return;
    };
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .with_state(naive.clone()),
    )
    .await;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let url = format!(
        "{}?prefix=proxy-prefix-{}-{nanos}",
        redis.trim_end_matches('/'),
        std::process::id()
    );
    let proxy = ProxyProcess::start_with(&upstream, &url, "test-secret", false, None, &[]);
    let http = reqwest::Client::new();
    // A key of this run only (a run of the code before the fix left its own
    // under the default prefix).
    let key = format!("prefixed-{nanos}");
    let res = send(&http, format!("{}/orders", proxy.base), &key, "{}").await;
    assert_eq!(res.status(), 201);
    let listed = crate::idemkit(vec![
        "keys".into(),
        "list".into(),
        "--database-url".into(),
        url.clone(),
        "--json".into(),
    ])
    .await;
    assert_eq!(listed.code, 0, "{listed:#?}");
    assert!(
        listed.stdout.contains(&key),
        "idemkit keys list with the proxy's URL does not list its record: {listed:#?}"
    );
    // Not under the default prefix.
    let default = crate::idemkit(vec![
        "keys".into(),
        "list".into(),
        "--database-url".into(),
        redis.clone(),
        "--json".into(),
    ])
    .await;
    assert!(!default.stdout.contains(&key), "{default:#?}");
}

// Item 5: compression on the way out ------------------------------------------

/// A JSON document long enough to be worth compressing.
fn document() -> String {
    format!(
        r#"{{"items":[{}]}}"#,
        vec![r#"{"sku":"A-1","quantity":2}"#; 64].join(",")
    )
}

async fn counted_document(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        document(),
    )
}

/// One keyed POST with `accept` as its `Accept-Encoding` (none: `identity`
/// only): the status, the `Content-Encoding`, whether it is a replay, and the
/// body decoded by that coding.
async fn post_accepting(base: &str, key: &str, accept: Option<&str>) -> (u16, Option<String>, bool, String) {
    use std::io::Read;
    let http = reqwest::Client::new();
    let mut req = http
        .post(format!("{base}/doc"))
        .header("authorization", "Bearer a")
        .header("idempotency-key", key)
        .body("{}");
    req = req.header("accept-encoding", accept.unwrap_or("identity"));
    let res = req.send().await.unwrap();
    let status = res.status().as_u16();
    let coding = res
        .headers()
        .get("content-encoding")
        .map(|v| v.to_str().unwrap().to_owned());
    let replayed = res.headers().contains_key("idempotent-replayed");
    let raw = res.bytes().await.unwrap();
    let text = match coding.as_deref() {
        Some("gzip") => {
            let mut out = String::new();
            flate2::read::GzDecoder::new(&raw[..])
                .read_to_string(&mut out)
                .expect("a gzip body that decodes");
            out
        }
        None => String::from_utf8(raw.to_vec()).unwrap(),
        Some(other) => panic!("an unexpected coding {other}"),
    };
    (status, coding, replayed, text)
}

/// The upstream gzips when asked (tower-http's compression, as real services
/// do). The proxy asks it for identity, stores identity bytes and compresses
/// each answer, first or replayed, as its own caller asks: a gzip-accepting
/// caller gets gzip that decodes, an identity-only caller plain bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_are_compressed_per_caller_first_and_replayed_alike() {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/doc", post(counted_document))
            .layer(tower_http::compression::CompressionLayer::new())
            .with_state(naive.clone()),
    )
    .await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("compress-out"), false, None);
    let doc = document();
    // First answer to a gzip caller, then a replay to it and to an identity-only caller.
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "cz-1", Some("gzip")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), false));
    assert_eq!(text, doc);
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "cz-1", Some("gzip, br;q=0.5")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), true));
    assert_eq!(text, doc);
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "cz-1", None).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, None, true));
    assert_eq!(text, doc);
    // First answer to an identity-only caller, replayed to a gzip caller.
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "cz-2", None).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, None, false));
    assert_eq!(text, doc);
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "cz-2", Some("gzip")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), true));
    assert_eq!(text, doc);
    assert_eq!(naive.posts.load(Ordering::SeqCst), 2, "each key ran once");
}

// Item 16: https:// upstreams ----------------------------------------------

/// An upstream over TLS with a self-signed certificate made here (`rcgen`),
/// offering HTTP/2 and HTTP/1.1 by ALPN: its base URL and the PEM of its
/// certificate (the CA to trust).
async fn tls_upstream(app: Router) -> (String, String) {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::service::TowerToHyperService;
    let certified = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
    let pem = certified.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(certified.signing_key.serialize_der().into());
    let mut config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![certified.cert.der().clone()], key)
            .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), TowerToHyperService::new(app))
                    .await;
            });
        }
    });
    (format!("https://localhost:{port}"), pem)
}

/// An `https://` upstream: verified against `--upstream-ca` (a self-signed
/// one is refused without it, and nothing is forwarded), over HTTP/1.1, or
/// HTTP/2 by ALPN with `--upstream-http2`; keyed and replayed as over HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_upstream_is_verified_against_the_given_ca() {
    let naive = Arc::new(Naive::default());
    let app = Router::new()
        .route("/version", get(version))
        .route("/orders", post(create))
        .with_state(naive.clone());
    let (upstream, pem) = tls_upstream(app).await;
    let ca = std::env::temp_dir().join(format!("idemkit-proxy-prod-ca-{}.pem", std::process::id()));
    std::fs::write(&ca, pem).unwrap();
    let ca = ca.display().to_string();
    let http = reqwest::Client::new();

    let untrusting = ProxyProcess::start(&upstream, &temp_db("tls-untrusted"), false, None);
    let res = http
        .get(format!("{}/version", untrusting.base))
        .send()
        .await
        .unwrap();
    assert_eq!(res.status(), 502, "a certificate no trusted CA signed is refused");
    let res = send(&http, format!("{}/orders", untrusting.base), "tls-0", "{}").await;
    assert_eq!(res.status(), 502);
    assert_eq!(naive.posts.load(Ordering::SeqCst), 0);

    for (h2, tag, expected) in [(false, "tls-h1", "HTTP/1.1"), (true, "tls-h2", "HTTP/2.0")] {
        let mut extra = vec!["--upstream-ca", ca.as_str()];
        if h2 {
            extra.push("--upstream-http2");
        }
        let proxy = ProxyProcess::start_with(
            &upstream,
            &sqlite(&temp_db(tag)),
            "test-secret",
            false,
            None,
            &extra,
        );
        let version = http
            .get(format!("{}/version", proxy.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert_eq!(version, expected);
        let first = send(&http, format!("{}/orders", proxy.base), tag, "{}").await;
        assert_eq!(first.status(), 201);
        let replay = send(&http, format!("{}/orders", proxy.base), tag, "{}").await;
        assert_eq!(replay.status(), 201);
        assert!(replay.headers().contains_key("idempotent-replayed"));
    }
    assert_eq!(
        naive.posts.load(Ordering::SeqCst),
        2,
        "one upstream write per key"
    );
    let refused = crate::idemkit(vec![
        "proxy".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--upstream".into(),
        "http://127.0.0.1:1".into(),
        "--upstream-ca".into(),
        ca,
        "--scope-secret".into(),
        "s".into(),
    ])
    .await;
    assert_ne!(refused.code, 0);
    assert!(
        refused
            .stderr
            .contains("--upstream-ca is for an https:// upstream"),
        "{refused:#?}"
    );
}

/// Gzips whatever the request asked for (an upstream that ignores
/// `Accept-Encoding: identity`).
async fn always_gzip() -> impl IntoResponse {
    use std::io::Write;
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(document().as_bytes()).unwrap();
    (
        StatusCode::CREATED,
        [("content-type", "application/json"), ("content-encoding", "gzip")],
        gz.finish().unwrap(),
    )
}

/// An answer the upstream compressed anyway is stored with its coding and
/// negotiated by the engine's replay rule, first answer and replays alike: a
/// caller accepting gzip decodes it, an identity-only caller gets `406
/// idempotency_replay_not_acceptable` and nothing runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_compressed_anyway_is_negotiated_like_a_replay() {
    let upstream = serve(Router::new().route("/doc", post(always_gzip))).await;
    let proxy = ProxyProcess::start(&upstream, &temp_db("gzip-anyway"), false, None);
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "ga-1", Some("gzip")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), false));
    assert_eq!(text, document());
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "ga-1", Some("gzip")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), true));
    assert_eq!(text, document());
    let (status, coding, _, text) = post_accepting(&proxy.base, "ga-1", None).await;
    assert_eq!((status, coding), (406, None), "{text}");
    assert!(text.contains("idempotency_replay_not_acceptable"), "{text}");
    let (status, _, _, text) = post_accepting(&proxy.base, "ga-2", None).await;
    assert_eq!(
        status, 406,
        "the first answer is negotiated as a replay is: {text}"
    );
    let (status, coding, replayed, text) = post_accepting(&proxy.base, "ga-2", Some("gzip")).await;
    assert_eq!((status, coding.as_deref(), replayed), (201, Some("gzip"), true));
    assert_eq!(text, document());
}
