//! Metrics and tracing, observed: each test records into its own
//! `DebuggingRecorder` (or tracing subscriber) installed for the test's thread
//! only, and runs server and client on a current-thread runtime on that thread,
//! so parallel tests cannot see each other's numbers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::{KeyStore, Policy};
use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
use idemkit_testkit::{ManualClock, MemoryStore};
use idemkit_tower::metrics::{self as m, op, outcome};
use idemkit_tower::{Completer, Reaper};
use metrics_util::CompositeKey;
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
use serde_json::json;

use super::{Runs, generic, memory, send, serve};

/// One snapshot of a `DebuggingRecorder`. Taking a snapshot drains the
/// recorder (counters and gauges restart from zero), so each is read once.
struct Seen(Vec<(CompositeKey, DebugValue)>);

impl Seen {
    fn take(snapshotter: &Snapshotter) -> Self {
        Self(
            snapshotter
                .snapshot()
                .into_vec()
                .into_iter()
                .map(|(key, _, _, value)| (key, value))
                .collect(),
        )
    }
}

/// Runs `test` on a current-thread runtime with a fresh recorder installed for
/// this thread, and returns what it recorded.
fn recorded(test: impl AsyncFnOnce()) -> Seen {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(test()));
    Seen::take(&snapshotter)
}

/// The values of every series named `name` whose labels include `labels`.
fn values<'a>(snap: &'a Seen, name: &str, labels: &[(&str, &str)]) -> Vec<&'a DebugValue> {
    snap.0
        .iter()
        .filter(|(key, _)| {
            let key = key.key();
            key.name() == name
                && labels
                    .iter()
                    .all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v))
        })
        .map(|(_, value)| value)
        .collect()
}

fn counter(snap: &Seen, name: &str, labels: &[(&str, &str)]) -> u64 {
    values(snap, name, labels)
        .into_iter()
        .map(|v| match v {
            DebugValue::Counter(n) => *n,
            other => panic!("{name} is not a counter: {other:?}"),
        })
        .sum()
}

fn gauge(snap: &Seen, name: &str) -> Option<f64> {
    values(snap, name, &[]).into_iter().find_map(|v| match v {
        DebugValue::Gauge(g) => Some(g.into_inner()),
        _ => None,
    })
}

fn requests(snap: &Seen, o: &str) -> u64 {
    counter(snap, m::REQUESTS, &[("outcome", o)])
}

/// A route that answers `201 run N`; a body containing `slow` waits for `gate`.
fn gated(layer: idemkit_tower::IdempotencyLayer, runs: Runs, gate: Arc<tokio::sync::Notify>) -> Router {
    Router::new()
        .route(
            "/op",
            post(move |State(runs): State<Runs>, body: String| async move {
                let n = runs.next();
                if body.contains("slow") {
                    gate.notified().await;
                }
                (StatusCode::CREATED, format!("run {n}"))
            })
            .layer(layer),
        )
        .with_state(runs)
}

#[test]
fn a_replay_a_mismatch_and_an_in_progress_conflict_each_move_their_counter() {
    let snap = recorded(async || {
        let runs = Runs::default();
        let gate = Arc::new(tokio::sync::Notify::new());
        let layer = generic(memory(), Policy::new()).build().unwrap();
        let base = serve(gated(layer, runs.clone(), gate.clone())).await;

        assert_eq!(send(&base, Some("k-1"), "a", &json!({"n": 1})).await.status, 201);
        let replay = send(&base, Some("k-1"), "a", &json!({"n": 1})).await;
        assert!(replay.replayed(), "{replay:?}");
        let reused = send(&base, Some("k-1"), "a", &json!({"n": 2})).await;
        assert_eq!(reused.code(), "idempotency_key_reused");

        let slow = tokio::spawn({
            let base = base.clone();
            async move { send(&base, Some("k-2"), "a", &json!({"slow": true})).await }
        });
        while runs.get() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let busy = send(&base, Some("k-2"), "a", &json!({"slow": true})).await;
        assert_eq!(busy.code(), "idempotency_request_in_progress");
        gate.notify_one();
        assert_eq!(slow.await.unwrap().status, 201);

        assert_eq!(
            send(&base, None, "a", &json!({})).await.code(),
            "idempotency_key_missing"
        );
        let long = "k".repeat(300);
        assert_eq!(
            send(&base, Some(&long), "a", &json!({})).await.code(),
            "idempotency_key_invalid"
        );
        assert_eq!(runs.get(), 2);
    });
    assert_eq!(requests(&snap, outcome::EXECUTED), 2);
    assert_eq!(requests(&snap, outcome::REPLAYED), 1);
    assert_eq!(requests(&snap, outcome::KEY_REUSED), 1);
    assert_eq!(requests(&snap, outcome::IN_PROGRESS), 1);
    assert_eq!(requests(&snap, outcome::KEY_MISSING), 1);
    assert_eq!(requests(&snap, outcome::KEY_INVALID), 1);
    assert_eq!(counter(&snap, m::REQUESTS, &[]), 7, "one count per request");
    assert_eq!(counter(&snap, m::FENCED_WRITES, &[]), 0, "no alarm");
    assert_eq!(gauge(&snap, m::IN_FLIGHT), Some(0.0), "every claim was let go");
    for o in [op::CLAIM, op::COMPLETE] {
        let latencies = values(&snap, m::STORE_SECONDS, &[("op", o)]);
        assert!(
            matches!(latencies.as_slice(), [DebugValue::Histogram(h)] if !h.is_empty()),
            "{o}: {latencies:?}"
        );
    }
}

/// The in-flight gauge counts a request while its handler runs.
#[test]
fn the_in_flight_gauge_follows_running_handlers() {
    let recorder = DebuggingRecorder::new();
    let snap = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let runs = Runs::default();
            let gate = Arc::new(tokio::sync::Notify::new());
            let layer = generic(memory(), Policy::new()).build().unwrap();
            let base = serve(gated(layer, runs.clone(), gate.clone())).await;
            let slow = tokio::spawn({
                let base = base.clone();
                async move { send(&base, Some("g"), "a", &json!({"slow": true})).await }
            });
            while runs.get() < 1 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            assert_eq!(gauge(&Seen::take(&snap), m::IN_FLIGHT), Some(1.0));
            gate.notify_one();
            slow.await.unwrap();
            // The first snapshot drained the gauge: this one is the change since.
            assert_eq!(gauge(&Seen::take(&snap), m::IN_FLIGHT), Some(-1.0));
        });
    });
}

/// A holder whose lease was taken over tries to complete: the store refuses the
/// stale write, and the duplicate-side-effect alarm counts it.
#[test]
fn a_fenced_stale_completion_increments_the_alarm() {
    let snap = recorded(async || {
        let clock = Arc::new(ManualClock::new());
        let store = Arc::new(MemoryStore::with_clock(clock.clone()));
        let runs = Runs::default();
        let gate = Arc::new(tokio::sync::Notify::new());
        let layer = generic(store, Policy::new()).build().unwrap();
        let app = Router::new()
            .route(
                "/op",
                post({
                    let gate = gate.clone();
                    move |State(runs): State<Runs>| async move {
                        let n = runs.next();
                        if n == 1 {
                            gate.notified().await; // A stalls past its lease
                        }
                        (StatusCode::CREATED, format!("holder {n}"))
                    }
                })
                .layer(layer),
            )
            .with_state(runs.clone());
        let base = serve(app).await;
        let a = tokio::spawn({
            let base = base.clone();
            async move { send(&base, Some("fence"), "a", &json!({})).await }
        });
        while runs.get() < 1 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        clock.advance(Duration::from_secs(31)); // A's 30 s lease expires
        let b = send(&base, Some("fence"), "a", &json!({})).await;
        assert_eq!(b.status, 201, "{b:?}");
        gate.notify_one();
        let a = a.await.unwrap();
        assert_eq!(a.code(), "idempotency_lease_lost", "{a:?}");
    });
    assert_eq!(counter(&snap, m::FENCED_WRITES, &[("op", op::COMPLETE)]), 1);
    assert_eq!(counter(&snap, m::FENCED_WRITES, &[]), 1, "counted once");
    assert_eq!(requests(&snap, outcome::LEASE_LOST), 1);
    assert_eq!(requests(&snap, outcome::EXECUTED), 1);
    assert_eq!(gauge(&snap, m::IN_FLIGHT), Some(0.0));
}

/// The completer's pass sets the orphaned-keys gauge and counts its resumes;
/// the reaper counts deletions and moves to review.
#[test]
fn completer_and_reaper_report_what_they_did() {
    let snap = recorded(async || {
        let clock = Arc::new(ManualClock::new());
        let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));
        let orphan = scope("a", "orphan");
        must_claim(&*store, &claim_req(&orphan, "{}")).await;
        let done = scope("a", "done");
        let lease = must_claim(&*store, &claim_req(&done, "{}")).await;
        store
            .complete(&done, lease.token, &response(201, "x"))
            .await
            .unwrap();
        clock.advance(Duration::from_secs(120));

        let layer = generic(store.clone(), Policy::new()).build().unwrap();
        let app = Router::new().route("/orders", post(|| async { StatusCode::CREATED }).layer(layer));
        let report = Completer::new(store.clone(), app)
            .min_age(Duration::from_secs(60))
            .run_once()
            .await
            .unwrap();
        assert_eq!((report.found, report.completed), (1, 1), "{report:?}");

        clock.advance(Duration::from_secs(73 * 3600));
        let stuck = scope("a", "stuck");
        let lease = must_claim(&*store, &claim_req(&stuck, "{}")).await;
        store.abandon(&stuck, lease.token, "gone").await.unwrap();
        clock.advance(Duration::from_secs(73 * 3600));
        let report = Reaper::new(store.clone(), &idemkit_core::Policy::new())
            .run_once()
            .await
            .unwrap();
        assert_eq!((report.deleted, report.moved_to_review), (2, 1), "{report:?}");
    });
    assert_eq!(gauge(&snap, m::ORPHANED_KEYS), Some(1.0));
    assert_eq!(
        counter(&snap, m::COMPLETER_RESUMES, &[("result", "completed")]),
        1
    );
    assert_eq!(counter(&snap, m::REAPER_DELETED, &[]), 2);
    assert_eq!(counter(&snap, m::REAPER_REVIEW, &[]), 1);
}

/// Every span closed while `scenario` runs on a current-thread runtime, as
/// `tracing_subscriber`'s `fmt` writes them (`name{field=value …}: close`).
///
/// tracing caches each callsite's interest process-wide. While a single
/// subscriber exists, a callsite that a test on another thread hits first
/// (with no subscriber of its own) is cached as "not interested" for every
/// thread, so a run may miss spans; the caller runs the scenario again until
/// its needles are all there, and the next run's `rebuild_interest_cache`
/// fixes every callsite registered by then. (nextest runs each test in its
/// own process, where this cannot happen.)
fn closed_spans<F: std::future::Future<Output = ()>>(scenario: impl Fn() -> F, needles: &[&str]) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let buf = Buf::default();
    let dispatch = tracing::Dispatch::new(
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::INFO)
            .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE)
            .with_ansi(false)
            .with_writer({
                let buf = buf.clone();
                move || buf.clone()
            })
            .finish(),
    );
    let run = || {
        buf.0.lock().unwrap().clear();
        tracing::dispatcher::with_default(&dispatch, || {
            tracing::callsite::rebuild_interest_cache();
            runtime.block_on(scenario());
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    };
    let mut out = run();
    for _ in 0..5 {
        if needles.iter().all(|n| out.contains(n)) {
            break;
        }
        out = run();
    }
    out
}

/// Claim and completion are `info` spans with their outcome; neither they nor
/// any `info` event carries the raw key, the account or the body.
#[test]
fn spans_carry_outcomes_and_never_the_key_or_the_body() {
    let needles = [
        "idemkit.request{",
        "idemkit.claim{",
        "idemkit.complete{",
        "outcome=\"claimed\"",
        "outcome=\"executed\"",
        "outcome=\"replayed\"",
        "key_hash=",
    ];
    let out = closed_spans(
        || async {
            let layer = generic(memory(), Policy::new()).build().unwrap();
            let base = serve(gated(layer, Runs::default(), Arc::default())).await;
            let body = json!({"card": "4111-SECRET-BODY"});
            let first = send(&base, Some("SECRET-KEY-42"), "tenant-x", &body).await;
            assert_eq!(first.status, 201);
            let again = send(&base, Some("SECRET-KEY-42"), "tenant-x", &body).await;
            assert!(again.replayed());
        },
        &needles,
    );
    for needle in needles {
        assert!(out.contains(needle), "no {needle} in:\n{out}");
    }
    for secret in ["SECRET-KEY-42", "SECRET-BODY", "tenant-x"] {
        assert!(!out.contains(secret), "{secret} leaked into:\n{out}");
    }
}

/// `idemkit.phase` spans carry the outcomes `docs/metrics.md` publishes: `done`
/// for a phase and a final phase that ran, `saved` for a phase skipped when a
/// retry resumes after it, `response_too_large` for a final phase whose answer
/// is over the storage cap.
#[test]
fn phase_spans_carry_their_outcomes() {
    use axum::response::IntoResponse;
    use idemkit_sqlite::SqliteStore;
    use idemkit_tower::{IdempotencyContext, Phases};
    let needles = [
        "step=\"insert\" kind=\"phase\" outcome=\"done\"",
        "step=\"insert\" kind=\"phase\" outcome=\"saved\"",
        "step=\"answer\" kind=\"finish\" outcome=\"done\"",
        "step=\"answer\" kind=\"finish\" outcome=\"response_too_large\"",
    ];
    let out = closed_spans(
        || async {
            let store = super::sqlite(None).await;
            let layer = generic(store.clone(), Policy::new().with_max_stored_body(64))
                .build()
                .unwrap();
            let app = Router::new()
                .route(
                    "/op",
                    post(
                        |State((store, runs)): State<(Arc<SqliteStore>, Runs)>,
                         ctx: IdempotencyContext,
                         axum::Json(body): axum::Json<serde_json::Value>| async move {
                            let n = runs.next();
                            let mut phases = Phases::begin(store, &ctx).await?;
                            phases
                                .phase("insert", async |_tx| Ok::<_, (StatusCode, String)>(()))
                                .await?;
                            // The first attempt dies after its phase committed.
                            assert!(n > 1, "the first attempt dies after its first phase");
                            let size = if body["big"] == json!(true) { 128 } else { 2 };
                            phases
                                .finish("answer", async |_tx| {
                                    Ok::<_, (StatusCode, String)>(
                                        (StatusCode::CREATED, "x".repeat(size)).into_response(),
                                    )
                                })
                                .await
                        },
                    )
                    .layer(layer),
                )
                .with_state((store.clone(), Runs::default()));
            let base = serve(app).await;
            let died = send(&base, Some("phased"), "a", &json!({})).await;
            assert_eq!(died.status, 500, "{died:?}");
            let resumed = send(&base, Some("phased"), "a", &json!({})).await;
            assert_eq!(resumed.status, 201, "{resumed:?}");
            let big = send(&base, Some("phased-big"), "a", &json!({"big": true})).await;
            assert_eq!(big.status, 500, "{big:?}");
        },
        &needles,
    );
    for needle in needles {
        assert!(out.contains(needle), "no {needle} in:\n{out}");
    }
    // In the order the requests ran: the resumed request's final phase, then
    // the one over the cap (each outcome belongs to its own request).
    let at = |needle: &str| out.find(needle).unwrap_or(usize::MAX);
    assert!(
        at(needles[1]) < at(needles[2]) && at(needles[2]) < at(needles[3]),
        "the outcomes in another order than the requests:\n{out}"
    );
}
