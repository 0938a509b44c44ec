//! The names idemkit puts on the wire, in one place: HTTP header names and
//! gRPC metadata keys, all lowercase `&'static str` so one constant serves as
//! an HTTP header (`http::HeaderName::from_static`), a gRPC metadata key and a
//! string to compare with. Every idemkit crate uses these; none defines its own.

/// The request header (and gRPC metadata key) that carries the idempotency key.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";

/// The response header (and gRPC metadata key) that marks a replayed answer:
/// `idempotent-replayed: true`.
pub const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";

/// The request header that carries the caller's remaining time budget in
/// milliseconds (`Request-Timeout`); see [`crate::parse_deadline_header`].
pub const REQUEST_TIMEOUT: &str = "request-timeout";

/// gRPC's deadline metadata (`grpc-timeout`, e.g. `1500m`).
pub const GRPC_TIMEOUT: &str = "grpc-timeout";

/// gRPC's retry count metadata (gRFC A6): how many attempts came before this one.
pub const GRPC_PREVIOUS_RPC_ATTEMPTS: &str = "grpc-previous-rpc-attempts";

/// gRPC's server pushback metadata (gRFC A6): milliseconds to wait before a retry.
pub const GRPC_RETRY_PUSHBACK_MS: &str = "grpc-retry-pushback-ms";

/// OASIS Repeatable Requests 1.0: the request id header.
pub const REPEATABILITY_REQUEST_ID: &str = "repeatability-request-id";

/// OASIS Repeatable Requests 1.0: when the request was first sent (an HTTP date).
pub const REPEATABILITY_FIRST_SENT: &str = "repeatability-first-sent";

/// OASIS Repeatable Requests 1.0: `accepted` or `rejected` on the answer.
pub const REPEATABILITY_RESULT: &str = "repeatability-result";

/// The idemkit client's attempt number on each attempt (1 for the first).
pub const IDEMKIT_ATTEMPT: &str = "idemkit-attempt";

/// The idemkit client's per-attempt timeout in milliseconds.
pub const IDEMKIT_TIMEOUT_MS: &str = "idemkit-timeout-ms";
