//! Regression tests for interleavings that once duplicated effects or left keys
//! stuck (SPEC §3, §5, §7): each fails on the code before its fix.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::{InFlightBehavior, KeyStore, PhaseUpdate, Policy, RecordState, Scope};
use idemkit_sqlite::SqliteStore;
use idemkit_testkit::mutants::{MutantStore, Mutation};
use idemkit_testkit::{ManualClock, MemoryStore, Probed};
use idemkit_tower::{IdempotencyContext, IdempotencyLayer, Override, PhaseError, Phases};
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::{Runs, generic, memory, send, serve, sqlite};

/// Lease mode (SPEC §3): a client that hangs up mid-request does not cancel
/// the handler. The work goes on detached from the connection, the key is not
/// stuck for the rest of the lease, and the retry gets the one result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_gets_the_one_result_on_retry() {
    let started = Runs::default();
    let finished = Arc::new(AtomicUsize::new(0));
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post({
                let finished = finished.clone();
                move |State(runs): State<Runs>| {
                    let finished = finished.clone();
                    async move {
                        let n = runs.next();
                        tokio::time::sleep(Duration::from_millis(400)).await;
                        finished.fetch_add(1, Ordering::SeqCst);
                        (StatusCode::CREATED, format!("made {n}"))
                    }
                }
            })
            .layer(layer),
        )
        .with_state(started.clone());
    let base = serve(app).await;

    // A raw client: sends the request, then closes its socket mid-request.
    let addr = base.trim_start_matches("http://");
    let mut socket = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = "POST /op HTTP/1.1\r\nhost: x\r\nauthorization: Bearer a\r\nidempotency-key: hang-up\r\n\
                   content-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    socket.write_all(request.as_bytes()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    drop(socket);

    let began = Instant::now();
    let replay = loop {
        let a = send(&base, Some("hang-up"), "a", &json!({})).await;
        if a.status != 409 {
            break a;
        }
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the key stayed in progress after the client left: {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(replay.status, 201, "{replay:?}");
    assert!(replay.replayed(), "the retry gets the detached run's result");
    assert_eq!(String::from_utf8_lossy(&replay.body), "made 1");
    assert_eq!(started.get(), 1, "the handler ran once");
    assert_eq!(finished.load(Ordering::SeqCst), 1, "and to its end");
}

/// The in-progress hint is the expected wait, never the whole lease: a client
/// whose deadline is shorter than the lease can wait for the answer.
#[tokio::test]
async fn in_progress_answers_hint_at_most_a_heartbeat_interval() {
    let slow = generic(memory(), Policy::new()).build().unwrap();
    let slow_base = serve(
        Router::new().route(
            "/op",
            post(|| async {
                tokio::time::sleep(Duration::from_millis(700)).await;
                StatusCode::CREATED
            })
            .layer(slow),
        ),
    )
    .await;
    let first = tokio::spawn({
        let b = slow_base.clone();
        async move { send(&b, Some("hint"), "a", &json!({})).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dup = send(&slow_base, Some("hint"), "a", &json!({})).await;
    assert_eq!(dup.status, 409, "{dup:?}");
    let hint: u64 = dup.headers["retry-after"].to_str().unwrap().parse().unwrap();
    let interval = Policy::new().heartbeat_interval().as_secs();
    assert!(
        (1..=interval).contains(&hint),
        "Retry-After {hint} s; the lease is {} s",
        Policy::new().lease.as_secs()
    );
    assert_eq!(first.await.unwrap().status, 201);
}

/// A final phase whose response is over the storage cap (SPEC §5): earlier
/// phases may have had effects, so the failure is stored and replayed, as in
/// single-step mode; the record is not left in flight to fail the same way
/// after every takeover.
#[tokio::test]
async fn a_final_phase_over_the_storage_cap_stores_its_problem() {
    let store = sqlite(None).await;
    let runs = Runs::default();
    let layer = IdempotencyLayer::lease(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .policy(Policy::new().with_max_stored_body(16))
    .build()
    .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(
                move |State((store, runs)): State<(Arc<SqliteStore>, Runs)>, ctx: IdempotencyContext| async move {
                    runs.next();
                    let mut phases = Phases::begin(store, &ctx).await?;
                    phases
                        .phase("insert", async |tx| {
                            sqlx::query("INSERT INTO rows (account, n) VALUES ('a', 1)")
                                .execute(&mut **tx)
                                .await
                                .map(|_| ())
                                .map_err(|e| (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
                        })
                        .await?;
                    phases
                        .finish("done", async |_tx| {
                            Ok::<_, (StatusCode, String)>((StatusCode::CREATED, "x".repeat(64)).into_response())
                        })
                        .await
                },
            )
            .layer(layer),
        )
        .with_state((store.clone(), runs.clone()));
    let base = serve(app).await;
    let first = send(&base, Some("big-finish"), "a", &json!({})).await;
    assert_eq!(
        (first.status, first.code().as_str()),
        (500, "idempotency_response_too_large"),
        "{first:?}"
    );
    let again = send(&base, Some("big-finish"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (500, true), "{again:?}");
    assert_eq!(runs.get(), 1, "the handler is not run again");
    assert_eq!(
        super::rows(&store).await,
        1,
        "its committed phase is not repeated"
    );
}

/// Downstream keys carry the request's generation (SPEC §7): the same across a
/// takeover, new when the key is reused after its replay window.
#[tokio::test]
async fn downstream_keys_are_stable_across_takeovers_and_new_after_the_window() {
    let clock = Arc::new(ManualClock::new());
    let store = sqlite(Some(clock.clone())).await;
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let fail_first = Arc::new(AtomicBool::new(true));
    let layer = IdempotencyLayer::lease(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .build()
    .unwrap();
    type Shared = (Arc<SqliteStore>, Arc<Mutex<Vec<String>>>, Arc<AtomicBool>);
    let app = Router::new()
        .route(
            "/op",
            post(
                |State((store, seen, fail_first)): State<Shared>, ctx: IdempotencyContext| async move {
                    let phases = Phases::begin(store, &ctx).await?;
                    seen.lock()
                        .unwrap()
                        .push(phases.downstream_key("courier").to_string());
                    if fail_first.swap(false, Ordering::SeqCst) {
                        // A retryable outcome: the next attempt takes over.
                        return Ok::<_, PhaseError<StatusCode>>(
                            (
                                StatusCode::SERVICE_UNAVAILABLE,
                                Override::Retryable,
                                "courier down",
                            )
                                .into_response(),
                        );
                    }
                    phases
                        .finish("done", async |_tx| Ok(StatusCode::CREATED.into_response()))
                        .await
                },
            )
            .layer(layer),
        )
        .with_state((store.clone(), seen.clone(), fail_first.clone()));
    let base = serve(app).await;
    assert_eq!(send(&base, Some("gen"), "a", &json!({})).await.status, 503);
    assert_eq!(send(&base, Some("gen"), "a", &json!({})).await.status, 201);
    clock.advance(Policy::new().replay_window + Duration::from_secs(1));
    assert_eq!(send(&base, Some("gen"), "a", &json!({})).await.status, 201);
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[0], seen[1], "a takeover re-sends the same downstream key");
    assert_ne!(seen[1], seen[2], "a reused key is a new request downstream too");
}

/// When the read that chooses between release and abandon fails, the layer
/// abandons (SPEC §5): recorded progress, here an external call's intent,
/// survives even on a store whose release would wipe it.
#[tokio::test]
async fn a_failed_read_while_settling_abandons_instead_of_releasing() {
    // Reads fail on demand: a pool timeout while the store flaps.
    let store = Arc::new(Probed::new(MutantStore::new(
        Mutation::ReleaseWipesProgress,
        Arc::new(ManualClock::new()),
    )));
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(
                |State(store): State<Arc<Probed<MutantStore>>>, ctx: IdempotencyContext| async move {
                    let intent = PhaseUpdate {
                        recovery_point: String::new(),
                        step: Some(("courier".into(), json!({ "intent": "k" }))),
                    };
                    store.advance(&ctx.scope, ctx.token, &intent).await.unwrap();
                    // The store starts flapping; the handler fails (a 5xx is released
                    // by default when nothing was recorded).
                    store.fail_reads(true);
                    StatusCode::INTERNAL_SERVER_ERROR
                },
            )
            .layer(layer),
        )
        .with_state(store.clone());
    let base = serve(app).await;
    assert_eq!(send(&base, Some("flap"), "a", &json!({})).await.status, 500);
    store.fail_reads(false);
    let scope = Scope::new(
        idemkit_core::Account::keyed(b"test-secret", b"a"),
        idemkit_core::IdempotencyKey::parse("flap").unwrap(),
    );
    let rec = store.get(&scope).await.unwrap().expect("the record is kept");
    assert_eq!(rec.state, RecordState::InFlight, "abandoned, resumable");
    assert!(rec.lease_expires_at <= store.now(), "its lease ended at once");
    assert_eq!(
        rec.step_outputs["courier"],
        json!({ "intent": "k" }),
        "the intent survives"
    );
}

/// The status URL of a completed request stops replaying with the window, as
/// the key itself does.
#[tokio::test]
async fn status_urls_stop_replaying_after_the_window() {
    let clock = Arc::new(ManualClock::new());
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));
    let layer = generic(store, Policy::new().with_in_flight(InFlightBehavior::Accepted))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|| async { (StatusCode::CREATED, "made") }).layer(layer.clone()),
        )
        .merge(layer.status_router());
    let base = serve(app).await;
    assert_eq!(send(&base, Some("st"), "a", &json!({})).await.status, 201);
    let url = format!("{base}/idempotency/requests/st");
    let client = reqwest::Client::new();
    let get = || client.get(&url).bearer_auth("a").send();
    assert_eq!(get().await.unwrap().status(), 201);
    clock.advance(Policy::new().replay_window + Duration::from_secs(1));
    assert_eq!(get().await.unwrap().status(), 404, "no replay past the window");
}

/// What the handler of `phases_begin_refuses_a_holder_whose_record_was_taken_over`
/// saw: the stale holder's `Phases::begin`, and the new holder's recovery point.
type Began = Arc<Mutex<Option<(Result<(), String>, Result<Option<String>, String>)>>>;

/// `Phases::begin` checks that the record it loads is still this attempt's
/// (its fencing token): a holder whose record was taken over before it began
/// (its lease ran out while it was paused) is refused at once, and never runs
/// on the new holder's recovery point and saved outputs; the new holder begins
/// from that recovery point.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_begin_refuses_a_holder_whose_record_was_taken_over() {
    let clock = Arc::new(ManualClock::new());
    let store = sqlite(Some(clock.clone())).await;
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let began: Began = Arc::default();
    let app = Router::new()
        .route(
            "/op",
            post(
                move |State((store, clock, began)): State<(Arc<SqliteStore>, Arc<ManualClock>, Began)>,
                      ctx: IdempotencyContext| async move {
                    // This holder pauses past its lease; another attempt takes
                    // the record over (a new token) and records progress.
                    clock.advance(Duration::from_secs(3600));
                    let record = store.get(&ctx.scope).await.unwrap().expect("the claimed record");
                    let takeover = idemkit_core::ClaimRequest {
                        scope: ctx.scope.clone(),
                        fingerprint: record.fingerprint,
                        request: record.request.clone(),
                        lease: Duration::from_secs(30),
                        replay_window: Duration::from_secs(86_400),
                        lock_wait: Duration::ZERO,
                        resume: None,
                        recovery_point: Some("charged".into()),
                    };
                    let idemkit_core::ClaimOutcome::Claimed(lease) = store.claim(&takeover).await.unwrap()
                    else {
                        panic!("a record whose lease ran out is taken over");
                    };
                    assert!(lease.token > ctx.token);
                    let result = Phases::begin(store.clone(), &ctx)
                        .await
                        .map(|_| ())
                        .map_err(|e| e.to_string());
                    // The new holder begins, from the recovery point its claim recorded.
                    let new_holder = IdempotencyContext::new(
                        ctx.scope.clone(),
                        lease.token,
                        lease.resumed_from.clone(),
                        ctx.policy.clone(),
                        None,
                        idemkit_tower::ClaimMode::Lease,
                    );
                    let resumed = Phases::begin(store, &new_holder)
                        .await
                        .map(|p| p.recovery_point().map(str::to_owned))
                        .map_err(|e| e.to_string());
                    *began.lock().unwrap() = Some((result, resumed));
                    StatusCode::SERVICE_UNAVAILABLE
                },
            )
            .layer(layer),
        )
        .with_state((store.clone(), clock.clone(), began.clone()));
    let base = serve(app).await;
    send(&base, Some("taken-over"), "a", &json!({})).await;
    let (stale, resumed) = began.lock().unwrap().take().expect("the handler ran to its end");
    let err = stale.expect_err("a holder whose record was taken over cannot begin its phases");
    assert_eq!(err, idemkit_core::StoreError::Fenced.to_string());
    assert_eq!(
        resumed,
        Ok(Some("charged".to_owned())),
        "the new holder begins from its recovery point"
    );
}
