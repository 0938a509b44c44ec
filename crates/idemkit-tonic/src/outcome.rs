//! How a gRPC handler overrides the storage policy for one answer.

use http::HeaderMap;
use idemkit_engine::Override;
use tonic::metadata::MetadataValue;

/// Metadata a handler sets on one answer (a [`tonic::Status`]'s metadata, or a
/// response's) to override the route's storage policy for it:
/// `final` stores and replays it whatever its code; `retryable` does not store
/// it and ends the lease at once, keeping recorded progress so the next attempt
/// resumes; `settled` leaves the record as the handler left it. The layer removes
/// the entry before the answer is stored or sent. Set it with [`with_outcome`].
pub const OUTCOME_METADATA: &str = "idemkit-outcome";

fn value(outcome: Override) -> &'static str {
    match outcome {
        Override::Final => "final",
        Override::Retryable => "retryable",
        _ => "settled",
    }
}

/// `status` marked with `outcome` (see [`OUTCOME_METADATA`]).
///
/// ```
/// use idemkit_tonic::{OUTCOME_METADATA, with_outcome};
/// use idemkit_engine::Override;
///
/// // A permanent refusal from downstream, after effects: store it, replay it.
/// let status = with_outcome(tonic::Status::failed_precondition("address rejected"), Override::Final);
/// assert_eq!(status.metadata().get(OUTCOME_METADATA).unwrap(), "final");
/// ```
pub fn with_outcome(mut status: tonic::Status, outcome: Override) -> tonic::Status {
    status
        .metadata_mut()
        .insert(OUTCOME_METADATA, MetadataValue::from_static(value(outcome)));
    status
}

/// Removes the marker from `headers` and reads it.
pub(crate) fn take(headers: &mut HeaderMap) -> Option<Override> {
    let marked = headers.remove(OUTCOME_METADATA)?;
    match marked.as_bytes() {
        b"final" => Some(Override::Final),
        b"retryable" => Some(Override::Retryable),
        b"settled" => Some(Override::Settled),
        other => {
            tracing::warn!(value = ?String::from_utf8_lossy(other), "idempotency: unknown {OUTCOME_METADATA} value ignored");
            None
        }
    }
}
