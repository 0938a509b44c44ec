//! How the gates reach the API under test: one request in, one full answer out.

use async_trait::async_trait;
use http::{HeaderMap, Method};

use crate::Gate;

/// One request the gates send.
#[derive(Debug, Clone)]
pub struct Request {
    /// The HTTP method.
    pub method: Method,
    /// The absolute URL.
    pub url: String,
    /// Every header to send (the key header included when the key travels in one).
    pub headers: HeaderMap,
    /// The body bytes (empty for none).
    pub body: Vec<u8>,
}

/// One answer, fully read.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The response headers.
    pub headers: HeaderMap,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl Answer {
    /// `true` for a 2xx status.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The first value of header `name` as text, if present and visible ASCII.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// The body parsed as JSON, if it is JSON.
    pub fn json(&self) -> Option<serde_json::Value> {
        serde_json::from_slice(&self.body).ok()
    }
}

/// A request that got no answer (connection refused or reset, timeout, …).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct TransportError(pub String);

/// Sends one request and reads the whole answer.
///
/// Implementations must let many `send`s run at once (the concurrency gates start
/// dozens together and await them jointly), must not follow redirects and must not
/// retry: every answer the server gives is evidence.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Sends `request` and returns the server's answer.
    async fn send(&self, request: Request) -> Result<Answer, TransportError>;

    /// Why `gate` cannot apply over this transport's protocol, if it cannot (the
    /// `x-idempotency` policy gate over gRPC): the gate is then reported
    /// [`Verdict::NotApplicable`](crate::Verdict::NotApplicable) and sends nothing.
    /// Defaults to every gate applying.
    fn not_applicable(&self, gate: Gate) -> Option<String> {
        let _ = gate;
        None
    }
}
