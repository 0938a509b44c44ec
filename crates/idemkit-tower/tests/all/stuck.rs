//! Stuck keys and wrong answers (issue 30, items 5–9) over real HTTP: a caller
//! that leaves while its key is being claimed, panicking handlers (attached,
//! detached, on every resume), single-step routes that settle their own record,
//! a lost completion reply, and replays past the caller's deadline. Each fails
//! on the code before its fix.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::scope;
use axum::Router;
use axum::extract::State;
use axum::response::IntoResponse;
use axum::routing::post;
use http::StatusCode;
use idemkit_core::wire::REQUEST_TIMEOUT;
use idemkit_core::{KeyStore, PhaseUpdate, Policy, RecordState};
use idemkit_sqlite::{SqliteStore, SqliteTx};
use idemkit_testkit::{MemoryStore, Probed};
use idemkit_tower::{Completer, IdempotencyContext, IdempotencyLayer, Override, Phases, Tx};
use serde_json::json;
use tokio::sync::Notify;

use super::{Answer, Runs, generic, rows, send, serve, sqlite};

/// A store with two faults on demand ([`Probed::delay_next_claim`],
/// [`Probed::lose_next_completion_reply`]): a claim that waits for a gate and
/// then lands on the store whether or not its caller is still there (as a
/// statement already sent to SQLite's worker or to PostgreSQL does), and a
/// completion that is applied but whose reply is lost.
type Faulty<S = MemoryStore> = Probed<S>;

/// Notifies when dropped: the future holding it ended, finished or cancelled.
struct NotifyOnDrop(Arc<Notify>);

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        self.0.notify_one();
    }
}

/// `app` with an outermost middleware that notifies `left` when the
/// connection's future for a request ends (the caller hung up, or was answered).
fn signalling(app: Router, left: Arc<Notify>) -> Router {
    app.layer(axum::middleware::from_fn(
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let guard = NotifyOnDrop(left.clone());
            async move {
                let _guard = guard;
                next.run(req).await
            }
        },
    ))
}

/// Sends a keyed request and gives up after `timeout` (the caller hangs up).
async fn send_giving_up(base: &str, key: &str, timeout: Duration) {
    let sent = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth("a")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body("{}")
        .timeout(timeout)
        .send()
        .await;
    assert!(sent.is_err(), "the request was expected to time out: {sent:?}");
}

/// Retries until the answer is not `409` (in progress), for at most 5 s.
async fn retry_until_settled(base: &str, key: &str) -> Answer {
    let began = Instant::now();
    loop {
        let a = send(base, Some(key), "a", &json!({})).await;
        if a.status != 409 {
            return a;
        }
        assert!(
            began.elapsed() < Duration::from_secs(5),
            "the key stayed in progress after its caller left: {a:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Item 5: the caller hangs up while its key is being claimed, and the claim
/// lands after it left. The claim belongs to the detached work: the handler
/// runs to its end and the retry gets the replay, not `409 in progress` for
/// the rest of a lease nobody holds.
async fn hang_up_mid_claim<S: KeyStore>(store: Arc<Faulty<S>>) {
    let runs = Runs::default();
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let app = super::counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("made {n}")).into_response()
    });
    let left = Arc::new(Notify::new());
    let base = serve(signalling(app, left.clone())).await;

    let gate = store.delay_next_claim();
    send_giving_up(&base, "mid-claim", Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(5), left.notified())
        .await
        .expect("the server never noticed the caller leave");
    // The claim lands after its caller left.
    gate.notify_one();

    let replay = retry_until_settled(&base, "mid-claim").await;
    assert_eq!((replay.status, replay.replayed()), (201, true), "{replay:?}");
    assert_eq!(String::from_utf8_lossy(&replay.body), "made 1");
    assert_eq!(runs.get(), 1, "the handler ran once, for the claim that landed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_hangs_up_mid_claim_leaves_no_key_held_by_nobody() {
    hang_up_mid_claim(Arc::new(Faulty::<MemoryStore>::default())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_hangs_up_mid_claim_leaves_no_key_held_by_nobody_on_sqlite() {
    let sqlite = SqliteStore::connect(super::tempfile("mid-claim")).await.unwrap();
    hang_up_mid_claim(Arc::new(Faulty::new(sqlite))).await;
}

/// A route whose handler panics on its first run, after waiting for `gate` (when set).
fn panicking_once(store: Arc<dyn KeyStore>, runs: Runs, gate: Option<Arc<Notify>>) -> Router {
    let layer = generic(store, Policy::new()).build().unwrap();
    Router::new()
        .route(
            "/op",
            post(move |State(runs): State<Runs>| {
                let gate = gate.clone();
                async move {
                    let n = runs.next();
                    if let Some(gate) = gate.filter(|_| n == 1) {
                        gate.notified().await;
                    }
                    assert!(n > 1, "handler bug on run {n}");
                    (StatusCode::CREATED, format!("made {n}"))
                }
            })
            .layer(layer),
        )
        .with_state(runs)
}

/// Item 6, detached: the handler panics after its caller left (in the task
/// the work moved to). Nothing was recorded, so the key is released: the
/// retry runs, instead of finding the key in progress for the whole lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_after_the_caller_left_releases_the_key() {
    let runs = Runs::default();
    let gate = Arc::new(Notify::new());
    let left = Arc::new(Notify::new());
    let app = panicking_once(super::memory(), runs.clone(), Some(gate.clone()));
    let base = serve(signalling(app, left.clone())).await;

    send_giving_up(&base, "late-panic", Duration::from_millis(200)).await;
    tokio::time::timeout(Duration::from_secs(5), left.notified())
        .await
        .expect("the server never noticed the caller leave");
    assert_eq!(runs.get(), 1, "the handler had started");
    gate.notify_one(); // the handler panics now, detached
    let again = retry_until_settled(&base, "late-panic").await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(String::from_utf8_lossy(&again.body), "made 2");
}

/// Item 6, attached: a panic answers 500 and releases the key at once.
#[tokio::test]
async fn a_panic_before_any_progress_releases_the_key() {
    let runs = Runs::default();
    let base = serve(panicking_once(super::memory(), runs.clone(), None)).await;
    let first = send(&base, Some("panic"), "a", &json!({})).await;
    assert_eq!(
        (first.status, first.code().as_str()),
        (500, "internal_error"),
        "{first:?}"
    );
    let again = send(&base, Some("panic"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(runs.get(), 2);
}

/// Item 6, the bound: a handler that records progress and then panics on
/// every run is resumed (by the completer) a bounded number of times, then
/// parked for review, never resumed forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_panics_on_every_resume_is_parked_after_a_bounded_number_of_runs() {
    let store = Arc::new(MemoryStore::new());
    let runs = Runs::default();
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(
                |State((store, runs)): State<(Arc<MemoryStore>, Runs)>, ctx: IdempotencyContext| async move {
                    runs.next();
                    let step = PhaseUpdate {
                        recovery_point: "reserved".into(),
                        step: Some(("reserve".into(), json!({ "done": 1 }))),
                    };
                    store.advance(&ctx.scope, ctx.token, &step).await.unwrap();
                    if runs.get() < 1_000 {
                        panic!("handler bug after recording progress");
                    }
                    StatusCode::CREATED
                },
            )
            .layer(layer),
        )
        .with_state((store.clone(), runs.clone()));
    let base = serve(app.clone()).await;

    let first = send(&base, Some("always"), "a", &json!({})).await;
    assert_eq!(first.status, 500, "{first:?}");
    let record = store.get(&scope("a", "always")).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::InFlight, "abandoned, resumable");
    assert!(record.lease_expires_at <= store.now(), "its lease ended at once");

    let completer = Completer::new(store.clone(), app).min_age(Duration::ZERO);
    let mut parked = 0;
    for _ in 0..6 {
        parked += completer.run_once().await.unwrap().parked;
    }
    let record = store.get(&scope("a", "always")).await.unwrap().unwrap();
    assert_eq!(
        record.state,
        RecordState::Parked,
        "still {:?} after {} runs: {:?}",
        record.state,
        runs.get(),
        record.last_error
    );
    assert_eq!(parked, 1);
    assert_eq!(runs.get(), 3, "the first run and two resumes");
    let retry = send(&base, Some("always"), "a", &json!({})).await;
    assert_eq!(
        (retry.status, retry.code().as_str()),
        (409, "idempotency_request_parked")
    );
    assert_eq!(runs.get(), 3);
}

/// Item 7: a single-step handler answering `Override::Settled` would have
/// its answer sent while its transaction rolls back. Refused: a 500 that
/// names the mistake, nothing committed, nothing acknowledged.
#[tokio::test]
async fn single_step_refuses_a_handler_that_settles_its_own_record() {
    let store = sqlite(None).await;
    let layer = IdempotencyLayer::single_step(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .build()
    .unwrap();
    let app = Router::new().route(
        "/op",
        post(|mut tx: Tx<SqliteTx>| async move {
            sqlx::query("INSERT INTO rows (account, n) VALUES ('a', 1)")
                .execute(&mut **tx)
                .await
                .unwrap();
            (StatusCode::CREATED, Override::Settled, "made")
        })
        .layer(layer),
    );
    let base = serve(app).await;
    for _ in 0..2 {
        let a = send(&base, Some("settled"), "a", &json!({})).await;
        assert_eq!(
            (a.status, a.code().as_str(), a.json()["retryable"].clone()),
            (500, "idempotency_misconfigured", json!(false)),
            "{a:?}"
        );
        assert!(a.json()["detail"].as_str().unwrap().contains("Override::Settled"));
    }
    assert_eq!(rows(&store).await, 0, "nothing was committed");
    assert!(store.get(&scope("a", "settled")).await.unwrap().is_none());
}

/// Item 7: `Phases` under a single-step layer never sees its uncommitted
/// claim; its `409 lease_lost` would be retried forever. Refused as a
/// misconfiguration instead.
#[tokio::test]
async fn phases_under_a_single_step_layer_are_refused_as_a_misconfiguration() {
    let store = sqlite(None).await;
    let layer = IdempotencyLayer::single_step(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .build()
    .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(
                |State(store): State<Arc<SqliteStore>>, ctx: IdempotencyContext| async move {
                    let phases = Phases::begin(store, &ctx).await?;
                    phases
                        .finish("done", async |_tx| {
                            Ok::<_, StatusCode>(StatusCode::CREATED.into_response())
                        })
                        .await
                },
            )
            .layer(layer),
        )
        .with_state(store.clone());
    let base = serve(app).await;
    let a = send(&base, Some("phased"), "a", &json!({})).await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (500, "idempotency_misconfigured"),
        "{a:?}"
    );
}

/// Item 8: the completion was applied but its reply was lost; the re-sent
/// write is fenced by its own first delivery. The record is read back: the
/// caller gets its answer, not `idempotency_lease_lost`.
#[tokio::test]
async fn a_lost_completion_reply_answers_the_stored_response() {
    let store = Arc::new(Faulty::<MemoryStore>::default());
    store.lose_next_completion_reply();
    let runs = Runs::default();
    let layer = generic(store.clone(), Policy::new()).build().unwrap();
    let base = serve(super::counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("made {n}")).into_response()
    }))
    .await;
    let first = send(&base, Some("lost-reply"), "a", &json!({})).await;
    assert_eq!((first.status, first.replayed()), (201, false), "{first:?}");
    assert_eq!(String::from_utf8_lossy(&first.body), "made 1");
    let again = send(&base, Some("lost-reply"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (201, true), "{again:?}");
    assert_eq!(again.body, first.body);
    assert_eq!(runs.get(), 1);
}

/// Item 9: a retry of a completed request whose deadline has already passed
/// gets the stored answer (a replay costs nothing); a request that would
/// have to claim is still refused before claiming.
#[tokio::test]
async fn an_expired_deadline_still_gets_the_replay() {
    let runs = Runs::default();
    let layer = generic(super::memory(), Policy::new()).build().unwrap();
    let base = serve(super::counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("made {n}")).into_response()
    }))
    .await;
    let with_deadline = |key: &'static str, ms: &'static str| {
        let base = base.clone();
        async move {
            let res = reqwest::Client::new()
                .post(format!("{base}/op"))
                .bearer_auth("a")
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .header(REQUEST_TIMEOUT, ms)
                .body("{}")
                .send()
                .await
                .unwrap();
            Answer {
                status: res.status().as_u16(),
                headers: res.headers().clone(),
                body: res.bytes().await.unwrap().to_vec(),
            }
        }
    };
    let first = with_deadline("late", "5000").await;
    assert_eq!(first.status, 201);
    let late = with_deadline("late", "0").await;
    assert_eq!((late.status, late.replayed()), (201, true), "{late:?}");
    assert_eq!(late.body, first.body);
    // A fresh key with an expired deadline is still refused before claiming.
    let fresh = with_deadline("late-fresh", "0").await;
    assert_eq!((fresh.status, fresh.code().as_str()), (504, "deadline_exceeded"));
    assert_eq!(runs.get(), 1);
}

/// Item 6, single-step: a handler that panics after writing through the
/// claim's transaction answers a 500 (the connection used to be dropped with
/// no answer), its transaction is rolled back through the store before that
/// answer, and the key is free.
#[tokio::test]
async fn a_single_step_panic_rolls_back_and_answers() {
    let sqlite = SqliteStore::connect(super::tempfile("panic")).await.unwrap();
    sqlx::query("CREATE TABLE rows (account TEXT NOT NULL, n INTEGER NOT NULL)")
        .execute(sqlite.pool())
        .await
        .unwrap();
    let store = Arc::new(idemkit_testkit::Probed::new(sqlite));
    let runs = Runs::default();
    let layer = IdempotencyLayer::single_step(
        store.clone(),
        idemkit_tower::BearerTokenAccount::new("test-secret"),
    )
    .build()
    .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>, mut tx: Tx<SqliteTx>| async move {
                sqlx::query("INSERT INTO rows (account, n) VALUES ('a', 1)")
                    .execute(&mut **tx)
                    .await
                    .unwrap();
                let n = runs.next();
                assert!(n > 1, "handler bug on run {n}");
                (StatusCode::CREATED, format!("made {n}"))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let first = send(&base, Some("tx-panic"), "a", &json!({})).await;
    assert_eq!(
        (first.status, first.code().as_str()),
        (500, "internal_error"),
        "{first:?}"
    );
    assert_eq!(
        store.rollbacks(),
        1,
        "rolled back through the store before the answer"
    );
    let again = send(&base, Some("tx-panic"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (201, false), "{again:?}");
    assert_eq!(rows(store.inner()).await, 1, "only the second run's row");
}
