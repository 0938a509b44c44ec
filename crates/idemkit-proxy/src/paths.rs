//! Keyed-route matching on one normalised form of the path, and the refusal
//! of every other spelling that an upstream might route to the same handler.

/// How a request path relates to a configured route template.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum PathMatch {
    /// The path is the template's canonical spelling: keyed.
    Exact,
    /// Another spelling of a path the template matches (trailing or doubled
    /// slash, `.`/`..` segments, `;params`, percent-encoded unreserved
    /// characters or lower-case hex digits, other letter case): refused,
    /// because the upstream may route it to the keyed handler.
    Ambiguous,
    /// Not this route.
    No,
}

/// A route template (`/orders/{id}/confirm`, `/files/{*rest}`) split in segments.
#[derive(Debug, Clone)]
pub(super) struct Template {
    segments: Vec<Segment>,
}

#[derive(Debug, Clone)]
enum Segment {
    Literal(String),
    /// `{name}`: any one non-empty segment.
    Param,
    /// `{*name}`: the rest of the path (one segment or more).
    Rest,
}

impl Template {
    pub(super) fn parse(template: &str) -> Result<Self, crate::ProxyError> {
        if !template.starts_with('/') {
            return Err(crate::ProxyError::Invalid(format!(
                "route path {template} must start with /"
            )));
        }
        let parts: Vec<&str> = template[1..].split('/').filter(|s| !s.is_empty()).collect();
        let mut segments = Vec::new();
        for (i, s) in parts.iter().enumerate() {
            segments.push(if s.starts_with("{*") && s.ends_with('}') {
                if i + 1 != parts.len() {
                    return Err(crate::ProxyError::Invalid(format!(
                        "route path {template}: {{*…}} must come last"
                    )));
                }
                Segment::Rest
            } else if s.starts_with('{') && s.ends_with('}') {
                Segment::Param
            } else {
                Segment::Literal((*s).to_owned())
            });
        }
        Ok(Self { segments })
    }

    /// Matches `path` (the request's, as sent).
    pub(super) fn matches(&self, path: &str) -> PathMatch {
        let raw: Vec<&str> = match path {
            "/" | "" => Vec::new(),
            _ => path.strip_prefix('/').unwrap_or(path).split('/').collect(),
        };
        if self.fits(&raw, |lit, seg| lit == seg) && !raw.iter().any(|s| s.is_empty()) && canonical(path) {
            return PathMatch::Exact;
        }
        let normal = normalise(path);
        let normal: Vec<&str> = normal.iter().map(String::as_str).collect();
        if self.fits(&normal, |lit, seg| lit.eq_ignore_ascii_case(seg)) {
            PathMatch::Ambiguous
        } else {
            PathMatch::No
        }
    }

    fn fits(&self, segs: &[&str], same: impl Fn(&str, &str) -> bool) -> bool {
        let mut i = 0;
        for s in &self.segments {
            match s {
                Segment::Rest => return i < segs.len() && segs[i..].iter().all(|s| !s.is_empty()),
                Segment::Param if i < segs.len() && !segs[i].is_empty() => {}
                Segment::Literal(l) if i < segs.len() && same(l, segs[i]) => {}
                _ => return false,
            }
            i += 1;
        }
        i == segs.len()
    }
}

/// Whether every segment of `path` is spelt in its one normal form: no `.`
/// or `..`, no `;`, no percent-encoded unreserved character, upper-case hex.
fn canonical(path: &str) -> bool {
    path.strip_prefix('/')
        .unwrap_or(path)
        .split('/')
        .all(|s| s != "." && s != ".." && !s.contains(';') && normal_segment(s).as_deref() == Some(s))
}

/// The segments of `path` after normalisation: empty and `.` segments
/// dropped, `..` resolved, `;params` cut, unreserved characters decoded,
/// percent-encoding hex upper-cased.
fn normalise(path: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for s in path.split('/') {
        let s = s.split(';').next().unwrap_or_default();
        let s = normal_segment(s).unwrap_or_else(|| s.to_owned());
        match s.as_str() {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            _ => out.push(s),
        }
    }
    out
}

/// One segment with unreserved characters (RFC 3986 §2.3) decoded and other
/// escapes' hex upper-cased; `None` when an escape is malformed.
fn normal_segment(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = String::with_capacity(s.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            let v = u8::from_str_radix(hex, 16).ok()?;
            if v.is_ascii_alphanumeric() || matches!(v, b'-' | b'.' | b'_' | b'~') {
                out.push(v as char);
            } else {
                out.push('%');
                out.push_str(&hex.to_ascii_uppercase());
            }
            i += 3;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spelling_is_keyed_every_other_refused() {
        let t = Template::parse("/orders/{id}/confirm").unwrap();
        assert_eq!(t.matches("/orders/7/confirm"), PathMatch::Exact);
        assert_eq!(t.matches("/orders/a%20b/confirm"), PathMatch::Exact);
        for variant in [
            "/orders/7/confirm/",
            "/orders/7/%63onfirm",
            "/orders//7/confirm",
            "/orders/7/./confirm",
            "/orders/7/x/../confirm",
            "/orders/7/confirm;x=1",
            "/Orders/7/confirm",
            "/orders/7/CONFIRM",
            "/orders/a%2fb/confirm",
        ] {
            assert_eq!(t.matches(variant), PathMatch::Ambiguous, "{variant}");
        }
        assert_eq!(t.matches("/orders/7"), PathMatch::No);
        assert_eq!(t.matches("/orders/7/cancel"), PathMatch::No);
        let rest = Template::parse("/files/{*path}").unwrap();
        assert_eq!(rest.matches("/files/a/b"), PathMatch::Exact);
        assert_eq!(rest.matches("/files/a//b"), PathMatch::Ambiguous);
        assert_eq!(rest.matches("/files"), PathMatch::No);
    }
}
