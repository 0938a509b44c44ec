//! Request fingerprints: SHA-256 over method, route path and canonical body (SPEC §2).

use std::fmt;

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
/// JSON bodies are canonicalised with RFC 8785 (JCS), so key order and
/// insignificant whitespace do not change the fingerprint; configured JSON
/// pointers (e.g. a `/idempotencyKey` field, or a client timestamp) are removed
/// first. Bodies that are not JSON are hashed as bytes.
///
/// ```
/// use idemkit_core::Fingerprinter;
/// let fp = Fingerprinter::default();
/// let a = fp.compute("POST", "/orders", br#"{"sku":"A","quantity":1}"#);
/// let b = fp.compute("POST", "/orders", b"{ \"quantity\": 1, \"sku\": \"A\" }");
/// assert_eq!(a, b);
/// assert_ne!(a, fp.compute("POST", "/orders", br#"{"sku":"A","quantity":2}"#));
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

    /// Fingerprints a request. `path` is the route path (no query string).
    pub fn compute(&self, method: &str, path: &str, body: &[u8]) -> Fingerprint {
        let mut h = Sha256::new();
        // Length-prefixed fields, so no choice of method/path/body can collide
        // with another by moving bytes across a boundary.
        for part in [method.as_bytes(), path.as_bytes()] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        match self.canonical_json(body) {
            Some(canonical) => {
                h.update(b"json");
                h.update(&canonical);
            }
            None => {
                h.update(b"blob");
                h.update(body);
            }
        }
        Fingerprint(h.finalize().into())
    }

    fn canonical_json(&self, body: &[u8]) -> Option<Vec<u8>> {
        let first = body.iter().find(|b| !b.is_ascii_whitespace())?;
        if !matches!(first, b'{' | b'[') {
            return None;
        }
        let mut value: serde_json::Value = serde_json::from_slice(body).ok()?;
        for pointer in &self.excluded {
            remove_pointer(&mut value, pointer);
        }
        serde_json_canonicalizer::to_vec(&value).ok()
    }
}

fn remove_pointer(value: &mut serde_json::Value, pointer: &str) {
    let Some((parent, last)) = pointer.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(serde_json::Value::Object(map)) => {
            map.remove(&last);
        }
        Some(serde_json::Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>()
                && i < items.len()
            {
                items.remove(i);
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::{Value, json};

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
            fp.compute("POST", "/", br#"{"a":1,"b":[1,2]}"#),
            fp.compute("POST", "/", b"\n{ \"b\" : [1, 2], \"a\": 1.0 }\n")
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
        fn canonical_form_is_a_fixed_point(v in arb_json()) {
            let once = serde_json_canonicalizer::to_vec(&v).unwrap();
            let reparsed: Value = serde_json::from_slice(&once).unwrap();
            prop_assert_eq!(serde_json_canonicalizer::to_vec(&reparsed).unwrap(), once);
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
}
