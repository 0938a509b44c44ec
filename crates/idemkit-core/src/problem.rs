//! RFC 9457 problem documents with stable machine codes (the behaviour contract, `docs/spec.md` §5).

use serde::{Deserialize, Serialize};

/// The media type of every error the idempotency layer or the framework produces.
pub const PROBLEM_CONTENT_TYPE: &str = "application/problem+json";

/// Stable machine-readable error codes. The string form is the public contract:
/// it never changes once published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The route requires a key and the request has none.
    #[serde(rename = "idempotency_key_missing")]
    KeyMissing,
    /// The key is malformed, too long, or sent more than once.
    #[serde(rename = "idempotency_key_invalid")]
    KeyInvalid,
    /// The key was already used with a different request (fingerprint mismatch).
    #[serde(rename = "idempotency_key_reused")]
    KeyReused,
    /// A request with this key is still being processed.
    #[serde(rename = "idempotency_request_in_progress")]
    RequestInProgress,
    /// The request was parked for human review (an external call's outcome is
    /// unknown and cannot be safely repeated); it will not run again.
    #[serde(rename = "idempotency_request_parked")]
    RequestParked,
    /// The response is larger than the configured storage cap; nothing was committed.
    #[serde(rename = "idempotency_response_too_large")]
    ResponseTooLarge,
    /// The lease on this key was taken over by a later attempt; this attempt's writes were discarded.
    #[serde(rename = "idempotency_lease_lost")]
    LeaseLost,
    /// The key store could not be reached or failed; safe to retry with the same key.
    #[serde(rename = "idempotency_store_unavailable")]
    StoreUnavailable,
    /// The caller's deadline (`grpc-timeout`, or the REST `Request-Timeout` header)
    /// had already passed when the request arrived, so it was refused before its key
    /// was claimed; or (single-step routes only) it passed while the handler ran and
    /// the handler's transaction was rolled back. Either way nothing was written and
    /// the key is still free. Not retryable: the caller's budget is spent; a new
    /// call with a fresh budget may reuse the key.
    #[serde(rename = "deadline_exceeded")]
    DeadlineExceeded,
    /// The route is configured in a way the layer cannot honour, found on the
    /// first request that runs into it (a single-step route whose handler
    /// settled the record itself with `Override::Settled`, as `Phases` does):
    /// nothing was committed and the key is free, but the same request will
    /// fail the same way until the route is fixed. Not retryable.
    #[serde(rename = "idempotency_misconfigured")]
    Misconfigured,
    /// An OASIS Repeatable Requests route was sent a `Repeatability-First-Sent`
    /// time outside the replay window (too old to know whether the request
    /// already ran, or in the future): `412`, nothing was claimed. Not
    /// retryable with the same headers.
    #[serde(rename = "repeatability_first_sent_out_of_window")]
    FirstSentOutOfWindow,
    /// The stored answer has a `Content-Encoding` this caller's `Accept-Encoding`
    /// does not accept, so it cannot be replayed to it byte for byte (`406`).
    /// The request ran once; repeating it with an `Accept-Encoding` that accepts
    /// the stored coding replays it.
    #[serde(rename = "idempotency_replay_not_acceptable")]
    ReplayNotAcceptable,
    /// The handler answered a keyed request with a stream (`text/event-stream`)
    /// that the layer cannot record and replay faithfully: the answer was not
    /// stored, never replayed empty or truncated (`500`). The route is
    /// misconfigured: streaming answers belong on unkeyed routes.
    #[serde(rename = "idempotency_streaming_unsupported")]
    StreamingUnsupported,
    /// The request body or parameters failed validation.
    ValidationFailed,
    /// The request body is larger than the route accepts.
    PayloadTooLarge,
    /// The request body has a media type the route does not accept.
    UnsupportedMediaType,
    /// No or unknown credentials.
    Unauthorized,
    /// The resource does not exist (or belongs to another account).
    NotFound,
    /// An unexpected server error.
    #[serde(rename = "internal_error")]
    Internal,
    /// A code this version does not know, read from a document a newer server
    /// sent (`Deserialize` maps every unknown string here instead of failing).
    /// Its own status, title and `retryable` member are in the [`Problem`] it
    /// came in; this crate never produces it.
    #[serde(other, rename = "unknown")]
    Unknown,
}

impl ErrorCode {
    /// The code as it appears in the `code` member.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::KeyMissing => "idempotency_key_missing",
            Self::KeyInvalid => "idempotency_key_invalid",
            Self::KeyReused => "idempotency_key_reused",
            Self::RequestInProgress => "idempotency_request_in_progress",
            Self::RequestParked => "idempotency_request_parked",
            Self::ResponseTooLarge => "idempotency_response_too_large",
            Self::LeaseLost => "idempotency_lease_lost",
            Self::StoreUnavailable => "idempotency_store_unavailable",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Misconfigured => "idempotency_misconfigured",
            Self::FirstSentOutOfWindow => "repeatability_first_sent_out_of_window",
            Self::ReplayNotAcceptable => "idempotency_replay_not_acceptable",
            Self::StreamingUnsupported => "idempotency_streaming_unsupported",
            Self::ValidationFailed => "validation_failed",
            Self::PayloadTooLarge => "payload_too_large",
            Self::UnsupportedMediaType => "unsupported_media_type",
            Self::Unauthorized => "unauthorized",
            Self::NotFound => "not_found",
            Self::Internal => "internal_error",
            Self::Unknown => "unknown",
        }
    }

    /// The HTTP status this code answers with by default.
    pub const fn default_status(self) -> u16 {
        match self {
            Self::KeyMissing | Self::KeyInvalid | Self::ValidationFailed => 400,
            Self::KeyReused | Self::RequestInProgress | Self::RequestParked => 409,
            Self::ResponseTooLarge
            | Self::Misconfigured
            | Self::StreamingUnsupported
            | Self::Internal
            | Self::Unknown => 500,
            Self::FirstSentOutOfWindow => 412,
            Self::ReplayNotAcceptable => 406,
            Self::LeaseLost | Self::StoreUnavailable => 503,
            Self::DeadlineExceeded => 504,
            Self::PayloadTooLarge => 413,
            Self::UnsupportedMediaType => 415,
            Self::Unauthorized => 401,
            Self::NotFound => 404,
        }
    }

    /// Whether retrying the same request (same key, same body) can succeed.
    pub const fn retryable(self) -> bool {
        matches!(
            self,
            Self::RequestInProgress | Self::LeaseLost | Self::StoreUnavailable | Self::Internal
        )
    }

    /// A short, human title (the problem `title`, constant per code).
    pub const fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency key missing",
            Self::KeyInvalid => "Idempotency key invalid",
            Self::KeyReused => "Idempotency key reused with a different request",
            Self::RequestInProgress => "A request with this idempotency key is in progress",
            Self::RequestParked => "Request parked for review",
            Self::ResponseTooLarge => "Response too large to store for replay",
            Self::LeaseLost => "Idempotency lease lost",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::DeadlineExceeded => "Deadline exceeded",
            Self::Misconfigured => "Idempotency misconfigured",
            Self::FirstSentOutOfWindow => "Repeatability-First-Sent outside the replay window",
            Self::ReplayNotAcceptable => "Stored answer not acceptable to this caller",
            Self::StreamingUnsupported => "Streaming answers are not stored for replay",
            Self::ValidationFailed => "Validation failed",
            Self::PayloadTooLarge => "Payload too large",
            Self::UnsupportedMediaType => "Unsupported media type",
            Self::Unauthorized => "Unauthorized",
            Self::NotFound => "Not found",
            Self::Internal => "Internal server error",
            Self::Unknown => "Unknown error code",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An RFC 9457 problem document with idemkit's two extension members,
/// `code` and `retryable`.
///
/// ```
/// use idemkit_core::{ErrorCode, Problem};
/// let p = Problem::new(ErrorCode::KeyReused, "key k1 was first used with another body");
/// let json = serde_json::to_value(&p).unwrap();
/// assert_eq!(json["code"], "idempotency_key_reused");
/// assert_eq!(json["status"], 409);
/// assert_eq!(json["retryable"], false);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Problem {
    /// A URI reference naming the problem type.
    #[serde(rename = "type")]
    pub type_uri: String,
    /// A short summary, constant per type.
    pub title: String,
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong with this request.
    pub detail: String,
    /// The stable machine code.
    pub code: ErrorCode,
    /// Whether the same request may be retried with the same key.
    pub retryable: bool,
}

impl Problem {
    /// A problem with the code's default status, title and retryability.
    pub fn new(code: ErrorCode, detail: impl Into<String>) -> Self {
        Self {
            type_uri: format!("urn:idemkit:problem:{}", code.as_str()),
            title: code.title().to_owned(),
            status: code.default_status(),
            detail: detail.into(),
            code,
            retryable: code.retryable(),
        }
    }

    /// Overrides the status (e.g. 422 for key reuse in IETF-draft style).
    pub fn with_status(mut self, status: u16) -> Self {
        self.status = status;
        self
    }

    /// The document serialised as JSON bytes.
    pub fn to_json(&self) -> Vec<u8> {
        // Serialising a struct of strings, numbers and bools cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conflict_codes_differ_and_serde_matches_as_str() {
        assert_ne!(
            ErrorCode::KeyReused.as_str(),
            ErrorCode::RequestInProgress.as_str()
        );
        for code in [
            ErrorCode::KeyMissing,
            ErrorCode::KeyInvalid,
            ErrorCode::KeyReused,
            ErrorCode::RequestInProgress,
            ErrorCode::ResponseTooLarge,
            ErrorCode::RequestParked,
            ErrorCode::LeaseLost,
            ErrorCode::StoreUnavailable,
            ErrorCode::DeadlineExceeded,
            ErrorCode::Misconfigured,
            ErrorCode::ValidationFailed,
            ErrorCode::PayloadTooLarge,
            ErrorCode::UnsupportedMediaType,
            ErrorCode::Unauthorized,
            ErrorCode::NotFound,
            ErrorCode::Internal,
        ] {
            let json = serde_json::to_value(code).unwrap();
            assert_eq!(json, code.as_str(), "{code:?}");
            let p = Problem::new(code, "d");
            assert_eq!(p.status, code.default_status());
        }
        assert!(!ErrorCode::ResponseTooLarge.retryable());
        // A code a newer server sends decodes instead of failing the document.
        let p: Problem = serde_json::from_str(
            r#"{"type":"urn:x","title":"t","status":503,"detail":"d","code":"idempotency_brand_new","retryable":true}"#,
        )
        .unwrap();
        assert_eq!(p.code, ErrorCode::Unknown);
        assert!(p.retryable, "the document's own retryable member is kept");
        assert_eq!(
            serde_json::from_str::<ErrorCode>(r#""idempotency_key_reused""#).unwrap(),
            ErrorCode::KeyReused
        );
        assert!(ErrorCode::RequestInProgress.retryable());
        assert_eq!(ErrorCode::DeadlineExceeded.as_str(), "deadline_exceeded");
        assert_eq!(ErrorCode::DeadlineExceeded.default_status(), 504);
        assert!(!ErrorCode::DeadlineExceeded.retryable());
        assert_eq!(ErrorCode::Misconfigured.as_str(), "idempotency_misconfigured");
        assert!(!ErrorCode::Misconfigured.retryable());
    }
}
