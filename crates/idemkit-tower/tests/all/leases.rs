//! Lease mode over time: heartbeats, a holder that lost its lease, the wait
//! and accepted in-flight behaviours, the reaper.

use super::*;

/// A slow handler's heartbeat keeps its lease alive far past the lease length,
/// so a duplicate gets 409 in progress instead of taking over.
#[tokio::test]
async fn heartbeat_keeps_a_slow_handler_from_being_taken_over() {
    let runs = Runs::default();
    let store: Arc<dyn KeyStore> = Arc::new(SqliteStore::connect(tempfile("hb")).await.unwrap());
    let layer = generic(store, Policy::new().with_lease(Duration::from_millis(300)))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(1500)).await;
                (StatusCode::CREATED, format!("run {n}"))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("slow"), "a", &json!({})).await }
    });
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let dup = send(&base, Some("slow"), "a", &json!({})).await;
        assert_eq!(dup.status, 409, "{dup:?}");
        assert_eq!(dup.code(), "idempotency_request_in_progress");
        assert!(dup.headers.get("retry-after").is_some());
    }
    let first = slow.await.unwrap();
    assert_eq!(first.status, 201);
    let replay = send(&base, Some("slow"), "a", &json!({})).await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert_eq!(runs.get(), 1);
}

/// A holder whose lease was taken over cannot complete: it gets
/// `503 idempotency_lease_lost`, and every retry sees the new holder's response.
#[tokio::test]
async fn a_holder_that_lost_its_lease_cannot_complete() {
    let clock = Arc::new(ManualClock::new());
    let store = Arc::new(MemoryStore::with_clock(clock.clone()));
    let gate = Arc::new(tokio::sync::Notify::new());
    let runs = Runs::default();
    let layer = generic(store, Policy::new()).build().unwrap();
    let app = Router::new()
        .route(
            "/op",
            post({
                let gate = gate.clone();
                move |State(runs): State<Runs>| async move {
                    let n = runs.next();
                    if n == 1 {
                        gate.notified().await; // A stalls (a GC pause, a stuck call …)
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
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    clock.advance(Duration::from_secs(31)); // A's 30 s lease expires, no heartbeat landed
    let b = send(&base, Some("fence"), "a", &json!({})).await;
    assert_eq!((b.status, b.body.as_slice()), (201, b"holder 2".as_slice()));
    gate.notify_one();
    let a = a.await.unwrap();
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(a.code(), "idempotency_lease_lost");
    assert_eq!(a.json()["retryable"], true);
    let c = send(&base, Some("fence"), "a", &json!({})).await;
    assert!(c.replayed());
    assert_eq!(c.body, b"holder 2");
}

#[tokio::test]
async fn wait_mode_hands_duplicates_the_winners_response() {
    let runs = Runs::default();
    let layer = generic(
        memory(),
        Policy::new().with_in_flight(InFlightBehavior::Wait(Duration::from_secs(5))),
    )
    .build()
    .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, format!("run {n}"))
            })
            .layer(layer),
        )
        .with_state(runs.clone());
    let base = serve(app).await;
    let empty = json!({});
    let started = std::time::Instant::now();
    let answers = futures::future::join_all((0..8).map(|_| async {
        let answer = send(&base, Some("wait"), "a", &empty).await;
        (answer, started.elapsed())
    }))
    .await;
    assert!(
        answers.iter().all(|(a, _)| a.status == 201 && a.body == b"run 1"),
        "{answers:?}"
    );
    assert_eq!(answers.iter().filter(|(a, _)| a.replayed()).count(), 7);
    assert_eq!(runs.get(), 1);
    // Every duplicate waited for the winner: none was answered before the
    // winner's 300 ms handler finished (a duplicate answered early would be a
    // 409 or a second run, but a wait that returns at once must not pass either).
    for (a, elapsed) in &answers {
        assert!(
            *elapsed >= Duration::from_millis(300),
            "answered after {elapsed:?}, before the winner finished: {a:?}"
        );
        assert!(
            *elapsed < Duration::from_secs(5),
            "within the wait bound: {elapsed:?}"
        );
    }
}

#[tokio::test]
async fn wait_mode_is_bounded_then_409() {
    let layer = generic(
        memory(),
        Policy::new().with_in_flight(InFlightBehavior::Wait(Duration::from_millis(200))),
    )
    .build()
    .unwrap();
    let app = Router::new().route(
        "/op",
        post(|| async {
            tokio::time::sleep(Duration::from_millis(1500)).await;
            StatusCode::CREATED
        })
        .layer(layer),
    );
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("bounded"), "a", &json!({})).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let dup = send(&base, Some("bounded"), "a", &json!({})).await;
    let waited = started.elapsed();
    assert_eq!(dup.code(), "idempotency_request_in_progress");
    // It waited its whole bound (200 ms) for the holder, then gave up long
    // before the holder's 1.5 s handler finished.
    assert!(
        waited >= Duration::from_millis(200),
        "answered after {waited:?}, without waiting its 200 ms"
    );
    assert!(waited < Duration::from_millis(1200), "waited {waited:?}");
    assert_eq!(slow.await.unwrap().status, 201);
}

/// In-flight = accepted: a duplicate of a running request gets `202` with a status
/// URL; `GET` on it answers in progress, then the stored response.
#[tokio::test]
async fn accepted_mode_hands_out_a_status_url() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_in_flight(InFlightBehavior::Accepted))
        .build()
        .unwrap();
    let app = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                let n = runs.next();
                tokio::time::sleep(Duration::from_millis(600)).await;
                (StatusCode::CREATED, format!("made {n}"))
            })
            .layer(layer.clone()),
        )
        .merge(layer.status_router())
        .with_state(runs.clone());
    let base = serve(app).await;
    let slow = tokio::spawn({
        let base = base.clone();
        async move { send(&base, Some("long/job#1"), "a", &json!({})).await }
    });
    tokio::time::sleep(Duration::from_millis(150)).await;
    let dup = send(&base, Some("long/job#1"), "a", &json!({})).await;
    assert_eq!(dup.status, 202, "{dup:?}");
    let location = dup.headers["location"].to_str().unwrap().to_owned();
    assert_eq!(location, "/idempotency/requests/long%2Fjob%231");
    let status_url = format!("{base}{location}");
    let client = reqwest::Client::new();
    let pending = client.get(&status_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(pending.status(), 202);
    assert_eq!(pending.json::<Value>().await.unwrap()["status"], "in_progress");
    // Another account cannot see it.
    assert_eq!(
        client
            .get(&status_url)
            .bearer_auth("b")
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    assert_eq!(slow.await.unwrap().status, 201);
    let done = client.get(&status_url).bearer_auth("a").send().await.unwrap();
    assert_eq!(done.status(), 201);
    assert!(done.headers().get("idempotent-replayed").is_some());
    assert_eq!(done.text().await.unwrap(), "made 1");
    assert_eq!(runs.get(), 1);
}

/// The reaper deletes what is past the threshold and keeps never-completed
/// requests in the store's review list, with where they got to.
#[tokio::test]
async fn reaper_deletes_old_records_and_keeps_unfinished_ones_for_review() {
    use idemkit_core::PhaseUpdate;
    use idemkit_testkit::suite::{claim_req, must_claim, response, scope};
    let clock = Arc::new(ManualClock::new());
    let store: Arc<dyn KeyStore> = Arc::new(MemoryStore::with_clock(clock.clone()));
    let done = scope("a", "old-done");
    let lease = must_claim(&*store, &claim_req(&done, "{}")).await;
    store
        .complete(&done, lease.token, &response(201, "x"))
        .await
        .unwrap();
    let stuck = scope("a", "old-stuck");
    let lease = must_claim(&*store, &claim_req(&stuck, "{}")).await;
    let update = PhaseUpdate {
        recovery_point: "insert".into(),
        step: None,
    };
    store.advance(&stuck, lease.token, &update).await.unwrap();
    store
        .abandon(&stuck, lease.token, "courier timed out")
        .await
        .unwrap();
    clock.advance(Duration::from_secs(73 * 3600));
    let fresh = scope("a", "fresh");
    must_claim(&*store, &claim_req(&fresh, "{}")).await;

    let report = Reaper::new(store.clone(), &idemkit_core::Policy::new())
        .run_once()
        .await
        .unwrap();
    assert_eq!((report.deleted, report.moved_to_review), (1, 1));
    assert!(store.get(&done).await.unwrap().is_none());
    let listed = store.get(&stuck).await.unwrap().expect("listed records stay");
    assert_eq!(
        listed.state,
        idemkit_core::RecordState::Parked,
        "and never run again"
    );
    assert!(
        store.get(&fresh).await.unwrap().is_some(),
        "recent records are kept"
    );
    let review = store.review(10).await.unwrap();
    assert_eq!(review.len(), 1);
    assert_eq!(review[0].scope, stuck);
    assert_eq!(review[0].recovery_point.as_deref(), Some("insert"));
    assert_eq!(review[0].last_error.as_deref(), Some("courier timed out"));
}
