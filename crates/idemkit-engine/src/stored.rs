//! What an HTTP adapter keeps of a request and of an answer.

use idemkit_core::{Policy, StoredHeader, StoredResponse};

/// The request headers an HTTP adapter keeps with the record (for the
/// completer and an operator's review): content negotiation only, never
/// credentials. The layer and `idemkit proxy` keep these.
pub const STORED_REQUEST_HEADERS: &[&str] = &["content-type", "accept", "content-language"];

/// The headers of `headers` named in `names`, as the record keeps them (the
/// first value of each, in `names`' order).
pub fn stored_request_headers(headers: &http::HeaderMap, names: &[&str]) -> Vec<StoredHeader> {
    names
        .iter()
        .filter_map(|name| {
            headers.get(*name).map(|v| StoredHeader {
                name: (*name).to_owned(),
                value: v.as_bytes().to_vec(),
            })
        })
        .collect()
}

/// What is kept of an HTTP answer to replay it: the status, the headers the
/// route policy replays (never `Set-Cookie` or hop-by-hop ones) and the body.
/// What the layer stores, and what `idemkit proxy` stores of an upstream's answer.
pub fn stored_response(parts: &http::response::Parts, body: &[u8], policy: &Policy) -> StoredResponse {
    StoredResponse {
        status: parts.status.as_u16(),
        headers: parts
            .headers
            .iter()
            .filter(|(name, _)| policy.replays_header(name.as_str()))
            .map(|(name, value)| StoredHeader {
                name: name.as_str().to_owned(),
                value: value.as_bytes().to_vec(),
            })
            .collect(),
        body: body.to_vec(),
    }
}
