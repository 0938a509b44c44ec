//! The rules: one verdict per state-changing operation, with where its key travels.
//!
//! Verdicts, in the order the table shows them:
//!
//! - `missing`: a POST or PATCH with no key and no `x-idempotency` saying otherwise;
//! - `claimed_idempotent`: a PUT or DELETE with no key — the method claims
//!   idempotency, which `idemkit check --gates claimed-idempotent` verifies;
//! - `retry_unsafe`: `x-idempotency: {"retrySafe": false}`, documented as not
//!   retry-safe;
//! - `safe`: `x-idempotency: {"safe": true}`, a read that uses a write method. Never
//!   guessed from a name or a word like "search";
//! - `keyed`: the key travels in a header parameter, a request-body property, or where
//!   `x-idempotency.key` says.

use serde::Serialize;
use serde_json::{Map, Value};

use crate::document::Document;

/// The verdict on one operation (spelled as in the JSON output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// A POST or PATCH without a key.
    Missing,
    /// A PUT or DELETE without a key: the method's claim must be verified.
    ClaimedIdempotent,
    /// Documented as not retry-safe.
    RetryUnsafe,
    /// Documented as a read.
    Safe,
    /// Takes a key.
    Keyed,
}

impl Verdict {
    /// Every verdict, in table order.
    pub const ALL: [Verdict; 5] = [
        Verdict::Missing,
        Verdict::ClaimedIdempotent,
        Verdict::RetryUnsafe,
        Verdict::Safe,
        Verdict::Keyed,
    ];

    /// The verdict as spelled in the output.
    pub const fn as_str(self) -> &'static str {
        match self {
            Verdict::Missing => "missing",
            Verdict::ClaimedIdempotent => "claimed_idempotent",
            Verdict::RetryUnsafe => "retry_unsafe",
            Verdict::Safe => "safe",
            Verdict::Keyed => "keyed",
        }
    }
}

/// Where a key travels: `{"in": "header", "name": "Idempotency-Key"}` or
/// `{"in": "body", "name": "/idempotency_key"}` (a JSON pointer, as `idemkit check
/// --key-field` takes it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Key {
    /// `header` or `body`.
    #[serde(rename = "in")]
    pub location: &'static str,
    /// The header name, or the body field's JSON pointer.
    pub name: String,
}

/// One state-changing operation and its verdict.
#[derive(Debug, Clone, Serialize)]
#[non_exhaustive]
pub struct Operation {
    /// `POST`, `PUT`, `PATCH` or `DELETE`.
    pub method: String,
    /// The path template.
    pub path: String,
    /// The operation id, if the document gives one.
    #[serde(rename = "operationId")]
    pub operation_id: Option<String>,
    /// Where its key travels, if it takes one.
    pub key: Option<Key>,
    /// The verdict.
    pub verdict: Verdict,
    /// What else the lint noticed (missing conflict codes, replay marker, …).
    pub notes: Vec<String>,
}

/// What the lint looks for.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct Options {
    /// Header names that carry a key (compared case-insensitively).
    pub key_headers: Vec<String>,
    /// Request-body property names that carry a key.
    pub key_fields: Vec<String>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            key_headers: vec!["Idempotency-Key".into(), REPEATABILITY_REQUEST_ID.into()],
            key_fields: vec!["idempotency_key".into(), "idempotencyKey".into()],
        }
    }
}

const METHODS: [&str; 4] = ["post", "put", "patch", "delete"];

/// The OASIS Repeatable Requests 1.0 key header.
const REPEATABILITY_REQUEST_ID: &str = "Repeatability-Request-ID";
/// The OASIS Repeatable Requests 1.0 first-sent header.
const REPEATABILITY_FIRST_SENT: &str = "Repeatability-First-Sent";
/// `x-idempotency.key.convention` of OASIS Repeatable Requests.
const OASIS_CONVENTION: &str = "oasis-repeatable-requests-1.0";

/// An operation keyed by OASIS Repeatable Requests (its key header is
/// `Repeatability-Request-ID`, or its `x-idempotency` says so) must declare the
/// required `Repeatability-First-Sent` header and document the `412` a stale
/// first-sent time gets; its `x-idempotency` must name the convention, or
/// clients reading it send no `Repeatability-First-Sent`.
fn repeatability_notes(
    key: Option<&Key>,
    x: Option<&Map<String, Value>>,
    params: &[&Value],
    codes: &[&str],
    notes: &mut Vec<String>,
) {
    let convention = x
        .and_then(|x| x.get("key"))
        .and_then(|k| k.get("convention"))
        .and_then(Value::as_str);
    let by_header =
        key.is_some_and(|k| k.location == "header" && k.name.eq_ignore_ascii_case(REPEATABILITY_REQUEST_ID));
    if !(by_header || convention == Some(OASIS_CONVENTION)) {
        return;
    }
    if x.is_some() && convention != Some(OASIS_CONVENTION) {
        notes.push(format!(
            "OASIS Repeatable Requests: `x-idempotency.key` names no `convention: \"{OASIS_CONVENTION}\"`, so clients reading it will not send `{REPEATABILITY_FIRST_SENT}`"
        ));
    }
    let first_sent = params.iter().find(|p| {
        p.get("in").and_then(Value::as_str) == Some("header")
            && p.get("name")
                .and_then(Value::as_str)
                .is_some_and(|n| n.eq_ignore_ascii_case(REPEATABILITY_FIRST_SENT))
    });
    match first_sent {
        None => notes.push(format!(
            "OASIS Repeatable Requests: the required `{REPEATABILITY_FIRST_SENT}` header is not declared"
        )),
        Some(p) if p.get("required").and_then(Value::as_bool) != Some(true) => notes.push(format!(
            "OASIS Repeatable Requests: `{REPEATABILITY_FIRST_SENT}` is declared optional; it is required"
        )),
        Some(_) => {}
    }
    if !codes.contains(&"412") && !codes.iter().any(|c| c.eq_ignore_ascii_case("4XX")) {
        notes.push(
            "OASIS Repeatable Requests: responses do not document 412 (a first-sent time outside the replay window)"
                .into(),
        );
    }
}

/// Lints every state-changing operation of `doc`, sorted by path, then method.
pub fn lint(doc: &Document, options: &Options) -> Vec<Operation> {
    let mut out = Vec::new();
    let Some(paths) = doc.root().get("paths").and_then(Value::as_object) else {
        return out;
    };
    for (path, item) in paths {
        let mut item_notes = Vec::new();
        let item = doc.deref(item, &mut item_notes);
        let path_params = item.get("parameters").and_then(Value::as_array);
        for method in METHODS {
            let Some(op) = item.get(method) else { continue };
            let mut notes = item_notes.clone();
            let op = doc.deref(op, &mut notes);
            out.push(operation(doc, options, path, method, op, path_params, notes));
        }
    }
    out
}

/// The parameters of an operation: the path item's, overridden by the operation's
/// own of the same name and location.
fn parameters<'a>(
    doc: &'a Document,
    path_params: Option<&'a Vec<Value>>,
    op: &'a Value,
    notes: &mut Vec<String>,
) -> Vec<&'a Value> {
    let mut merged: Vec<&Value> = Vec::new();
    let id = |p: &Value| {
        (
            p.get("in").and_then(Value::as_str).unwrap_or_default().to_owned(),
            p.get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_ascii_lowercase(),
        )
    };
    for list in [path_params, op.get("parameters").and_then(Value::as_array)]
        .into_iter()
        .flatten()
    {
        for p in list {
            let p = doc.deref(p, notes);
            let key = id(p);
            merged.retain(|q| id(q) != key);
            merged.push(p);
        }
    }
    merged
}

fn operation(
    doc: &Document,
    options: &Options,
    path: &str,
    method: &str,
    op: &Value,
    path_params: Option<&Vec<Value>>,
    mut notes: Vec<String>,
) -> Operation {
    let params = parameters(doc, path_params, op, &mut notes);
    let header_key = params.iter().find_map(|p| {
        let name = p.get("name")?.as_str()?;
        (p.get("in")?.as_str()? == "header"
            && options.key_headers.iter().any(|k| k.eq_ignore_ascii_case(name)))
        .then_some(*p)
    });
    let field_key = body_key(doc, op, &params, options, &mut notes);
    let detected = match (header_key, &field_key) {
        (Some(p), _) => {
            if p.get("required").and_then(Value::as_bool) != Some(true) {
                notes.push(format!(
                    "the key header `{}` is optional: a caller may leave it out",
                    p["name"].as_str().unwrap_or_default()
                ));
            }
            Some(Key {
                location: "header",
                name: p["name"].as_str().unwrap_or_default().to_owned(),
            })
        }
        (None, Some((field, required))) => {
            if !required {
                notes.push(format!(
                    "the key field `{field}` is optional in the request body schema: a caller may leave it out"
                ));
            }
            Some(Key {
                location: "body",
                name: format!("/{field}"),
            })
        }
        (None, None) => None,
    };

    let mut x = op.get("x-idempotency").map(|x| doc.deref(x, &mut notes));
    if let Some(v) = x
        && !v.is_object()
    {
        notes.push("`x-idempotency` is not an object: ignored".into());
        x = None;
    }
    let x = x.and_then(Value::as_object);
    let flag = |name: &str| x.and_then(|x| x.get(name)).and_then(Value::as_bool);

    let (verdict, key) = if flag("safe") == Some(true) {
        (Verdict::Safe, None)
    } else if flag("retrySafe") == Some(false) {
        (Verdict::RetryUnsafe, None)
    } else if let Some(published) = x.and_then(published_key) {
        check_published(&published, &params, doc, op, &detected, &mut notes);
        (Verdict::Keyed, Some(published))
    } else {
        if x.is_some() {
            notes.push(
                "`x-idempotency` names no key (`key`), is not `safe` and not `retrySafe: false`".into(),
            );
        }
        match (&detected, method) {
            (Some(_), _) => (Verdict::Keyed, detected.clone()),
            (None, "put" | "delete") => {
                notes.push(
                    "no key: the method claims idempotency; verify it with `idemkit check --gates claimed-idempotent`"
                        .into(),
                );
                (Verdict::ClaimedIdempotent, None)
            }
            (None, _) => (Verdict::Missing, None),
        }
    };
    if verdict == Verdict::Keyed {
        response_notes(doc, op, x, &mut notes);
        let mut ignored = Vec::new();
        let responses = op
            .get("responses")
            .map(|r| doc.deref(r, &mut ignored))
            .and_then(Value::as_object);
        let codes: Vec<&str> = responses
            .map(|r| r.keys().map(String::as_str).collect())
            .unwrap_or_default();
        repeatability_notes(key.as_ref(), x, &params, &codes, &mut notes);
    }
    notes.dedup();
    Operation {
        method: method.to_ascii_uppercase(),
        path: path.to_owned(),
        operation_id: op.get("operationId").and_then(Value::as_str).map(str::to_owned),
        key,
        verdict,
        notes,
    }
}

/// `x-idempotency.key` as a [`Key`].
fn published_key(x: &Map<String, Value>) -> Option<Key> {
    let key = x.get("key")?;
    let name = key.get("name")?.as_str()?;
    match key.get("in")?.as_str()? {
        "header" => Some(Key {
            location: "header",
            name: name.to_owned(),
        }),
        "body" => Some(Key {
            location: "body",
            name: if name.starts_with('/') {
                name.to_owned()
            } else {
                format!("/{name}")
            },
        }),
        _ => None,
    }
}

/// Notes where `x-idempotency.key` and the operation's declared inputs disagree.
fn check_published(
    published: &Key,
    params: &[&Value],
    doc: &Document,
    op: &Value,
    detected: &Option<Key>,
    notes: &mut Vec<String>,
) {
    match published.location {
        "header" => {
            let declared = params.iter().any(|p| {
                p.get("in").and_then(Value::as_str) == Some("header")
                    && p.get("name")
                        .and_then(Value::as_str)
                        .is_some_and(|n| n.eq_ignore_ascii_case(&published.name))
            });
            if !declared {
                notes.push(format!(
                    "`x-idempotency` puts the key in header `{}`, which the operation does not declare as a parameter",
                    published.name
                ));
            }
        }
        _ => {
            let field = published.name.trim_start_matches('/');
            let options = Options {
                key_headers: Vec::new(),
                key_fields: vec![field.to_owned()],
            };
            let mut ignored = Vec::new();
            if !field.contains('/') && body_key(doc, op, params, &options, &mut ignored).is_none() {
                notes.push(format!(
                    "`x-idempotency` puts the key in body field `{}`, which the request body schema does not declare",
                    published.name
                ));
            }
        }
    }
    if let Some(d) = detected
        && d != published
    {
        notes.push(format!(
            "the operation also declares a key in {} `{}`, but `x-idempotency` says {} `{}`",
            d.location, d.name, published.location, published.name
        ));
    }
}

/// The first key-field name found among the request body's top-level properties
/// (OpenAPI 3 `requestBody`, any media type; Swagger 2 `in: body` schemas and
/// `in: formData` parameters), through `allOf`, `oneOf` and `anyOf`.
fn body_key(
    doc: &Document,
    op: &Value,
    params: &[&Value],
    options: &Options,
    notes: &mut Vec<String>,
) -> Option<(String, bool)> {
    let mut schemas: Vec<&Value> = Vec::new();
    if let Some(body) = op.get("requestBody") {
        let body = doc.deref(body, notes);
        if let Some(content) = body.get("content").and_then(Value::as_object) {
            schemas.extend(content.values().filter_map(|m| m.get("schema")));
        }
    }
    for p in params {
        match p.get("in").and_then(Value::as_str) {
            Some("body") => schemas.extend(p.get("schema")),
            Some("formData") => {
                if let Some(name) = p.get("name").and_then(Value::as_str)
                    && options.key_fields.iter().any(|f| f == name)
                {
                    let required = p.get("required").and_then(Value::as_bool) == Some(true);
                    return Some((name.to_owned(), required));
                }
            }
            _ => {}
        }
    }
    schemas
        .into_iter()
        .find_map(|s| property(doc, s, options, notes, 0))
}

/// The key field's name and whether the schema requires it.
fn property(
    doc: &Document,
    schema: &Value,
    options: &Options,
    notes: &mut Vec<String>,
    depth: u8,
) -> Option<(String, bool)> {
    if depth > 16 {
        return None;
    }
    let schema = doc.deref(schema, notes);
    if let Some(props) = schema.get("properties").and_then(Value::as_object)
        && let Some(f) = options.key_fields.iter().find(|f| props.contains_key(f.as_str()))
    {
        let required = schema
            .get("required")
            .and_then(Value::as_array)
            .is_some_and(|r| r.iter().any(|n| n.as_str() == Some(f.as_str())));
        return Some((f.clone(), required));
    }
    ["allOf", "oneOf", "anyOf"]
        .iter()
        .filter_map(|k| schema.get(*k).and_then(Value::as_array))
        .flatten()
        .find_map(|s| property(doc, s, options, notes, depth + 1))
}

/// For keyed operations: the conflict statuses the contract needs and the replay
/// marker must be documented.
fn response_notes(doc: &Document, op: &Value, x: Option<&Map<String, Value>>, notes: &mut Vec<String>) {
    let responses = op
        .get("responses")
        .map(|r| doc.deref(r, notes))
        .and_then(Value::as_object);
    let codes: Vec<&str> = responses
        .map(|r| r.keys().map(String::as_str).collect())
        .unwrap_or_default();
    let published_status = |name: &str| {
        x.and_then(|x| x.get("conflicts"))
            .and_then(|c| c.get(name))
            .and_then(|c| c.get("status"))
            .and_then(Value::as_u64)
    };
    let mut needed = vec![published_status("mismatch").unwrap_or(409)];
    needed.push(published_status("inProgress").unwrap_or(409));
    needed.sort_unstable();
    needed.dedup();
    for status in needed {
        let s = status.to_string();
        if codes.contains(&s.as_str()) {
            continue;
        }
        let why = if status == 422 {
            "the mismatch conflict its policy publishes"
        } else {
            "the conflict a reused or in-flight key gets"
        };
        let range = format!("{}XX", &s[..1]);
        if codes.iter().any(|c| c.eq_ignore_ascii_case(&range)) {
            notes.push(format!("{status} ({why}) is documented only through {range}"));
        } else {
            notes.push(format!("responses do not document {status} ({why})"));
        }
    }

    let marker = x
        .and_then(|x| x.get("replay"))
        .and_then(|r| r.get("marker"))
        .and_then(|m| m.get("header"))
        .and_then(Value::as_str)
        .unwrap_or("Idempotent-Replayed");
    let published = x.is_some_and(|x| x.get("replay").and_then(|r| r.get("marker")).is_some());
    let lower = marker.to_ascii_lowercase();
    let mentions = |v: &Value| {
        ["description", "summary"]
            .iter()
            .filter_map(|k| v.get(*k).and_then(Value::as_str))
            .any(|t| t.to_ascii_lowercase().contains(&lower))
    };
    let mut ignored = Vec::new();
    let in_responses = responses.is_some_and(|r| {
        r.values().any(|resp| {
            let resp = doc.deref(resp, &mut ignored);
            mentions(resp)
                || resp
                    .get("headers")
                    .and_then(Value::as_object)
                    .is_some_and(|h| h.keys().any(|k| k.eq_ignore_ascii_case(marker)))
        })
    });
    if !(published || in_responses || mentions(op)) {
        notes.push(format!("no response mentions the replay marker `{marker}`"));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn one(doc: Value) -> Operation {
        let doc = Document::new(doc).unwrap();
        let mut ops = lint(&doc, &Options::default());
        assert_eq!(ops.len(), 1, "{ops:?}");
        ops.remove(0)
    }

    fn oas(path_item: Value) -> Value {
        json!({"openapi": "3.1.0", "info": {"title": "t", "version": "1"}, "paths": {"/x": path_item},
               "components": {"parameters": {"Key": {"name": "idempotency-key", "in": "header", "required": true}}}})
    }

    #[test]
    fn a_referenced_path_level_header_is_a_key_case_insensitively() {
        let op = one(oas(json!({
            "parameters": [{"$ref": "#/components/parameters/Key"}],
            "post": {"operationId": "make", "responses": {"201": {"description": "made",
                "headers": {"Idempotent-Replayed": {"schema": {"type": "string"}}}}, "409": {"description": "conflict"}}}
        })));
        assert_eq!(op.verdict, Verdict::Keyed);
        assert_eq!(
            op.key,
            Some(Key {
                location: "header",
                name: "idempotency-key".into()
            })
        );
        assert_eq!(op.operation_id.as_deref(), Some("make"));
        assert!(op.notes.is_empty(), "{:?}", op.notes);
    }

    #[test]
    fn oasis_repeatable_requests_need_their_first_sent_header_and_412() {
        let bare = one(oas(json!({
            "post": {"parameters": [{"name": "Repeatability-Request-ID", "in": "header", "required": true}],
                "responses": {"201": {"description": "made, Idempotent-Replayed on replays"}, "409": {"description": "conflict"}}}
        })));
        assert_eq!(bare.verdict, Verdict::Keyed);
        assert_eq!(bare.key.as_ref().unwrap().name, "Repeatability-Request-ID");
        assert!(
            bare.notes
                .iter()
                .any(|n| n.contains("`Repeatability-First-Sent` header is not declared")),
            "{:?}",
            bare.notes
        );
        assert!(bare.notes.iter().any(|n| n.contains("412")), "{:?}", bare.notes);

        let published_without_convention = one(oas(json!({
            "post": {"x-idempotency": {"key": {"in": "header", "name": "Repeatability-Request-ID"}},
                "parameters": [{"name": "Repeatability-Request-ID", "in": "header", "required": true},
                               {"name": "Repeatability-First-Sent", "in": "header", "required": true}],
                "responses": {"201": {"description": "made, Idempotent-Replayed on replays"}, "409": {"description": "c"}, "412": {"description": "stale"}}}
        })));
        assert_eq!(
            published_without_convention.notes.len(),
            1,
            "{:?}",
            published_without_convention.notes
        );
        assert!(published_without_convention.notes[0].contains("convention"));

        let complete = one(oas(json!({
            "post": {"x-idempotency": {"key": {"in": "header", "name": "Repeatability-Request-ID", "convention": "oasis-repeatable-requests-1.0"}},
                "parameters": [{"name": "Repeatability-Request-ID", "in": "header", "required": true},
                               {"name": "Repeatability-First-Sent", "in": "header", "required": true}],
                "responses": {"201": {"description": "made, Idempotent-Replayed on replays"}, "409": {"description": "c"}, "412": {"description": "stale"}}}
        })));
        assert!(complete.notes.is_empty(), "{:?}", complete.notes);
    }

    #[test]
    fn operation_parameters_override_path_parameters() {
        let op = one(oas(json!({
            "parameters": [{"$ref": "#/components/parameters/Key"}],
            "post": {"parameters": [{"name": "Idempotency-Key", "in": "header", "required": false}], "responses": {}}
        })));
        assert_eq!(op.verdict, Verdict::Keyed);
        assert!(
            op.notes.iter().any(|n| n.contains("is optional")),
            "{:?}",
            op.notes
        );
        assert!(
            op.notes.iter().any(|n| n.contains("do not document 409")),
            "{:?}",
            op.notes
        );
        assert!(
            op.notes.iter().any(|n| n.contains("replay marker")),
            "{:?}",
            op.notes
        );
    }
}
