//! # idemkit-tonic
//!
//! idemkit for gRPC: a tower [`Layer`](tower::Layer) for tonic servers over the
//! same protocol-neutral engine as `idemkit-tower`'s HTTP layer. The
//! configured unary methods require an idempotency key (in the message field the
//! API defines, or in `idempotency-key` metadata), claim it in a
//! [`KeyStore`](idemkit_core::KeyStore) scoped per account (resolved from
//! metadata), run the handler at most once per key within the replay window, and
//! replay its stored answer (response message bytes, metadata and trailers,
//! byte-identical, plus `idempotent-replayed: true` metadata) to every retry.
//!
//! ```
//! use idemkit_tonic::{BearerTokenAccount, IdempotencyLayer};
//!
//! let store = idemkit_testkit::MemoryStore::new();
//! let secret = std::env::var("ACCOUNT_SECRET").unwrap_or_else(|_| "dev only".into());
//! let layer = IdempotencyLayer::lease(store, BearerTokenAccount::new(secret))
//!     // the key is field 1 of CreateLabelRequest, or `idempotency-key` metadata
//!     .unary_with_key_field("/labels.v1.Labels/CreateLabel", 1)
//!     .build()
//!     .unwrap();
//! // tonic::transport::Server::builder().layer(layer).add_service(..)
//! # let _ = layer;
//! ```
//!
//! ## The fingerprint
//!
//! A call's fingerprint is SHA-256 over its full method name
//! (`/pkg.Service/Method`) and its request *frame*: the 5-byte gRPC prefix (flag
//! `0`, big-endian length) and the serialized message, exactly as received. The
//! layer does not decode the message, so the fingerprint is over its *encoding*:
//! two encoders that write the same fields in a different order (protobuf allows
//! any order, and unknown fields are kept), or a client that changes its library,
//! produce different bytes for the same message, and a retry that re-serializes
//! rather than resending the same bytes is answered `FAILED_PRECONDITION`
//! (`idempotency_key_reused`). It never replays a different request; clients
//! should serialize once and resend those bytes (every official library's
//! deterministic field-number order also gives equal bytes for equal messages).
//! Compressed request frames are refused (`INVALID_ARGUMENT`,
//! `unsupported_media_type`): their bytes depend on the compressor.
//!
//! ## Status mapping
//!
//! Refusals are `tonic::Status`es with `google.rpc.ErrorInfo` (`reason` = the
//! stable code of the HTTP problem documents, `domain` = `idemkit`) and, where
//! the client should wait, `google.rpc.RetryInfo`: see [`code_for`]. The
//! handler's own status decides what is stored: see [`http_equivalent`].

mod body;
mod deadline;
mod frame;
mod layer;
mod outcome;
mod service;
mod status;

pub use deadline::parse_grpc_timeout;
pub use idemkit_engine::{AccountResolver, BearerTokenAccount, TrustedHeaderAccount, Unscoped};
pub use layer::{BuildError, IdempotencyLayer, IdempotencyLayerBuilder};
pub use outcome::{OUTCOME_METADATA, with_outcome};
pub use service::{ATTEMPTS_METRIC, Idempotency, ResponseFuture};
pub use status::{ERROR_DOMAIN, code_for, disposition, http_equivalent, status_for};

pub use idemkit_core::wire;
pub(crate) use idemkit_core::wire::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};

/// How a stored trailer's name starts in the record (`trailers/grpc-status`).
pub const TRAILER_PREFIX: &str = "trailers/";
