//! The gRPC transport: the gates' requests sent to one unary method of a running
//! gRPC service (plaintext HTTP/2), so every gate runs unchanged.
//!
//! - **Descriptors** come from the server's reflection service
//!   (`grpc.reflection.v1`, else `grpc.reflection.v1alpha`): no proto file is needed.
//! - **The request** is the template's JSON body read with the proto3 JSON mapping
//!   into a message of the method's input type (an unknown field is an error), then
//!   sent as its binary encoding with a raw-bytes codec. Only unary methods are
//!   supported; a streaming method is refused when the transport is built.
//! - **The key** travels where the template puts it: a header becomes gRPC metadata
//!   (`idempotency-key` by default); a body field (an AIP-155 `request_id`) is a
//!   field of the message, by its JSON name ([`GrpcTransport::key_pointer`]).
//! - **The answer** the gates read: the HTTP status of the gRPC code
//!   ([`http_status`], google.rpc's mapping), the response metadata (headers and
//!   trailers, so `idempotent-replayed: true` is the replay marker as over HTTP, and
//!   `Retry-After` in whole seconds from a `google.rpc.RetryInfo`), and a JSON body:
//!   for `OK`, `{"message": <the response as proto3 JSON>, "sha256": <hex digest of
//!   the response message's bytes>}`, so a replay must repeat the bytes, not only the
//!   fields; otherwise `{"code": <the google.rpc.ErrorInfo reason, else the gRPC code
//!   name>, "grpcStatus": <the code name>, "message": <the status message>}`.
//!
//! Requests to any other URL (the count and state probes) go to the probe
//! transport given with [`GrpcTransport::with_probes`].

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes};
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use prost_reflect::prost::Message as _;
use prost_reflect::prost_types::FileDescriptorProto;
use prost_reflect::{DescriptorPool, DynamicMessage, Kind, MessageDescriptor, MethodDescriptor};
use sha2::{Digest as _, Sha256};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::MetadataMap;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};
use tonic_types::StatusExt as _;

use crate::{Answer, Gate, Request, Transport, TransportError};

/// Sends the gates' requests to one unary gRPC method.
#[derive(Clone)]
pub struct GrpcTransport {
    channel: Channel,
    method: MethodDescriptor,
    path: PathAndQuery,
    url: String,
    timeout: Duration,
    probes: Option<Arc<dyn Transport>>,
}

impl std::fmt::Debug for GrpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcTransport")
            .field("url", &self.url)
            .field("method", &self.method.full_name())
            .field("timeout", &self.timeout)
            .field("probes", &self.probes.is_some())
            .finish()
    }
}

impl GrpcTransport {
    /// Connects to `endpoint` (`http://host:port`), fetches the descriptors of
    /// `method` (`pkg.Service/Method`) by server reflection and checks that it is
    /// unary. Every call gives up after `timeout`.
    pub async fn connect(endpoint: &str, method: &str, timeout: Duration) -> Result<Self, TransportError> {
        let endpoint = endpoint.trim_end_matches('/').to_owned();
        let (service, name) = split_method(method)?;
        let channel = Endpoint::from_shared(endpoint.clone())
            .map_err(|e| TransportError(format!("the gRPC endpoint `{endpoint}`: {e}")))?
            .connect_timeout(timeout)
            .connect()
            .await
            .map_err(|e| TransportError(format!("connecting to {endpoint}: {}", chain(&e))))?;
        let pool = reflect(&channel, service, timeout).await?;
        let method = find_method(&pool, service, name)?;
        let path: PathAndQuery = format!("/{}/{}", method.parent_service().full_name(), method.name())
            .parse()
            .map_err(|e| TransportError(format!("the method path of {}: {e}", method.full_name())))?;
        Ok(Self {
            url: format!("{endpoint}{path}"),
            channel,
            method,
            path,
            timeout,
            probes: None,
        })
    }

    /// Sends every request that is not for the method (the count and state probes'
    /// reads) with `probes`, e.g. an [`HttpTransport`](crate::HttpTransport).
    pub fn with_probes(mut self, probes: Arc<dyn Transport>) -> Self {
        self.probes = Some(probes);
        self
    }

    /// The URL the template must use for the method's calls:
    /// `http://host:port/pkg.Service/Method`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The method.
    pub fn method(&self) -> &MethodDescriptor {
        &self.method
    }

    /// The JSON pointer of the request field `field` (by its proto name, e.g.
    /// `request_id`) in the proto3 JSON mapping (`/requestId`), for a template
    /// that carries the key in that field. The field must be a singular string.
    pub fn key_pointer(&self, field: &str) -> Result<String, TransportError> {
        key_pointer(&self.method.input(), field)
    }

    /// The request message `json` maps to (see [`request_message`]).
    pub fn message(&self, json: &[u8]) -> Result<DynamicMessage, TransportError> {
        request_message(&self.method.input(), json)
    }
}

/// `pkg.Service/Method` (a leading `/` allowed) → (`pkg.Service`, `Method`).
fn split_method(method: &str) -> Result<(&str, &str), TransportError> {
    let trimmed = method.trim().trim_start_matches('/');
    match trimmed.rsplit_once('/') {
        Some((service, name)) if !service.is_empty() && !name.is_empty() && !name.contains('.') => {
            Ok((service, name))
        }
        _ => Err(TransportError(format!(
            "the gRPC method `{method}` is not `package.Service/Method`"
        ))),
    }
}

fn find_method(pool: &DescriptorPool, service: &str, name: &str) -> Result<MethodDescriptor, TransportError> {
    let svc = pool.get_service_by_name(service).ok_or_else(|| {
        TransportError(format!(
            "the server's reflection describes no service `{service}`"
        ))
    })?;
    let method = svc.methods().find(|m| m.name() == name).ok_or_else(|| {
        let names: Vec<String> = svc.methods().map(|m| m.name().to_owned()).collect();
        TransportError(format!(
            "the service `{service}` has no method `{name}` (it has {})",
            names.join(", ")
        ))
    })?;
    if method.is_client_streaming() || method.is_server_streaming() {
        return Err(TransportError(format!(
            "`{service}/{name}` is a streaming method ({}): idemkit check supports unary methods only",
            match (method.is_client_streaming(), method.is_server_streaming()) {
                (true, true) => "bidirectional",
                (true, false) => "client streaming",
                _ => "server streaming",
            }
        )));
    }
    Ok(method)
}

/// The request message of type `input` that the proto3 JSON `json` maps to (an
/// empty body is the empty message). A member the message does not have, or a
/// value of the wrong type, is an error naming the message type.
pub fn request_message(input: &MessageDescriptor, json: &[u8]) -> Result<DynamicMessage, TransportError> {
    let json: &[u8] = if json.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        json
    };
    let mut de = serde_json::Deserializer::from_slice(json);
    DynamicMessage::deserialize(input.clone(), &mut de)
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| {
            TransportError(format!(
                "the body is not the proto3 JSON mapping of {}: {e}",
                input.full_name()
            ))
        })
}

fn key_pointer(input: &MessageDescriptor, field: &str) -> Result<String, TransportError> {
    let Some(f) = input.get_field_by_name(field) else {
        let names: Vec<String> = input.fields().map(|f| f.name().to_owned()).collect();
        return Err(TransportError(format!(
            "the request message {} has no field `{field}` (it has {})",
            input.full_name(),
            names.join(", ")
        )));
    };
    if f.kind() != Kind::String || f.is_list() || f.is_map() {
        return Err(TransportError(format!(
            "the key field `{field}` of {} is not a singular string",
            input.full_name()
        )));
    }
    Ok(format!(
        "/{}",
        f.json_name().replace('~', "~0").replace('/', "~1")
    ))
}

/// The HTTP status a gRPC code stands for, as google.rpc's `code.proto` maps them:
/// `OK` 200; `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `OUT_OF_RANGE` 400;
/// `UNAUTHENTICATED` 401; `PERMISSION_DENIED` 403; `NOT_FOUND` 404; `ABORTED`,
/// `ALREADY_EXISTS` 409; `RESOURCE_EXHAUSTED` 429; `CANCELLED` 499; `UNKNOWN`,
/// `INTERNAL`, `DATA_LOSS` 500; `UNIMPLEMENTED` 501; `UNAVAILABLE` 503;
/// `DEADLINE_EXCEEDED` 504.
pub fn http_status(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::NotFound => 404,
        Code::Aborted | Code::AlreadyExists => 409,
        Code::ResourceExhausted => 429,
        Code::Cancelled => 499,
        Code::Unknown | Code::Internal | Code::DataLoss => 500,
        Code::Unimplemented => 501,
        Code::Unavailable => 503,
        Code::DeadlineExceeded => 504,
    }
}

/// `ABORTED`, as google.rpc spells the codes.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Headers that are HTTP's, not the call's metadata.
const NOT_METADATA: [&str; 5] = [
    "content-type",
    "content-length",
    "host",
    "te",
    "transfer-encoding",
];

#[async_trait]
impl Transport for GrpcTransport {
    async fn send(&self, request: Request) -> Result<Answer, TransportError> {
        if request.url != self.url {
            return match &self.probes {
                Some(probes) => probes.send(request).await,
                None => Err(TransportError(format!(
                    "{} is not the gRPC method under test ({}) and no probe transport was given",
                    request.url, self.url
                ))),
            };
        }
        let message = self.message(&request.body)?;
        let mut headers = request.headers;
        for name in NOT_METADATA {
            headers.remove(name);
        }
        let mut call = tonic::Request::new(Bytes::from(message.encode_to_vec()));
        *call.metadata_mut() = MetadataMap::from_headers(headers);
        call.set_timeout(self.timeout);
        let (channel, path, timeout, output) = (
            self.channel.clone(),
            self.path.clone(),
            self.timeout,
            self.method.output(),
        );
        let task = tokio::spawn(async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready()
                .await
                .map_err(|e| TransportError(format!("the channel is not ready: {}", chain(&e))))?;
            match tokio::time::timeout(timeout, grpc.unary(call, path, RawCodec)).await {
                Ok(result) => Ok(result),
                Err(_) => Err(TransportError(format!(
                    "no answer within {} s",
                    timeout.as_secs_f64()
                ))),
            }
        });
        let result = match task.await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => return Err(e),
            Err(e) => return Err(TransportError(format!("request task failed: {e}"))),
        };
        match result {
            Ok(response) => {
                let (metadata, bytes, _) = response.into_parts();
                Ok(Answer {
                    status: 200,
                    headers: metadata.into_headers(),
                    body: ok_body(&output, &bytes),
                })
            }
            // A status the client made itself (connection refused or reset) is no
            // answer from the server.
            Err(status) if std::error::Error::source(&status).is_some() => Err(TransportError(format!(
                "{}: {}",
                code_name(status.code()),
                chain(&status)
            ))),
            Err(status) => Ok(error_answer(&status)),
        }
    }

    fn not_applicable(&self, gate: Gate) -> Option<String> {
        (gate == Gate::Policy).then(|| {
            "the x-idempotency policy is published for HTTP operations (OpenAPI); a gRPC method has none to \
             compare with"
                .to_owned()
        })
    }
}

/// `{"message": …, "sha256": …}` for an `OK` answer's message `bytes`.
fn ok_body(output: &MessageDescriptor, bytes: &[u8]) -> Vec<u8> {
    let digest = hex::encode(Sha256::digest(bytes));
    let message = match DynamicMessage::decode(output.clone(), bytes) {
        Ok(m) => serde_json::to_value(&m)
            .map(sorted)
            .unwrap_or_else(|e| serde_json::Value::String(format!("(not JSON-mappable: {e})"))),
        Err(e) => serde_json::Value::String(format!("(not a {}: {e})", output.full_name())),
    };
    serde_json::json!({ "message": message, "sha256": digest })
        .to_string()
        .into_bytes()
}

/// The same JSON with every object's members in name order (the JSON of a proto
/// map is written in no fixed order; the digest is what is compared, this keeps
/// the text stable too).
fn sorted(v: serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(map) => {
            let ordered: BTreeMap<String, serde_json::Value> =
                map.into_iter().map(|(k, v)| (k, sorted(v))).collect();
            serde_json::Value::Object(ordered.into_iter().collect())
        }
        serde_json::Value::Array(items) => serde_json::Value::Array(items.into_iter().map(sorted).collect()),
        leaf => leaf,
    }
}

/// A status from the server as an answer: its HTTP status, its metadata (plus
/// `Retry-After` from a RetryInfo) and `{"code", "grpcStatus", "message"}`.
fn error_answer(status: &Status) -> Answer {
    let details = status.get_error_details();
    let mut headers: HeaderMap = status.metadata().clone().into_headers();
    if let Some(delay) = details.retry_info().and_then(|r| r.retry_delay)
        && !headers.contains_key(http::header::RETRY_AFTER)
    {
        let secs = delay.as_secs() + u64::from(delay.subsec_nanos() > 0);
        headers.insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    }
    let name = code_name(status.code());
    let code = details
        .error_info()
        .map(|i| i.reason.clone())
        .filter(|r| !r.is_empty())
        .unwrap_or_else(|| name.to_owned());
    Answer {
        status: http_status(status.code()),
        headers,
        body: serde_json::json!({
            "code": code,
            "grpcStatus": name,
            "message": status.message(),
        })
        .to_string()
        .into_bytes(),
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let s = cause.to_string();
        if !text.contains(&s) {
            text.push_str(": ");
            text.push_str(&s);
        }
        source = cause.source();
    }
    text
}

/// Sends and receives messages as the bytes they already are.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put(item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        let n = src.remaining();
        Ok(Some(src.copy_to_bytes(n)))
    }
}

/// What to ask the reflection service for.
enum Lookup {
    Symbol(String),
    File(String),
}

/// One reflection request over `grpc.reflection.$version`: the serialized
/// `FileDescriptorProto`s of the answer.
macro_rules! reflection_call {
    ($name:ident, $version:ident) => {
        async fn $name(channel: Channel, lookup: &Lookup) -> Result<Vec<Vec<u8>>, Status> {
            use tonic_reflection::pb::$version::server_reflection_client::ServerReflectionClient;
            use tonic_reflection::pb::$version::server_reflection_request::MessageRequest;
            use tonic_reflection::pb::$version::server_reflection_response::MessageResponse;
            use tonic_reflection::pb::$version::{ServerReflectionRequest, ServerReflectionResponse};
            let message_request = match lookup {
                Lookup::Symbol(s) => MessageRequest::FileContainingSymbol(s.clone()),
                Lookup::File(f) => MessageRequest::FileByFilename(f.clone()),
            };
            let request = ServerReflectionRequest {
                host: String::new(),
                message_request: Some(message_request),
            };
            let mut answers = ServerReflectionClient::new(channel)
                .server_reflection_info(futures::stream::iter([request]))
                .await?
                .into_inner();
            match answers.message().await? {
                Some(ServerReflectionResponse {
                    message_response: Some(MessageResponse::FileDescriptorResponse(files)),
                    ..
                }) => Ok(files.file_descriptor_proto),
                Some(ServerReflectionResponse {
                    message_response: Some(MessageResponse::ErrorResponse(e)),
                    ..
                }) => Err(Status::new(Code::from_i32(e.error_code), e.error_message)),
                other => Err(Status::internal(format!(
                    "an unexpected reflection answer: {other:?}"
                ))),
            }
        }
    };
}

reflection_call!(reflect_v1, v1);
reflection_call!(reflect_v1alpha, v1alpha);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V1Alpha,
}

async fn lookup(
    channel: &Channel,
    version: Version,
    what: &Lookup,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>, Status> {
    let call = async {
        match version {
            Version::V1 => reflect_v1(channel.clone(), what).await,
            Version::V1Alpha => reflect_v1alpha(channel.clone(), what).await,
        }
    };
    tokio::time::timeout(timeout, call)
        .await
        .unwrap_or_else(|_| Err(Status::deadline_exceeded("no reflection answer in time")))
}

/// The descriptors of `service` and every file it depends on, by server
/// reflection: `grpc.reflection.v1`, or `v1alpha` where v1 is not served.
async fn reflect(
    channel: &Channel,
    service: &str,
    timeout: Duration,
) -> Result<DescriptorPool, TransportError> {
    let first = Lookup::Symbol(service.to_owned());
    let (version, mut pending) = match lookup(channel, Version::V1, &first, timeout).await {
        Ok(files) => (Version::V1, files),
        Err(s) if s.code() == Code::Unimplemented => {
            let files = lookup(channel, Version::V1Alpha, &first, timeout)
                .await
                .map_err(|s| reflection_error(service, &s))?;
            (Version::V1Alpha, files)
        }
        Err(s) => return Err(reflection_error(service, &s)),
    };
    let mut files: HashMap<String, FileDescriptorProto> = HashMap::new();
    let mut asked: BTreeSet<String> = BTreeSet::new();
    loop {
        for raw in pending.drain(..) {
            let file = FileDescriptorProto::decode(raw.as_slice()).map_err(|e| {
                TransportError(format!(
                    "the server's reflection sent a malformed file descriptor: {e}"
                ))
            })?;
            files.entry(file.name().to_owned()).or_insert(file);
        }
        let missing: BTreeSet<String> = files
            .values()
            .flat_map(|f| f.dependency.iter())
            .filter(|d| !files.contains_key(*d))
            .cloned()
            .collect();
        if missing.is_empty() {
            break;
        }
        for dep in missing {
            if !asked.insert(dep.clone()) {
                return Err(TransportError(format!(
                    "the server's reflection does not serve `{dep}`, which `{service}` depends on"
                )));
            }
            pending.extend(
                lookup(channel, version, &Lookup::File(dep.clone()), timeout)
                    .await
                    .map_err(|s| reflection_error(&dep, &s))?,
            );
        }
    }
    let mut pool = DescriptorPool::new();
    pool.add_file_descriptor_protos(files.into_values())
        .map_err(|e| TransportError(format!("the descriptors of `{service}` do not resolve: {e}")))?;
    Ok(pool)
}

fn reflection_error(what: &str, status: &Status) -> TransportError {
    TransportError(format!(
        "server reflection (grpc.reflection.v1 and v1alpha) did not describe `{what}`: {} {}",
        code_name(status.code()),
        status.message()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A descriptor of `test.v1.Create { string request_id = 1; string name = 2;
    /// uint32 count = 3; repeated string tags = 4; }`, built in code.
    fn create() -> MessageDescriptor {
        use prost_reflect::prost_types::field_descriptor_proto::{Label, Type};
        use prost_reflect::prost_types::{DescriptorProto, FieldDescriptorProto};
        let field = |name: &str, number, ty: Type, label: Label| FieldDescriptorProto {
            name: Some(name.into()),
            number: Some(number),
            r#type: Some(ty as i32),
            label: Some(label as i32),
            json_name: None,
            ..Default::default()
        };
        let file = FileDescriptorProto {
            name: Some("test/v1/create.proto".into()),
            package: Some("test.v1".into()),
            syntax: Some("proto3".into()),
            message_type: vec![DescriptorProto {
                name: Some("Create".into()),
                field: vec![
                    field("request_id", 1, Type::String, Label::Optional),
                    field("name", 2, Type::String, Label::Optional),
                    field("count", 3, Type::Uint32, Label::Optional),
                    field("tags", 4, Type::String, Label::Repeated),
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let mut pool = DescriptorPool::new();
        pool.add_file_descriptor_proto(file).unwrap();
        pool.get_message_by_name("test.v1.Create").unwrap()
    }

    #[test]
    fn grpc_codes_map_to_google_rpc_http_statuses() {
        let expected = [
            (Code::Ok, 200),
            (Code::InvalidArgument, 400),
            (Code::FailedPrecondition, 400),
            (Code::OutOfRange, 400),
            (Code::Unauthenticated, 401),
            (Code::PermissionDenied, 403),
            (Code::NotFound, 404),
            (Code::Aborted, 409),
            (Code::AlreadyExists, 409),
            (Code::ResourceExhausted, 429),
            (Code::Cancelled, 499),
            (Code::Unknown, 500),
            (Code::Internal, 500),
            (Code::DataLoss, 500),
            (Code::Unimplemented, 501),
            (Code::Unavailable, 503),
            (Code::DeadlineExceeded, 504),
        ];
        assert_eq!(expected.len(), 17, "every gRPC code");
        for (code, status) in expected {
            assert_eq!(http_status(code), status, "{code:?}");
        }
    }

    #[test]
    fn json_maps_to_the_message_and_unknown_members_are_named() {
        let input = create();
        let m = request_message(&input, br#"{"requestId":"r","name":"n","count":3,"tags":["a"]}"#).unwrap();
        assert_eq!(m.get_field_by_name("request_id").unwrap().as_str(), Some("r"));
        assert_eq!(m.get_field_by_name("count").unwrap().as_u32(), Some(3));
        // The proto field name is accepted too, as the mapping allows.
        let m = request_message(&input, br#"{"request_id":"r"}"#).unwrap();
        assert_eq!(m.get_field_by_name("request_id").unwrap().as_str(), Some("r"));
        assert_eq!(
            request_message(&input, b"").unwrap().encode_to_vec(),
            Vec::<u8>::new()
        );

        let err = request_message(&input, br#"{"name":"n","colour":"red"}"#).unwrap_err();
        assert!(err.0.contains("test.v1.Create"), "{err}");
        assert!(err.0.contains("colour"), "{err}");
        let err = request_message(&input, br#"{"count":"many"}"#).unwrap_err();
        assert!(err.0.contains("proto3 JSON mapping of test.v1.Create"), "{err}");
        let err = request_message(&input, b"{} trailing").unwrap_err();
        assert!(err.0.contains("test.v1.Create"), "{err}");
    }

    #[test]
    fn key_fields_are_singular_strings_named_by_json_pointer() {
        let input = create();
        assert_eq!(key_pointer(&input, "request_id").unwrap(), "/requestId");
        let err = key_pointer(&input, "requestid").unwrap_err();
        assert!(
            err.0.contains("no field `requestid`") && err.0.contains("request_id"),
            "{err}"
        );
        assert!(key_pointer(&input, "count").is_err());
        assert!(key_pointer(&input, "tags").is_err());
    }

    #[test]
    fn methods_are_package_service_slash_method() {
        assert_eq!(
            split_method("labels.v1.Labels/CreateLabel").unwrap(),
            ("labels.v1.Labels", "CreateLabel")
        );
        assert_eq!(split_method("/a.B/C").unwrap(), ("a.B", "C"));
        assert!(split_method("labels.v1.Labels.CreateLabel").is_err());
        assert!(split_method("labels.v1.Labels/").is_err());
    }

    #[test]
    fn error_answers_carry_the_reason_status_and_retry_after() {
        let mut details = tonic_types::ErrorDetails::with_error_info(
            "idempotency_request_in_progress",
            "idemkit",
            [("retryable".to_owned(), "true".to_owned())],
        );
        details.set_retry_info(Some(Duration::from_millis(1500)));
        let status = Status::with_error_details(Code::Aborted, "still running", details);
        let a = error_answer(&status);
        assert_eq!(a.status, 409);
        assert_eq!(a.header("retry-after"), Some("2"));
        let body = a.json().unwrap();
        assert_eq!(body["code"], "idempotency_request_in_progress");
        assert_eq!(body["grpcStatus"], "ABORTED");
        let plain = error_answer(&Status::unimplemented("no"));
        assert_eq!(
            (plain.status, plain.json().unwrap()["code"].clone()),
            (501, "UNIMPLEMENTED".into())
        );
        assert!(plain.header("retry-after").is_none());
    }

    #[test]
    fn ok_bodies_digest_the_bytes_and_show_the_message() {
        let input = create();
        let m = request_message(&input, br#"{"name":"n","count":3}"#).unwrap();
        let bytes = m.encode_to_vec();
        let body: serde_json::Value = serde_json::from_slice(&ok_body(&input, &bytes)).unwrap();
        assert_eq!(body["message"]["name"], "n");
        assert_eq!(body["sha256"], hex::encode(Sha256::digest(&bytes)));
        // The same fields in another encoding (reordered on the wire) are other bytes.
        let mut reordered = Vec::new();
        reordered.extend_from_slice(&bytes[bytes.len() - 2..]);
        reordered.extend_from_slice(&bytes[..bytes.len() - 2]);
        let other: serde_json::Value = serde_json::from_slice(&ok_body(&input, &reordered)).unwrap();
        assert_eq!(other["message"], body["message"]);
        assert_ne!(other["sha256"], body["sha256"]);
    }
}
