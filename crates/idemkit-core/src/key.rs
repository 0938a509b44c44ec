//! The idempotency key a client sends, and its validation (the behaviour contract, `docs/spec.md` §1).

use std::fmt;

use crate::problem::ErrorCode;

/// Longest accepted key, in characters (after unquoting).
pub const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key: 1–255 visible ASCII characters (0x21–0x7E).
///
/// The IETF structured-field string form (`"abc"`) is accepted and unquoted, so
/// `"abc"` and `abc` are the same key.
///
/// ```
/// use idemkit_core::IdempotencyKey;
/// let a = IdempotencyKey::parse("order-confirm-42").unwrap();
/// let b = IdempotencyKey::parse("\"order-confirm-42\"").unwrap();
/// assert_eq!(a, b);
/// assert!(IdempotencyKey::parse("").is_err());
/// assert!(IdempotencyKey::parse("has space").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(String);

/// Why a key was refused. Every variant maps to one stable problem code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The route requires a key and none was sent.
    #[error("the request has no idempotency key")]
    Missing,
    /// The key is empty.
    #[error("the idempotency key is empty")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`].
    #[error("the idempotency key is {0} characters long; at most {MAX_KEY_LEN} are allowed")]
    TooLong(usize),
    /// The key holds a byte outside visible ASCII (0x21–0x7E).
    #[error("the idempotency key contains a character outside visible ASCII (0x21-0x7E) at position {0}")]
    InvalidCharacter(usize),
    /// The key starts with a quote but is not a valid structured-field string.
    #[error("the idempotency key is quoted but is not a valid structured-field string")]
    BadQuoting,
    /// The request carries the key more than once.
    #[error("the request carries {0} idempotency keys; send exactly one")]
    Multiple(usize),
}

impl KeyError {
    /// The stable problem code this error answers with.
    pub const fn code(&self) -> ErrorCode {
        match self {
            Self::Missing => ErrorCode::KeyMissing,
            _ => ErrorCode::KeyInvalid,
        }
    }
}

impl IdempotencyKey {
    /// Parses one key value as sent on the wire (header value or JSON field).
    pub fn parse(raw: impl AsRef<[u8]>) -> Result<Self, KeyError> {
        let raw = raw.as_ref();
        if raw.first() == Some(&b'"') {
            return Self::parse_quoted(raw);
        }
        Self::validate(raw)
    }

    /// Parses the values of every occurrence of the key header on one request.
    /// None is [`KeyError::Missing`]; several are [`KeyError::Multiple`], even when
    /// they are equal, because a proxy that duplicates headers is a bug worth surfacing.
    pub fn from_header_values<'a, I>(values: I) -> Result<Self, KeyError>
    where
        I: IntoIterator<Item = &'a [u8]>,
    {
        let mut values = values.into_iter();
        let first = values.next().ok_or(KeyError::Missing)?;
        let extra = values.count();
        if extra > 0 {
            return Err(KeyError::Multiple(extra + 1));
        }
        Self::parse(first)
    }

    fn parse_quoted(raw: &[u8]) -> Result<Self, KeyError> {
        let item: sfv::Item = sfv::Parser::new(raw).parse().map_err(|_| KeyError::BadQuoting)?;
        if !item.params.is_empty() {
            return Err(KeyError::BadQuoting);
        }
        let inner = item.bare_item.as_string().ok_or(KeyError::BadQuoting)?.as_str();
        Self::validate(inner.as_bytes())
    }

    fn validate(raw: &[u8]) -> Result<Self, KeyError> {
        if raw.is_empty() {
            return Err(KeyError::Empty);
        }
        if let Some(pos) = raw.iter().position(|b| !(0x21..=0x7e).contains(b)) {
            return Err(KeyError::InvalidCharacter(pos));
        }
        if raw.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong(raw.len()));
        }
        // Every byte is visible ASCII, so this cannot fail.
        let s = std::str::from_utf8(raw).map_err(|_| KeyError::InvalidCharacter(0))?;
        Ok(Self(s.to_owned()))
    }

    /// The key as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    // Keys can be guessable identifiers; Debug shows a short prefix only so that
    // records logged at debug level do not leak whole keys.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown: String = self.0.chars().take(6).collect();
        write!(f, "IdempotencyKey({shown}…, len {})", self.0.len())
    }
}

impl std::str::FromStr for IdempotencyKey {
    type Err = KeyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_bounds() {
        assert!(IdempotencyKey::parse("a").is_ok());
        assert!(IdempotencyKey::parse("!~").is_ok());
        assert!(IdempotencyKey::parse("a".repeat(255)).is_ok());
        assert_eq!(
            IdempotencyKey::parse("a".repeat(256)),
            Err(KeyError::TooLong(256))
        );
    }

    #[test]
    fn rejects_bad_characters() {
        assert_eq!(IdempotencyKey::parse(""), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse("a b"), Err(KeyError::InvalidCharacter(1)));
        assert_eq!(IdempotencyKey::parse("a\tb"), Err(KeyError::InvalidCharacter(1)));
        assert_eq!(IdempotencyKey::parse("\x7f"), Err(KeyError::InvalidCharacter(0)));
        assert_eq!(IdempotencyKey::parse("ké"), Err(KeyError::InvalidCharacter(1)));
        assert_eq!(IdempotencyKey::parse("a\nb"), Err(KeyError::InvalidCharacter(1)));
    }

    #[test]
    fn quoted_form_equals_bare() {
        assert_eq!(
            IdempotencyKey::parse("\"abc\"").unwrap(),
            IdempotencyKey::parse("abc").unwrap()
        );
        assert_eq!(IdempotencyKey::parse("\"\""), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse("\"a b\""),
            Err(KeyError::InvalidCharacter(1))
        );
        assert_eq!(IdempotencyKey::parse("\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(IdempotencyKey::parse("\"abc\";p=1"), Err(KeyError::BadQuoting));
        // An escaped quote inside a structured-field string is a literal quote.
        assert_eq!(IdempotencyKey::parse(r#""a\"b""#).unwrap().as_str(), "a\"b");
    }

    #[test]
    fn several_headers_are_invalid() {
        let v: [&[u8]; 2] = [b"a", b"a"];
        assert_eq!(IdempotencyKey::from_header_values(v), Err(KeyError::Multiple(2)));
        assert_eq!(IdempotencyKey::from_header_values([]), Err(KeyError::Missing));
        assert_eq!(KeyError::Missing.code(), ErrorCode::KeyMissing);
        assert_eq!(KeyError::Multiple(2).code(), ErrorCode::KeyInvalid);
    }

    #[test]
    fn debug_does_not_print_whole_key() {
        let k = IdempotencyKey::parse("secret-order-1234567").unwrap();
        assert!(!format!("{k:?}").contains("1234567"));
    }

    proptest! {
        #[test]
        fn visible_ascii_round_trips(s in "[!#-~][!-~]{0,254}") {
            let k = IdempotencyKey::parse(&s).unwrap();
            prop_assert_eq!(k.as_str(), s.as_str());
        }

        #[test]
        fn quoting_is_transparent(s in "[!#-\\[\\]-~]{1,255}") {
            // Any visible-ASCII key without `"` or `\` quotes to itself.
            let quoted = format!("\"{s}\"");
            prop_assert_eq!(IdempotencyKey::parse(&quoted).unwrap(), IdempotencyKey::parse(&s).unwrap());
        }

        #[test]
        fn never_accepts_invalid_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let ok = !bytes.is_empty()
                && bytes.len() <= MAX_KEY_LEN
                && bytes.iter().all(|b| (0x21..=0x7e).contains(b));
            if bytes.first() != Some(&b'"') {
                prop_assert_eq!(IdempotencyKey::parse(&bytes).is_ok(), ok);
            } else if let Ok(k) = IdempotencyKey::parse(&bytes) {
                prop_assert!(k.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b)));
                prop_assert!(k.as_str().len() <= MAX_KEY_LEN);
            }
        }
    }
}
