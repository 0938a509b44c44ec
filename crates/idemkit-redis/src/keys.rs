//! Key layout: `<prefix>:{<account>}:k:<key>` for a record (one hash) and
//! `<prefix>:{<account>}:c:<key>` for its change channel.
//!
//! The braces are a Redis Cluster hash tag: only the account decides the slot,
//! so a record, its channel and every other record of the account live on one
//! primary. The account is escaped so that it can never close the tag early
//! (`}`), open a second one, or smuggle control bytes into a key name.

use idemkit_core::Scope;

/// Percent-escapes everything outside visible ASCII, and `%`, `{`, `}`.
fn escape_account(account: &str, out: &mut String) {
    for b in account.bytes() {
        match b {
            b'%' | b'{' | b'}' => push_escaped(b, out),
            0x21..=0x7e => out.push(char::from(b)),
            _ => push_escaped(b, out),
        }
    }
}

fn push_escaped(b: u8, out: &mut String) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    out.push('%');
    out.push(char::from(HEX[usize::from(b >> 4)]));
    out.push(char::from(HEX[usize::from(b & 0x0f)]));
}

/// Builds a name of the form `<prefix>:{<account>}:<kind>:<key>`.
fn name(prefix: &str, scope: &Scope, kind: &str) -> String {
    let key = scope.key.as_str();
    let mut out = String::with_capacity(prefix.len() + scope.account.as_str().len() + key.len() + 8);
    out.push_str(prefix);
    out.push_str(":{");
    escape_account(scope.account.as_str(), &mut out);
    out.push_str("}:");
    out.push_str(kind);
    out.push(':');
    // Keys are visible ASCII (validated by `IdempotencyKey`); braces after the tag
    // do not change the slot, so the key needs no escaping.
    out.push_str(key);
    out
}

/// The record's hash key.
pub(crate) fn record_key(prefix: &str, scope: &Scope) -> String {
    name(prefix, scope, "k")
}

/// The record's change channel (published on completion, release, abandon).
pub(crate) fn channel(prefix: &str, scope: &Scope) -> String {
    name(prefix, scope, "c")
}

#[cfg(test)]
mod tests {
    use super::*;
    use idemkit_core::{Account, IdempotencyKey};

    fn scope(account: &str, key: &str) -> Scope {
        Scope::new(Account::new(account), IdempotencyKey::parse(key).unwrap())
    }

    #[test]
    fn layout_and_escaping() {
        assert_eq!(record_key("ik", &scope("acct-1", "k")), "ik:{acct-1}:k:k");
        assert_eq!(channel("ik", &scope("acct-1", "k")), "ik:{acct-1}:c:k");
        assert_eq!(
            record_key("ik", &scope("a}b{c%", "x{y}")),
            "ik:{a%7Db%7Bc%25}:k:x{y}"
        );
        assert_eq!(
            record_key(
                "ik",
                &Scope::new(Account::unscoped(), IdempotencyKey::parse("k").unwrap())
            ),
            "ik:{%01unscoped}:k:k"
        );
        assert_eq!(record_key("ik", &scope("é", "k")), "ik:{%C3%A9}:k:k");
    }

    #[test]
    fn distinct_accounts_never_collide() {
        // `%` is escaped too, so an account that looks escaped stays distinct.
        assert_ne!(
            record_key("ik", &scope("%7D", "k")),
            record_key("ik", &scope("}", "k"))
        );
    }
}
