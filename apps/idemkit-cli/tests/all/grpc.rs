//! The labels contract over gRPC, with real processes: `idemkit serve` and
//! `idemkit courier` from the built binary, called with the generated tonic
//! client (`labels.v1.Labels`) over HTTP/2.

use std::time::Duration;

use idemkit_labels::proto::labels_client::LabelsClient;
use idemkit_labels::proto::{self, CreateLabelRequest, GetLabelRequest};
use prost::Message;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_types::StatusExt;

use crate::labels::{Labels, body};

const TOKEN: &str = "demo-token-acme";

async fn client(base: &str) -> LabelsClient<Channel> {
    let channel = Channel::from_shared(base.to_owned())
        .unwrap()
        .connect()
        .await
        .expect("connect over h2c");
    LabelsClient::new(channel)
}

/// The REST fixture body as the gRPC request (its proto3 JSON mapping).
fn create(key: &str) -> CreateLabelRequest {
    proto::from_json(&body(key, "GB").to_string()).expect("the REST body is the request's JSON mapping")
}

fn call<T>(message: T, token: &str) -> Request<T> {
    let mut req = Request::new(message);
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req.set_timeout(Duration::from_secs(20));
    req
}

fn reason(status: &Status) -> String {
    status
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default()
}

/// One answer, reduced to what a replay must reproduce.
#[derive(Debug, PartialEq)]
enum Answer {
    Ok { bytes: Vec<u8>, replayed: bool },
    Err { code: Code, reason: String },
}

async fn create_label(c: &mut LabelsClient<Channel>, message: CreateLabelRequest) -> Answer {
    match c.create_label(call(message, TOKEN)).await {
        Ok(res) => Answer::Ok {
            replayed: res
                .metadata()
                .get("idempotent-replayed")
                .is_some_and(|v| v == "true"),
            bytes: res.into_inner().encode_to_vec(),
        },
        Err(s) => Answer::Err {
            code: s.code(),
            reason: reason(&s),
        },
    }
}

/// Rows in the service's `labels` table.
async fn label_count(labels: &Labels) -> i64 {
    let url = format!("sqlite://{}?mode=ro", labels.db().display());
    let pool = sqlx::SqlitePool::connect(&url).await.unwrap();
    let n = sqlx::query_scalar("SELECT COUNT(*) FROM labels")
        .fetch_one(&pool)
        .await
        .unwrap();
    pool.close().await;
    n
}

async fn shipments(labels: &Labels) -> u64 {
    labels.stats().await["shipments"].as_u64().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_calls_with_one_key_make_one_label_and_one_shipment() {
    let labels = Labels::start();
    let c = client(&labels.base).await;
    let message = create("grpc-64");
    let answers = futures::future::join_all((0..64).map(|_| {
        let mut c = c.clone();
        let m = message.clone();
        async move { create_label(&mut c, m).await }
    }))
    .await;
    let mut winner: Option<Vec<u8>> = None;
    let (mut ok, mut aborted) = (0, 0);
    for a in &answers {
        match a {
            Answer::Ok { bytes, .. } => {
                ok += 1;
                match &winner {
                    Some(w) => assert_eq!(w, bytes, "every OK answer is the winner's label, byte for byte"),
                    None => winner = Some(bytes.clone()),
                }
            }
            Answer::Err {
                code: Code::Aborted,
                reason,
            } => {
                assert_eq!(reason, "idempotency_request_in_progress");
                aborted += 1;
            }
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert!(ok >= 1, "{answers:?}");
    assert_eq!(ok + aborted, 64);
    assert_eq!(shipments(&labels).await, 1, "one courier shipment");
    assert_eq!(label_count(&labels).await, 1, "one label row");
    // After the fact, a retry is the stored answer, marked.
    let mut c2 = c.clone();
    let again = create_label(&mut c2, message).await;
    let Answer::Ok { bytes, replayed } = again else {
        panic!("{again:?}")
    };
    assert!(replayed, "a retry is marked idempotent-replayed");
    assert_eq!(Some(bytes.clone()), winner, "the replay is byte-identical");
    let label = proto::Label::decode(bytes.as_slice()).unwrap();
    assert_eq!(label.status, "created");
    // The same label over REST, and its JSON mapping is the REST document.
    let rest: serde_json::Value = reqwest::Client::new()
        .get(format!("{}/labels/{}", labels.base, label.id))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mapped: serde_json::Value = serde_json::from_str(&proto::to_json(&label)).unwrap();
    for (k, v) in mapped.as_object().unwrap() {
        assert_eq!(&rest[k], v, "field {k}: REST {rest} vs gRPC {mapped}");
    }
    let got = c
        .clone()
        .get_label(call(GetLabelRequest { id: label.id.clone() }, TOKEN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got, label);
    assert_eq!(shipments(&labels).await, 1);
}

#[tokio::test]
async fn refusals_carry_the_stable_codes() {
    let labels = Labels::start();
    let mut c = client(&labels.base).await;
    assert!(matches!(
        create_label(&mut c, create("grpc-reuse")).await,
        Answer::Ok { replayed: false, .. }
    ));
    // The same key with another request.
    let mut other = create("grpc-reuse");
    other.parcel.as_mut().unwrap().weight_grams += 1;
    assert_eq!(
        create_label(&mut c, other).await,
        Answer::Err {
            code: Code::FailedPrecondition,
            reason: "idempotency_key_reused".into()
        }
    );
    // No key in the field and none in metadata.
    assert_eq!(
        create_label(&mut c, create("")).await,
        Answer::Err {
            code: Code::InvalidArgument,
            reason: "idempotency_key_missing".into()
        }
    );
    // A key with a control character.
    assert_eq!(
        create_label(&mut c, create("bad\u{7}key")).await,
        Answer::Err {
            code: Code::InvalidArgument,
            reason: "idempotency_key_invalid".into()
        }
    );
    // An invalid label: validated like the REST body, nothing stored.
    let mut bad = create("grpc-bad-country");
    bad.ship_to.as_mut().unwrap().country = "XX".into();
    assert_eq!(
        create_label(&mut c, bad).await,
        Answer::Err {
            code: Code::InvalidArgument,
            reason: "validation_failed".into()
        }
    );
    // The key in metadata when the field is empty.
    let mut req = call(create(""), TOKEN);
    req.metadata_mut()
        .insert("idempotency-key", "grpc-meta".parse().unwrap());
    assert!(c.create_label(req).await.is_ok());
    // A wrong token.
    let s = c.create_label(call(create("grpc-x"), "nope")).await.unwrap_err();
    assert_eq!(
        (s.code(), reason(&s).as_str()),
        (Code::Unauthenticated, "unauthorized")
    );
    assert_eq!(shipments(&labels).await, 2);
}

#[tokio::test]
async fn the_client_deadline_reaches_the_courier_as_the_remainder() {
    // The service's own courier deadline (10 s) is longer than the caller's.
    let labels = Labels::start_with_defaults();
    let mut c = client(&labels.base).await;
    let deadline = || async {
        let v: serde_json::Value = reqwest::get(format!("{}/_deadline", labels.courier))
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        v["lastRequestTimeoutMs"]
            .as_u64()
            .expect("the courier saw a Request-Timeout")
    };
    let mut req = call(create("grpc-deadline"), TOKEN);
    req.set_timeout(Duration::from_secs(2));
    c.create_label(req).await.expect("created within 2 s");
    let seen = deadline().await;
    assert!(
        seen > 0 && seen <= 2000,
        "the courier got {seen} ms: only what was left of the caller's 2 s"
    );
    // Control: without a caller deadline the courier gets the service's own.
    let mut req = call(create("grpc-no-deadline"), TOKEN);
    req.set_timeout(Duration::from_secs(60));
    c.create_label(req).await.unwrap();
    let seen = deadline().await;
    assert!(seen > 2000 && seen <= 10_000, "{seen}");
}

#[tokio::test]
async fn reflection_lists_the_service_on_the_grpc_listener() {
    use tonic_reflection::pb::{v1, v1alpha};
    let mut labels = Labels::courier_only();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    labels.extra_args = vec!["--grpc-listen".into(), format!("127.0.0.1:{port}")];
    labels.start_service(&[]);
    let base = format!("http://127.0.0.1:{port}");
    let channel = Channel::from_shared(base.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(
            String::new(),
        )),
    };
    let mut stream = v1::server_reflection_client::ServerReflectionClient::new(channel.clone())
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let listed = format!("{:?}", stream.message().await.unwrap().unwrap());
    assert!(listed.contains(proto::SERVICE), "{listed}");
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
                "labels.v1.CreateLabelRequest".into(),
            ),
        ),
    };
    let mut stream = v1alpha::server_reflection_client::ServerReflectionClient::new(channel)
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let file = format!("{:?}", stream.message().await.unwrap().unwrap());
    assert!(file.contains("FileDescriptorResponse"), "{file}");
    // The API itself on the gRPC listener.
    let mut c = client(&base).await;
    assert!(matches!(
        create_label(&mut c, create("grpc-own-port")).await,
        Answer::Ok { .. }
    ));
}

#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_call_then_restart_and_retry_makes_one_label() {
    for boundary in ["idemkit::after_intent", "idemkit::after_call"] {
        let mut labels = Labels::courier_only();
        labels.start_service(&[("IDEMKIT_CRASH_AT", boundary)]);
        let base = labels.base.clone();
        let message = create("grpc-crash");
        let first = tokio::spawn({
            let m = message.clone();
            async move {
                let mut c = client(&base).await;
                c.create_label(call(m, TOKEN)).await
            }
        });
        labels.wait_line(&format!("CRASHPOINT {boundary}"));
        labels.kill9();
        assert!(first.await.unwrap().is_err(), "the call died with the process");
        labels.start_service(&[]);
        let mut c = client(&labels.base).await;
        // The lease (400 ms) must lapse before the retry takes the request over.
        let label = loop {
            match c.create_label(call(message.clone(), TOKEN)).await {
                Ok(res) => break res.into_inner(),
                Err(s) if s.code() == Code::Aborted => tokio::time::sleep(Duration::from_millis(200)).await,
                Err(s) => panic!("{boundary}: {s:?}"),
            }
        };
        assert_eq!(label.status, "created", "{boundary}");
        assert_eq!(shipments(&labels).await, 1, "{boundary}: one courier shipment");
        let rows = crate::labels::label_rows(&labels, "grpc-crash").await;
        assert_eq!(rows.len(), 1, "{boundary}: one label row: {rows:?}");
        assert_eq!(rows[0].id, label.id, "{boundary}");
    }
}

/// A call abandoned by a crash is finished by the restarted service's
/// completer, with no client retry; the client's later call is the replay.
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_completer_finishes_an_abandoned_call_with_no_retry() {
    let mut labels = Labels::courier_only();
    labels.start_service(&[("IDEMKIT_CRASH_AT", "idemkit::after_intent")]);
    let base = labels.base.clone();
    let message = create("grpc-completer");
    let first = tokio::spawn({
        let m = message.clone();
        async move { client(&base).await.create_label(call(m, TOKEN)).await }
    });
    labels.wait_line("CRASHPOINT idemkit::after_intent");
    labels.kill9();
    assert!(first.await.unwrap().is_err());
    assert_eq!(
        shipments(&labels).await,
        0,
        "the crash came before the courier call"
    );
    labels.start_service(&[]);
    let started = std::time::Instant::now();
    let row = loop {
        let rows = crate::labels::label_rows(&labels, "grpc-completer").await;
        if rows.first().is_some_and(|r| r.status == "created") {
            break rows[0].clone();
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "not completed: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(shipments(&labels).await, 1);
    let mut c = client(&labels.base).await;
    let Answer::Ok { bytes, replayed } = create_label(&mut c, message).await else {
        panic!("the stored answer")
    };
    assert!(
        replayed,
        "the completer stored the answer; the client's call replays it"
    );
    assert_eq!(proto::Label::decode(bytes.as_slice()).unwrap().id, row.id);
    assert_eq!(shipments(&labels).await, 1);
}

/// A courier that refuses the label for good: `FAILED_PRECONDITION` with the
/// courier's reason, stored (marked final), so the retry is that same answer
/// and the courier is not called again. A courier outage: `UNAVAILABLE` with
/// RetryInfo, not stored; the retry resumes and books the same label.
#[tokio::test]
async fn courier_refusal_is_stored_and_an_outage_resumes() {
    let labels = Labels::start();
    let mut c = client(&labels.base).await;
    let calls = || async { labels.stats().await["calls"].as_u64().unwrap() };
    labels.faults(serde_json::json!({"rejectNext": 1})).await;
    let refused = c
        .create_label(call(create("grpc-refused"), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let info = refused.get_error_details().error_info().cloned().unwrap();
    assert_eq!(
        (info.reason.as_str(), info.domain.as_str()),
        ("address_rejected", "labels.v1")
    );
    assert!(
        refused.metadata().get("idemkit-outcome").is_none(),
        "the marker never leaves the server"
    );
    let before = calls().await;
    let again = c
        .create_label(call(create("grpc-refused"), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(
        (again.code(), reason(&again)),
        (Code::FailedPrecondition, "address_rejected".into())
    );
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(calls().await, before, "a stored refusal calls nothing");

    labels
        .faults(serde_json::json!({"failNext": 100, "status": 503}))
        .await;
    let down = c
        .create_label(call(create("grpc-outage"), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(
        (down.code(), reason(&down)),
        (Code::Unavailable, "courier_unavailable".into())
    );
    assert!(down.get_error_details().retry_info().is_some(), "RetryInfo");
    let failed_id = down.get_error_details().error_info().unwrap().metadata["label_id"].clone();
    labels.faults(serde_json::json!({"reset": true})).await;
    let label = c
        .create_label(call(create("grpc-outage"), TOKEN))
        .await
        .expect("the retry resumes")
        .into_inner();
    assert_eq!(
        (label.status.as_str(), label.id),
        ("created", failed_id),
        "the same label"
    );
    assert_eq!(shipments(&labels).await, 1);
}

/// The AIP-155 form: `CreateLabelWithRequestId` keyed by its `request_id`
/// field (a UUID4, resolved by name from the descriptor set), sharing the key
/// space and label creation of `CreateLabel`; retries numbered by gRFC A6
/// `grpc-previous-rpc-attempts` are counted in `/metrics`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aip_155_request_ids_key_create_label_with_request_id() {
    let labels = Labels::start();
    let mut c = client(&labels.base).await;
    let with_id = |id: &str| {
        let base = create("unused");
        proto::CreateLabelWithRequestIdRequest {
            request_id: id.to_owned(),
            courier: base.courier,
            ship_from: base.ship_from,
            ship_to: base.ship_to,
            parcel: base.parcel,
        }
    };
    let id = "7c9e6679-7425-40de-944b-e07fc1f90ae7";
    let first = c
        .create_label_with_request_id(call(with_id(id), TOKEN))
        .await
        .unwrap();
    assert!(first.metadata().get("idempotent-replayed").is_none());
    let first = first.into_inner();
    assert_eq!(first.status, "created");
    let mut retry = call(with_id(id), TOKEN);
    retry
        .metadata_mut()
        .insert("grpc-previous-rpc-attempts", "1".parse().unwrap());
    let again = c.create_label_with_request_id(retry).await.unwrap();
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(
        again.into_inner(),
        first,
        "the first answer, not the label's current state"
    );
    assert_eq!(shipments(&labels).await, 1);

    let not_uuid = c
        .create_label_with_request_id(call(with_id("label-order-4711"), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(not_uuid.code(), Code::InvalidArgument);
    assert_eq!(reason(&not_uuid), "idempotency_key_invalid");
    assert!(not_uuid.message().contains("UUID4"), "{}", not_uuid.message());
    let not_v4 = c
        .create_label_with_request_id(call(with_id("7c9e6679-7425-10de-944b-e07fc1f90ae7"), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(reason(&not_v4), "idempotency_key_invalid");
    let none = c
        .create_label_with_request_id(call(with_id(""), TOKEN))
        .await
        .unwrap_err();
    assert_eq!(reason(&none), "idempotency_key_missing");
    assert_eq!(shipments(&labels).await, 1);

    let metrics = reqwest::get(format!("{}/metrics", labels.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let line = |bucket: &str| {
        metrics
            .lines()
            .find(|l| {
                l.starts_with("idemkit_grpc_call_attempts_total")
                    && l.contains(&format!("previous_attempts=\"{bucket}\""))
            })
            .map(str::to_owned)
    };
    assert!(line("1").is_some_and(|l| l.ends_with(" 1")), "{metrics}");
    assert!(line("0").is_some(), "{metrics}");
}

/// Forwards every call; the first call's answer is lost on the way back (the
/// server ran it) and replaced by `UNAVAILABLE`, so the client retries.
#[derive(Clone)]
struct LoseFirstAnswer<S> {
    inner: S,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for LoseFirstAnswer<S>
where
    S: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    S::Error: Send,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        let n = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let fut = self.inner.call(req);
        Box::pin(async move {
            let res = fut.await?;
            if n > 0 {
                return Ok(res);
            }
            // Read the answer to its end (the server finished), then lose it.
            let _ = http_body_util::BodyExt::collect(res.into_body()).await;
            Ok(Status::unavailable("connection lost").into_http())
        })
    }
}

/// AIP-4235 / gRFC A6 through `idemkit-client`'s tonic layer: an empty
/// `request_id` is filled with one UUID4 for the logical call and reused by the
/// retry (the server replays instead of booking twice), and the retry carries
/// `grpc-previous-rpc-attempts: 1`, which the server counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_fills_the_request_id_once_and_numbers_its_retries() {
    use idemkit_client::{GrpcRetryLayer, RetryConfig, RetryPolicy};
    let labels = Labels::start();
    let channel = Channel::from_shared(labels.base.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let service = tower::ServiceBuilder::new()
        .layer(
            GrpcRetryLayer::new(RetryPolicy::new(RetryConfig::new()).with_seed(3))
                .with_request_id_field(proto::CREATE_LABEL_WITH_REQUEST_ID, 1),
        )
        .service(LoseFirstAnswer {
            inner: channel,
            calls: calls.clone(),
        });
    let mut c = LabelsClient::new(service);
    let base = create("unused");
    let message = proto::CreateLabelWithRequestIdRequest {
        request_id: String::new(),
        courier: base.courier,
        ship_from: base.ship_from,
        ship_to: base.ship_to,
        parcel: base.parcel,
    };
    let res = c
        .create_label_with_request_id(call(message, TOKEN))
        .await
        .unwrap();
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 2, "one retry");
    assert_eq!(
        res.metadata()
            .get("idempotent-replayed")
            .map(|v| v.to_str().unwrap().to_owned()),
        Some("true".into()),
        "the retry reused the request id: the first run's answer is replayed"
    );
    assert_eq!(res.into_inner().status, "created");
    assert_eq!(shipments(&labels).await, 1, "booked once");
    let metrics = reqwest::get(format!("{}/metrics", labels.base))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("idemkit_grpc_call_attempts_total")
                && l.contains("previous_attempts=\"1\"")
                && l.ends_with(" 1")),
        "{metrics}"
    );
}
