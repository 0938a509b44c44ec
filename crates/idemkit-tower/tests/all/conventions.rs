//! Conventions users already have, over real HTTP: replayed headers configured
//! per route in the TOML, compressed answers replayed only to callers that
//! accept their coding, OASIS Repeatable Requests headers, and streaming
//! answers on keyed routes.

use std::time::{Duration, SystemTime};

use idemkit_tower::config::IdemkitConfig;

use super::*;

fn configured(toml: &str, path: &str) -> IdempotencyLayerBuilder {
    let config = IdemkitConfig::from_toml(toml).unwrap();
    config
        .route("POST", path)
        .unwrap()
        .configure(IdempotencyLayer::lease(
            memory(),
            BearerTokenAccount::new("test-secret"),
        ))
        .unwrap()
}

async fn post(base: &str, headers: &[(&str, String)], body: &str) -> Answer {
    let mut req = reqwest::Client::new()
        .post(format!("{base}/op"))
        .bearer_auth("a")
        .header("content-type", "application/json")
        .body(body.to_owned());
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let res = req.send().await.unwrap();
    Answer {
        status: res.status().as_u16(),
        headers: res.headers().clone(),
        body: res.bytes().await.unwrap().to_vec(),
    }
}

#[tokio::test]
async fn replayed_headers_come_from_the_route_configuration() {
    let layer = configured(
        "[[routes]]\nmethod = \"POST\"\npath = \"/op\"\nreplay_headers = [\"etag\", \"cache-control\", \"link\"]\n",
        "/op",
    )
    .build()
    .unwrap();
    let runs = Runs::default();
    let app = counting(layer, runs.clone(), |n| {
        (
            StatusCode::CREATED,
            [
                (header::ETAG, format!("\"v{n}\"")),
                (header::CACHE_CONTROL, "no-store".to_owned()),
                (header::LINK, "</labels/1>; rel=\"self\"".to_owned()),
                (header::LOCATION, "/labels/1".to_owned()),
                (header::SET_COOKIE, "s=1".to_owned()),
                (HeaderName::from_static("x-unlisted"), "no".to_owned()),
            ],
            format!("{{\"run\":{n}}}"),
        )
            .into_response()
    });
    let base = serve(app).await;
    let key = || vec![("idempotency-key", "k1".to_owned())];
    let first = post(&base, &key(), "{}").await;
    assert_eq!(first.status, 201);
    let replay = post(&base, &key(), "{}").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    for h in ["etag", "cache-control", "link", "location"] {
        assert_eq!(
            replay.headers.get(h),
            first.headers.get(h),
            "{h} replayed as sent"
        );
    }
    assert!(replay.headers.get("set-cookie").is_none());
    assert!(replay.headers.get("x-unlisted").is_none());
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_compressed_answer_replays_with_its_coding_only_to_callers_that_accept_it() {
    let layer = configured("[[routes]]\nmethod = \"POST\"\npath = \"/op\"\n", "/op")
        .build()
        .unwrap();
    let runs = Runs::default();
    // Not real gzip: the bytes must come back exactly, whatever they are.
    let app = counting(layer, runs.clone(), |_| {
        (
            StatusCode::CREATED,
            [
                (header::CONTENT_ENCODING, "gzip"),
                (header::CONTENT_TYPE, "application/json"),
            ],
            vec![0x1f_u8, 0x8b, 8, 0, 1, 2, 3],
        )
            .into_response()
    });
    let base = serve(app).await;
    let gzip = || {
        vec![
            ("idempotency-key", "k1".to_owned()),
            ("accept-encoding", "gzip, br".to_owned()),
        ]
    };
    let first = post(&base, &gzip(), "{}").await;
    assert_eq!(first.status, 201);
    let replay = post(&base, &gzip(), "{}").await;
    assert!(replay.replayed());
    assert_eq!(
        replay.headers["content-encoding"], "gzip",
        "the coding is replayed with the body"
    );
    assert_eq!(replay.body, first.body);
    for accept in [None, Some("br"), Some("gzip;q=0")] {
        let mut headers = vec![("idempotency-key", "k1".to_owned())];
        if let Some(a) = accept {
            headers.push(("accept-encoding", a.to_owned()));
        }
        let refused = post(&base, &headers, "{}").await;
        assert_eq!(refused.status, 406, "{accept:?}");
        assert_eq!(refused.code(), "idempotency_replay_not_acceptable");
        assert!(refused.headers.get("content-encoding").is_none());
    }
    assert_eq!(runs.get(), 1, "never run again");
}

fn http_date(t: SystemTime) -> String {
    httpdate::fmt_http_date(t)
}

fn repeatable(id: &str, first_sent: SystemTime) -> Vec<(&'static str, String)> {
    vec![
        ("repeatability-request-id", id.to_owned()),
        ("repeatability-first-sent", http_date(first_sent)),
    ]
}

#[tokio::test]
async fn oasis_repeatable_requests_are_keyed_by_their_headers() {
    let layer = configured(
        "[defaults]\nreplay_window = \"10m\"\nreap_threshold = \"1h\"\nlease = \"5s\"\n\
         [[routes]]\nmethod = \"POST\"\npath = \"/op\"\nkey = \"repeatability\"\n",
        "/op",
    )
    .build()
    .unwrap();
    let runs = Runs::default();
    let app = counting(layer, runs.clone(), |n| {
        (StatusCode::CREATED, format!("{{\"run\":{n}}}")).into_response()
    });
    let base = serve(app).await;
    let now = SystemTime::now();
    let result = |a: &Answer| {
        a.headers
            .get("repeatability-result")
            .map(|v| v.to_str().unwrap().to_owned())
    };

    let first = post(&base, &repeatable("r-1", now), "{\"a\":1}").await;
    assert_eq!(first.status, 201);
    assert_eq!(result(&first).as_deref(), Some("accepted"));
    let again = post(&base, &repeatable("r-1", now), "{\"a\":1}").await;
    assert_eq!(again.status, 201);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(
        result(&again).as_deref(),
        Some("accepted"),
        "a replay is accepted"
    );

    let reused = post(&base, &repeatable("r-1", now), "{\"a\":2}").await;
    assert_eq!(reused.status, 409);
    assert_eq!(reused.code(), "idempotency_key_reused");
    assert_eq!(result(&reused).as_deref(), Some("rejected"));

    let stale = post(
        &base,
        &repeatable("r-2", now - Duration::from_secs(11 * 60)),
        "{}",
    )
    .await;
    assert_eq!(stale.status, 412);
    assert_eq!(stale.code(), "repeatability_first_sent_out_of_window");
    assert_eq!(stale.headers["content-type"], "application/problem+json");
    assert_eq!(result(&stale).as_deref(), Some("rejected"));

    let ahead = post(&base, &repeatable("r-3", now + Duration::from_secs(3600)), "{}").await;
    assert_eq!(ahead.status, 412);

    let no_first_sent = post(&base, &[("repeatability-request-id", "r-4".to_owned())], "{}").await;
    assert_eq!(no_first_sent.status, 400);
    assert_eq!(no_first_sent.code(), "idempotency_key_missing");
    assert_eq!(result(&no_first_sent).as_deref(), Some("rejected"));

    let bad_date = post(
        &base,
        &[
            ("repeatability-request-id", "r-5".to_owned()),
            ("repeatability-first-sent", "yesterday".to_owned()),
        ],
        "{}",
    )
    .await;
    assert_eq!(bad_date.code(), "idempotency_key_invalid");

    let idempotency_key = post(&base, &[("idempotency-key", "k".to_owned())], "{}").await;
    assert_eq!(
        idempotency_key.status, 400,
        "this route speaks only repeatability"
    );
    assert_eq!(idempotency_key.code(), "idempotency_key_missing");
    assert_eq!(runs.get(), 1, "only the first request ran");
}

/// An answer that never ends: server-sent events, one every 10 ms, forever.
fn endless_events() -> Response {
    let events = futures::stream::unfold(0u64, |n| async move {
        tokio::time::sleep(Duration::from_millis(10)).await;
        Some((
            Ok::<_, std::io::Error>(bytes::Bytes::from(format!("data: {n}\n\n"))),
            n + 1,
        ))
    });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .body(axum::body::Body::from_stream(events))
        .unwrap()
}

#[tokio::test]
async fn a_streaming_answer_on_a_keyed_route_is_refused_never_replayed_truncated() {
    let layer = generic(memory(), Policy::new()).build().unwrap();
    let runs = Runs::default();
    let app = counting(layer, runs.clone(), |_| endless_events());
    let base = serve(app).await;
    let key = || vec![("idempotency-key", "s1".to_owned())];
    let first = tokio::time::timeout(Duration::from_secs(5), post(&base, &key(), "{}"))
        .await
        .expect("the layer answers at once instead of buffering the stream");
    assert_eq!(first.status, 500);
    assert_eq!(first.code(), "idempotency_streaming_unsupported");
    // The handler ran (lease mode): the retry gets the same failure, never a
    // second run and never an empty or partial stream.
    let retry = tokio::time::timeout(Duration::from_secs(5), post(&base, &key(), "{}"))
        .await
        .unwrap();
    assert_eq!(retry.code(), "idempotency_streaming_unsupported");
    assert_eq!(runs.get(), 1);
}

#[tokio::test]
async fn a_streaming_answer_in_single_step_mode_rolls_back_and_frees_the_key() {
    let store = sqlite(None).await;
    let layer = IdempotencyLayer::single_step(store.clone(), BearerTokenAccount::new("test-secret"))
        .build()
        .unwrap();
    let runs = Runs::default();
    let app = counting(layer, runs.clone(), |_| endless_events());
    let base = serve(app).await;
    let key = || vec![("idempotency-key", "s1".to_owned())];
    for run in 1..=2 {
        let answer = tokio::time::timeout(Duration::from_secs(5), post(&base, &key(), "{}"))
            .await
            .unwrap();
        assert_eq!(answer.code(), "idempotency_streaming_unsupported");
        assert_eq!(runs.get(), run, "nothing was committed: the key is free again");
    }
}
