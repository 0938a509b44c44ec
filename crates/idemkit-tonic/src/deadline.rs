//! The caller's deadline as gRPC carries it: the `grpc-timeout` request header.

use std::time::{Duration, Instant};

use http::HeaderMap;

pub(crate) use idemkit_core::wire::GRPC_TIMEOUT;

/// Parses a `grpc-timeout` value as the gRPC over HTTP/2 specification writes it:
/// at most 8 ASCII digits followed by one unit, `H` (hours), `M` (minutes), `S`
/// (seconds), `m` (milliseconds), `u` (microseconds) or `n` (nanoseconds).
/// `None` when malformed (the header is then ignored, as tonic and grpc-go do).
///
/// ```
/// use std::time::Duration;
/// use idemkit_tonic::parse_grpc_timeout;
/// assert_eq!(parse_grpc_timeout("1999m"), Some(Duration::from_millis(1999)));
/// assert_eq!(parse_grpc_timeout("2S"), Some(Duration::from_secs(2)));
/// assert_eq!(parse_grpc_timeout("0n"), Some(Duration::ZERO));
/// assert_eq!(parse_grpc_timeout("123456789S"), None);
/// assert_eq!(parse_grpc_timeout("5s"), None);
/// ```
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    let unit = value.chars().last()?;
    let digits = &value[..value.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n * 3600),
        'M' => Duration::from_secs(n * 60),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The caller's deadline: now plus a single well-formed `grpc-timeout`.
pub(crate) fn request_deadline(headers: &HeaderMap) -> Option<Instant> {
    let mut values = headers.get_all(GRPC_TIMEOUT).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return None;
    };
    let budget = parse_grpc_timeout(value.to_str().ok()?)?;
    Instant::now().checked_add(budget)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_unit_and_the_bounds() {
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse_grpc_timeout("7u"), Some(Duration::from_micros(7)));
        assert_eq!(
            parse_grpc_timeout("99999999H"),
            Some(Duration::from_secs(99_999_999 * 3600))
        );
        assert_eq!(parse_grpc_timeout(""), None);
        assert_eq!(parse_grpc_timeout("m"), None);
        assert_eq!(parse_grpc_timeout("-1m"), None);
        assert_eq!(parse_grpc_timeout("1.5S"), None);
        assert_eq!(parse_grpc_timeout("10"), None);
        assert_eq!(parse_grpc_timeout("1é"), None);
    }
}
