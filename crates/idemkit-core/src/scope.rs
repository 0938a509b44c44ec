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
