//! What the layer answers: replays (headers kept and dropped, the replay
//! status), mismatches, 5xx and handler-marked outcomes, oversized answers,
//! keys from the body, extractor rejections, configuration and window reuse.

use super::*;

#[tokio::test]
async fn replays_never_carry_cookies_or_unlisted_headers() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_replayed_header("x-allowed"))
        .build()
        .unwrap();
    let app = counting(layer, runs.clone(), |n| {
        (
            StatusCode::CREATED,
            [
                (header::SET_COOKIE, "session=abc".to_owned()),
                (HeaderName::from_static("x-allowed"), format!("run-{n}")),
                (HeaderName::from_static("x-unlisted"), "no".to_owned()),
                (header::CONTENT_TYPE, "application/json".to_owned()),
            ],
            format!("{{\"run\":{n}}}"),
        )
            .into_response()
    });
    let base = serve(app).await;
    let first = send(&base, Some("k"), "a", &json!({})).await;
    assert_eq!(first.status, 201);
    assert!(
        first.headers.get("set-cookie").is_some(),
        "the original keeps its cookie"
    );
    let replay = send(&base, Some("k"), "a", &json!({})).await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    assert!(replay.headers.get("set-cookie").is_none(), "cookie replayed");
    assert!(replay.headers.get("x-unlisted").is_none());
    assert_eq!(replay.headers["x-allowed"], "run-1");
    assert_eq!(replay.headers["content-type"], "application/json");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn too_large_in_lease_mode_answers_the_same_failure_every_time() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_max_stored_body(10))
        .build()
        .unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        (StatusCode::OK, "x".repeat(11)).into_response()
    }))
    .await;
    let a = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(
        (a.status, a.code().as_str()),
        (500, "idempotency_response_too_large")
    );
    let b = send(&base, Some("big"), "a", &json!({})).await;
    assert_eq!(b.status, 500);
    assert!(b.replayed());
    assert_eq!(runs.get(), 1, "the handler's effects are not repeated");
}

#[tokio::test]
async fn key_reuse_after_the_replay_window_is_a_new_request() {
    let clock = Arc::new(ManualClock::new());
    let store = sqlite(Some(clock.clone())).await;
    let window = Duration::from_secs(3600);
    let policy = Policy::new()
        .with_replay_window(window)
        .with_reap_threshold(window * 3);
    let base = serve(tx_route(store.clone(), policy, 4)).await;
    assert_eq!(send(&base, Some("w"), "a", &json!({})).await.status, 201);
    clock.advance(window - Duration::from_secs(1));
    assert!(send(&base, Some("w"), "a", &json!({})).await.replayed());
    assert_eq!(rows(&store).await, 1);
    clock.advance(Duration::from_secs(2));
    let later = send(&base, Some("w"), "a", &json!({"changed": true})).await;
    assert_eq!(later.status, 201);
    assert!(!later.replayed());
    assert_eq!(rows(&store).await, 2);
}

#[tokio::test]
async fn mismatch_status_is_configurable_to_422() {
    let layer = generic(
        memory(),
        Policy::new().with_mismatch_status(MismatchStatus::UnprocessableContent),
    )
    .build()
    .unwrap();
    let base = serve(counting(layer, Runs::default(), |_| {
        StatusCode::CREATED.into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("m"), "a", &json!({"n": 1})).await.status, 201);
    let other = send(&base, Some("m"), "a", &json!({"n": 2})).await;
    assert_eq!(
        (other.status, other.code().as_str()),
        (422, "idempotency_key_reused")
    );
}

#[tokio::test]
async fn key_can_come_from_a_json_body_field() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new())
        .key_json_field("/idempotencyKey")
        .build()
        .unwrap();
    let base = serve(counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("run {n}")).into_response()
    }))
    .await;
    let first = send(
        &base,
        None,
        "a",
        &json!({"idempotencyKey": "body-k", "x": 1, "y": 2}),
    )
    .await;
    assert_eq!(first.status, 201);
    let again = send(
        &base,
        None,
        "a",
        &json!({"y": 2, "x": 1, "idempotencyKey": "body-k"}),
    )
    .await;
    assert!(again.replayed());
    let changed = send(
        &base,
        None,
        "a",
        &json!({"idempotencyKey": "body-k", "x": 9, "y": 2}),
    )
    .await;
    assert_eq!(changed.code(), "idempotency_key_reused");
    assert_eq!(
        send(&base, None, "a", &json!({"x": 1})).await.code(),
        "idempotency_key_missing"
    );
    assert_eq!(
        send(&base, None, "a", &json!({"idempotencyKey": 7})).await.code(),
        "idempotency_key_invalid"
    );
    assert_eq!(
        send(&base, None, "a", &json!({"idempotencyKey": "a b"}))
            .await
            .code(),
        "idempotency_key_invalid"
    );
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn five_hundreds_are_released_by_default_and_replayed_on_request() {
    // The defaults, untouched: `Policy::new()`, and a route of a configuration
    // file that says nothing about server errors.
    let config =
        idemkit_tower::config::IdemkitConfig::from_toml("[[routes]]\nmethod = \"POST\"\npath = \"/op\"\n")
            .unwrap();
    let route = config.route("POST", "/op").unwrap();
    let layers = [
        ("Policy::new()", generic(memory(), Policy::new()), false),
        (
            "the default configuration",
            route.configure(generic(memory(), Policy::new())).unwrap(),
            false,
        ),
        (
            "ServerErrorPolicy::Replay",
            generic(
                memory(),
                Policy::new().with_server_error_policy(ServerErrorPolicy::Replay),
            ),
            true,
        ),
    ];
    for (what, builder, replays) in layers {
        let runs = Runs::default();
        let base = serve(counting(builder.build().unwrap(), runs.clone(), |_| {
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }))
        .await;
        assert_eq!(
            send(&base, Some("e"), "a", &json!({})).await.status,
            500,
            "{what}"
        );
        let second = send(&base, Some("e"), "a", &json!({})).await;
        assert_eq!(second.status, 500, "{what}");
        assert_eq!(second.replayed(), replays, "{what}");
        // Released: the retry ran the handler again; replayed: it did not.
        assert_eq!(runs.get(), if replays { 1 } else { 2 }, "{what}");
    }
}

#[tokio::test]
async fn handler_can_mark_an_outcome_retryable_or_final() {
    // Retryable: not stored, lease ended at once: the retry runs without a 409.
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let base = serve(counting(layer, runs.clone(), |n| {
        if n == 1 {
            (StatusCode::BAD_GATEWAY, Override::Retryable, "courier timed out").into_response()
        } else {
            (StatusCode::CREATED, "label").into_response()
        }
    }))
    .await;
    assert_eq!(send(&base, Some("r"), "a", &json!({})).await.status, 502);
    let second = send(&base, Some("r"), "a", &json!({})).await;
    assert_eq!((second.status, second.replayed()), (201, false));
    assert_eq!(runs.get(), 2);

    // Final: a 502 is stored and replayed.
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        (StatusCode::BAD_GATEWAY, Override::Final, "address rejected").into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("f"), "a", &json!({})).await.status, 502);
    let again = send(&base, Some("f"), "a", &json!({})).await;
    assert_eq!((again.status, again.replayed()), (502, true));
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn replay_status_override_and_safe_methods_pass_through() {
    let runs = Runs::default();
    let layer = generic(memory(), Policy::new().with_replay_status(200))
        .build()
        .unwrap();
    let app = counting(layer.clone(), runs.clone(), |_| {
        (StatusCode::CREATED, "made").into_response()
    })
    .route("/read", get(|| async { "no key needed" }).layer(layer));
    let base = serve(app).await;
    assert_eq!(send(&base, Some("s"), "a", &json!({})).await.status, 201);
    let replay = send(&base, Some("s"), "a", &json!({})).await;
    assert_eq!((replay.status, replay.body.as_slice()), (200, b"made".as_slice()));
    let read = reqwest::get(format!("{base}/read")).await.unwrap();
    assert_eq!(read.status(), 200);
}

#[tokio::test]
async fn configuration_is_validated_and_unscoped_is_explicit() {
    let err = IdempotencyLayer::lease(memory(), Unscoped)
        .policy(
            Policy::new()
                .with_replay_window(Duration::from_secs(60))
                .with_longest_retry_chain(Duration::from_secs(600)),
        )
        .build()
        .unwrap_err();
    assert!(matches!(err, BuildError::Policy(_)), "{err}");
    assert!(
        IdempotencyLayer::lease(memory(), Unscoped)
            .key_json_field("nope")
            .build()
            .is_err()
    );

    // Unscoped on purpose: two callers share one key space.
    let runs = Runs::default();
    let layer = IdempotencyLayer::lease(memory(), Unscoped).build().unwrap();
    let base = serve(counting(layer, runs.clone(), |_| {
        StatusCode::CREATED.into_response()
    }))
    .await;
    assert_eq!(send(&base, Some("u"), "alice", &json!({})).await.status, 201);
    assert!(send(&base, Some("u"), "bob", &json!({})).await.replayed());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn json_extractor_rejections_are_problems() {
    #[derive(serde::Deserialize)]
    #[allow(dead_code)]
    struct Body {
        n: u32,
    }
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let app = Router::new().route(
        "/op",
        post(|Json(_b): Json<Body>| async { StatusCode::CREATED }).layer(layer),
    );
    let base = serve(app).await;
    let shape = send(&base, Some("j1"), "a", &json!({"n": "x"})).await;
    assert_eq!((shape.status, shape.code().as_str()), (400, "validation_failed"));
    assert_eq!(shape.headers["content-type"], "application/problem+json");
    // The validation error released the key: the fixed body may reuse it.
    assert_eq!(send(&base, Some("j1"), "a", &json!({"n": 1})).await.status, 201);
    let no_ct = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth("a")
        .header("idempotency-key", "j2")
        .body("{\"n\":1}")
        .send()
        .await
        .unwrap();
    assert_eq!(no_ct.status(), 415);
    assert_eq!(no_ct.headers()["content-type"], "application/problem+json");
}

/// The layer takes any `http_body::Body`, as tower-http's layers do: here a
/// hyper-style `Full<Bytes>` request, in front of an axum router. The key is
/// claimed from it and the second request with the same key is a replay.
#[tokio::test]
async fn the_layer_takes_any_request_body() {
    use http_body_util::Full;
    use tower::{Layer, ServiceExt};

    let runs = Runs::default();
    let keys = IdempotencyLayer::lease(memory(), BearerTokenAccount::new("test-secret"))
        .build()
        .unwrap();
    let router = Router::new()
        .route(
            "/op",
            post(|State(runs): State<Runs>| async move {
                runs.next();
                StatusCode::CREATED
            }),
        )
        .with_state(runs.clone());
    let service = keys.layer(router);
    let request = || {
        http::Request::post("/op")
            .header("authorization", "Bearer a")
            .header("idempotency-key", "any-body")
            .header("content-type", "application/json")
            .body(Full::new(bytes::Bytes::from_static(br#"{"n":1}"#)))
            .unwrap()
    };
    let first = service.clone().oneshot(request()).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = service.oneshot(request()).await.unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(runs.get(), 1, "the replay did not run the handler");
}
