//! Idempotency keys: validated values, event-derived helpers and the auto-key setting.

use std::fmt;

use http::HeaderValue;

pub(crate) use idemkit_core::wire::IDEMPOTENCY_KEY as IDEMPOTENCY_KEY_STR;

/// Longest key the idemkit contract accepts.
const MAX_LEN: usize = 255;

/// A validated idempotency key: 1–255 visible ASCII characters (0x21–0x7E).
///
/// Ranked by how well they protect a write:
/// 1. event-derived ([`IdempotencyKey::derived`]): the same business event always maps to
///    the same key, even across process restarts;
/// 2. request-scoped: created once when the caller decides to perform the operation;
/// 3. random ([`IdempotencyKey::random`]), reused on every attempt of one logical call
///    (what the retry layer does automatically).
///
/// A fresh key per attempt (a timestamp, a new UUID on each retry) defeats the
/// mechanism: the server sees a brand-new operation every time. The retry layer never
/// regenerates a key on retry.
///
/// ```
/// use idemkit_client::IdempotencyKey;
///
/// let key = IdempotencyKey::derived("order-confirm", 42);
/// assert_eq!(key.as_str(), "order-confirm-42");
/// assert!(IdempotencyKey::new("has space").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(HeaderValue);

impl IdempotencyKey {
    /// Validates `value` as a key.
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when the value is empty, longer than 255 characters or holds a
    /// character outside visible ASCII.
    pub fn new(value: impl AsRef<str>) -> Result<Self, InvalidKey> {
        let value = value.as_ref();
        if value.is_empty() || value.len() > MAX_LEN {
            return Err(InvalidKey { len: value.len() });
        }
        if !value.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(InvalidKey { len: value.len() });
        }
        HeaderValue::from_str(value)
            .map(Self)
            .map_err(|_| InvalidKey { len: value.len() })
    }

    /// An event-derived key: `"{prefix}-{id}"`, e.g. `order-confirm-1234`.
    ///
    /// The same event always yields the same key, so a retry after a crash or a
    /// redeploy is still recognised as the same operation.
    ///
    /// # Panics
    ///
    /// When the result is not a valid key (empty, too long, or with characters outside
    /// visible ASCII). Use [`IdempotencyKey::try_derived`] for untrusted parts.
    #[must_use]
    pub fn derived(prefix: impl fmt::Display, id: impl fmt::Display) -> Self {
        Self::try_derived(prefix, id).expect("derived idempotency key must be 1-255 visible ASCII")
    }

    /// Fallible form of [`IdempotencyKey::derived`].
    ///
    /// # Errors
    ///
    /// [`InvalidKey`] when `"{prefix}-{id}"` is not a valid key.
    pub fn try_derived(prefix: impl fmt::Display, id: impl fmt::Display) -> Result<Self, InvalidKey> {
        Self::new(format!("{prefix}-{id}"))
    }

    /// A random UUID v4 key. Create it once per logical operation and reuse it on
    /// every attempt.
    #[must_use]
    pub fn random() -> Self {
        let value = uuid::Uuid::new_v4().hyphenated().to_string();
        Self(HeaderValue::from_str(&value).expect("a UUID is visible ASCII"))
    }

    /// The key as text.
    #[must_use]
    pub fn as_str(&self) -> &str {
        // Validated as visible ASCII on construction.
        self.0.to_str().unwrap_or_default()
    }

    /// The key as a header value.
    #[must_use]
    pub fn header_value(&self) -> HeaderValue {
        self.0.clone()
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&self.as_str()).finish()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = InvalidKey;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl From<IdempotencyKey> for HeaderValue {
    fn from(key: IdempotencyKey) -> Self {
        key.0
    }
}

/// A value that is not a valid idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an idempotency key must be 1-255 visible ASCII characters (got {len} bytes)")]
#[non_exhaustive]
pub struct InvalidKey {
    /// Length of the rejected value, in bytes.
    pub len: usize,
}

/// Whether the retry layer attaches a key to requests that have none, and whether
/// that key makes a *maybe executed* write safe to retry.
///
/// A key the client makes up protects a write only if the server de-duplicates by
/// it, and nothing in a request proves that: a server that ignores `Idempotency-Key`
/// performs every retry again. So by default the generated key is sent (an idemkit
/// server requires one, and de-duplicates by it) but is *not* counted as protection,
/// unless the route is known to honour it. A key the caller sets is always counted:
/// setting one is the caller's statement that the server honours it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum AutoKey {
    /// Default: a POST, PATCH, PUT or DELETE (any method but GET, HEAD, OPTIONS and
    /// TRACE; see [`gets_auto_key`](crate::gets_auto_key)) without a key gets a UUID v4
    /// generated once per logical call and sent on every attempt. A non-idempotent
    /// request (POST, PATCH) whose outcome is unknown — a timeout or reset after
    /// sending, or a `502`/`504` from a gateway — is retried only when the route is
    /// known to honour the key:
    ///
    /// - the server's published `x-idempotency` policy, given to
    ///   [`RetryPolicy::with_published_policy`](crate::RetryPolicy::with_published_policy),
    ///   names a key for this method and path in the header the client sends it in
    ///   (and does not mark the operation `retrySafe: false`), or
    /// - during this very call the server answered `409 idempotency_request_in_progress`
    ///   to this key: it recognised the key on this route.
    ///
    /// Otherwise the call ends with
    /// [`FatalReason::AutoKeyUnconfirmed`](crate::FatalReason::AutoKeyUnconfirmed).
    /// Evidence from another call or another route (a replay marker, an idempotency
    /// problem) is not used: one origin can route paths to servers that differ.
    #[default]
    Generate,
    /// Like [`Generate`](Self::Generate), and the generated key counts as protection on
    /// every route the published policy (if any) does not describe otherwise: the
    /// caller states that this server honours keys everywhere (an idemkit server with
    /// the layer on every write route). Against a server that ignores keys a
    /// maybe-executed write is performed twice.
    GenerateTrusted,
    /// No key is generated: only keys the caller set protect a request. A
    /// non-idempotent request (POST, PATCH) without a key whose outcome is unknown is
    /// not retried.
    CallerOnly,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_length_and_charset() {
        assert!(IdempotencyKey::new("").is_err());
        assert!(IdempotencyKey::new("a".repeat(256)).is_err());
        assert!(IdempotencyKey::new("a".repeat(255)).is_ok());
        assert!(IdempotencyKey::new("tab\there").is_err());
        assert!(IdempotencyKey::new("ünïcode").is_err());
        assert!(IdempotencyKey::new("~!\"#").is_ok());
    }

    #[test]
    fn random_keys_are_uuids_and_distinct() {
        let a = IdempotencyKey::random();
        let b = IdempotencyKey::random();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 36);
        assert!(uuid::Uuid::parse_str(a.as_str()).is_ok());
    }

    #[test]
    fn derived_is_stable() {
        assert_eq!(
            IdempotencyKey::derived("order-confirm", "A-17"),
            IdempotencyKey::derived("order-confirm", "A-17")
        );
        assert!(IdempotencyKey::try_derived("bad prefix", 1).is_err());
    }
}
