//! The completer's mark on the requests it replays.

use idemkit_core::{FencingToken, Scope};

/// Marks a request the completer replays for a record's own (account, key); the
/// layer claims with this scope instead of resolving one. Only code in the same
/// process can attach request extensions, so clients cannot forge it.
#[derive(Debug, Clone)]
pub struct Resume {
    scope: Scope,
    /// The token of the abandoned record the completer saw: the layer's claim
    /// takes over exactly that record state or runs nothing.
    token: FencingToken,
}

impl Resume {
    /// The mark for a replay of the record of `scope` as the completer saw it
    /// (`token`): what `idemkit_tower::Completer` attaches to its requests.
    pub fn new(scope: Scope, token: FencingToken) -> Self {
        Self { scope, token }
    }
}

/// When this request is a completer's (`idemkit_tower::Completer`) replay of an abandoned record: that
/// record's scope (account and key) and the fencing token the completer saw.
/// The HTTP layer claims with them itself; other protocol adapters over the
/// [`Engine`](crate::Engine) (`idemkit-tonic`) do the same: claim
/// `ClaimRequest { scope, resume: Some(token), .. }` instead of resolving an
/// account, so a record that changed since the completer read it runs nothing.
/// Only code in the process can set request extensions; clients cannot forge it.
pub fn completer_resume(extensions: &http::Extensions) -> Option<(&Scope, FencingToken)> {
    extensions.get::<Resume>().map(|r| (&r.scope, r.token))
}
