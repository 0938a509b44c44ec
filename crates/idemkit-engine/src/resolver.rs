//! Resolving the account a key belongs to: keys are scoped per account.

use http::request::Parts;
use http::{HeaderName, header};
use idemkit_core::{Account, AccountKey, ErrorCode};

use crate::ProblemResponse;

/// Maps a request to the account its idempotency key is scoped by. The
/// application supplies it: typically it reads the identity an authentication
/// layer already established (a request extension, a verified claim).
///
/// One trait for both adapters: the HTTP layer and `idemkit-tonic`'s gRPC layer
/// hand it the request's [`Parts`] (for gRPC, the HTTP/2 request: metadata are
/// its headers, and the extensions an auth layer set are there). A refusal is a
/// [`ProblemResponse`]; the gRPC layer answers it as the status its code maps to
/// (`Unauthorized` is `UNAUTHENTICATED`).
///
/// ```
/// use http::request::Parts;
/// use idemkit_core::{Account, AccountKey, ErrorCode};
/// use idemkit_engine::{AccountResolver, ProblemResponse};
///
/// /// What the application's authentication middleware puts in the extensions.
/// #[derive(Clone)]
/// struct Caller { account_id: String }
///
/// struct FromAuth;
/// impl AccountResolver for FromAuth {
///     fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
///         parts.extensions.get::<Caller>().map(|c| Account::new(&c.account_id)).ok_or_else(|| {
///             ProblemResponse::new(ErrorCode::Unauthorized, "not signed in")
///         })
///     }
/// }
/// ```
pub trait AccountResolver: Send + Sync + 'static {
    /// The caller's account, or the problem to answer (usually 401).
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse>;
}

impl<F> AccountResolver for F
where
    F: Fn(&Parts) -> Result<Account, ProblemResponse> + Send + Sync + 'static,
{
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
        self(parts)
    }
}

/// The account is derived from the bearer token (`Authorization: Bearer
/// <token>`, HTTP header or gRPC metadata) with a server secret, without
/// keeping the token: [`Account::keyed`] (hex `HMAC-SHA256(secret, token)`).
/// The token never reaches the key table, logs, `Debug` output or
/// `idemkit keys list`, and nobody without the secret can tell from an
/// account which token it came from.
///
/// Every instance sharing a store must use the same secret, and it must
/// outlive the replay window: a new secret moves every caller to a new account.
/// It suits services whose tokens are stable per caller; a service whose
/// tokens rotate (short-lived JWTs) should resolve the account its
/// authentication layer already knows instead, with its own [`AccountResolver`]
/// (see the crate's README for one that reads a request extension).
///
/// ```
/// use idemkit_engine::{AccountResolver, BearerTokenAccount};
/// let resolver = BearerTokenAccount::new(b"32 bytes or more of server secret".to_vec());
/// let parts = http::Request::builder()
///     .header("authorization", "Bearer tok_123")
///     .body(())
///     .unwrap()
///     .into_parts()
///     .0;
/// let account = resolver.resolve(&parts).unwrap();
/// assert!(!account.as_str().contains("tok_123"));
/// ```
#[derive(Clone)]
pub struct BearerTokenAccount {
    key: AccountKey,
}

impl BearerTokenAccount {
    /// Derives accounts with this secret (keep at least 32 random bytes, the
    /// same on every instance).
    ///
    /// # Panics
    ///
    /// If `secret` is empty: an empty key would make the account a plain hash
    /// of the token, which anyone can compute.
    pub fn new(secret: impl Into<Vec<u8>>) -> Self {
        let secret: Vec<u8> = secret.into();
        assert!(
            !secret.is_empty(),
            "BearerTokenAccount needs a non-empty secret: an empty one would make the account a plain hash of the token"
        );
        Self {
            key: AccountKey::new(&secret),
        }
    }
}

impl std::fmt::Debug for BearerTokenAccount {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BearerTokenAccount")
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl AccountResolver for BearerTokenAccount {
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
        bearer_token(parts)
            .map(|token| self.key.account(token.as_bytes()))
            .ok_or_else(|| {
                ProblemResponse::new(ErrorCode::Unauthorized, "send `Authorization: Bearer <token>`")
            })
    }
}

/// The bearer token of a request, if it carries exactly one well-formed one.
pub fn bearer_token(parts: &Parts) -> Option<&str> {
    let mut values = parts.headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let value = value.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty() && !token.contains(' ')).then_some(token)
}

/// The account is the value of a header set by a trusted authentication proxy
/// (e.g. `x-account-id`). Only sound when the proxy strips that header from
/// client requests.
#[derive(Debug, Clone)]
pub struct TrustedHeaderAccount(pub HeaderName);

impl AccountResolver for TrustedHeaderAccount {
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
        let mut values = parts.headers.get_all(&self.0).iter();
        match (values.next().map(|v| v.to_str()), values.next()) {
            (Some(Ok(v)), None) if !v.is_empty() => Ok(Account::new(v)),
            _ => Err(ProblemResponse::new(
                ErrorCode::Unauthorized,
                format!("missing `{}` header", self.0),
            )),
        }
    }
}

/// The explicit single-tenant choice: every request shares one account
/// ([`Account::unscoped`]), so one caller's key can answer another's request.
/// Only for deployments with a single caller; see `docs/decisions.md`.
#[derive(Debug, Clone, Copy)]
pub struct Unscoped;

impl AccountResolver for Unscoped {
    fn resolve(&self, _: &Parts) -> Result<Account, ProblemResponse> {
        Ok(Account::unscoped())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(auth: &[&str]) -> Parts {
        let mut b = http::Request::builder();
        for a in auth {
            b = b.header(header::AUTHORIZATION, *a);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn bearer_parsing() {
        assert_eq!(bearer_token(&parts(&["Bearer abc"])), Some("abc"));
        assert_eq!(bearer_token(&parts(&["bearer  abc "])), Some("abc"));
        assert_eq!(bearer_token(&parts(&["Basic abc"])), None);
        assert_eq!(bearer_token(&parts(&["Bearer "])), None);
        assert_eq!(bearer_token(&parts(&["Bearer a", "Bearer b"])), None);
        assert_eq!(bearer_token(&parts(&[])), None);
        let r = BearerTokenAccount::new(b"s3cr3t-value".to_vec());
        assert!(r.resolve(&parts(&[])).is_err());
        let a = r.resolve(&parts(&["Bearer abc"])).unwrap();
        assert_eq!(a, Account::keyed(b"s3cr3t-value", b"abc"));
        assert!(!a.as_str().contains("abc"));
        assert!(!format!("{r:?}").contains("s3cr3t"), "the secret is redacted");
        assert_ne!(
            a,
            BearerTokenAccount::new(b"other".to_vec())
                .resolve(&parts(&["Bearer abc"]))
                .unwrap()
        );
    }
}
