//! The request template the gates repeat, and the variants they derive from it.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use serde_json::Value;

use super::transport::Request;

/// Where the idempotency key travels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPlacement {
    /// In a request header (`Idempotency-Key` by default).
    Header(HeaderName),
    /// In the JSON body at this JSON pointer (RFC 6901), e.g. `/idempotencyKey`.
    /// The member's parent must exist in the template body; the member is set (or,
    /// for the missing-key case, removed) on every request.
    Field(String),
}

/// The OASIS Repeatable Requests key header: a template keyed by it gets
/// `Repeatability-First-Sent` on every keyed request.
pub(crate) const REPEATABILITY_REQUEST_ID: &str = "repeatability-request-id";
const REPEATABILITY_FIRST_SENT: &str = "repeatability-first-sent";

impl Default for KeyPlacement {
    fn default() -> Self {
        KeyPlacement::Header(HeaderName::from_static("idempotency-key"))
    }
}

/// A template (or alternative body) that cannot be used.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TemplateError {
    /// `--key-field` needs a JSON object body.
    #[error("the key goes in the body at `{0}`, but the body is not a JSON object")]
    KeyFieldNeedsJson(String),
    /// The pointer is malformed or its parent is not an object in the body.
    #[error(
        "cannot place the key at `{0}`: the pointer must start with `/` and its parent must be a JSON object in the body"
    )]
    BadKeyPointer(String),
}

#[derive(Debug, Clone, PartialEq)]
enum Body {
    Empty,
    Json(Value),
    Raw(Vec<u8>),
}

impl Body {
    fn parse(bytes: &[u8]) -> Self {
        if bytes.iter().all(u8::is_ascii_whitespace) {
            Body::Empty
        } else {
            match serde_json::from_slice(bytes) {
                Ok(v) => Body::Json(v),
                Err(_) => Body::Raw(bytes.to_vec()),
            }
        }
    }
}

/// Which body a request carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Variant {
    /// The template body.
    Template,
    /// The second valid body (explicit, or derived by changing the first leaf).
    Alt,
    /// The template's JSON with every object's members in reverse order and extra
    /// whitespace: the same canonical JSON, different bytes.
    Reordered,
}

/// The request the gates repeat: method, URL, headers, body and where the key goes.
///
/// JSON bodies are sent re-serialised (compact, members in `serde_json`'s map
/// order), so the reordered variant is guaranteed to differ in member order.
#[derive(Debug, Clone)]
pub struct Template {
    method: Method,
    url: String,
    headers: HeaderMap,
    body: Body,
    alt: Option<Body>,
    key: KeyPlacement,
}

impl Template {
    /// A template for `method url` with no headers, no body and the key in the
    /// `Idempotency-Key` header.
    pub fn new(method: Method, url: impl Into<String>) -> Self {
        Self {
            method,
            url: url.into(),
            headers: HeaderMap::new(),
            body: Body::Empty,
            alt: None,
            key: KeyPlacement::default(),
        }
    }

    /// Sets the headers sent with every request (credentials, content type, …).
    pub fn with_headers(mut self, headers: HeaderMap) -> Self {
        self.headers = headers;
        self
    }

    /// Sets where the key goes.
    pub fn with_key(mut self, key: KeyPlacement) -> Result<Self, TemplateError> {
        self.key = key;
        self.validate()?;
        Ok(self)
    }

    /// Sets the body (JSON when it parses as JSON, raw bytes otherwise).
    pub fn with_body(mut self, body: &[u8]) -> Result<Self, TemplateError> {
        self.body = Body::parse(body);
        self.validate()?;
        Ok(self)
    }

    /// Sets the second valid body for the mismatch gate. Without one, the template's
    /// first string or number leaf (in serialisation order, the key field skipped) is
    /// changed: a number gets 1 added, a string gets `-alt` appended.
    pub fn with_alt_body(mut self, body: &[u8]) -> Result<Self, TemplateError> {
        self.alt = Some(Body::parse(body));
        self.validate()?;
        Ok(self)
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The headers sent with every request.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// Where the key goes.
    pub fn key(&self) -> &KeyPlacement {
        &self.key
    }

    fn validate(&self) -> Result<(), TemplateError> {
        if let KeyPlacement::Field(pointer) = &self.key {
            for body in std::iter::once(&self.body).chain(self.alt.as_ref()) {
                let Body::Json(v) = body else {
                    return Err(TemplateError::KeyFieldNeedsJson(pointer.clone()));
                };
                let mut v = v.clone();
                if !set_member(&mut v, pointer, Some("probe")) {
                    return Err(TemplateError::BadKeyPointer(pointer.clone()));
                }
            }
        }
        Ok(())
    }

    /// The alternative body, explicit or derived; `None` when none can be derived.
    fn alt_body(&self) -> Option<Body> {
        if let Some(alt) = &self.alt {
            return Some(alt.clone());
        }
        let Body::Json(v) = &self.body else {
            return None;
        };
        let mut v = v.clone();
        let skip = match &self.key {
            KeyPlacement::Field(p) => Some(p.as_str()),
            KeyPlacement::Header(_) => None,
        };
        change_first_leaf(&mut v, &mut String::new(), skip).then_some(Body::Json(v))
    }

    /// Whether an alternative body exists (explicit or derivable).
    pub(crate) fn has_alt(&self) -> bool {
        self.alt_body().is_some()
    }

    /// Whether the reordered variant changes member order (some object in the body,
    /// key field included, has two members or more).
    pub(crate) fn reorderable(&self) -> bool {
        match &self.body {
            Body::Json(v) => {
                let mut v = v.clone();
                if let KeyPlacement::Field(p) = &self.key {
                    set_member(&mut v, p, Some("k"));
                }
                has_wide_object(&v)
            }
            _ => false,
        }
    }

    /// The request for `key` (`None`: no key at all) carrying `variant`'s body, with
    /// `replace` overriding the template header of the same name (another account's
    /// credentials).
    pub(crate) fn request(
        &self,
        key: Option<&str>,
        variant: Variant,
        replace: Option<&(HeaderName, HeaderValue)>,
    ) -> Request {
        let mut headers = self.headers.clone();
        if let Some((name, value)) = replace {
            headers.insert(name.clone(), value.clone());
        }
        let body = match variant {
            Variant::Template | Variant::Reordered => self.body.clone(),
            Variant::Alt => self.alt_body().unwrap_or_else(|| self.body.clone()),
        };
        let bytes = match body {
            Body::Empty => Vec::new(),
            Body::Raw(b) => b,
            Body::Json(mut v) => {
                if let KeyPlacement::Field(p) = &self.key {
                    set_member(&mut v, p, key);
                }
                if !headers.contains_key(CONTENT_TYPE) {
                    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
                }
                if variant == Variant::Reordered {
                    let mut out = String::from("\n");
                    write_reordered(&v, &mut out);
                    out.push('\n');
                    out.into_bytes()
                } else {
                    v.to_string().into_bytes()
                }
            }
        };
        if let KeyPlacement::Header(name) = &self.key {
            // A key header given with the template's headers never leaks into a request
            // (least of all the missing-key one): the gates choose every key.
            headers.remove(name);
            if let Some(key) = key {
                // The gates' keys are visible ASCII, except the deliberate control-character
                // key, which is a tab (the one control character HTTP field values allow).
                let value =
                    HeaderValue::from_bytes(key.as_bytes()).expect("gate keys are valid header values");
                headers.insert(name.clone(), value);
                if name == REPEATABILITY_REQUEST_ID && !headers.contains_key(REPEATABILITY_FIRST_SENT) {
                    // OASIS Repeatable Requests: the id travels with the time of
                    // the first attempt. The gates' repeats follow within seconds,
                    // well inside any replay window; "now" on each is as good.
                    let now = httpdate::fmt_http_date(std::time::SystemTime::now());
                    headers.insert(
                        HeaderName::from_static(REPEATABILITY_FIRST_SENT),
                        HeaderValue::from_str(&now).expect("an HTTP-date is a valid header value"),
                    );
                }
            }
        }
        Request {
            method: self.method.clone(),
            url: self.url.clone(),
            headers,
            body: bytes,
        }
    }

    /// The control-character key the bad-keys gate sends: a tab in a header (the only
    /// control character an HTTP field value can carry), U+0001 in a JSON field.
    pub(crate) fn control_key(&self, unique: &str) -> String {
        match self.key {
            KeyPlacement::Header(_) => format!("idemkit\tcheck-{unique}"),
            KeyPlacement::Field(_) => format!("idemkit\u{1}check-{unique}"),
        }
    }
}

fn unescape(token: &str) -> String {
    token.replace("~1", "/").replace("~0", "~")
}

fn escape(token: &str) -> String {
    token.replace('~', "~0").replace('/', "~1")
}

/// Sets (or with `None` removes) the member at `pointer`; `false` when the pointer
/// is malformed or its parent is not an object.
fn set_member(v: &mut Value, pointer: &str, value: Option<&str>) -> bool {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return false;
    };
    if !(parent.is_empty() || parent.starts_with('/')) {
        return false;
    }
    let Some(Value::Object(map)) = v.pointer_mut(parent) else {
        return false;
    };
    let name = unescape(last);
    match value {
        Some(key) => {
            map.insert(name, Value::String(key.to_owned()));
        }
        None => {
            map.remove(&name);
        }
    }
    true
}

fn change_first_leaf(v: &mut Value, path: &mut String, skip: Option<&str>) -> bool {
    match v {
        Value::String(s) => {
            if Some(path.as_str()) == skip {
                return false;
            }
            s.push_str("-alt");
            true
        }
        Value::Number(n) => {
            if Some(path.as_str()) == skip {
                return false;
            }
            *n = if let Some(i) = n.as_i64() {
                i.checked_add(1).unwrap_or(i - 1).into()
            } else if let Some(u) = n.as_u64() {
                u.saturating_sub(1).into()
            } else {
                match n.as_f64().and_then(|f| serde_json::Number::from_f64(f + 1.0)) {
                    Some(changed) => changed,
                    None => return false,
                }
            };
            true
        }
        Value::Array(items) => {
            for (i, item) in items.iter_mut().enumerate() {
                let len = path.len();
                path.push_str(&format!("/{i}"));
                let changed = change_first_leaf(item, path, skip);
                path.truncate(len);
                if changed {
                    return true;
                }
            }
            false
        }
        Value::Object(map) => {
            for (name, item) in map.iter_mut() {
                let len = path.len();
                path.push('/');
                path.push_str(&escape(name));
                let changed = change_first_leaf(item, path, skip);
                path.truncate(len);
                if changed {
                    return true;
                }
            }
            false
        }
        Value::Null | Value::Bool(_) => false,
    }
}

fn has_wide_object(v: &Value) -> bool {
    match v {
        Value::Object(map) => map.len() >= 2 || map.values().any(has_wide_object),
        Value::Array(items) => items.iter().any(has_wide_object),
        _ => false,
    }
}

/// The same JSON value with every object's members in reverse order, spaced out.
fn write_reordered(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            out.push_str("{ ");
            for (i, (name, item)) in map.iter().rev().enumerate() {
                if i > 0 {
                    out.push_str(" ,\n  ");
                }
                out.push_str(&Value::String(name.clone()).to_string());
                out.push_str(" : ");
                write_reordered(item, out);
            }
            out.push_str(" }");
        }
        Value::Array(items) => {
            out.push_str("[ ");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(" , ");
                }
                write_reordered(item, out);
            }
            out.push_str(" ]");
        }
        leaf => out.push_str(&leaf.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(body: &str) -> Template {
        Template::new(Method::POST, "http://127.0.0.1:1/orders")
            .with_body(body.as_bytes())
            .unwrap()
    }

    fn body_of(t: &Template, key: Option<&str>, variant: Variant) -> Value {
        serde_json::from_slice(&t.request(key, variant, None).body).unwrap()
    }

    #[test]
    fn alt_body_changes_exactly_one_leaf() {
        let t = template(r#"{"sku":"A","quantity":1}"#);
        let original = body_of(&t, Some("k"), Variant::Template);
        let alt = body_of(&t, Some("k"), Variant::Alt);
        assert_ne!(original, alt);
        let changed = ["sku", "quantity"]
            .iter()
            .filter(|m| original[**m] != alt[**m])
            .count();
        assert_eq!(changed, 1, "{original} vs {alt}");
    }

    #[test]
    fn alt_body_skips_the_key_field_and_explicit_alt_wins() {
        let t = template(r#"{"idempotencyKey":"x","amount":5}"#)
            .with_key(KeyPlacement::Field("/idempotencyKey".into()))
            .unwrap();
        let alt = body_of(&t, Some("k1"), Variant::Alt);
        assert_eq!(alt["idempotencyKey"], "k1");
        assert_eq!(alt["amount"], 6);
        let t = t.with_alt_body(br#"{"amount":9}"#).unwrap();
        assert_eq!(body_of(&t, Some("k1"), Variant::Alt)["amount"], 9);
    }

    #[test]
    fn reordered_body_is_the_same_json_in_other_bytes_and_order() {
        let t = template(r#"{"b":{"y":1,"x":[{"q":1,"p":2}]},"a":"s"}"#);
        let original = t.request(Some("k"), Variant::Template, None).body;
        let reordered = t.request(Some("k"), Variant::Reordered, None).body;
        assert_ne!(original, reordered);
        let parse = |b: &[u8]| serde_json::from_slice::<Value>(b).unwrap();
        assert_eq!(parse(&original), parse(&reordered));
        let first_member = |b: &[u8]| {
            let s = String::from_utf8(b.to_vec()).unwrap();
            let a = s.find("\"a\"").unwrap();
            let b = s.find("\"b\"").unwrap();
            a < b
        };
        assert_ne!(first_member(&original), first_member(&reordered));
        assert!(t.reorderable());
        assert!(!template(r#"{"only":1}"#).reorderable());
        assert!(!template("plain text").reorderable());
    }

    #[test]
    fn key_in_header_or_field_or_missing() {
        let t = template(r#"{"a":1}"#);
        let r = t.request(Some("abc"), Variant::Template, None);
        assert_eq!(r.headers["idempotency-key"], "abc");
        let mut with_key = HeaderMap::new();
        with_key.insert("idempotency-key", HeaderValue::from_static("from-template"));
        let t2 = t.clone().with_headers(with_key);
        assert!(
            !t2.request(None, Variant::Template, None)
                .headers
                .contains_key("idempotency-key")
        );
        assert_eq!(
            t2.request(Some("abc"), Variant::Template, None).headers["idempotency-key"],
            "abc"
        );
        assert_eq!(r.headers["content-type"], "application/json");
        assert!(
            !t.request(None, Variant::Template, None)
                .headers
                .contains_key("idempotency-key")
        );

        let t = template(r#"{"meta":{"key":null},"a":1}"#)
            .with_key(KeyPlacement::Field("/meta/key".into()))
            .unwrap();
        assert_eq!(body_of(&t, Some("abc"), Variant::Template)["meta"]["key"], "abc");
        assert!(body_of(&t, None, Variant::Template)["meta"].get("key").is_none());
        assert!(
            template("{}")
                .with_key(KeyPlacement::Field("/no/parent".into()))
                .is_err()
        );
        assert!(
            template("text")
                .with_key(KeyPlacement::Field("/k".into()))
                .is_err()
        );
    }

    #[test]
    fn other_account_header_replaces_the_template_one() {
        let mut headers = HeaderMap::new();
        headers.insert("authorization", HeaderValue::from_static("Bearer a"));
        let t = template("{}").with_headers(headers);
        let other = (
            HeaderName::from_static("authorization"),
            HeaderValue::from_static("Bearer b"),
        );
        let r = t.request(Some("k"), Variant::Template, Some(&other));
        assert_eq!(r.headers.get_all("authorization").iter().count(), 1);
        assert_eq!(r.headers["authorization"], "Bearer b");
    }
}
