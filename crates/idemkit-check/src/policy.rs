//! Gate 9: the endpoint does what its published policy (`x-idempotency`, see
//! `docs/x-idempotency.md`) says: the key is read where the policy puts it, replays
//! carry the published status and marker, and the mismatch, in-progress, missing-key
//! and invalid-key answers have the published statuses and codes. Every difference is
//! a failure, named with both sides.

use http::HeaderName;

use super::{
    Account, Answer, Ctx, Findings, Judgement, KeyPlacement, OVERSIZED_KEY_LEN, Unjudged, Variant, code_of,
    header_title, is_conflict,
};

/// An answer the policy publishes: a status and, when published, a machine code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expected {
    /// The HTTP status.
    pub status: u16,
    /// The machine code (`code` of a problem document), when the policy names one.
    pub code: Option<String>,
}

impl Expected {
    /// A status and code.
    pub fn new(status: u16, code: Option<&str>) -> Self {
        Self {
            status,
            code: code.map(str::to_owned),
        }
    }

    fn show(&self) -> String {
        match &self.code {
            Some(c) => format!("{} {c}", self.status),
            None => self.status.to_string(),
        }
    }

    /// Why `answer` is not this, if it is not.
    fn differs(&self, answer: &Answer) -> Option<String> {
        let code = code_of(answer);
        let status_ok = answer.status == self.status;
        let code_ok = self.code.is_none() || code == self.code;
        (!status_ok || !code_ok).then(|| {
            format!(
                "{} {}",
                answer.status,
                code.unwrap_or_else(|| "(no code)".to_owned())
            )
        })
    }
}

/// What an endpoint publishes about its idempotency, as the gates compare it.
#[derive(Debug, Clone)]
pub struct Published {
    /// Where the key travels.
    pub key: KeyPlacement,
    /// The status of a replayed 2xx (`None`: the stored status).
    pub replay_status: Option<u16>,
    /// The replay marker: header and value (`None`: not published, not compared).
    pub replay_marker: Option<(HeaderName, String)>,
    /// A different request under a used key.
    pub mismatch: Option<Expected>,
    /// A duplicate of a request still in flight.
    pub in_progress: Option<Expected>,
    /// Whether duplicates wait for the first answer (`inFlight.behavior: wait`), so
    /// seeing no in-progress answer is no gap.
    pub duplicates_wait: bool,
    /// Whether the in-progress answer carries `Retry-After`.
    pub retry_after: bool,
    /// No key.
    pub key_missing: Option<Expected>,
    /// A malformed key.
    pub key_invalid: Option<Expected>,
    /// Where the policy came from, for the evidence.
    pub source: String,
}

fn key_text(key: &KeyPlacement) -> String {
    match key {
        KeyPlacement::Header(h) => format!("header {}", header_title(h)),
        KeyPlacement::Field(p) => format!("body field {p}"),
    }
}

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let Some(p) = &ctx.cfg.published else {
        return Err(Unjudged(
            "no published policy to compare with: pass --policy URL (an OpenAPI document with x-idempotency, \
             or its JSON policy)"
                .into(),
        ));
    };
    let mut findings = Findings::default();
    let mut seen = Vec::new();
    let template_key = ctx.cfg.template.key();
    if template_key != &p.key {
        findings.fail(format!(
            "key location: the policy publishes the {}, the check was told the {}",
            key_text(&p.key),
            key_text(template_key)
        ));
    }

    // Key location, replay status and marker: a fresh key, then the same request.
    let key = ctx.fresh_key("policy");
    let request = ctx.request(Some(&key), Variant::Template, Account::Main);
    let original = ctx.send(request.clone()).await?;
    if !original.is_success() {
        return Err(Unjudged(format!(
            "the template request with a fresh key in the {} was answered {}: the gate needs it to succeed",
            key_text(template_key),
            ctx.describe(&original)
        )));
    }
    let retry = ctx.send(request).await?;
    if retry.body != original.body {
        findings.fail(format!(
            "key location: a retry with the key in the published {} was not replayed (got {}): the key is not \
             read from there",
            key_text(&p.key),
            ctx.describe(&retry)
        ));
    } else {
        let want = p.replay_status.unwrap_or(original.status);
        if retry.status != want {
            findings.fail(format!(
                "replay status: published {}, observed {}",
                p.replay_status
                    .map_or_else(|| format!("the stored status ({want})"), |s| s.to_string()),
                retry.status
            ));
        }
        if let Some((marker_name, marker_value)) = &p.replay_marker
            && !retry
                .headers
                .get(marker_name)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.trim().eq_ignore_ascii_case(marker_value))
        {
            findings.fail(format!(
                "replay marker: published `{}: {marker_value}`, the replay carried {}",
                header_title(marker_name),
                retry
                    .headers
                    .get(marker_name)
                    .and_then(|v| v.to_str().ok())
                    .map_or_else(|| "no such header".to_owned(), |v| format!("`{v}`"))
            ));
        }
    }
    seen.push(format!(
        "key in the {} → {}, retry → {}",
        key_text(&p.key),
        original.status,
        ctx.label(&retry)
    ));

    // The mismatch conflict.
    if let Some(mismatch) = &p.mismatch
        && ctx.cfg.template.has_alt()
    {
        let other = ctx
            .send(ctx.request(Some(&key), Variant::Alt, Account::Main))
            .await?;
        if let Some(got) = mismatch.differs(&other) {
            // As the mismatch gate does: a second body refused on its own too says
            // nothing about mismatches (it may be validation), so it is not compared.
            let alone = if other.is_success() {
                None
            } else {
                let fresh = ctx.fresh_key("policy-alt");
                Some(
                    ctx.send(ctx.request(Some(&fresh), Variant::Alt, Account::Main))
                        .await?,
                )
            };
            match alone {
                Some(alone) if !alone.is_success() => findings.unjudged(format!(
                    "the mismatch answer was not compared: the second body is refused on its own too ({}), so \
                     {got} may be validation, not a mismatch: pass a valid --alt-body",
                    ctx.describe(&alone)
                )),
                _ => findings.fail(format!("mismatch: published {}, observed {got}", mismatch.show())),
            }
        }
        seen.push(format!("mismatch → {}", ctx.label(&other)));
    } else if p.mismatch.is_some() {
        findings.unjudged("the mismatch answer was not compared: no second body (pass --alt-body)");
    }

    // Missing and malformed keys.
    for (name, expected, key) in [
        ("missing key", &p.key_missing, None),
        (
            "invalid key",
            &p.key_invalid,
            Some(format!(
                "{:k<OVERSIZED_KEY_LEN$}",
                ctx.fresh_key("policy-invalid")
            )),
        ),
    ] {
        let Some(expected) = expected else { continue };
        let answer = ctx
            .send(ctx.request(key.as_deref(), Variant::Template, Account::Main))
            .await?;
        if let Some(got) = expected.differs(&answer) {
            findings.fail(format!("{name}: published {}, observed {got}", expected.show()));
        }
        seen.push(format!("{name} → {}", ctx.label(&answer)));
    }

    // The in-flight answer: duplicates started together with the original.
    let burst_key = ctx.fresh_key("policy-in-progress");
    let burst = ctx
        .burst(
            &ctx.request(Some(&burst_key), Variant::Template, Account::Main),
            ctx.cfg.concurrency,
        )
        .await?;
    let conflicts: Vec<&Answer> = burst.iter().filter(|a| is_conflict(a)).collect();
    match (&p.in_progress, conflicts.first()) {
        (Some(expected), Some(_)) => {
            let mut wrong: Vec<String> = Vec::new();
            for a in &conflicts {
                if let Some(got) = expected.differs(a) {
                    let line = format!("observed {got}");
                    if !wrong.contains(&line) {
                        wrong.push(line);
                    }
                } else if p.retry_after && a.header("retry-after").is_none_or(|v| v.trim().is_empty()) {
                    let line = "no Retry-After".to_owned();
                    if !wrong.contains(&line) {
                        wrong.push(line);
                    }
                }
            }
            if !wrong.is_empty() {
                findings.fail(format!(
                    "in progress: published {}{}, {}",
                    expected.show(),
                    if p.retry_after { " with Retry-After" } else { "" },
                    wrong.join(", ")
                ));
            }
        }
        (Some(_), None) if p.duplicates_wait => {}
        (Some(expected), None) => findings.unjudged(format!(
            "in progress: the published {} was not observed ({} duplicates at once all got {}): no overlap provoked",
            expected.show(),
            burst.len(),
            ctx.histogram(&burst)
        )),
        (None, Some(a)) => findings.note(format!(
            "in progress: the policy publishes no in-progress answer; a duplicate got {}",
            ctx.describe(a)
        )),
        (None, None) => {}
    }
    seen.push(format!("{} at once → {}", burst.len(), ctx.histogram(&burst)));

    findings.finish(format!("policy from {}: {}", p.source, seen.join("; ")))
}
