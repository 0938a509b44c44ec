//! Gate 3: the same key with a different body is a 4xx conflict, never a replay.

use super::{
    Account, Ctx, Findings, Judgement, NO_PROBE, Signal, Unjudged, Variant, count_change, is_conflict,
};

/// Burst size when no in-progress conflict has been seen yet in this check.
const PROBE_BURST: usize = 16;

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    if !ctx.cfg.template.has_alt() {
        return Err(Unjudged(
            "no second body: the template body is not JSON with a string or number to change; pass --alt-body"
                .into(),
        ));
    }
    let key = ctx.fresh_key("mismatch");
    let original = ctx
        .send(ctx.request(Some(&key), Variant::Template, Account::Main))
        .await?;
    if !original.is_success() {
        return Err(Unjudged(format!(
            "the template request with a fresh key was answered {}: the gate needs it to succeed",
            ctx.describe(&original)
        )));
    }
    let before = ctx.count(Account::Main).await?;
    let other = ctx
        .send(ctx.request(Some(&key), Variant::Alt, Account::Main))
        .await?;
    let after = ctx.count(Account::Main).await?;

    let mut findings = Findings::default();
    findings.note(format!("mismatch answer: {}", ctx.describe(&other)));
    let marker = ctx.marker();
    if other.is_success() {
        if other.body == original.body {
            findings.fail(format!(
                "a different body under a used key got the original's {} back{}: a silent replay, the payload is not fingerprinted",
                other.status,
                if ctx.marked(&other) { format!(" (with `{marker}`)") } else { String::new() }
            ));
        } else {
            findings.fail(format!(
                "a different body under a used key was executed as a new request ({})",
                ctx.describe(&other)
            ));
        }
    } else if !(400..500).contains(&other.status) {
        findings.fail(format!(
            "a mismatch must be a 4xx conflict, got {}",
            ctx.describe(&other)
        ));
    } else {
        if ctx.marked(&other) {
            findings.fail(format!(
                "the mismatch answer carries the replay marker `{marker}`"
            ));
        }
        if other.body == original.body {
            findings.fail("the mismatch answer repeats the original's body");
        }
        let signal = Signal::of(&other);
        ctx.record_mismatch(signal.clone());
        let mut in_progress = ctx.in_progress_signals();
        if in_progress.is_empty() {
            // Nothing seen yet in this check: provoke a few duplicates to learn it.
            let probe_key = ctx.fresh_key("mismatch-overlap");
            let probe = ctx.request(Some(&probe_key), Variant::Template, Account::Main);
            for a in ctx
                .burst(&probe, PROBE_BURST)
                .await?
                .iter()
                .filter(|a| is_conflict(a))
            {
                ctx.record_in_progress(Signal::of(a));
            }
            in_progress = ctx.in_progress_signals();
        }
        match in_progress.iter().find(|s| !signal.distinct_from(s)) {
            Some(same) => findings.fail(format!(
                "the mismatch conflict ({signal}) is the same as the conflict identical in-flight duplicates got ({same}): a client cannot tell a reused key from one still running"
            )),
            None if in_progress.is_empty() => findings.note(
                "no in-progress conflict was observed in this check, so the codes could not be compared",
            ),
            None => {}
        }
    }
    match (before, after) {
        (Some(b), Some(a)) if a != b => findings.fail(format!(
            "the different body made {} effect(s) under the used key ({})",
            a - b,
            count_change(before, after)
        )),
        (Some(_), Some(_)) => {}
        _ => findings.unjudged(format!(
            "whether the different body ran under the used key is unseen: {NO_PROBE}"
        )),
    }

    // The second body must be acceptable on its own, or its refusal proves nothing.
    let alone = ctx
        .send(ctx.request(Some(&ctx.fresh_key("mismatch-alt")), Variant::Alt, Account::Main))
        .await?;
    if !alone.is_success() && findings.failures.is_empty() {
        findings.unjudged(format!(
            "the second body is refused on its own too ({}), so the conflict may be validation, not a mismatch: pass a valid --alt-body",
            ctx.describe(&alone)
        ));
    }

    let in_progress: Vec<String> = ctx
        .in_progress_signals()
        .iter()
        .map(ToString::to_string)
        .collect();
    let observed = format!(
        "original {}; same key, different body → {}{}; the second body alone → {}; {}",
        original.status,
        ctx.label(&other),
        if in_progress.is_empty() {
            String::new()
        } else {
            format!(" (in-progress conflicts seen: {})", in_progress.join(", "))
        },
        alone.status,
        count_change(before, after)
    );
    findings.finish(observed)
}
