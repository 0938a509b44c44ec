//! Key layout: `<prefix>:{<account>}:k:<key>` for a record (one hash),
//! `<prefix>:{<account>}:c:<key>` for its change channel,
//! `<prefix>:{<account>}:r:<key>` for its review-list entries (a hash, one
//! field per listed claim) and `<prefix>:{<account>}:t` for the account's
//! fencing-token high-water mark; `<prefix>:{<account>}:b:<name>` are the
//! application's business keys written with a phase advance.
//!
//! The braces are a Redis Cluster hash tag: only the account decides the slot,
//! so a record, its channel and every other record of the account live on one
//! primary. The account is escaped so that it can never close the tag early
//! (`}`), open a second one, or smuggle control bytes into a key name.

use idemkit_core::{Account, IdempotencyKey, Scope};

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

/// The record's review-list hash.
pub(crate) fn review_key(prefix: &str, scope: &Scope) -> String {
    name(prefix, scope, "r")
}

/// A business key of the application's, in the account's slot:
/// `<prefix>:{<account>}:b:<name>`.
pub(crate) fn business_key(prefix: &str, account: &Account, name: &str) -> String {
    let mut out = String::with_capacity(prefix.len() + account.as_str().len() + name.len() + 8);
    out.push_str(prefix);
    out.push_str(":{");
    escape_account(account.as_str(), &mut out);
    out.push_str("}:b:");
    out.push_str(name);
    out
}

/// The account's token high-water mark (a counter without TTL).
pub(crate) fn token_key(prefix: &str, scope: &Scope) -> String {
    let mut out = String::with_capacity(prefix.len() + scope.account.as_str().len() + 6);
    out.push_str(prefix);
    out.push_str(":{");
    escape_account(scope.account.as_str(), &mut out);
    out.push_str("}:t");
    out
}

/// Escapes the glob metacharacters of `MATCH` patterns.
pub(crate) fn push_glob_literal(s: &str, out: &mut String) {
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
}

/// A `SCAN MATCH` pattern for every name of `kind` (`k` records, `r` review
/// hashes), of one account or all. Matches may include other names (a key can
/// contain `}:k:`): [`parse`] is the filter.
pub(crate) fn pattern(prefix: &str, kind: &str, account: Option<&Account>) -> String {
    let mut out = String::new();
    push_glob_literal(prefix, &mut out);
    out.push_str(":{");
    match account {
        Some(a) => {
            let mut escaped = String::new();
            escape_account(a.as_str(), &mut escaped);
            push_glob_literal(&escaped, &mut out);
            out.push('}');
        }
        None => out.push('*'),
    }
    out.push(':');
    out.push_str(kind);
    out.push_str(":*");
    out
}

/// The scope of a name built by [`name`] with this `kind`, or `None`.
pub(crate) fn parse(prefix: &str, kind: &str, name: &str) -> Option<Scope> {
    let rest = name.strip_prefix(prefix)?.strip_prefix(":{")?;
    let close = rest.find('}')?;
    let (escaped, rest) = rest.split_at(close);
    let key = rest.strip_prefix("}:")?.strip_prefix(kind)?.strip_prefix(':')?;
    let mut bytes = Vec::with_capacity(escaped.len());
    let raw = escaped.as_bytes();
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let hex = escaped.get(i + 1..i + 3)?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            bytes.push(raw[i]);
            i += 1;
        }
    }
    let account = String::from_utf8(bytes).ok()?;
    Some(Scope::new(
        Account::new(account),
        IdempotencyKey::parse(key).ok()?,
    ))
}

/// The hash tag (cluster slot) of a name: through its first `}`.
pub(crate) fn tag(name: &str) -> &str {
    name.find('}').map_or(name, |i| &name[..=i])
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
    fn names_parse_back_to_their_scope() {
        for (account, key) in [("acct-1", "k"), ("a}b{c%", "x{y}:k:z"), ("é", "*?[")] {
            let s = scope(account, key);
            assert_eq!(parse("ik", "k", &record_key("ik", &s)), Some(s.clone()));
            assert_eq!(parse("ik", "r", &review_key("ik", &s)), Some(s.clone()));
            assert_eq!(parse("ik", "k", &review_key("ik", &s)), None);
            assert_eq!(parse("ik", "k", &token_key("ik", &s)), None);
            assert_eq!(parse("other", "k", &record_key("ik", &s)), None);
            assert_eq!(tag(&record_key("ik", &s)), tag(&token_key("ik", &s)));
        }
        let unscoped = Scope::new(Account::unscoped(), IdempotencyKey::parse("k").unwrap());
        assert_eq!(parse("ik", "k", &record_key("ik", &unscoped)), Some(unscoped));
        assert_eq!(pattern("i*k", "k", None), "i\\*k:{*:k:*");
        assert_eq!(pattern("ik", "r", Some(&Account::new("a?}"))), "ik:{a\\?%7D}:r:*");
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
