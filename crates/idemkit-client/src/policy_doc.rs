//! Policies servers publish: the `x-idempotency` extension of their OpenAPI document,
//! or the JSON policy document served next to their contract
//! (`docs/x-idempotency.md` in the idemkit repository specifies both).
//!
//! [`PublishedPolicy`] answers, for a request the client is about to send, whether
//! the operation takes a key and where the key goes, so a client follows what the
//! server publishes instead of guessing from the method.
//!
//! ```
//! use http::Method;
//! use idemkit_client::{KeyLocation, PublishedPolicy};
//!
//! let doc = serde_json::json!({
//!     "openapi": "3.1.0",
//!     "paths": {
//!         "/labels": {"post": {"x-idempotency": {
//!             "version": 1, "retrySafe": true,
//!             "key": {"in": "body", "name": "/idempotencyKey"},
//!             "replay": {"marker": {"header": "Idempotent-Replayed", "value": "true"}, "status": 200}
//!         }}},
//!         "/labels/{id}/void": {"post": {"x-idempotency": {"version": 1, "retrySafe": false}}}
//!     }
//! });
//! let policy = PublishedPolicy::from_document("https://api.example.com/v1", &doc).unwrap();
//! let op = policy.operation(&Method::POST, "https://api.example.com/v1/labels").unwrap();
//! assert_eq!(op.key, Some(KeyLocation::Body("/idempotencyKey".into())));
//! assert_eq!(op.replay_status, Some(200));
//! assert!(policy.key_for(&Method::POST, "https://api.example.com/v1/labels/42/void").is_none());
//! assert!(!policy.operation(&Method::POST, "https://api.example.com/v1/labels/42/void").unwrap().retry_safe);
//! ```

use http::{HeaderName, Method};
use serde_json::Value;

/// Where an operation's key travels.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyLocation {
    /// In this request header.
    Header(HeaderName),
    /// In the JSON body, at this JSON pointer (`/idempotencyKey`).
    Body(String),
    /// OASIS Repeatable Requests 1.0: `Repeatability-Request-ID` with
    /// `Repeatability-First-Sent` (configure the client with
    /// [`RetryConfig::with_repeatability`](crate::RetryConfig::with_repeatability),
    /// or [`PublishedOperation::configure`]).
    Repeatability,
}

/// A published answer: its status and machine code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishedAnswer {
    /// The HTTP status.
    pub status: u16,
    /// The `code` of the problem document, when published.
    pub code: Option<String>,
}

/// One operation's published policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PublishedOperation {
    /// The method.
    pub method: Method,
    /// The path template, as published (`/labels/{id}`).
    pub path: String,
    /// `false` when the operation is documented as not retry-safe.
    pub retry_safe: bool,
    /// `true` for an operation documented as a read despite its method.
    pub safe: bool,
    /// Where the key goes; `None` when the operation takes none.
    pub key: Option<KeyLocation>,
    /// The status replays of a stored 2xx answer with (`None`: the stored status).
    pub replay_status: Option<u16>,
    /// The replay marker: header name and value.
    pub replay_marker: Option<(HeaderName, String)>,
    /// The answer to a different request under a used key.
    pub mismatch: Option<PublishedAnswer>,
    /// The answer to a duplicate of a request in flight.
    pub in_progress: Option<PublishedAnswer>,
    /// Whether the in-progress answer carries `Retry-After`.
    pub retry_after: bool,
    /// `reject`, `wait` or `accepted`, as published.
    pub in_flight: Option<String>,
    /// The answer to a request without its key.
    pub key_missing: Option<PublishedAnswer>,
    /// The answer to a malformed key.
    pub key_invalid: Option<PublishedAnswer>,
    /// The `x-idempotency` object itself, for what this type does not model.
    pub raw: Value,
}

impl PublishedOperation {
    /// `config` adjusted to speak the operation's published key convention: OASIS
    /// Repeatable Requests headers where the operation publishes them.
    #[must_use]
    pub fn configure(&self, config: crate::RetryConfig) -> crate::RetryConfig {
        match self.key {
            Some(KeyLocation::Repeatability) => config.with_repeatability(),
            _ => config,
        }
    }
}

/// A document that is not a policy this module can read.
#[derive(Debug, Clone, thiserror::Error)]
#[error("not a published idempotency policy: {0}")]
pub struct PolicyDocError(String);

/// Every operation a server publishes a policy for, under one base URL.
#[derive(Debug, Clone)]
pub struct PublishedPolicy {
    base: String,
    operations: Vec<PublishedOperation>,
}

const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "options", "head", "patch", "trace",
];

impl PublishedPolicy {
    /// Reads the operations of `doc` for the API at `base_url`: an OpenAPI (or
    /// Swagger 2.0) document whose operations carry `x-idempotency` (operations
    /// without it are left out), or a policy document
    /// `{"operations": [{"method", "path", "x-idempotency"}]}`. Only local `$ref`s
    /// are followed.
    ///
    /// # Errors
    ///
    /// [`PolicyDocError`] when `doc` has neither `paths` nor `operations`, or an
    /// `x-idempotency` is not an object.
    pub fn from_document(base_url: &str, doc: &Value) -> Result<Self, PolicyDocError> {
        let mut operations = Vec::new();
        if let Some(paths) = doc.get("paths").and_then(Value::as_object) {
            for (path, item) in paths {
                let item = deref(doc, item);
                for m in METHODS {
                    let Some(op) = item.get(m) else { continue };
                    let Some(x) = deref(doc, op).get("x-idempotency") else {
                        continue;
                    };
                    operations.push(operation(m, path, deref(doc, x))?);
                }
            }
        } else if let Some(ops) = doc.get("operations").and_then(Value::as_array) {
            for op in ops {
                let (Some(m), Some(path), Some(x)) = (
                    op.get("method").and_then(Value::as_str),
                    op.get("path").and_then(Value::as_str),
                    op.get("x-idempotency"),
                ) else {
                    return Err(PolicyDocError(format!(
                        "an operation lacks method, path or x-idempotency: {op}"
                    )));
                };
                operations.push(operation(m, path, x)?);
            }
        } else {
            return Err(PolicyDocError(
                "neither `paths` (OpenAPI) nor `operations` (policy document)".into(),
            ));
        }
        Ok(Self {
            base: base_url.trim_end_matches('/').to_owned(),
            operations,
        })
    }

    /// The published operations.
    pub fn operations(&self) -> &[PublishedOperation] {
        &self.operations
    }

    /// The operation a request to `url` (absolute, under the base URL, or a path
    /// relative to it) with `method` is sent to; literal path segments win over
    /// `{parameters}`.
    pub fn operation(&self, method: &Method, url: &str) -> Option<&PublishedOperation> {
        let path = self.path_of(url);
        self.operations
            .iter()
            .filter(|op| op.method == method)
            .filter_map(|op| template_score(&op.path, &path).map(|score| (score, op)))
            .max_by_key(|(score, _)| *score)
            .map(|(_, op)| op)
    }

    /// Where the key of a request to `url` goes; `None` when the published
    /// operation takes no key, or no operation is published for it.
    pub fn key_for(&self, method: &Method, url: &str) -> Option<&KeyLocation> {
        self.operation(method, url)
            .filter(|op| op.retry_safe && !op.safe)
            .and_then(|op| op.key.as_ref())
    }

    fn path_of(&self, url: &str) -> String {
        let rest = url.strip_prefix(&self.base).unwrap_or_else(|| {
            // Another spelling of the host, or a bare path: keep the path part.
            url.split_once("://")
                .and_then(|(_, r)| r.find('/').map(|i| &r[i..]))
                .unwrap_or(url)
        });
        let rest = rest.split(['?', '#']).next().unwrap_or_default();
        if rest.starts_with('/') {
            rest.to_owned()
        } else {
            format!("/{rest}")
        }
    }
}

/// How well `template` matches `path`: `None` when it does not, otherwise the number
/// of literal segments (more is more specific).
fn template_score(template: &str, path: &str) -> Option<usize> {
    let t: Vec<&str> = template.trim_end_matches('/').split('/').collect();
    let p: Vec<&str> = path.trim_end_matches('/').split('/').collect();
    if t.len() != p.len() {
        return None;
    }
    let mut score = 0;
    for (t, p) in t.iter().zip(&p) {
        if t.starts_with('{') && t.ends_with('}') {
            if p.is_empty() {
                return None;
            }
        } else if t == p {
            score += 1;
        } else {
            return None;
        }
    }
    Some(score)
}

/// Follows local `$ref`s (`#/components/...`), at most 32 hops.
fn deref<'a>(doc: &'a Value, mut v: &'a Value) -> &'a Value {
    for _ in 0..32 {
        match v
            .get("$ref")
            .and_then(Value::as_str)
            .and_then(|r| r.strip_prefix('#'))
        {
            Some(pointer) => match doc.pointer(pointer) {
                Some(next) => v = next,
                None => return v,
            },
            None => return v,
        }
    }
    v
}

fn answer(v: Option<&Value>) -> Option<PublishedAnswer> {
    let v = v?;
    Some(PublishedAnswer {
        status: u16::try_from(v.get("status")?.as_u64()?).ok()?,
        code: v.get("code").and_then(Value::as_str).map(str::to_owned),
    })
}

fn operation(method: &str, path: &str, x: &Value) -> Result<PublishedOperation, PolicyDocError> {
    if !x.is_object() {
        return Err(PolicyDocError(format!(
            "x-idempotency of {} {path} is not an object",
            method.to_ascii_uppercase()
        )));
    }
    let method = Method::from_bytes(method.to_ascii_uppercase().as_bytes())
        .map_err(|_| PolicyDocError(format!("`{method}` is not a method")))?;
    let key = x.get("key").and_then(|k| {
        if k.get("convention").and_then(Value::as_str) == Some("oasis-repeatable-requests-1.0") {
            return Some(KeyLocation::Repeatability);
        }
        let name = k.get("name")?.as_str()?;
        match k.get("in")?.as_str()? {
            "header" => HeaderName::from_bytes(name.as_bytes())
                .ok()
                .map(KeyLocation::Header),
            "body" => Some(KeyLocation::Body(if name.starts_with('/') {
                name.to_owned()
            } else {
                format!("/{name}")
            })),
            _ => None,
        }
    });
    let marker = x.pointer("/replay/marker").and_then(|m| {
        let name = HeaderName::from_bytes(m.get("header")?.as_str()?.as_bytes()).ok()?;
        Some((
            name,
            m.get("value")
                .and_then(Value::as_str)
                .unwrap_or("true")
                .to_owned(),
        ))
    });
    let conflicts = x.get("conflicts");
    let get = |name: &str| conflicts.and_then(|c| c.get(name));
    Ok(PublishedOperation {
        method,
        path: path.to_owned(),
        retry_safe: x.get("retrySafe").and_then(Value::as_bool).unwrap_or(true),
        safe: x.get("safe").and_then(Value::as_bool).unwrap_or(false),
        key,
        replay_status: x
            .pointer("/replay/status")
            .and_then(Value::as_u64)
            .and_then(|s| u16::try_from(s).ok()),
        replay_marker: marker,
        mismatch: answer(get("mismatch")),
        in_progress: answer(get("inProgress")),
        retry_after: get("inProgress")
            .and_then(|c| c.get("retryAfter"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        in_flight: x
            .pointer("/inFlight/behavior")
            .and_then(Value::as_str)
            .map(str::to_owned),
        key_missing: answer(get("missing")),
        key_invalid: answer(get("invalid")),
        raw: x.clone(),
    })
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_policy_document_and_templates_with_literals_first() {
        let doc = json!({"version": 1, "operations": [
            {"method": "PUT", "path": "/items/{id}", "x-idempotency": {"key": {"in": "header", "name": "Idempotency-Key"}}},
            {"method": "PUT", "path": "/items/special", "x-idempotency": {"retrySafe": false}},
        ]});
        let p = PublishedPolicy::from_document("http://127.0.0.1:9/", &doc).unwrap();
        assert_eq!(
            p.key_for(&Method::PUT, "http://127.0.0.1:9/items/7?x=1"),
            Some(&KeyLocation::Header(HeaderName::from_static("idempotency-key")))
        );
        assert_eq!(p.key_for(&Method::PUT, "/items/special"), None);
        assert_eq!(p.key_for(&Method::POST, "/items/7"), None);
        assert!(p.operation(&Method::PUT, "/items/7/x").is_none());
        assert!(PublishedPolicy::from_document("x", &json!({"a": 1})).is_err());
    }

    #[test]
    fn oasis_repeatable_requests_are_read_and_configure_the_client() {
        let doc = json!({"operations": [{"method": "POST", "path": "/r", "x-idempotency": {
            "key": {"in": "header", "name": "Repeatability-Request-ID", "convention": "oasis-repeatable-requests-1.0"}
        }}]});
        let p = PublishedPolicy::from_document("http://h", &doc).unwrap();
        let op = p.operation(&Method::POST, "/r").unwrap();
        assert_eq!(op.key, Some(KeyLocation::Repeatability));
        let config = op.configure(crate::RetryConfig::new());
        assert!(config.repeatability());
        assert_eq!(config.key_header(), "repeatability-request-id");
        let policy = crate::RetryPolicy::new(config).with_seed(1);
        let mut call = policy.start(&Method::POST, "/r", &http::HeaderMap::new(), true);
        let mut first = http::HeaderMap::new();
        call.before_attempt(std::time::Duration::ZERO).apply(&mut first);
        let key = first["repeatability-request-id"].clone();
        let sent = first["repeatability-first-sent"].clone();
        assert!(httpdate::parse_http_date(sent.to_str().unwrap()).is_ok());
        call.after_attempt(
            std::time::Duration::from_millis(1),
            &crate::Outcome::status(http::StatusCode::SERVICE_UNAVAILABLE),
        );
        let mut second = http::HeaderMap::new();
        call.before_attempt(std::time::Duration::from_secs(2))
            .apply(&mut second);
        assert_eq!(second["repeatability-request-id"], key, "one id per logical call");
        assert_eq!(
            second["repeatability-first-sent"], sent,
            "one first-sent per logical call"
        );
        assert!(second.get("idempotency-key").is_none());
    }
}
