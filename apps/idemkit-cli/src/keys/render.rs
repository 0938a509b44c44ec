//! How `idemkit keys` prints: tables for people, JSON with `--json`, times in
//! RFC 3339 UTC, and the account and scope arguments it reads.

use super::*;

pub(super) fn account_arg(s: &str) -> Account {
    if s == UNSCOPED_NAME {
        Account::unscoped()
    } else {
        Account::new(s)
    }
}

pub(super) fn account_text(a: &Account) -> String {
    if a.as_str() == Account::UNSCOPED {
        UNSCOPED_NAME.to_owned()
    } else {
        a.as_str().escape_debug().to_string()
    }
}

pub(super) fn scope_arg(s: &ScopeArgs) -> anyhow::Result<Scope> {
    let key = IdempotencyKey::parse(&s.key).map_err(|e| anyhow::anyhow!("--key: {e}"))?;
    Ok(Scope::new(account_arg(&s.account), key))
}

/// RFC 3339 in UTC, to the millisecond.
pub(super) fn time(m: Millis) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(m.0).unwrap_or(0));
    humantime::format_rfc3339_millis(t).to_string()
}

/// RFC 3339 in UTC, to the second (tables).
pub(super) fn time_s(m: Millis) -> String {
    let t = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(m.0).unwrap_or(0));
    humantime::format_rfc3339_seconds(t).to_string()
}

/// What the lease/completion column says about a record at `now`.
pub(super) fn lease_text(r: &Record, now: Millis) -> String {
    match r.state {
        RecordState::Completed => format!("completed {}", time_s(r.completed_at.unwrap_or(r.created_at))),
        RecordState::InFlight if r.lease_expires_at > now => {
            format!("held until {}", time_s(r.lease_expires_at))
        }
        RecordState::InFlight => format!("expired {}", time_s(r.lease_expires_at)),
        RecordState::Parked => format!("parked {}", time_s(r.lease_expires_at)),
        _ => "-".to_owned(),
    }
}

pub(super) fn or_dash(s: Option<&str>) -> String {
    s.map_or_else(|| "-".to_owned(), one_line)
}

/// Newlines and other control characters would break a table row.
pub(super) fn one_line(s: &str) -> String {
    s.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

pub(super) fn cut(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        s.to_owned()
    } else {
        let mut t: String = s.chars().take(max.saturating_sub(1)).collect();
        t.push('…');
        t
    }
}

/// A body as text: UTF-8 (lossy), cut to `max` bytes when given.
pub(super) fn body_text(body: &[u8], max: Option<usize>) -> String {
    match max {
        Some(max) if body.len() > max => format!(
            "{}… ({} more bytes)",
            String::from_utf8_lossy(&body[..max]),
            body.len() - max
        ),
        _ => String::from_utf8_lossy(body).into_owned(),
    }
}

pub(super) fn headers_json(headers: &[StoredHeader]) -> Value {
    Value::Array(
        headers
            .iter()
            .map(|h| json!({"name": h.name, "value": String::from_utf8_lossy(&h.value)}))
            .collect(),
    )
}

pub(super) fn state_text(s: RecordState) -> &'static str {
    s.as_str()
}

/// Left-aligned columns under a header and a rule.
pub(super) fn table(out: &mut impl Write, headers: &[&str], rows: &[Vec<String>]) -> anyhow::Result<()> {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let last = cells.len().saturating_sub(1);
        let mut s = String::new();
        for (i, (cell, w)) in cells.into_iter().zip(&widths).enumerate() {
            if i == last {
                s.push_str(&cell);
            } else {
                let pad = w - cell.chars().count();
                s.push_str(&cell);
                s.push_str(&" ".repeat(pad + 2));
            }
        }
        s.trim_end().to_owned()
    };
    writeln!(out, "{}", line(headers.iter().map(|h| (*h).to_owned()).collect()))?;
    writeln!(out, "{}", line(widths.iter().map(|w| "-".repeat(*w)).collect()))?;
    for row in rows {
        writeln!(out, "{}", line(row.clone()))?;
    }
    Ok(())
}

pub(super) fn json_out(out: &mut impl Write, v: &Value) -> anyhow::Result<()> {
    serde_json::to_writer_pretty(&mut *out, v)?;
    writeln!(out)?;
    Ok(())
}

/// A record for `list --json` (no bodies) or `show --json` (everything).
pub(super) fn record_json(r: &Record, now: Millis, full: bool) -> Value {
    let lease_live = r.state == RecordState::InFlight && r.lease_expires_at > now;
    let mut v = json!({
        "account": r.scope.account.as_str(),
        "key": r.scope.key.as_str(),
        "state": state_text(r.state),
        "created_at": time(r.created_at),
        "completed_at": r.completed_at.map(time),
        "lease_expires_at": time(r.lease_expires_at),
        "lease_live": lease_live,
        "fencing_token": r.fencing_token.0,
        "recovery_point": r.recovery_point,
        "last_error": r.last_error,
        "request": {"method": r.request.method, "path": r.request.path},
        "response_status": r.response.as_ref().map(|s| s.status),
    });
    if full {
        v["fingerprint"] = json!(r.fingerprint.to_hex());
        v["step_outputs"] = json!(r.step_outputs);
        v["request"]["headers"] = headers_json(&r.request.headers);
        v["request"]["body"] = json!(body_text(&r.request.body, None));
        v["request"]["body_bytes"] = json!(r.request.body.len());
        v["response"] = match &r.response {
            Some(resp) => json!({
                "status": resp.status,
                "headers": headers_json(&resp.headers),
                "body": body_text(&resp.body, None),
                "body_bytes": resp.body.len(),
            }),
            None => Value::Null,
        };
    }
    v
}

pub(super) fn review_json(e: &ReviewEntry) -> Value {
    json!({
        "account": e.scope.account.as_str(),
        "key": e.scope.key.as_str(),
        "state": state_text(e.state),
        "created_at": time(e.created_at),
        "reaped_at": time(e.reaped_at),
        "recovery_point": e.recovery_point,
        "step_outputs": e.step_outputs,
        "last_error": e.last_error,
        "request": {
            "method": e.request.method,
            "path": e.request.path,
            "headers": headers_json(&e.request.headers),
            "body": body_text(&e.request.body, None),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(time(Millis(0)), "1970-01-01T00:00:00.000Z");
        assert_eq!(time_s(Millis(1_700_000_000_123)), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn tables_align_and_cells_stay_on_one_line() {
        let mut out = Vec::new();
        table(
            &mut out,
            &["a", "bb"],
            &[vec!["xyz".into(), one_line("1\n2")], vec!["-".into(), "-".into()]],
        )
        .unwrap();
        assert_eq!(
            String::from_utf8(out).unwrap(),
            "a    bb\n---  ---\nxyz  1 2\n-    -\n"
        );
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(body_text(b"abcdef", Some(2)), "ab… (4 more bytes)");
    }

    #[test]
    fn unscoped_account_has_a_name() {
        assert_eq!(account_arg(UNSCOPED_NAME), Account::unscoped());
        assert_eq!(account_text(&Account::unscoped()), UNSCOPED_NAME);
    }
}
