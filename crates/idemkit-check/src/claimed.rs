//! Gate 8: a method that claims to be idempotent (PUT, PATCH, DELETE, or any route
//! the caller names) is verified, not trusted: the same request twice **without** a
//! key must leave the state as the first one left it.
//!
//! The state is read through the probe: the JSON of `--state-url` with volatile
//! members (timestamps, versions) removed by pointer, or the count of `--count-url`.
//! A PUT that appends to a list or a DELETE that decrements a counter changes it a
//! second time and fails; a PUT that replaces or a DELETE that tolerates an absent
//! resource leaves it alone and passes.

use serde_json::Value;

use super::{Account, Ctx, Findings, Judgement, Unjudged, Variant, excerpt};

/// What the probe read.
#[derive(Debug, Clone, PartialEq)]
enum State {
    Json(Value),
    Count(i64),
}

impl State {
    fn show(&self) -> String {
        match self {
            State::Json(v) => excerpt(v.to_string().as_bytes()),
            State::Count(n) => format!("count {n}"),
        }
    }
}

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    if ctx.cfg.state_url.is_none() && ctx.cfg.count_url.is_none() {
        return Err(Unjudged(
            "no state probe: pass --state-url (JSON compared without the --volatile pointers) or --count-url"
                .into(),
        ));
    }
    let method = ctx.cfg.template.method().clone();
    let request = ctx.request(None, Variant::Template, Account::Main);
    let s0 = state(ctx).await?;
    let first = ctx.send(request.clone()).await?;
    let s1 = state(ctx).await?;
    let second = ctx.send(request).await?;
    let s2 = state(ctx).await?;

    let mut findings = Findings::default();
    let observed = format!(
        "{method} twice without a key: first → {}, second → {}; state {} → {} → {}",
        ctx.label(&first),
        ctx.label(&second),
        s0.show(),
        s1.show(),
        s2.show()
    );
    if !first.is_success() {
        let keyed = (400..500).contains(&first.status)
            && super::code_of(&first).is_some_and(|c| c.contains("idempotency_key"));
        if keyed && !second.is_success() && s0 == s1 && s1 == s2 {
            findings.note(
                "the route refuses requests without a key, so it does not rely on its method being idempotent \
                 (the other gates judge its keys)",
            );
            return findings.finish(observed);
        }
        return Err(Unjudged(format!(
            "the first request without a key was answered {}: the gate needs it to succeed (check the template, \
             or that the resource exists before the check)",
            ctx.describe(&first)
        )));
    }
    if s1 != s2 {
        let change = match (&s1, &s2) {
            (State::Json(a), State::Json(b)) => difference(a, b, "")
                .map(|(at, was, now)| format!("at `{}` {was} → {now}", if at.is_empty() { "/" } else { &at }))
                .unwrap_or_else(|| "the state differs".to_owned()),
            _ => format!("{} → {}", s1.show(), s2.show()),
        };
        findings.fail(format!(
            "a second identical {method} changed the state again ({change}): the method claims idempotency the \
             route does not have; give it a key or make it replace instead of accumulate"
        ));
        findings.note(format!("after the first: {}", s1.show()));
        findings.note(format!("after the second: {}", s2.show()));
    }
    if second.status >= 500 {
        findings.fail(format!(
            "the second identical request failed with {}",
            ctx.describe(&second)
        ));
    }
    if s0 == s1 {
        findings.note(
            "the first request changed nothing the probe shows (the resource was already in that state)",
        );
    }
    findings.finish(observed)
}

/// The probe's reading: the state URL's JSON without the volatile members, or the
/// count.
async fn state(ctx: &Ctx<'_>) -> Result<State, Unjudged> {
    let Some(url) = &ctx.cfg.state_url else {
        return Ok(State::Count(ctx.count(Account::Main).await?.unwrap_or_default()));
    };
    let answer = ctx
        .send(ctx.probe_request(url, Account::Main))
        .await
        .map_err(|Unjudged(e)| Unjudged(format!("the state probe failed: {e}")))?;
    let mut value = match (answer.is_success(), answer.json()) {
        (true, Some(v)) => v,
        _ => {
            return Err(Unjudged(format!(
                "the state probe {url} answered {} `{}`, not a JSON document",
                answer.status,
                excerpt(&answer.body)
            )));
        }
    };
    for pointer in &ctx.cfg.volatile {
        remove(&mut value, pointer);
    }
    Ok(State::Json(value))
}

/// Removes the member or element at `pointer`; `*` as a segment means every element or
/// member (`/items/*/updatedAt`).
pub(super) fn remove(value: &mut Value, pointer: &str) {
    let segments: Vec<String> = pointer
        .split('/')
        .skip(1)
        .map(|s| s.replace("~1", "/").replace("~0", "~"))
        .collect();
    remove_at(value, &segments);
}

fn remove_at(value: &mut Value, segments: &[String]) {
    let Some((head, rest)) = segments.split_first() else {
        return;
    };
    if rest.is_empty() {
        match value {
            Value::Object(map) if head == "*" => map.clear(),
            Value::Object(map) => {
                map.remove(head);
            }
            Value::Array(items) if head == "*" => items.clear(),
            Value::Array(items) => {
                if let Ok(i) = head.parse::<usize>()
                    && i < items.len()
                {
                    items.remove(i);
                }
            }
            _ => {}
        }
        return;
    }
    match value {
        Value::Object(map) if head == "*" => map.values_mut().for_each(|v| remove_at(v, rest)),
        Value::Object(map) => {
            if let Some(v) = map.get_mut(head) {
                remove_at(v, rest);
            }
        }
        Value::Array(items) if head == "*" => items.iter_mut().for_each(|v| remove_at(v, rest)),
        Value::Array(items) => {
            if let Some(v) = head.parse::<usize>().ok().and_then(|i| items.get_mut(i)) {
                remove_at(v, rest);
            }
        }
        _ => {}
    }
}

/// The first place two documents differ: its pointer and both values, shortened.
fn difference(a: &Value, b: &Value, at: &str) -> Option<(String, String, String)> {
    let short = |v: Option<&Value>| match v {
        None => "absent".to_owned(),
        Some(Value::Array(items)) => format!("{} element(s)", items.len()),
        Some(v) => excerpt(v.to_string().as_bytes()),
    };
    match (a, b) {
        _ if a == b => None,
        (Value::Object(x), Value::Object(y)) => {
            for key in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let here = format!("{at}/{}", key.replace('~', "~0").replace('/', "~1"));
                match (x.get(key), y.get(key)) {
                    (Some(p), Some(q)) => {
                        if let Some(d) = difference(p, q, &here) {
                            return Some(d);
                        }
                    }
                    (p, q) => return Some((here, short(p), short(q))),
                }
            }
            None
        }
        (Value::Array(x), Value::Array(y)) if x.len() != y.len() => {
            Some((at.to_owned(), short(Some(a)), short(Some(b))))
        }
        (Value::Array(x), Value::Array(y)) => x
            .iter()
            .zip(y)
            .enumerate()
            .find_map(|(i, (p, q))| difference(p, q, &format!("{at}/{i}"))),
        _ => Some((at.to_owned(), short(Some(a)), short(Some(b)))),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn volatile_members_are_removed_by_pointer_with_wildcards() {
        let mut v = json!({"updatedAt": 1, "items": [{"id": 1, "at": 2}, {"id": 2, "at": 3}], "a/b": 4});
        remove(&mut v, "/updatedAt");
        remove(&mut v, "/items/*/at");
        remove(&mut v, "/a~1b");
        remove(&mut v, "/nothing/here");
        assert_eq!(v, json!({"items": [{"id": 1}, {"id": 2}]}));
    }

    #[test]
    fn the_first_difference_is_named_by_pointer() {
        let a = json!({"list": {"items": ["x"]}, "n": 1});
        let b = json!({"list": {"items": ["x", "x"]}, "n": 1});
        assert_eq!(
            difference(&a, &b, ""),
            Some(("/list/items".into(), "1 element(s)".into(), "2 element(s)".into()))
        );
        assert_eq!(
            difference(&json!({"value": 3}), &json!({"value": 2}), ""),
            Some(("/value".into(), "3".into(), "2".into()))
        );
        assert_eq!(difference(&a, &a, ""), None);
    }
}
