//! The conventions users already have, spoken by the HTTP adapter: OASIS
//! Repeatable Requests 1.0 headers, and content negotiation of a stored
//! answer's `Content-Encoding` at replay.

use std::time::{Duration, SystemTime};

use http::HeaderMap;
use idemkit_core::{ErrorCode, IdempotencyKey, KeyError};

use crate::ProblemResponse;
use crate::metrics::outcome;
use crate::shared::{REPEATABILITY_CLOCK_SKEW, REPEATABILITY_FIRST_SENT, REPEATABILITY_REQUEST_ID};

/// Reads an OASIS repeatable request's key and checks its first-sent time
/// against `window` (the route's replay window) at `now`.
///
/// A first-sent time older than the window means the first attempt may have
/// run and its record may no longer replay: re-executing it would not be safe,
/// so it is `412` (OASIS §2.3). One further in the future than
/// [`REPEATABILITY_CLOCK_SKEW`] is just as unknowable.
pub(crate) fn read_repeatable(
    headers: &HeaderMap,
    window: Duration,
    now: SystemTime,
) -> Result<IdempotencyKey, ProblemResponse> {
    let key = IdempotencyKey::from_header_values(
        headers
            .get_all(REPEATABILITY_REQUEST_ID)
            .iter()
            .map(http::HeaderValue::as_bytes),
    )
    .map_err(|e| {
        let code = e.code();
        let detail = match e {
            KeyError::Missing => "this route speaks OASIS Repeatable Requests: send `Repeatability-Request-ID` (e.g. a UUID) and `Repeatability-First-Sent` (an HTTP-date)".to_owned(),
            other => format!("`Repeatability-Request-ID`: {other}"),
        };
        ProblemResponse::new(code, detail)
    })?;
    let mut sent = headers.get_all(REPEATABILITY_FIRST_SENT).iter();
    let first_sent = match (sent.next(), sent.next()) {
        (None, _) => {
            return Err(ProblemResponse::new(
                ErrorCode::KeyMissing,
                "`Repeatability-First-Sent` is required with `Repeatability-Request-ID`: the HTTP-date (IMF-fixdate) of the first attempt",
            ));
        }
        (Some(v), None) => v
            .to_str()
            .ok()
            .and_then(|s| httpdate::parse_http_date(s.trim()).ok())
            .ok_or_else(|| {
                ProblemResponse::new(
                    ErrorCode::KeyInvalid,
                    "`Repeatability-First-Sent` must be an HTTP-date such as `Sun, 06 Nov 1994 08:49:37 GMT`",
                )
            })?,
        (Some(_), Some(_)) => {
            return Err(ProblemResponse::new(
                ErrorCode::KeyInvalid,
                "`Repeatability-First-Sent` was sent more than once",
            ));
        }
    };
    // HTTP-dates have whole seconds: the request's own second counts as now.
    let too_old = now
        .checked_sub(window)
        .is_some_and(|oldest| first_sent + Duration::from_secs(1) <= oldest);
    let too_new = first_sent > now + REPEATABILITY_CLOCK_SKEW;
    if too_old || too_new {
        return Err(ProblemResponse::new(
            ErrorCode::FirstSentOutOfWindow,
            format!(
                "`Repeatability-First-Sent` is outside this route's replay window of {} s: whether the first attempt ran can no longer be known, so it is not executed; send a new request with a new `Repeatability-Request-ID`",
                window.as_secs()
            ),
        ));
    }
    Ok(key)
}

/// The `Repeatability-Result` of an answer: `accepted` when the request ran (or
/// its first answer is replayed), `rejected` when it was refused because of its
/// repeatability headers (missing, malformed, out of window, reused with
/// another request, or a duplicate still in flight); none for answers that say
/// nothing about repeatability (authentication, the store being down).
pub(crate) fn repeatability_result(counted: &str, status: u16) -> Option<&'static str> {
    match counted {
        outcome::EXECUTED | outcome::REPLAYED | outcome::RELEASED | outcome::ABANDONED => Some("accepted"),
        outcome::KEY_MISSING | outcome::KEY_INVALID | outcome::KEY_REUSED | outcome::IN_PROGRESS => {
            Some("rejected")
        }
        outcome::REJECTED if status == 412 => Some("rejected"),
        _ => None,
    }
}

/// Whether a caller sending these `Accept-Encoding` headers accepts `coding`
/// (RFC 9110 §12.5.3), strictly: the coding, or `*`, listed with a non-zero
/// weight. A caller that sends no `Accept-Encoding` is not taken to accept a
/// compressed replay (RFC 9110 would allow it; a replay must decode for every
/// caller, the behaviour contract, `docs/spec.md` §5). `identity` is always acceptable unless refused by `q=0`.
pub fn accepts_encoding(headers: &HeaderMap, coding: &str) -> bool {
    let coding = coding.trim();
    let mut named = None;
    let mut star = None;
    for value in headers.get_all(http::header::ACCEPT_ENCODING) {
        let Ok(value) = value.to_str() else { continue };
        for item in value.split(',') {
            let mut parts = item.split(';');
            let name = parts.next().unwrap_or_default().trim();
            if name.is_empty() {
                continue;
            }
            let q = parts
                .filter_map(|p| {
                    let (k, v) = p.split_once('=')?;
                    k.trim()
                        .eq_ignore_ascii_case("q")
                        .then(|| v.trim().parse::<f32>().ok())?
                })
                .next()
                .unwrap_or(1.0);
            if name.eq_ignore_ascii_case(coding) {
                named = Some(q > 0.0);
            } else if name == "*" {
                star = Some(q > 0.0);
            }
        }
    }
    let identity = coding.eq_ignore_ascii_case("identity");
    named.or(star).unwrap_or(identity)
}

/// The `Content-Encoding` of a stored answer that is not `identity`.
pub(crate) fn stored_coding(stored: &idemkit_core::StoredResponse) -> Option<String> {
    stored
        .headers
        .iter()
        .find(|h| h.name.eq_ignore_ascii_case("content-encoding"))
        .and_then(|h| std::str::from_utf8(&h.value).ok())
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty() && !v.eq_ignore_ascii_case("identity"))
}

/// Whether an answer is a stream the layer cannot record and replay faithfully
/// (server-sent events: an answer without an end in sight by design).
pub(crate) fn is_streaming(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("text/event-stream"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn accept_encoding_is_read_strictly() {
        assert!(accepts_encoding(
            &headers(&[("accept-encoding", "gzip, br")]),
            "gzip"
        ));
        assert!(accepts_encoding(
            &headers(&[("accept-encoding", "br;q=0.5, GZIP;q=0.1")]),
            "gzip"
        ));
        assert!(!accepts_encoding(
            &headers(&[("accept-encoding", "gzip;q=0")]),
            "gzip"
        ));
        assert!(!accepts_encoding(&headers(&[("accept-encoding", "br")]), "gzip"));
        assert!(accepts_encoding(&headers(&[("accept-encoding", "*")]), "gzip"));
        assert!(!accepts_encoding(
            &headers(&[("accept-encoding", "*, gzip;q=0")]),
            "gzip"
        ));
        assert!(
            !accepts_encoding(&HeaderMap::new(), "gzip"),
            "no header: not accepted"
        );
        assert!(accepts_encoding(&HeaderMap::new(), "identity"));
    }

    #[test]
    fn first_sent_must_be_inside_the_window() {
        let now = httpdate::parse_http_date("Thu, 03 Dec 2026 08:00:00 GMT").unwrap();
        let window = Duration::from_secs(3600);
        let at = |first: &str| {
            read_repeatable(
                &headers(&[
                    ("repeatability-request-id", "r1"),
                    ("repeatability-first-sent", first),
                ]),
                window,
                now,
            )
            .map_err(|p| p.problem.code)
        };
        assert!(at("Thu, 03 Dec 2026 07:30:00 GMT").is_ok());
        assert!(at("Thu, 03 Dec 2026 08:00:30 GMT").is_ok(), "small skew ahead");
        assert_eq!(
            at("Thu, 03 Dec 2026 06:59:59 GMT"),
            Err(ErrorCode::FirstSentOutOfWindow)
        );
        assert_eq!(
            at("Thu, 03 Dec 2026 08:05:00 GMT"),
            Err(ErrorCode::FirstSentOutOfWindow)
        );
        assert_eq!(at("yesterday"), Err(ErrorCode::KeyInvalid));
        let missing = read_repeatable(&headers(&[("repeatability-request-id", "r1")]), window, now);
        assert_eq!(missing.unwrap_err().problem.code, ErrorCode::KeyMissing);
        let no_id = read_repeatable(&HeaderMap::new(), window, now);
        assert_eq!(no_id.unwrap_err().problem.code, ErrorCode::KeyMissing);
    }
}
