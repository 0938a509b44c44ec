//! `idemkit check --grpc`: the real binary against the real labels service's gRPC
//! API (real processes; descriptors by server reflection), keyed by metadata and by
//! an AIP-155 request id; and, as the negative control, against an in-test gRPC
//! server that ignores keys, which the concurrency and replay gates must fail.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use crate::labels::{Labels, body};
use crate::{Run, idemkit};

/// The labels request body as the gRPC message's JSON, without a key member.
fn label_body(courier: &str) -> Value {
    let mut b = body("unused", "GB");
    b.as_object_mut().unwrap().remove("idempotencyKey");
    b["courier"] = json!(courier);
    b
}

async fn check_labels(labels: &Labels, method: &str, extra: &[&str]) -> Run {
    let mut args: Vec<String> = [
        "check",
        "--grpc",
        &labels.base,
        "--grpc-method",
        method,
        "-H",
        "authorization: Bearer demo-token-acme",
        "--other-account-header",
        "authorization: Bearer demo-token-globex",
        "--body",
        &label_body("ups").to_string(),
        "--alt-body",
        &label_body("dhl").to_string(),
        "--count-url",
        &format!("{}/_stats", labels.courier),
        "--count-pointer",
        "/shipments",
        "--json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    idemkit(args).await
}

/// Every gate that applies passed, and the policy gate was not applicable.
fn assert_all_applicable_pass(run: &Run) {
    assert_eq!(
        run.verdicts(),
        crate::expect(&[
            ("concurrency", "pass"),
            ("replay", "pass"),
            ("mismatch", "pass"),
            ("in-progress", "pass"),
            ("bad-keys", "pass"),
            ("isolation", "pass"),
            ("fresh-key", "pass"),
            ("policy", "not-applicable"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.code, 0, "{run:#?}");
    let report = run.report();
    assert_eq!(report["verdict"], "pass");
    assert_eq!(report["target"]["protocol"], "grpc");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_check_passes_create_label_keyed_by_metadata() {
    let labels = Labels::start();
    let run = check_labels(&labels, "labels.v1.Labels/CreateLabel", &[]).await;
    assert_all_applicable_pass(&run);
    assert_eq!(run.report()["target"]["key"], "key in metadata idempotency-key");
    // The stable codes came from the ErrorInfo reasons, the statuses from the codes.
    let mismatch = run.evidence("mismatch");
    assert!(
        mismatch.contains("400 idempotency_key_reused"),
        "FAILED_PRECONDITION → 400: {mismatch}"
    );
    let bad = run.evidence("bad-keys");
    assert!(bad.contains("missing → 400 idempotency_key_missing"), "{bad}");
    let replay = run.evidence("replay");
    assert!(replay.contains("2 × 200 replay"), "{replay}");
    assert!(run.evidence("policy").contains("x-idempotency"), "{run:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_check_passes_create_label_with_request_id_keyed_by_the_field() {
    let labels = Labels::start();
    let run = check_labels(
        &labels,
        "labels.v1.Labels/CreateLabelWithRequestId",
        &["--grpc-key-field", "request_id"],
    )
    .await;
    assert_all_applicable_pass(&run);
    assert_eq!(run.report()["target"]["key"], "key in field request_id (a UUID4)");
    // A key that is not a UUID4 is refused by the service: the 256-character one.
    let bad = run.evidence("bad-keys");
    assert!(
        bad.contains("256 characters → 400 idempotency_key_invalid"),
        "{bad}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_check_refuses_what_it_cannot_check() {
    let labels = Labels::start();
    // A JSON member the request message lacks.
    let run = idemkit(
        [
            "check",
            "--grpc",
            &labels.base,
            "--grpc-method",
            "labels.v1.Labels/CreateLabel",
            "--body",
            r#"{"courier":"ups","colour":"red"}"#,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    )
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.stderr.contains("labels.v1.CreateLabelRequest") && run.stderr.contains("colour"),
        "{run:#?}"
    );
    // A method the service does not have.
    let run = idemkit(
        [
            "check",
            "--grpc",
            &labels.base,
            "--grpc-method",
            "labels.v1.Labels/DeleteLabel",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    )
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.stderr.contains("no method `DeleteLabel`") && run.stderr.contains("CreateLabel"),
        "{run:#?}"
    );
    // A key field that is not a string field of the request.
    let run = idemkit(
        [
            "check",
            "--grpc",
            &labels.base,
            "--grpc-method",
            "labels.v1.Labels/CreateLabelWithRequestId",
            "--grpc-key-field",
            "parcel",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    )
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("not a singular string"), "{run:#?}");
}

/// `test.v1.Orders/Create(CreateOrder) returns (Order)`, by hand.
#[derive(Clone, PartialEq, prost::Message)]
struct CreateOrder {
    #[prost(string, tag = "1")]
    sku: String,
    #[prost(uint32, tag = "2")]
    quantity: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Order {
    #[prost(string, tag = "1")]
    id: String,
    #[prost(string, tag = "2")]
    sku: String,
    #[prost(uint32, tag = "3")]
    quantity: u32,
}

/// The encoded descriptor set of the `test.v1` file, for reflection.
fn orders_descriptor_set() -> Vec<u8> {
    use prost::Message as _;
    use prost_reflect::prost_types::field_descriptor_proto::{Label, Type};
    use prost_reflect::prost_types::{
        DescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet, MethodDescriptorProto,
        ServiceDescriptorProto,
    };
    let field = |name: &str, number, ty: Type| FieldDescriptorProto {
        name: Some(name.into()),
        number: Some(number),
        r#type: Some(ty as i32),
        label: Some(Label::Optional as i32),
        ..Default::default()
    };
    let message = |name: &str, fields| DescriptorProto {
        name: Some(name.into()),
        field: fields,
        ..Default::default()
    };
    FileDescriptorSet {
        file: vec![FileDescriptorProto {
            name: Some("test/v1/orders.proto".into()),
            package: Some("test.v1".into()),
            syntax: Some("proto3".into()),
            message_type: vec![
                message(
                    "CreateOrder",
                    vec![field("sku", 1, Type::String), field("quantity", 2, Type::Uint32)],
                ),
                message(
                    "Order",
                    vec![
                        field("id", 1, Type::String),
                        field("sku", 2, Type::String),
                        field("quantity", 3, Type::Uint32),
                    ],
                ),
            ],
            service: vec![ServiceDescriptorProto {
                name: Some("Orders".into()),
                method: vec![
                    MethodDescriptorProto {
                        name: Some("Create".into()),
                        input_type: Some(".test.v1.CreateOrder".into()),
                        output_type: Some(".test.v1.Order".into()),
                        ..Default::default()
                    },
                    // Described, never served: the check must refuse it unsent.
                    MethodDescriptorProto {
                        name: Some("Watch".into()),
                        input_type: Some(".test.v1.CreateOrder".into()),
                        output_type: Some(".test.v1.Order".into()),
                        server_streaming: Some(true),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
            ..Default::default()
        }],
    }
    .encode_to_vec()
}

/// Creates a new order on every call, whatever the key: the classic service
/// with no idempotency at all.
struct Forgetful(Arc<AtomicU64>);

impl tonic::server::UnaryService<CreateOrder> for Forgetful {
    type Response = Order;
    type Future = futures::future::Ready<Result<tonic::Response<Order>, tonic::Status>>;

    fn call(&mut self, request: tonic::Request<CreateOrder>) -> Self::Future {
        let n = self.0.fetch_add(1, Ordering::SeqCst) + 1;
        let m = request.into_inner();
        futures::future::ready(Ok(tonic::Response::new(Order {
            id: format!("ord-{n}"),
            sku: m.sku,
            quantity: m.quantity,
        })))
    }
}

/// Which reflection service the test server offers.
#[derive(Clone, Copy, PartialEq)]
enum Reflection {
    V1,
    V1AlphaOnly,
}

/// Serves `test.v1.Orders` (and reflection) over h2c, and the order count at
/// `GET /count`; returns its base URL.
async fn forgetful_server(reflection: Reflection) -> String {
    let orders = Arc::new(AtomicU64::new(0));
    let create = {
        let orders = orders.clone();
        tower::service_fn(move |req: http::Request<axum::body::Body>| {
            let orders = orders.clone();
            async move {
                let mut grpc =
                    tonic::server::Grpc::new(tonic_prost::ProstCodec::<Order, CreateOrder>::default());
                Ok::<_, Infallible>(
                    grpc.unary(Forgetful(orders), req.map(tonic::body::Body::new))
                        .await,
                )
            }
        })
    };
    let set = orders_descriptor_set();
    let builder =
        || tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(&set);
    let app = axum::Router::new().route_service("/test.v1.Orders/Create", create);
    let app = match reflection {
        Reflection::V1 => app.route_service(
            "/grpc.reflection.v1.ServerReflection/{*method}",
            builder().build_v1().unwrap(),
        ),
        Reflection::V1AlphaOnly => app.route_service(
            "/grpc.reflection.v1alpha.ServerReflection/{*method}",
            builder().build_v1alpha().unwrap(),
        ),
    };
    let app = app
        .fallback(|| async {
            // What a gRPC server answers for a service it does not have.
            (
                [("content-type", "application/grpc"), ("grpc-status", "12")],
                axum::body::Body::empty(),
            )
        })
        .route(
            "/count",
            axum::routing::get(move || {
                let orders = orders.clone();
                async move { axum::Json(json!({"count": orders.load(Ordering::SeqCst)})) }
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_check_fails_a_server_that_ignores_keys() {
    let base = forgetful_server(Reflection::V1).await;
    let run = idemkit(
        [
            "check",
            "--grpc",
            &base,
            "--grpc-method",
            "test.v1.Orders/Create",
            "--body",
            r#"{"sku":"BOOK-1","quantity":1}"#,
            "--count-url",
            "/count",
            "--gates",
            "concurrency,replay,fresh-key,policy",
            "-n",
            "8",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect(),
    )
    .await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(
        run.verdicts(),
        crate::expect(&[
            ("concurrency", "fail"),
            ("replay", "fail"),
            ("fresh-key", "fail"),
            ("policy", "not-applicable"),
        ]),
        "{run:#?}"
    );
    let concurrency = run.evidence("concurrency");
    assert!(concurrency.contains("8 effects for one key"), "{concurrency}");
    let replay = run.evidence("replay");
    assert!(replay.contains("body differs"), "{replay}");
}

/// A server that offers only `grpc.reflection.v1alpha` is described through it; a
/// streaming method is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_check_falls_back_to_reflection_v1alpha_and_refuses_streaming() {
    let base = forgetful_server(Reflection::V1AlphaOnly).await;
    let args = |method: &str| -> Vec<String> {
        [
            "check",
            "--grpc",
            &base,
            "--grpc-method",
            method,
            "--body",
            r#"{"sku":"BOOK-1","quantity":1}"#,
            "--count-url",
            "/count",
            "--gates",
            "replay",
            "--json",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let run = idemkit(args("test.v1.Orders/Create")).await;
    assert_eq!(run.code, 1, "{run:#?}");
    assert_eq!(run.verdicts(), crate::expect(&[("replay", "fail")]), "{run:#?}");
    let run = idemkit(args("test.v1.Orders/Watch")).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.stderr.contains("streaming method (server streaming)")
            && run.stderr.contains("unary methods only"),
        "{run:#?}"
    );
    assert!(run.stdout.is_empty(), "nothing was checked: {run:#?}");
}
