//! Resolving the account a key belongs to from request metadata.

use http::{HeaderMap, HeaderName, header};
use idemkit_core::Account;

/// Maps a call's metadata (its HTTP/2 headers) to the account its idempotency
/// key is scoped by. The gRPC counterpart of `idemkit_tower::AccountResolver`.
pub trait MetadataAccountResolver: Send + Sync + 'static {
    /// The caller's account, or the status to answer (usually `UNAUTHENTICATED`).
    fn resolve(&self, metadata: &HeaderMap) -> Result<Account, tonic::Status>;
}

impl<F> MetadataAccountResolver for F
where
    F: Fn(&HeaderMap) -> Result<Account, tonic::Status> + Send + Sync + 'static,
{
    fn resolve(&self, metadata: &HeaderMap) -> Result<Account, tonic::Status> {
        self(metadata)
    }
}

/// The account is the bearer token itself (`authorization: Bearer <token>`
/// metadata). Suits demos; real services map tokens to accounts.
#[derive(Debug, Clone, Copy, Default)]
pub struct BearerTokenAccount;

impl MetadataAccountResolver for BearerTokenAccount {
    fn resolve(&self, metadata: &HeaderMap) -> Result<Account, tonic::Status> {
        let mut values = metadata.get_all(header::AUTHORIZATION).iter();
        let token = match (values.next().map(|v| v.to_str()), values.next()) {
            (Some(Ok(v)), None) => v
                .split_once(' ')
                .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                .map(|(_, t)| t.trim())
                .filter(|t| !t.is_empty() && !t.contains(' ')),
            _ => None,
        };
        token
            .map(Account::new)
            .ok_or_else(|| tonic::Status::unauthenticated("send `authorization: Bearer <token>` metadata"))
    }
}

/// The account is the value of a metadata entry set by a trusted authenticating
/// proxy. Only sound when the proxy strips that entry from client calls.
#[derive(Debug, Clone)]
pub struct TrustedMetadataAccount(pub HeaderName);

impl MetadataAccountResolver for TrustedMetadataAccount {
    fn resolve(&self, metadata: &HeaderMap) -> Result<Account, tonic::Status> {
        let mut values = metadata.get_all(&self.0).iter();
        match (values.next().map(|v| v.to_str()), values.next()) {
            (Some(Ok(v)), None) if !v.is_empty() => Ok(Account::new(v)),
            _ => Err(tonic::Status::unauthenticated(format!(
                "missing `{}` metadata",
                self.0
            ))),
        }
    }
}

/// Every call shares one account (the explicit single-tenant choice).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unscoped;

impl MetadataAccountResolver for Unscoped {
    fn resolve(&self, _: &HeaderMap) -> Result<Account, tonic::Status> {
        Ok(Account::unscoped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer() {
        let mut h = HeaderMap::new();
        assert!(BearerTokenAccount.resolve(&h).is_err());
        h.insert(header::AUTHORIZATION, "Bearer abc".parse().unwrap());
        assert_eq!(BearerTokenAccount.resolve(&h).unwrap(), Account::new("abc"));
        h.append(header::AUTHORIZATION, "Bearer def".parse().unwrap());
        assert!(BearerTokenAccount.resolve(&h).is_err());
    }
}
