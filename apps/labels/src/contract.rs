//! The labels service's integrator contract: the generic contract of its
//! configuration ([`idemkit_contract`]) plus what only this service has, handed
//! over as data: the example bodies of `POST /labels` and the `## gRPC` section
//! (the labels API over gRPC and every refusal's code there, from
//! `idemkit_tonic::code_for`).

use std::fmt::Write;

use idemkit_contract::{Contract, Format, RouteExample, human_duration, keyed_body};
use idemkit_core::{ErrorCode, InFlightBehavior, Policy};
use idemkit_engine::{Disposition, Override};
use idemkit_tower::config::{IdemkitConfig, RouteConfig};
use serde_json::{Value, json};
use tonic::Code;

/// The default configuration: the labels service's own.
pub const DEFAULT_CONFIG: &str = include_str!("../idemkit.toml");

/// The labels service's configuration.
pub fn default_config() -> IdemkitConfig {
    IdemkitConfig::from_toml(DEFAULT_CONFIG)
        .unwrap_or_else(|e| unreachable!("the shipped configuration is valid: {e}"))
}

/// A valid `POST /labels` body, without its key.
pub fn example_label() -> Value {
    json!({
        "courier": "ups",
        "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
        "shipTo": {"name": "Ada", "line1": "10 Downing St", "city": "London", "postalCode": "SW1A 2AA", "country": "GB"},
        "parcel": {"weightGrams": 900, "lengthCm": 20, "widthCm": 10, "heightCm": 5}
    })
}

/// The labels contract of `config`: its routes, with the labels example bodies
/// for `POST /labels` and the gRPC section under that route's policy.
pub fn contract(config: &IdemkitConfig) -> Contract {
    // What the labels service serves whatever file it runs with: gRPC on the
    // same port, its OpenAPI document and the contract routes.
    let mut config = config.clone();
    config.service.grpc = true;
    config.service.openapi = Some("/openapi.json".to_owned());
    config.service.contract_routes = true;
    let config = &config;
    let mut contract = Contract::new(config.clone());
    if let Some(route) = config.route("POST", "/labels") {
        let mut different = example_label();
        different["courier"] = json!("dhl");
        contract = contract
            .with_example(
                "POST",
                "/labels",
                RouteExample {
                    body: example_label(),
                    different,
                },
            )
            .with_section(section(route));
    }
    if config.route("POST", crate::service::REPEATABLE_PATH).is_some() {
        let mut different = example_label();
        different["courier"] = json!("dhl");
        contract = contract.with_example(
            "POST",
            crate::service::REPEATABLE_PATH,
            RouteExample {
                body: example_label(),
                different,
            },
        );
    }
    contract
}

/// Renders the labels contract of `config` (`idemkit docs`, `GET /docs/idempotency`).
pub fn render(config: &IdemkitConfig, format: Format) -> String {
    contract(config).render(format)
}

/// Every stable code a refusal can carry, in the order the contract lists them.
/// `ErrorCode` is `#[non_exhaustive]`, so a new code must be added here too.
const REFUSAL_CODES: [ErrorCode; 16] = [
    ErrorCode::KeyMissing,
    ErrorCode::KeyInvalid,
    ErrorCode::ValidationFailed,
    ErrorCode::UnsupportedMediaType,
    ErrorCode::PayloadTooLarge,
    ErrorCode::Unauthorized,
    ErrorCode::NotFound,
    ErrorCode::KeyReused,
    ErrorCode::RequestParked,
    ErrorCode::RequestInProgress,
    ErrorCode::LeaseLost,
    ErrorCode::StoreUnavailable,
    ErrorCode::DeadlineExceeded,
    ErrorCode::ResponseTooLarge,
    ErrorCode::Misconfigured,
    ErrorCode::Internal,
];

/// The REST status of a refusal under `policy` (the mismatch status is configurable).
fn rest_status(code: ErrorCode, policy: &Policy) -> u16 {
    match code {
        ErrorCode::KeyReused => policy.mismatch_status.as_u16(),
        _ => code.default_status(),
    }
}

/// Whether the engine sends a wait hint with a refusal (`Retry-After` over
/// REST, `google.rpc.RetryInfo` over gRPC).
fn carries_retry_info(code: ErrorCode) -> bool {
    matches!(
        code,
        ErrorCode::RequestInProgress | ErrorCode::LeaseLost | ErrorCode::StoreUnavailable
    )
}

/// A gRPC code as the gRPC specification spells it (`FAILED_PRECONDITION`).
fn grpc_name(code: Code) -> String {
    let mut name = String::new();
    for (i, c) in format!("{code:?}").chars().enumerate() {
        if i > 0 && c.is_ascii_uppercase() {
            name.push('_');
        }
        name.push(c.to_ascii_uppercase());
    }
    name
}

/// What the layer does with a `CreateLabel` answer, as integrators read it.
fn stored(code: Code, outcome: Option<Override>, policy: &Policy) -> &'static str {
    match idemkit_tonic::disposition(code, outcome, policy) {
        Disposition::Store => "yes: replayed to every retry with this key",
        Disposition::Release | Disposition::Discard => "no: the key is free again",
        Disposition::Abandon => "no: a retry with the same key and bytes resumes the request",
        Disposition::Leave => "as the request left it",
    }
}

/// The `## gRPC` section: `labels.v1.Labels`, with `CreateLabel` under the
/// policy of `route` (`POST /labels`).
fn section(route: &RouteConfig) -> String {
    let mut out = String::new();
    let w = &mut out;
    let p = route.policy();
    let create = crate::proto::CREATE_LABEL.trim_start_matches('/');
    let _ = writeln!(w, "## gRPC\n");
    let _ = writeln!(
        w,
        "The same API is served over gRPC as `{service}` (`CreateLabel`, `GetLabel`, `GetTracking`): the same \
         accounts, labels, courier and keys as REST, and `CreateLabel` runs under the policy of `{} {}` above \
         (the same replay window, lease and key scope).\n\n\
         - **Where.** By default on the REST port, multiplexed by path (HTTP/2 without TLS, h2c: \
         `grpcurl -plaintext`); or on a listener of its own with `idemkit serve --grpc-listen ADDR`. Server \
         reflection (v1 and v1alpha) is on, so tools need no proto file; the proto is \
         `apps/labels/proto/labels/v1/labels.proto`. With the keys in Redis (`--keys-url`) only REST is served.\n\
         - **The key** goes in `CreateLabelRequest.idempotency_key` (field {field}), as in the REST body; when the \
         field is empty, the `{key_metadata}` metadata is read instead. Both set to different keys is \
         `{invalid}` (`{key_invalid}`). The rules of *The key* above apply, and the scope is the same as REST's: \
         a key used for `{} {}` is `{key_reused}` on `CreateLabel`, and the other way round.\n\
         - **The token** goes in `authorization: Bearer <token>` metadata.\n\
         - **One key is one request: the same method and the same message bytes.** The fingerprint is over the \
         full method name (`{method}`) and the request message exactly as serialized; the message is not \
         decoded. Serialize the request once and resend those bytes on every retry. The official protobuf \
         libraries write fields in field-number order, so equal messages give equal bytes; an encoder that \
         orders fields differently, writes default values or keeps unknown fields (or a client that changes \
         its library between retries) sends different bytes for the same message, and its retry is answered \
         `{reused}` (`{key_reused}`): never a wrong replay, but no replay either. Compressed request messages \
         are refused (`{compressed}`, `{unsupported}`).\n\
         - **Replay.** A replay is byte-identical to the first answer (message, metadata and trailers) and \
         carries `{replayed}: true` metadata.\n\
         - **AIP-155.** `{with_request_id}` is `CreateLabel` with the key in the `{request_id}` field (field 1): \
         a UUID4 (`{key_invalid}` otherwise) that your client generates once per logical call and sends \
         unchanged on every retry, as Google's client libraries do (AIP-4235; `idemkit-client`'s tonic layer \
         fills an empty one); empty, the `{key_metadata}` metadata is read instead. The same scope, window and \
         rules apply. A duplicate gets the first call's recorded answer, not the label as it is now (AIP-155's \
         \"stale success\"): read the current state with `GetLabel`.\n\
         - **While in flight** a second call with the same key {in_flight}.\n\
         - The proto3 JSON mapping of `CreateLabelRequest` is the REST body, and that of `Label` the REST label \
         document, so the example body above is also a `CreateLabel` request (set `GRPC` to the gRPC \
         address, `host:port`):\n",
        route.method,
        route.path,
        route.method,
        route.path,
        service = crate::proto::SERVICE,
        field = crate::proto::KEY_FIELD_NUMBER,
        key_metadata = idemkit_tonic::wire::IDEMPOTENCY_KEY,
        invalid = grpc_name(idemkit_tonic::code_for(ErrorCode::KeyInvalid)),
        key_invalid = ErrorCode::KeyInvalid,
        method = crate::proto::CREATE_LABEL,
        reused = grpc_name(idemkit_tonic::code_for(ErrorCode::KeyReused)),
        key_reused = ErrorCode::KeyReused,
        compressed = grpc_name(idemkit_tonic::code_for(ErrorCode::UnsupportedMediaType)),
        unsupported = ErrorCode::UnsupportedMediaType,
        replayed = idemkit_tonic::wire::IDEMPOTENT_REPLAYED,
        with_request_id = crate::proto::CREATE_LABEL_WITH_REQUEST_ID
            .rsplit('/')
            .next()
            .unwrap_or_default(),
        request_id = crate::proto::REQUEST_ID_FIELD,
        in_flight = match p.in_flight {
            InFlightBehavior::Wait(t) => format!(
                "waits up to {} for the first one's answer, then replays it (or gets `{}`)",
                human_duration(t),
                grpc_name(idemkit_tonic::code_for(ErrorCode::RequestInProgress))
            ),
            _ => format!(
                "gets `{}` (`{}`) with `RetryInfo`: retry after that delay",
                grpc_name(idemkit_tonic::code_for(ErrorCode::RequestInProgress)),
                ErrorCode::RequestInProgress
            ),
        },
    );
    let (body, _) = keyed_body(route, &example_label(), "order-4711-label");
    let _ = writeln!(
        w,
        "```sh\ngrpcurl -plaintext -H \"authorization: Bearer $TOKEN\" \\\n  -d '{body}' \\\n  \"$GRPC\" {create}\n```\n"
    );
    let _ = writeln!(
        w,
        "Refusals carry a `google.rpc.ErrorInfo` with `domain` `{}`, `reason` = the stable code of the REST \
         problem documents and metadata `retryable` (whether the same call with the same key can succeed), and, \
         where you should wait, a `google.rpc.RetryInfo` with the delay (the gRPC `Retry-After`):\n",
        idemkit_tonic::ERROR_DOMAIN
    );
    let _ = writeln!(
        w,
        "| `reason` | REST status | gRPC code | `retryable` | `RetryInfo` |"
    );
    let _ = writeln!(w, "|---|---|---|---|---|");
    for code in REFUSAL_CODES {
        let _ = writeln!(
            w,
            "| `{code}` | {} | `{}` | {} | {} |",
            rest_status(code, &p),
            grpc_name(idemkit_tonic::code_for(code)),
            code.retryable(),
            if carries_retry_info(code) { "yes" } else { "—" }
        );
    }
    let _ = writeln!(
        w,
        "\nA missing or unknown token is `{}` (`unauthorized`): it is refused before any idempotency work.\n",
        grpc_name(idemkit_tonic::code_for(ErrorCode::Unauthorized))
    );
    let _ = writeln!(
        w,
        "`CreateLabel`'s own answers (a label's outcome has `ErrorInfo` `domain` `{domain}`, and metadata \
         `label_id` and `retryable`):\n",
        domain = crate::service::LABELS_DOMAIN
    );
    let _ = writeln!(w, "| outcome | REST | gRPC | stored |");
    let _ = writeln!(w, "|---|---|---|---|");
    let rows: [(&str, &str, Code, &str, Option<Override>); 3] = [
        ("created", "`201` label", Code::Ok, "the label", None),
        (
            "the courier refused the label",
            "`502` failed label, `error.retryable: false`",
            Code::FailedPrecondition,
            "`reason` = the courier's code (e.g. `address_rejected`); correct the request and use a new key",
            Some(Override::Final),
        ),
        (
            "the courier is unavailable",
            "`502` failed label, `error.retryable: true`",
            Code::Unavailable,
            "`reason` `courier_unavailable`, with `RetryInfo`",
            Some(Override::Retryable),
        ),
    ];
    for (outcome, rest, code, detail, marker) in rows {
        let _ = writeln!(
            w,
            "| {outcome} | {rest} | `{}`, {detail} | {} |",
            grpc_name(code),
            stored(code, marker, &p)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_examples_are_valid_requests() {
        let config = default_config();
        let doc = contract(&config).render(Format::Markdown);
        let route = config.route("POST", "/labels").unwrap();
        let (first, headers) = keyed_body(route, &example_label(), "order-4711-label");
        assert!(headers.is_empty(), "the labels key travels in the body");
        crate::service::CreateLabel::parse(first.to_string().as_bytes()).expect("the first example is valid");
        assert!(doc.contains(&format!("-d '{first}'")));
        let mut other = example_label();
        other["courier"] = json!("dhl");
        let (other, _) = keyed_body(route, &other, "order-4711-label");
        crate::service::CreateLabel::parse(other.to_string().as_bytes())
            .expect("the mismatch example is valid");
        assert!(doc.contains(&format!("-d '{other}'")));
        assert!(
            doc.contains("| `idempotency_key_reused` | 409 |"),
            "the gRPC table"
        );
    }

    #[test]
    fn the_grpc_section_maps_every_refusal_through_code_for() {
        let config = default_config();
        let doc = render(&config, Format::Markdown);
        let grpc = &doc[doc.find("\n## gRPC\n").expect("a gRPC section")..];
        let grpc = &grpc[..grpc.find("\n## Policy as data").unwrap_or(grpc.len())];
        assert!(grpc.contains("`labels.v1.Labels`") && grpc.contains("--grpc-listen ADDR"));
        assert!(grpc.contains("reflection (v1 and v1alpha)"));
        assert!(grpc.contains("apps/labels/proto/labels/v1/labels.proto"));
        assert!(grpc.contains("`CreateLabelRequest.idempotency_key` (field 1)"));
        assert!(grpc.contains("`idempotency-key` metadata"));
        assert!(grpc.contains("`authorization: Bearer <token>`"));
        assert!(grpc.contains("`/labels.v1.Labels/CreateLabel`") && grpc.contains("field-number order"));
        assert!(grpc.contains("`idempotent-replayed: true`"));
        // The AIP-155 form and its stale-success note.
        assert!(
            grpc.contains(
                "`CreateLabelWithRequestId` is `CreateLabel` with the key in the `request_id` field"
            )
        );
        assert!(grpc.contains("a UUID4 (`idempotency_key_invalid` otherwise)"));
        assert!(grpc.contains("\"stale success\"): read the current state with `GetLabel`"));

        // One row per code, its gRPC code derived from the layer's own mapping.
        for code in REFUSAL_CODES {
            let row = format!(
                "| `{code}` | {} | `{}` | {} |",
                code.default_status(),
                grpc_name(idemkit_tonic::code_for(code)),
                code.retryable()
            );
            assert!(grpc.contains(&row), "{row}\n{grpc}");
        }
        assert_eq!(
            grpc_name(idemkit_tonic::code_for(ErrorCode::KeyReused)),
            "FAILED_PRECONDITION"
        );
        assert!(grpc.contains("| `idempotency_key_reused` | 409 | `FAILED_PRECONDITION` | false | — |"));
        assert!(grpc.contains("| `idempotency_request_in_progress` | 409 | `ABORTED` | true | yes |"));
        assert!(grpc.contains("| `idempotency_lease_lost` | 503 | `ABORTED` | true | yes |"));
        assert!(grpc.contains("| `idempotency_store_unavailable` | 503 | `UNAVAILABLE` | true | yes |"));
        assert!(grpc.contains("| `internal_error` | 500 | `INTERNAL` | true | — |"));
        assert_eq!(grpc_name(Code::Ok), "OK");
        assert_eq!(grpc_name(Code::DeadlineExceeded), "DEADLINE_EXCEEDED");

        // CreateLabel's own outcomes, storage derived from the layer's disposition.
        assert!(grpc.contains("`domain` `labels.v1`"));
        assert!(grpc.contains(
            "| the courier refused the label | `502` failed label, `error.retryable: false` | \
             `FAILED_PRECONDITION`, `reason` = the courier's code"
        ));
        assert!(grpc.contains("`UNAVAILABLE`, `reason` `courier_unavailable`, with `RetryInfo` | no: a retry with the same key and bytes resumes the request |"));
        assert!(grpc.contains(
            "| created | `201` label | `OK`, the label | yes: replayed to every retry with this key |"
        ));

        // The grpcurl example sends the REST example body, a valid request.
        let route = config.route("POST", "/labels").unwrap();
        let (body, _) = keyed_body(route, &example_label(), "order-4711-label");
        assert!(grpc.contains(&format!("-d '{body}'")));
        crate::proto::from_json::<crate::proto::CreateLabelRequest>(&body.to_string())
            .expect("the example body is a CreateLabelRequest in the JSON mapping");
    }
}
