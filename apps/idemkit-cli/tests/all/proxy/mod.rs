//! `idemkit proxy` in front of a deliberately naive upstream: it counts POSTs,
//! ignores idempotency keys and duplicates every retried write. The proxy runs
//! in-process on a private SQLite file.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use idemkit_proxy::{ProxyOptions, SqliteSync, router};
use serde_json::Value;

mod processes;
mod production;

#[derive(Default)]
struct Naive {
    posts: AtomicU64,
    keys: std::sync::Mutex<Vec<String>>,
    /// Holds `/lag`'s answer until the test lets it go.
    gate: tokio::sync::Notify,
}

async fn create(State(n): State<Arc<Naive>>, headers: HeaderMap, body: String) -> impl IntoResponse {
    let id = n.posts.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(k) = headers.get("idempotency-key") {
        n.keys.lock().unwrap().push(k.to_str().unwrap().to_owned());
    }
    (
        StatusCode::CREATED,
        [
            ("content-type", "application/json"),
            ("set-cookie", "session=secret"),
            ("location", "/orders/1"),
        ],
        format!(r#"{{"id":{id},"echo":{body}}}"#),
    )
}

async fn slow(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(800)).await;
    (StatusCode::CREATED, "late")
}

/// An answer held until the test opens `Naive::gate`.
async fn lag(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    n.gate.notified().await;
    (StatusCode::CREATED, "lagged")
}

/// An answer over the default storage cap (1 MiB).
async fn big(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (StatusCode::CREATED, "x".repeat((1 << 20) + 1))
}

async fn invalid(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (StatusCode::UNPROCESSABLE_ENTITY, "no")
}

/// A `201` whose body stalls after its first chunk, past the proxy's
/// upstream timeout (300 ms in these tests).
async fn stall(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    use futures::StreamExt;
    let chunks =
        futures::stream::iter([Ok::<_, std::io::Error>("{\"id\":")]).chain(futures::stream::once(async {
            tokio::time::sleep(Duration::from_millis(800)).await;
            Ok("1}")
        }));
    (StatusCode::CREATED, axum::body::Body::from_stream(chunks))
}

/// A `201` whose body fails part-way (the connection is cut mid-body).
async fn cut(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    let chunks = futures::stream::iter([
        Ok("{\"id\":"),
        Err(std::io::Error::other("the upstream fell over")),
    ]);
    (StatusCode::CREATED, axum::body::Body::from_stream(chunks))
}

/// A gateway's `504`: the service behind it may have run the request.
async fn gateway(State(n): State<Arc<Naive>>) -> impl IntoResponse {
    n.posts.fetch_add(1, Ordering::SeqCst);
    (StatusCode::GATEWAY_TIMEOUT, "upstream timed out")
}

async fn count(State(n): State<Arc<Naive>>, uri: axum::http::Uri) -> String {
    format!("{} {}", n.posts.load(Ordering::SeqCst), uri.query().unwrap_or(""))
}

/// The checker's shape of the naive upstream: `POST /orders` (slow enough for
/// duplicates to overlap) and a per-credential `GET /orders/count`.
#[derive(Default)]
struct Orders {
    by_account: std::sync::Mutex<std::collections::HashMap<String, u64>>,
}

fn credential(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default()
}

async fn order(State(o): State<Arc<Orders>>, headers: HeaderMap, body: String) -> impl IntoResponse {
    let n = {
        let mut map = o.by_account.lock().unwrap();
        let n = map.entry(credential(&headers)).or_default();
        *n += 1;
        *n
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    (
        StatusCode::CREATED,
        [("content-type", "application/json"), ("location", "/orders/x")],
        format!(r#"{{"n":{n},"order":{body}}}"#),
    )
}

async fn order_count(State(o): State<Arc<Orders>>, headers: HeaderMap) -> String {
    let n = o
        .by_account
        .lock()
        .unwrap()
        .get(&credential(&headers))
        .copied()
        .unwrap_or(0);
    format!(r#"{{"count":{n}}}"#)
}

async fn serve(app: Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

struct Setup {
    naive: Arc<Naive>,
    proxy: String,
    http: reqwest::Client,
}

async fn setup(name: &str, honours_keys: bool) -> Setup {
    setup_with(name, honours_keys, None).await
}

/// [`setup`], with `config` (TOML) as the proxy's `--config` file.
async fn setup_with(name: &str, honours_keys: bool, config: Option<&str>) -> Setup {
    setup_timed(name, honours_keys, config, 300).await
}

/// [`setup_with`], with the proxy's upstream timeout.
async fn setup_timed(
    name: &str,
    honours_keys: bool,
    config: Option<&str>,
    upstream_timeout_ms: u64,
) -> Setup {
    let naive = Arc::new(Naive::default());
    let upstream = serve(
        Router::new()
            .route("/orders", post(create))
            .route("/orders/{id}/confirm", post(create))
            .route("/stall", post(stall))
            .route("/cut", post(cut))
            .route("/gateway", post(gateway))
            .route("/slow", post(slow))
            .route("/lag", post(lag))
            .route("/invalid", post(invalid))
            .route("/big", post(big))
            .route("/count", get(count))
            .with_state(naive.clone()),
    )
    .await;
    let db = std::env::temp_dir().join(format!("idemkit-proxy-{name}-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&db);
    let config = config.map(|toml| {
        let path = db.with_extension("toml");
        std::fs::write(&path, toml).unwrap();
        path
    });
    let mut args = ProxyOptions::new(&upstream, &format!("sqlite://{}", db.display()), "test-secret");
    args.config = config;
    args.upstream_honours_keys = honours_keys;
    args.upstream_timeout_ms = upstream_timeout_ms;
    args.sqlite_synchronous = SqliteSync::Claims;
    let app = router(args).await.unwrap();
    Setup {
        naive,
        proxy: serve(app).await,
        http: reqwest::Client::new(),
    }
}

impl Setup {
    async fn post(&self, path: &str, key: Option<&str>, auth: Option<&str>, body: &str) -> reqwest::Response {
        let mut req = self
            .http
            .post(format!("{}{path}", self.proxy))
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = key {
            req = req.header("Idempotency-Key", k);
        }
        if let Some(a) = auth {
            req = req.header("Authorization", a);
        }
        req.send().await.unwrap()
    }

    fn posts(&self) -> u64 {
        self.naive.posts.load(Ordering::SeqCst)
    }

    /// Sends `POST path` with `key` `times` times: every answer is the parked
    /// problem, and the upstream saw the request once.
    async fn parked_every_time(&self, path: &str, key: &str, times: usize) {
        for _ in 0..times {
            assert_eq!(
                code(self.post(path, Some(key), Some("Bearer a"), "{}").await).await,
                (409, "idempotency_request_parked".into())
            );
        }
        assert_eq!(self.posts(), 1, "never forwarded twice");
    }
}

async fn code(res: reqwest::Response) -> (u16, String) {
    let status = res.status().as_u16();
    let doc: Value = res.json().await.unwrap();
    (status, doc["code"].as_str().unwrap().to_owned())
}

#[tokio::test]
async fn a_retried_post_reaches_the_upstream_once_and_replays_byte_identically() {
    let s = setup("retry", false).await;
    let first = s
        .post("/orders", Some("k-1"), Some("Bearer a"), r#"{"sku":"A"}"#)
        .await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    assert_eq!(first.headers()["set-cookie"], "session=secret");
    let body = first.bytes().await.unwrap();
    for _ in 0..3 {
        let again = s
            .post("/orders", Some("k-1"), Some("Bearer a"), r#"{"sku":"A"}"#)
            .await;
        assert_eq!(again.status(), 201);
        assert_eq!(again.headers()["idempotent-replayed"], "true");
        assert_eq!(again.headers()["location"], "/orders/1");
        assert!(
            again.headers().get("set-cookie").is_none(),
            "Set-Cookie is never stored"
        );
        assert_eq!(again.bytes().await.unwrap(), body);
    }
    assert_eq!(s.posts(), 1);
    // The same key under another credential is another request.
    let other = s
        .post("/orders", Some("k-1"), Some("Bearer b"), r#"{"sku":"A"}"#)
        .await;
    assert_eq!(other.status(), 201);
    assert!(other.headers().get("idempotent-replayed").is_none());
    assert_eq!(s.posts(), 2);
    // The upstream got the caller's own key.
    assert_eq!(*s.naive.keys.lock().unwrap(), ["k-1", "k-1"]);
}

#[tokio::test]
async fn twenty_concurrent_duplicates_make_one_upstream_call() {
    let s = Arc::new(setup("storm", false).await);
    let answers = futures::future::join_all((0..20).map(|_| {
        let s = s.clone();
        async move {
            let res = s
                .post("/orders", Some("storm"), Some("Bearer a"), r#"{"sku":"S"}"#)
                .await;
            (res.status().as_u16(), res.bytes().await.unwrap())
        }
    }))
    .await;
    assert_eq!(s.posts(), 1, "{answers:?}");
    let winner = answers
        .iter()
        .find(|(st, _)| *st == 201)
        .expect("one 201")
        .1
        .clone();
    for (status, body) in &answers {
        match status {
            201 => assert_eq!(body, &winner),
            409 => assert!(String::from_utf8_lossy(body).contains("idempotency_request_in_progress")),
            other => panic!("unexpected {other}: {body:?}"),
        }
    }
}

#[tokio::test]
async fn refusals_never_reach_the_upstream() {
    let s = setup("refusals", false).await;
    assert_eq!(
        s.post("/orders", Some("k"), Some("Bearer a"), r#"{"sku":"A"}"#)
            .await
            .status(),
        201
    );
    // Same key, another body: a client bug.
    assert_eq!(
        code(
            s.post("/orders", Some("k"), Some("Bearer a"), r#"{"sku":"B"}"#)
                .await
        )
        .await,
        (409, "idempotency_key_reused".into())
    );
    // No credential, an empty one, or two: 401 from the proxy.
    assert_eq!(
        code(s.post("/orders", Some("k2"), None, "{}").await).await,
        (401, "unauthorized".into())
    );
    assert_eq!(
        code(s.post("/orders", Some("k2"), Some(" "), "{}").await).await,
        (401, "unauthorized".into())
    );
    let two = s
        .http
        .post(format!("{}/orders", s.proxy))
        .header("Idempotency-Key", "k2")
        .header("Authorization", "Bearer victim")
        .header("Authorization", "Bearer mallory")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(code(two).await, (401, "unauthorized".into()));
    // No key, a bad key.
    assert_eq!(
        code(s.post("/orders", None, Some("Bearer a"), "{}").await).await,
        (400, "idempotency_key_missing".into())
    );
    assert_eq!(
        code(s.post("/orders", Some("bad key"), Some("Bearer a"), "{}").await).await,
        (400, "idempotency_key_invalid".into())
    );
    // A body over --max-request-body (1 MiB here): 413, nothing claimed.
    let huge = format!(r#"{{"pad":"{}"}}"#, "x".repeat((1 << 20) + 1));
    assert_eq!(
        code(s.post("/orders", Some("huge"), Some("Bearer a"), &huge).await).await,
        (413, "payload_too_large".into())
    );
    assert_eq!(
        s.post("/orders", Some("huge"), Some("Bearer a"), r#"{"sku":"small"}"#)
            .await
            .status(),
        201,
        "the key was never claimed"
    );
    assert_eq!(s.posts(), 2);
}

#[tokio::test]
async fn safe_methods_pass_through_and_liveness_answers() {
    let s = setup("passthrough", false).await;
    let res = s.http.get(format!("{}/count?x=1", s.proxy)).send().await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(res.text().await.unwrap(), "0 x=1");
    let live = s
        .http
        .get(format!("{}/_idemkit/live", s.proxy))
        .send()
        .await
        .unwrap();
    assert_eq!(live.status(), 200);
}

/// A caller that hangs up while the upstream works does not orphan its
/// request: the claim, the forward and the store go on without it, so its
/// retry replays the upstream's answer. (Cancelled with the caller, the proxy
/// would leave an intent nobody holds: "in progress" until the lease ran out,
/// then parked.)
#[tokio::test]
async fn a_caller_that_hangs_up_mid_request_gets_the_answer_on_retry() {
    let s = Arc::new(setup_timed("hangup", false, None, 10_000).await);
    let send = |s: &Setup| {
        s.http
            .post(format!("{}/lag", s.proxy))
            .header("content-type", "application/json")
            .header("Idempotency-Key", "hangup")
            .header("Authorization", "Bearer a")
            .body("{}")
            .send()
    };
    let caller = tokio::spawn({
        let s = s.clone();
        async move { send(&s).await }
    });
    // The request has reached the upstream, which holds its answer: the
    // caller hangs up, and the proxy is given time to notice.
    while s.posts() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    caller.abort();
    assert!(caller.await.unwrap_err().is_cancelled());
    tokio::time::sleep(Duration::from_millis(100)).await;
    s.naive.gate.notify_one();
    // The retry finds the request in progress until the proxy has stored the
    // upstream's answer; then it replays.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let replay = loop {
        let res = send(&s).await.unwrap();
        if res.status() != 409 {
            break res;
        }
        assert_eq!(code(res).await.1, "idempotency_request_in_progress");
        assert!(
            std::time::Instant::now() < deadline,
            "still in progress after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    };
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "lagged");
    assert_eq!(s.posts(), 1, "forwarded once");
}

#[tokio::test]
async fn a_validation_answer_frees_the_key() {
    let s = setup("invalid", false).await;
    for _ in 0..2 {
        let res = s.post("/invalid", Some("v"), Some("Bearer a"), "{}").await;
        assert_eq!(res.status(), 422);
        assert!(res.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(s.posts(), 2, "a released answer is forwarded again");
    // The key is free: the corrected request under it is a first attempt,
    // forwarded once and then replayed.
    let corrected = || s.post("/orders", Some("v"), Some("Bearer a"), r#"{"sku":"fixed"}"#);
    let first = corrected().await;
    assert_eq!(first.status(), 201);
    assert!(first.headers().get("idempotent-replayed").is_none());
    let first = first.bytes().await.unwrap();
    assert_eq!(s.posts(), 3);
    let again = corrected().await;
    assert_eq!(again.status(), 201);
    assert_eq!(
        again
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap()),
        Some("true")
    );
    assert_eq!(again.bytes().await.unwrap(), first);
    assert_eq!(s.posts(), 3, "the replay did not reach the upstream");
}

#[tokio::test]
async fn an_answer_over_the_storage_cap_is_refused_and_never_forwarded_again() {
    let s = setup("big", false).await;
    for _ in 0..2 {
        assert_eq!(
            code(s.post("/big", Some("b"), Some("Bearer a"), "{}").await).await,
            (500, "idempotency_response_too_large".into())
        );
    }
    assert_eq!(
        s.posts(),
        1,
        "the upstream acted once; the key answers the problem"
    );
}

#[tokio::test]
async fn an_unknown_outcome_is_parked_for_a_key_ignoring_upstream() {
    let s = setup("parked", false).await;
    s.parked_every_time("/slow", "p", 3).await;
}

/// A key-honouring upstream that answers after the timeout: the caller gets
/// `504`, the proxy keeps the lease and waits out the grace period, so the
/// retry meanwhile is "in progress" (never re-sent into the upstream's own
/// in-progress) and the late answer is stored and replayed.
#[tokio::test]
async fn a_late_answer_of_a_key_honouring_upstream_is_awaited_and_replayed() {
    let s = setup("honours", true).await;
    let first = s.post("/slow", Some("h"), Some("Bearer a"), "{}").await;
    assert_eq!(first.status(), 504);
    assert_eq!(s.posts(), 1);
    let again = s.post("/slow", Some("h"), Some("Bearer a"), "{}").await;
    assert_eq!(code(again).await, (409, "idempotency_request_in_progress".into()));
    tokio::time::sleep(Duration::from_millis(900)).await;
    let replay = s.post("/slow", Some("h"), Some("Bearer a"), "{}").await;
    assert_eq!(replay.status(), 201);
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(replay.text().await.unwrap(), "late");
    assert_eq!(s.posts(), 1, "never re-sent while the first ran");
}

/// The timeout covers an answer's body too: a `201` whose body stalls past it
/// is an unknown outcome (parked, never forwarded again), not a caller held
/// for as long as the upstream stalls.
#[tokio::test]
async fn an_answer_whose_body_stalls_is_an_unknown_outcome() {
    let s = setup("stall", false).await;
    s.parked_every_time("/stall", "st", 2).await;
}

/// A connection cut part-way through an answer to be stored: the upstream
/// acted, so the request is parked (a key-ignoring upstream) or re-sent with
/// the same key (a key-honouring one), never answered as retryable and freed.
#[tokio::test]
async fn an_answer_cut_part_way_is_an_unknown_outcome() {
    let s = setup("cut", false).await;
    s.parked_every_time("/cut", "c", 2).await;
    let h = setup("cut-honours", true).await;
    let res = h.post("/cut", Some("c"), Some("Bearer a"), "{}").await;
    assert_eq!(res.status(), 502);
    assert!(res.headers().contains_key("retry-after"));
    assert_eq!(
        h.post("/cut", Some("c"), Some("Bearer a"), "{}").await.status(),
        502
    );
    assert_eq!(h.posts(), 2, "re-sent with the same key");
}

/// A `502` or `504` the policy does not store is a gateway's answer: the
/// service behind it may have run the request, so the key is not freed for a
/// second forward (it is under `retry` for a `500` or `503`).
#[tokio::test]
async fn a_gateway_answer_is_an_unknown_outcome() {
    let s = setup("gateway", false).await;
    s.parked_every_time("/gateway", "g", 2).await;
}

/// `--config` routes are templates, as the service writes them; a configured
/// safe method is never keyed.
#[tokio::test]
async fn configured_routes_match_path_templates_and_skip_safe_methods() {
    let s = setup_with(
        "templates",
        false,
        Some(
            "[[routes]]\nmethod = \"POST\"\npath = \"/orders/{id}/confirm\"\n\
             [[routes]]\nmethod = \"GET\"\npath = \"/count\"\n",
        ),
    )
    .await;
    for _ in 0..2 {
        let res = s
            .post("/orders/7/confirm", Some("t"), Some("Bearer a"), "{}")
            .await;
        assert_eq!(res.status(), 201);
    }
    assert_eq!(s.posts(), 1, "the template keyed the route");
    let replay = s
        .post("/orders/8/confirm", Some("t"), Some("Bearer a"), "{}")
        .await;
    assert_eq!(
        code(replay).await,
        (409, "idempotency_key_reused".into()),
        "another path is another request under the key"
    );
    // Not a configured route: passed through, not keyed.
    assert_eq!(s.post("/orders", Some("t"), None, "{}").await.status(), 201);
    assert_eq!(s.posts(), 2);
    // A keyed GET would need the credential; a safe method passes through.
    let res = s.http.get(format!("{}/count", s.proxy)).send().await.unwrap();
    assert_eq!(res.status(), 200);
}

/// The issue's acceptance over real processes (the checker is the real binary):
/// the naive upstream fails the gates alone and passes all 7 behind the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemkit_check_passes_every_gate_through_the_proxy_and_fails_without_it() {
    let upstream = serve(
        Router::new()
            .route("/orders", post(order))
            .route("/orders/count", get(order_count))
            .with_state(Arc::new(Orders::default())),
    )
    .await;
    let naked = crate::idemkit(crate::check_args(&upstream, &["--json"])).await;
    assert_eq!(naked.code, 1, "negative control: {naked:#?}");
    assert!(
        naked
            .verdicts()
            .iter()
            .any(|(g, v)| g == "concurrency" && v == "fail"),
        "{naked:#?}"
    );
    let db = std::env::temp_dir().join(format!("idemkit-proxy-check-{}.db", std::process::id()));
    let _ = std::fs::remove_file(&db);
    let mut args = ProxyOptions::new(&upstream, &format!("sqlite://{}", db.display()), "test-secret");
    args.upstream_timeout_ms = 10_000;
    let app = router(args).await.unwrap();
    let proxy = serve(app).await;
    let run = crate::idemkit(crate::check_args(&proxy, &["--json"])).await;
    let verdicts = run.verdicts();
    assert_eq!(verdicts.len(), 7, "{run:#?}");
    assert!(verdicts.iter().all(|(_, v)| v == "pass"), "{run:#?}");
    assert_eq!(run.code, 0, "{run:#?}");
}
