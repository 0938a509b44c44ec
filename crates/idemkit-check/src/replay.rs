//! Gate 2: a retry after completion is a faithful, marked replay with no new effect.

use super::{Account, Ctx, Findings, Judgement, NO_PROBE, Unjudged, Variant, count_change, header_title};

/// How many sequential retries the gate sends after the original.
const RETRIES: usize = 2;

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let key = ctx.fresh_key("replay");
    let request = ctx.request(Some(&key), Variant::Template, Account::Main);
    let before = ctx.count(Account::Main).await?;
    let original = ctx.send(request.clone()).await?;
    if !original.is_success() {
        return Err(Unjudged(format!(
            "the template request with a fresh key was answered {}: the gate needs it to succeed (check the template)",
            ctx.describe(&original)
        )));
    }
    let mut retries = Vec::with_capacity(RETRIES);
    for _ in 0..RETRIES {
        retries.push(ctx.send(request.clone()).await?);
    }
    let after = ctx.count(Account::Main).await?;

    let mut findings = Findings::default();
    let marker = ctx.marker();
    if ctx.marked(&original) {
        findings.fail(format!(
            "the first answer to a fresh key already carries `{marker}`"
        ));
    }
    let expected_status = ctx.replay_status(&original);
    for (i, retry) in retries.iter().enumerate() {
        let n = i + 1;
        if retry.status != expected_status {
            findings.fail(format!(
                "retry {n} answered {} instead of {expected_status}{}",
                retry.status,
                if ctx.cfg.replay_status.is_some() {
                    " (the declared replay status)"
                } else {
                    ""
                }
            ));
        }
        if retry.body != original.body {
            findings.fail(format!(
                "retry {n}'s body differs from the original's ({} vs {} bytes)",
                retry.body.len(),
                original.body.len()
            ));
            findings.note(format!("original: {}", ctx.describe(&original)));
            findings.note(format!("retry {n}: {}", ctx.describe(retry)));
        }
        for name in &ctx.cfg.same_headers {
            let want: Vec<_> = original.headers.get_all(name).iter().collect();
            let got: Vec<_> = retry.headers.get_all(name).iter().collect();
            if want != got {
                findings.fail(format!(
                    "retry {n}'s {} is {got:?}, the original's {want:?}",
                    header_title(name)
                ));
            }
        }
        if !ctx.marked(retry) {
            findings.fail(format!("retry {n} lacks the replay marker `{marker}`"));
        }
    }
    match (before, after) {
        (Some(b), Some(a)) if a - b != 1 => findings.fail(format!(
            "one original and {RETRIES} retries made {} effects ({})",
            a - b,
            count_change(before, after)
        )),
        (Some(_), Some(_)) => {}
        _ => findings.unjudged(format!(
            "the retries look like replays, but whether one of them ran again is unseen: {NO_PROBE}"
        )),
    }

    let headers: Vec<String> = ctx
        .cfg
        .same_headers
        .iter()
        .filter(|h| original.headers.contains_key(*h))
        .map(header_title)
        .collect();
    let observed = format!(
        "original {} ({} B); {RETRIES} retries: {}; compared {}; {}",
        original.status,
        original.body.len(),
        ctx.histogram(&retries),
        if headers.is_empty() {
            "body and status only (no allowlisted header present)".to_owned()
        } else {
            format!("body bytes, status, {}", headers.join(", "))
        },
        count_change(before, after)
    );
    findings.finish(observed)
}
