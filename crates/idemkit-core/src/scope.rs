//! The scope a record is keyed by: (account, key), never the key alone (the behaviour contract, `docs/spec.md` §1).

use std::fmt;

use crate::IdempotencyKey;

/// The account a key belongs to, resolved from the caller's authenticated identity
/// by a resolver the application supplies.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct Account(String);

impl Account {
    /// The account used when a deployment explicitly runs unscoped (single-tenant).
    /// Only reachable through an explicit setting; see `docs/decisions.md`. It starts
    /// with U+0001, which no identity provider issues and every store can hold
    /// (PostgreSQL text cannot hold NUL).
    pub const UNSCOPED: &'static str = "\u{1}unscoped";

    /// Wraps an account identifier.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The account of a credential (a bearer token, an API key) without keeping
    /// the credential: hex `HMAC-SHA256(secret, credential)`. The same secret
    /// and credential give the same account on every instance and after every
    /// restart; without the secret the account reveals nothing of the
    /// credential, so it can sit in the key table, logs and `keys list`.
    /// Rotating the secret moves every caller to a new account (their keys
    /// start afresh), so keep it as stable as the replay window needs.
    ///
    /// ```
    /// use idemkit_core::Account;
    /// let a = Account::keyed(b"server secret", b"tok_live_123");
    /// assert_eq!(a, Account::keyed(b"server secret", b"tok_live_123"));
    /// assert_ne!(a, Account::keyed(b"another secret", b"tok_live_123"));
    /// assert!(!a.as_str().contains("tok_live_123"));
    /// assert_eq!(a.as_str().len(), 64);
    /// ```
    pub fn keyed(secret: &[u8], credential: &[u8]) -> Self {
        AccountKey::new(secret).account(credential)
    }

    /// The single account of an explicitly unscoped (single-tenant) deployment.
    pub fn unscoped() -> Self {
        Self(Self::UNSCOPED.to_owned())
    }

    /// The identifier as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Account {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A secret keyed once, from which [`Account::keyed`] derives accounts: a
/// resolver that derives one per request keeps one of these instead of the
/// secret, so the HMAC's key schedule is not redone on every request. The
/// same secret and credential give the same account as [`Account::keyed`].
///
/// ```
/// use idemkit_core::{Account, AccountKey};
/// let key = AccountKey::new(b"server secret");
/// assert_eq!(key.account(b"tok_live_123"), Account::keyed(b"server secret", b"tok_live_123"));
/// ```
#[derive(Clone)]
pub struct AccountKey(hmac::Hmac<sha2::Sha256>);

impl AccountKey {
    /// Keys the HMAC with `secret`.
    pub fn new(secret: &[u8]) -> Self {
        use hmac::KeyInit;
        Self(hmac::Hmac::new_from_slice(secret).expect("HMAC takes a key of any length"))
    }

    /// The account of `credential`: hex `HMAC-SHA256(secret, credential)`.
    pub fn account(&self, credential: &[u8]) -> Account {
        use hmac::Mac;
        let mut mac = self.0.clone();
        mac.update(credential);
        let mut hex = [0u8; 64];
        hex::encode_to_slice(mac.finalize().into_bytes(), &mut hex).expect("64 hex digits for 32 bytes");
        Account(String::from_utf8(hex.to_vec()).expect("hex digits are ASCII"))
    }
}

impl fmt::Debug for AccountKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AccountKey(<redacted>)")
    }
}

/// The identity of one idempotency record.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub struct Scope {
    /// Whose key it is.
    pub account: Account,
    /// The key the client sent.
    pub key: IdempotencyKey,
}

impl Scope {
    /// Builds a scope.
    pub fn new(account: Account, key: IdempotencyKey) -> Self {
        Self { account, key }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231_case_2() {
        assert_eq!(
            AccountKey::new(b"Jefe")
                .account(b"what do ya want for nothing?")
                .as_str(),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }
}
