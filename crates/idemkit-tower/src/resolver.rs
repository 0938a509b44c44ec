//! Resolving the account a key belongs to (SPEC §1: keys are scoped per account).

use http::request::Parts;
use http::{HeaderName, header};
use idemkit_core::{Account, ErrorCode};

use crate::ProblemResponse;

/// Maps a request to the account its idempotency key is scoped by. The
/// application supplies it: typically it reads the identity an authentication
/// layer already established.
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

/// The account is the bearer token itself (`Authorization: Bearer <token>`).
/// Suits demos and services whose tokens are opaque account identifiers; real
/// services map tokens to accounts in their own resolver.
#[derive(Debug, Clone, Copy, Default)]
pub struct BearerTokenAccount;

impl AccountResolver for BearerTokenAccount {
    fn resolve(&self, parts: &Parts) -> Result<Account, ProblemResponse> {
        bearer_token(parts).map(Account::new).ok_or_else(|| {
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

/// The explicit single-tenant choice: every request shares one account. Only
/// reachable through [`crate::IdempotencyLayerBuilder::unscoped`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unscoped;

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
        assert!(BearerTokenAccount.resolve(&parts(&[])).is_err());
    }
}
