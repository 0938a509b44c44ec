//! Request fingerprints: SHA-256 over method, route path, query string and the
//! canonical body (the behaviour contract, `docs/spec.md` §2).

use std::collections::BTreeMap;
use std::fmt;

use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

/// A request fingerprint. Same key with a different fingerprint is a client bug
/// answered with `idempotency_key_reused`, never a silent replay.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// Wraps raw digest bytes (as read back from a store).
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex, as stored in text columns.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// Parses lower- or upper-case hex.
    pub fn from_hex(s: &str) -> Option<Self> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).ok()?;
        Some(Self(out))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", &self.to_hex()[..12])
    }
}

/// Computes fingerprints for one route.
///
/// The fingerprint is SHA-256 over the method, the route path, the query string
/// and the body. JSON bodies (objects and arrays) are canonicalised first: the
/// document is parsed (by `serde_json`) and hashed as a tree, so member order,
/// insignificant whitespace and string-escape spellings (`"\u0061"` is `"a"`) do
/// not change the fingerprint. **Numbers keep every digit**: a number is hashed
/// as the text the client sent, so `9007199254740993` and `9007199254740992`
/// (one double apart: RFC 8785 would write both as `9007199254740992`), or `1`
/// and `1.0` (an integer and a float to most parsers), are different requests.
/// Two spellings of one number only ever cost a `409 idempotency_key_reused`,
/// never a replay of a different request. Configured JSON pointers (e.g. a
/// `/idempotencyKey` field, or a client timestamp) are left out. Bodies that are
/// not JSON are hashed as bytes.
///
/// ```
/// use idemkit_core::Fingerprinter;
/// let fp = Fingerprinter::default();
/// let a = fp.compute("POST", "/orders", br#"{"sku":"A","quantity":1}"#);
/// let b = fp.compute("POST", "/orders", b"{ \"quantity\": 1, \"sku\": \"A\" }");
/// assert_eq!(a, b);
/// assert_ne!(a, fp.compute("POST", "/orders", br#"{"sku":"A","quantity":2}"#));
/// // The query string is part of the request.
/// assert_ne!(
///     fp.compute("POST", "/refunds?amount=5", b""),
///     fp.compute("POST", "/refunds?amount=500", b"")
/// );
/// ```
#[derive(Clone, Debug, Default)]
pub struct Fingerprinter {
    excluded: Vec<String>,
}

/// A JSON pointer that cannot be excluded from fingerprints.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a JSON pointer to a field (it must start with `/` and name a member)")]
pub struct PointerError(pub String);

impl Fingerprinter {
    /// A fingerprinter that excludes nothing.
    pub const fn new() -> Self {
        Self { excluded: Vec::new() }
    }

    /// Excludes the JSON field at `pointer` (RFC 6901) from the fingerprint.
    pub fn exclude(mut self, pointer: impl Into<String>) -> Result<Self, PointerError> {
        let pointer = pointer.into();
        if !pointer.starts_with('/') || pointer.len() < 2 {
            return Err(PointerError(pointer));
        }
        self.excluded.push(pointer);
        Ok(self)
    }

    /// The excluded pointers.
    pub fn excluded(&self) -> &[String] {
        &self.excluded
    }

    /// Fingerprints a request. `target` is the route path with its query string,
    /// if any (`/refunds?amount=5`): the query is part of the request. An empty
    /// query (`/refunds?`) is the same as none; parameters are not reordered, so
    /// `?a=1&b=2` and `?b=2&a=1` are different requests.
    pub fn compute(&self, method: &str, target: &str, body: &[u8]) -> Fingerprint {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let mut h = Sha256::new();
        // Length-prefixed fields, so no choice of method/path/query/body can
        // collide with another by moving bytes across a boundary.
        for part in [method.as_bytes(), path.as_bytes(), query.as_bytes()] {
            put(&mut h, b'f', part);
        }
        let mut json = Sha256::new();
        if self.canonical_json(body, &mut json).is_some() {
            h.update(b"json");
            h.update(json.finalize());
        } else {
            h.update(b"blob");
            h.update(body);
        }
        Fingerprint(h.finalize().into())
    }

    /// Hashes the canonical form of a JSON object or array body into `h`;
    /// `None` when the body is not one.
    fn canonical_json(&self, body: &[u8], h: &mut Sha256) -> Option<()> {
        let text = std::str::from_utf8(body).ok()?.trim_matches(JSON_WS);
        if !matches!(text.as_bytes().first(), Some(b'{' | b'[')) {
            return None;
        }
        // The walk's parse of the document validates all of it (values are
        // parsed as `RawValue`s, trailing text refused): no separate pass.
        let mut pointer = String::new();
        self.walk(text, &mut pointer, h).ok()
    }

    /// Hashes one value as a prefix-free sequence of tokens (`{`, `}`, `[`, `]`,
    /// and tagged, length-prefixed member names, strings and scalars), which is
    /// injective: two documents hash the same input only if they are the same tree.
    ///
    /// Names and strings are borrowed from the body unless they contain escapes,
    /// and the JSON pointer of each value is only built when a route excludes
    /// fields: a request's fingerprint allocates per object and array, not per
    /// member.
    ///
    /// `text` is one JSON value without surrounding whitespace (a
    /// `RawValue`'s text has none).
    fn walk(&self, text: &str, pointer: &mut String, h: &mut Sha256) -> Result<(), serde_json::Error> {
        match text.as_bytes().first() {
            Some(b'{') => {
                // Member names are decoded (escapes resolved) and sorted; a
                // repeated name keeps its last value, as `serde_json::Value` does.
                let members: BTreeMap<Text<'_>, &RawValue> = serde_json::from_str(text)?;
                h.update(b"{");
                for (Text(name), value) in &members {
                    let at = pointer.len();
                    if !self.excluded.is_empty() {
                        pointer.push('/');
                        pointer.push_str(&name.replace('~', "~0").replace('/', "~1"));
                        if self.is_excluded(pointer) {
                            pointer.truncate(at);
                            continue;
                        }
                    }
                    put(h, b'k', name.as_bytes());
                    self.walk(value.get(), pointer, h)?;
                    pointer.truncate(at);
                }
                h.update(b"}");
            }
            Some(b'[') => {
                let items: Vec<&RawValue> = serde_json::from_str(text)?;
                h.update(b"[");
                for (i, item) in items.iter().enumerate() {
                    let at = pointer.len();
                    if !self.excluded.is_empty() {
                        pointer.push('/');
                        pointer.push_str(&i.to_string());
                        if self.is_excluded(pointer) {
                            pointer.truncate(at);
                            continue;
                        }
                    }
                    self.walk(item.get(), pointer, h)?;
                    pointer.truncate(at);
                }
                h.update(b"]");
            }
            Some(b'"') => {
                let Text(s) = serde_json::from_str(text)?;
                put(h, b's', s.as_bytes());
            }
            // Numbers, `true`, `false` and `null`, already validated by the parse:
            // their text is the value, every digit kept.
            _ => put(h, b'n', text.as_bytes()),
        }
        Ok(())
    }

    fn is_excluded(&self, pointer: &str) -> bool {
        !self.excluded.is_empty() && self.excluded.iter().any(|e| e == pointer)
    }
}

/// A JSON string's decoded text, borrowed from the document when it has no
/// escapes. Ordered as `String` is (by bytes), so member order is unchanged.
#[derive(serde::Deserialize, PartialEq, Eq, PartialOrd, Ord)]
struct Text<'a>(#[serde(borrow)] std::borrow::Cow<'a, str>);

/// JSON's insignificant whitespace (RFC 8259 §2).
const JSON_WS: &[char] = &[' ', '\t', '\n', '\r'];

/// One tagged, length-prefixed token.
fn put(h: &mut Sha256, tag: u8, bytes: &[u8]) {
    h.update([tag]);
    h.update((bytes.len() as u64).to_be_bytes());
    h.update(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};
    use std::collections::BTreeMap;

    #[test]
    fn method_and_path_matter() {
        let fp = Fingerprinter::new();
        let a = fp.compute("POST", "/a", b"{}");
        assert_ne!(a, fp.compute("PUT", "/a", b"{}"));
        assert_ne!(a, fp.compute("POST", "/b", b"{}"));
        // Boundary shifting cannot collide.
        assert_ne!(fp.compute("POS", "T/a", b"x"), fp.compute("POST", "/a", b"x"));
    }

    #[test]
    fn json_is_canonicalised_bytes_are_not() {
        let fp = Fingerprinter::new();
        assert_eq!(
            fp.compute("POST", "/", br#"{"a":1,"b":[1,2],"c":"x"}"#),
            fp.compute(
                "POST",
                "/",
                b"\n{ \"c\": \"\\u0078\", \"b\" : [1, 2], \"a\": 1 }\n"
            )
        );
        assert_ne!(fp.compute("POST", "/", b"a b"), fp.compute("POST", "/", b"a  b"));
        // Invalid JSON is hashed as bytes rather than failing.
        assert_ne!(
            fp.compute("POST", "/", b"{bad"),
            fp.compute("POST", "/", b"{ bad")
        );
        assert_eq!(fp.compute("POST", "/", b"{bad"), fp.compute("POST", "/", b"{bad"));
    }

    #[test]
    fn numbers_keep_every_digit() {
        let fp = Fingerprinter::new();
        let f = |body: &str| fp.compute("POST", "/", body.as_bytes());
        // One double apart: RFC 8785 (and `serde_json_canonicalizer`) writes both as 9007199254740992.
        assert_ne!(
            f(r#"{"amount":9007199254740993}"#),
            f(r#"{"amount":9007199254740992}"#)
        );
        assert_ne!(f(r#"{"amount":1}"#), f(r#"{"amount":1.0}"#));
        assert_ne!(f(r#"[0.1]"#), f(r#"[0.10000000000000001]"#));
        assert_ne!(f(r#"[1e400]"#), f(r#"[2e400]"#));
        // Nor is a number ever its string spelling.
        assert_ne!(f(r#"{"a":1}"#), f(r#"{"a":"1"}"#));
    }

    #[test]
    fn the_query_string_is_part_of_the_request() {
        let fp = Fingerprinter::new();
        assert_ne!(
            fp.compute("POST", "/refunds?amount=5", b"{}"),
            fp.compute("POST", "/refunds?amount=500", b"{}")
        );
        assert_ne!(
            fp.compute("POST", "/refunds?amount=5", b"{}"),
            fp.compute("POST", "/refunds", b"{}")
        );
        assert_eq!(
            fp.compute("POST", "/refunds?", b"{}"),
            fp.compute("POST", "/refunds", b"{}")
        );
        // The boundary between path and query cannot be moved.
        assert_ne!(fp.compute("POST", "/a?b", b""), fp.compute("POST", "/a?b", b"x"));
        assert_ne!(fp.compute("POST", "/ab?", b""), fp.compute("POST", "/a?b", b""));
    }

    #[test]
    fn excluded_pointers_do_not_count() {
        let fp = Fingerprinter::new()
            .exclude("/idempotencyKey")
            .unwrap()
            .exclude("/meta/sentAt")
            .unwrap();
        let a = json!({"idempotencyKey": "k1", "x": 1, "meta": {"sentAt": 1, "v": 2}});
        let b = json!({"idempotencyKey": "k2", "x": 1, "meta": {"sentAt": 9, "v": 2}});
        let c = json!({"idempotencyKey": "k1", "x": 2, "meta": {"sentAt": 1, "v": 2}});
        let f = |v: &Value| fp.compute("POST", "/", v.to_string().as_bytes());
        assert_eq!(f(&a), f(&b));
        assert_ne!(f(&a), f(&c));
        assert!(Fingerprinter::new().exclude("nope").is_err());
    }

    /// Fingerprints are stored: a retry after an upgrade must still match.
    /// These values were computed before the walk stopped allocating per member.
    #[test]
    fn fingerprints_are_stable_across_versions() {
        let body = br#"{"b":[1,2.50,{"z":"\u00e9t\u00e9","a":null}],"a~/\"x":true,"s":"plain","n":-0.0e+1}"#;
        let plain = Fingerprinter::new().compute("POST", "/orders?x=1", body);
        let excluding = Fingerprinter::new()
            .exclude("/a~0~1\"x")
            .unwrap()
            .exclude("/b/2/z")
            .unwrap()
            .compute("POST", "/orders?x=1", body);
        assert_eq!(
            plain.to_hex(),
            "8ba35ac85aae218655da30e295da59a7e9a977b0bff7c2efde6c347a156f1a20"
        );
        assert_eq!(
            excluding.to_hex(),
            "1d75215781179848e3295e71d690cc558beaed3f98835083157d79d870dfbcfc"
        );
    }

    #[test]
    fn hex_round_trip() {
        let f = Fingerprinter::new().compute("POST", "/", b"{}");
        assert_eq!(Fingerprint::from_hex(&f.to_hex()), Some(f));
        assert_eq!(Fingerprint::from_hex("zz"), None);
    }

    fn arb_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|i| json!(i)),
            "[a-z\\u{e9}\\u{1F600} ]{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{1,4}", inner, 0..5)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// Serialises objects with their members in reverse order and extra whitespace.
    fn scrambled(v: &Value) -> String {
        match v {
            Value::Object(m) => {
                let parts: Vec<String> = m
                    .iter()
                    .rev()
                    .map(|(k, v)| format!(" {} :\n{} ", Value::String(k.clone()), scrambled(v)))
                    .collect();
                format!("{{{}}}", parts.join(","))
            }
            Value::Array(a) => {
                let parts: Vec<String> = a.iter().map(scrambled).collect();
                format!("[ {} ]", parts.join(" , "))
            }
            other => other.to_string(),
        }
    }

    proptest! {
        #[test]
        fn key_order_and_whitespace_never_matter(v in arb_json()) {
            let wrapped = json!({ "v": v });
            let fp = Fingerprinter::new();
            prop_assert_eq!(
                fp.compute("POST", "/p", wrapped.to_string().as_bytes()),
                fp.compute("POST", "/p", scrambled(&wrapped).as_bytes())
            );
        }

        #[test]
        fn different_values_differ(a in arb_json(), b in arb_json()) {
            prop_assume!(a != b);
            let fp = Fingerprinter::new();
            prop_assert_ne!(
                fp.compute("POST", "/p", json!({"v": a}).to_string().as_bytes()),
                fp.compute("POST", "/p", json!({"v": b}).to_string().as_bytes())
            );
        }
    }

    /// A JSON document as a tree whose numbers are their exact text: two trees
    /// are equal exactly when `serde_json` with arbitrary-precision numbers
    /// parses their renderings to equal values.
    #[derive(Debug, Clone, PartialEq)]
    enum Doc {
        Num(String),
        Str(String),
        Bool(bool),
        Null,
        Arr(Vec<Doc>),
        Obj(BTreeMap<String, Doc>),
    }

    fn arb_doc() -> impl Strategy<Value = Doc> {
        let leaf = prop_oneof![
            "-?(0|[1-9][0-9]{0,24})(\\.[0-9]{1,20})?([eE][+-]?[0-9]{1,3})?".prop_map(Doc::Num),
            "[a-z\"\\\\/\u{e9}\u{1F600}\u{1} ]{0,6}".prop_map(Doc::Str),
            any::<bool>().prop_map(Doc::Bool),
            Just(Doc::Null),
        ];
        leaf.prop_recursive(4, 32, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Doc::Arr),
                proptest::collection::btree_map("[a-z~/]{1,3}", inner, 0..4).prop_map(Doc::Obj),
            ]
        })
    }

    /// Writes a string with every character escaped as `\uXXXX` when `escape`.
    fn render_str(s: &str, escape: bool) -> String {
        if !escape {
            return Value::String(s.to_owned()).to_string();
        }
        let mut out = String::from("\"");
        for unit in s.encode_utf16() {
            out.push_str(&format!("\\u{unit:04x}"));
        }
        out.push('"');
        out
    }

    /// Renders a document; `alt` reverses member order, pads with whitespace
    /// and spells every string with escapes.
    fn render(d: &Doc, alt: bool) -> String {
        let ws = if alt { " \n\t" } else { "" };
        match d {
            Doc::Num(n) => n.clone(),
            Doc::Str(s) => render_str(s, alt),
            Doc::Bool(b) => b.to_string(),
            Doc::Null => "null".into(),
            Doc::Arr(items) => {
                let parts: Vec<String> = items.iter().map(|i| render(i, alt)).collect();
                format!("[{ws}{}{ws}]", parts.join(&format!("{ws},{ws}")))
            }
            Doc::Obj(m) => {
                let mut parts: Vec<String> = m
                    .iter()
                    .map(|(k, v)| format!("{}{ws}:{ws}{}", render_str(k, alt), render(v, alt)))
                    .collect();
                if alt {
                    parts.reverse();
                }
                format!("{{{ws}{}{ws}}}", parts.join(","))
            }
        }
    }

    proptest! {
        #[test]
        fn arbitrary_precision_documents_collide_only_when_equal(a in arb_doc(), b in arb_doc()) {
            let fp = Fingerprinter::new();
            let f = |d: &Doc, alt: bool| fp.compute("POST", "/p", format!("[{}]", render(d, alt)).as_bytes());
            // Spelling (escapes, order, whitespace) never matters ...
            prop_assert_eq!(f(&a, false), f(&a, true));
            // ... and different documents never share a fingerprint.
            prop_assert_eq!(a == b, f(&a, false) == f(&b, true));
        }

        #[test]
        fn a_changed_digit_changes_the_fingerprint(n in "[1-9][0-9]{15,30}", at in 0usize..15) {
            let mut other: Vec<u8> = n.clone().into_bytes();
            other[at] = if other[at] == b'9' { b'1' } else { other[at] + 1 };
            let other = String::from_utf8(other).unwrap();
            let fp = Fingerprinter::new();
            prop_assert_ne!(
                fp.compute("POST", "/p", format!("{{\"n\":{n}}}").as_bytes()),
                fp.compute("POST", "/p", format!("{{\"n\":{other}}}").as_bytes())
            );
        }
    }
}
