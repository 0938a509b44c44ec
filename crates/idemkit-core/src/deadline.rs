//! The REST deadline convention (the behaviour contract, `docs/spec.md` §10, "Deadlines").
//!
//! gRPC carries a caller's deadline natively (`grpc-timeout`); plain HTTP has no
//! standard header for it, so idemkit defines one:
//!
//! ```text
//! Request-Timeout: <milliseconds remaining>
//! ```
//!
//! The value is the time the caller is still willing to wait, in whole
//! milliseconds, as 1 to 10 ASCII digits (no sign, no unit, no fraction). It is
//! *relative* on purpose: a relative budget survives clock skew between client and
//! server, and the server turns it into a deadline the moment the request arrives.
//! A client rounds its remaining budget *down* (it never claims more time than it
//! has); `0` means the deadline has already passed, and such a request is refused
//! before its key is claimed. A value that does not have this form is ignored
//! (the request has no deadline), as gRPC servers ignore a malformed
//! `grpc-timeout`.

use std::time::Duration;

/// The most digits a [`crate::wire::REQUEST_TIMEOUT`] value may have.
pub const DEADLINE_HEADER_MAX_DIGITS: usize = 10;

/// Parses a [`crate::wire::REQUEST_TIMEOUT`] value into the remaining budget; `None` when the
/// value is malformed (the header is then ignored).
///
/// ```
/// use std::time::Duration;
/// use idemkit_core::parse_deadline_header;
/// assert_eq!(parse_deadline_header("1500"), Some(Duration::from_millis(1500)));
/// assert_eq!(parse_deadline_header("0"), Some(Duration::ZERO));
/// assert_eq!(parse_deadline_header("1.5"), None);
/// assert_eq!(parse_deadline_header("-1"), None);
/// ```
pub fn parse_deadline_header(value: &str) -> Option<Duration> {
    let value = value.trim_matches(|c| c == ' ' || c == '\t');
    if value.is_empty()
        || value.len() > DEADLINE_HEADER_MAX_DIGITS
        || !value.bytes().all(|b| b.is_ascii_digit())
    {
        return None;
    }
    value.parse::<u64>().ok().map(Duration::from_millis)
}

/// Formats a remaining budget as a [`crate::wire::REQUEST_TIMEOUT`] value, rounding down to
/// whole milliseconds and saturating at the largest value the header allows.
///
/// ```
/// use std::time::Duration;
/// use idemkit_core::format_deadline_header;
/// assert_eq!(format_deadline_header(Duration::from_micros(1_999_900)), "1999");
/// assert_eq!(format_deadline_header(Duration::ZERO), "0");
/// ```
pub fn format_deadline_header(remaining: Duration) -> String {
    const MAX: u128 = 9_999_999_999;
    remaining.as_millis().min(MAX).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        assert_eq!(
            parse_deadline_header(&format_deadline_header(Duration::from_secs(2))),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            format_deadline_header(Duration::from_secs(u64::MAX)),
            "9999999999"
        );
        assert_eq!(
            parse_deadline_header("9999999999"),
            Some(Duration::from_millis(9_999_999_999))
        );
        assert_eq!(parse_deadline_header("10000000000"), None);
        assert_eq!(parse_deadline_header(" 250 "), Some(Duration::from_millis(250)));
        assert_eq!(parse_deadline_header(""), None);
        assert_eq!(parse_deadline_header("+5"), None);
        assert_eq!(parse_deadline_header("5ms"), None);
    }
}
