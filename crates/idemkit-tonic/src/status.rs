//! The gRPC face of the contract: problems as `tonic::Status` with `google.rpc`
//! rich error details, and gRPC codes as the engine's dispositions.

use std::time::Duration;

use idemkit_core::{ErrorCode, Policy, Problem};
use idemkit_engine::{Disposition, Override};
use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

/// The `domain` of every `google.rpc.ErrorInfo` the layer sends.
pub const ERROR_DOMAIN: &str = "idemkit";

/// The gRPC code a problem is answered with:
///
/// | stable code (`ErrorInfo.reason`)   | gRPC code             |
/// |------------------------------------|-----------------------|
/// | `idempotency_key_missing`, `idempotency_key_invalid`, `validation_failed`, `unsupported_media_type` | `INVALID_ARGUMENT` |
/// | `idempotency_key_reused`           | `FAILED_PRECONDITION` |
/// | `idempotency_request_parked`       | `FAILED_PRECONDITION` |
/// | `idempotency_request_in_progress`  | `ABORTED` + `RetryInfo` |
/// | `idempotency_lease_lost`           | `ABORTED` + `RetryInfo` |
/// | `idempotency_store_unavailable`    | `UNAVAILABLE` + `RetryInfo` |
/// | `deadline_exceeded`                | `DEADLINE_EXCEEDED`   |
/// | `payload_too_large`                | `RESOURCE_EXHAUSTED`  |
/// | `unauthorized`                     | `UNAUTHENTICATED`     |
/// | `not_found`                        | `NOT_FOUND`           |
/// | `idempotency_response_too_large`, `idempotency_misconfigured`, `internal_error` | `INTERNAL` |
pub fn code_for(code: ErrorCode) -> Code {
    match code {
        ErrorCode::KeyMissing
        | ErrorCode::KeyInvalid
        | ErrorCode::ValidationFailed
        | ErrorCode::UnsupportedMediaType => Code::InvalidArgument,
        ErrorCode::KeyReused | ErrorCode::RequestParked => Code::FailedPrecondition,
        ErrorCode::RequestInProgress | ErrorCode::LeaseLost => Code::Aborted,
        ErrorCode::StoreUnavailable => Code::Unavailable,
        ErrorCode::DeadlineExceeded => Code::DeadlineExceeded,
        ErrorCode::PayloadTooLarge => Code::ResourceExhausted,
        ErrorCode::Unauthorized => Code::Unauthenticated,
        ErrorCode::NotFound => Code::NotFound,
        _ => Code::Internal,
    }
}

/// A problem as a status: the code of [`code_for`], the problem's detail as the
/// message, and as details a `google.rpc.ErrorInfo` (`reason` = the stable code,
/// `domain` = [`ERROR_DOMAIN`], metadata `retryable`) plus, when the client
/// should wait, a `google.rpc.RetryInfo` with the delay.
pub fn status_for(problem: &Problem, retry_after: Option<Duration>) -> tonic::Status {
    let mut details = ErrorDetails::with_error_info(
        problem.code.as_str(),
        ERROR_DOMAIN,
        [("retryable".to_owned(), problem.retryable.to_string())],
    );
    if let Some(d) = retry_after {
        details.set_retry_info(Some(d));
    }
    tonic::Status::with_error_details(code_for(problem.code), problem.detail.clone(), details)
}

/// The HTTP status whose disposition a gRPC code shares (google.rpc's
/// `code.proto` mapping, except `CANCELLED` and `ABORTED`, which the layer
/// treats like `408`: nothing was carried out, so the key is released and a
/// retry runs). So `INVALID_ARGUMENT`, `FAILED_PRECONDITION`, `OUT_OF_RANGE`,
/// `UNAUTHENTICATED`, `PERMISSION_DENIED` and `RESOURCE_EXHAUSTED` release the
/// key like `400`/`401`/`403`/`429`; `INTERNAL`, `UNKNOWN`, `DATA_LOSS`,
/// `UNAVAILABLE`, `UNIMPLEMENTED` and `DEADLINE_EXCEEDED` follow the route's
/// server-error policy like `5xx`; `OK`, `NOT_FOUND` and `ALREADY_EXISTS` are stored.
pub fn http_equivalent(code: Code) -> u16 {
    match code {
        Code::Ok => 200,
        Code::Cancelled | Code::Aborted => 408,
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
        Code::DeadlineExceeded => 504,
        Code::NotFound => 404,
        Code::AlreadyExists => 409,
        Code::PermissionDenied => 403,
        Code::ResourceExhausted => 429,
        Code::Unimplemented => 501,
        Code::Unavailable => 503,
        Code::Unauthenticated => 401,
        Code::Unknown | Code::Internal | Code::DataLoss => 500,
    }
}

/// What happens to an answer with `code`, unless the handler overrode it with
/// `outcome` (an [`Override`] in the response's extensions).
pub fn disposition(code: Code, outcome: Option<Override>, policy: &Policy) -> Disposition {
    Disposition::of(http_equivalent(code), outcome, policy)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispositions() {
        let p = Policy::new();
        let d = |c| disposition(c, None, &p);
        assert_eq!(d(Code::Ok), Disposition::Store);
        assert_eq!(d(Code::AlreadyExists), Disposition::Store);
        assert_eq!(d(Code::NotFound), Disposition::Store);
        for c in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::Unauthenticated,
            Code::Cancelled,
            Code::Aborted,
            Code::ResourceExhausted,
            Code::Unavailable,
            Code::Internal,
        ] {
            assert_eq!(d(c), Disposition::Release, "{c:?}");
        }
        assert_eq!(
            disposition(Code::Internal, Some(Override::Final), &p),
            Disposition::Store
        );
    }

    #[test]
    fn statuses_carry_error_info_and_retry_info() {
        let p = Problem::new(ErrorCode::RequestInProgress, "busy");
        let s = status_for(&p, Some(Duration::from_secs(2)));
        assert_eq!(s.code(), Code::Aborted);
        let details = s.get_error_details();
        let info = details.error_info().unwrap();
        assert_eq!(info.reason, "idempotency_request_in_progress");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert_eq!(
            details.retry_info().unwrap().retry_delay,
            Some(Duration::from_secs(2))
        );
        let reused = status_for(&Problem::new(ErrorCode::KeyReused, "x"), None);
        assert_eq!(reused.code(), Code::FailedPrecondition);
        assert!(reused.get_error_details().retry_info().is_none());
    }
}
