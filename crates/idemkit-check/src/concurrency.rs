//! Gate 1: N identical requests with one fresh key at once → one effect.

use super::{
    Account, Answer, Ctx, Findings, Judgement, NO_PROBE, Signal, Unjudged, Variant, count_change, is_conflict,
};

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let n = ctx.cfg.concurrency;
    let key = ctx.fresh_key("concurrency");
    let before = ctx.count(Account::Main).await?;
    let request = ctx.request(Some(&key), Variant::Template, Account::Main);
    let answers = ctx.burst(&request, n).await?;
    let after = ctx.count(Account::Main).await?;

    let observed = format!(
        "{n} identical requests with one key at once, {}: {}",
        count_change(before, after),
        ctx.histogram(&answers)
    );
    let mut findings = Findings::default();
    let successes: Vec<&Answer> = answers.iter().filter(|a| a.is_success()).collect();
    if successes.is_empty() {
        findings.unjudged("no request succeeded, so there is no effect to count: check the request template");
        return findings.finish(observed);
    }

    // Every successful answer must be the same answer: one original and its replays.
    let mut outcomes: Vec<&Answer> = Vec::new();
    for a in &successes {
        if !outcomes.iter().any(|o| o.body == a.body) {
            outcomes.push(a);
        }
    }
    if outcomes.len() > 1 {
        let ids: Vec<String> = outcomes.iter().filter_map(|a| ctx.id_of(a)).collect();
        let ids = if ids.is_empty() {
            String::new()
        } else {
            format!(" (ids {})", ids.join(", "))
        };
        findings.fail(format!(
            "{} different successful answers to one key{ids}: duplicates ran as new requests (check-then-insert race?)",
            outcomes.len()
        ));
        for o in outcomes.iter().take(3) {
            findings.note(format!("successful answer: {}", ctx.describe(o)));
        }
    }

    let odd: Vec<&Answer> = answers
        .iter()
        .filter(|a| !a.is_success() && !is_conflict(a))
        .collect();
    if !odd.is_empty() {
        findings.fail(format!(
            "{} answers were neither a replay nor a conflict ({})",
            odd.len(),
            ctx.histogram(odd.iter().copied())
        ));
        findings.note(format!("first odd answer: {}", ctx.describe(odd[0])));
    }

    for a in answers.iter().filter(|a| is_conflict(a)) {
        ctx.record_in_progress(Signal::of(a));
    }

    match (before, after) {
        (Some(b), Some(a)) => {
            let effects = a - b;
            if effects > 1 {
                findings.fail(format!("{effects} effects for one key ({})", count_change(before, after)));
            } else if effects < 1 {
                findings.fail(format!(
                    "a {} was answered but the probe shows no effect ({}): the write was acknowledged and not applied",
                    successes[0].status,
                    count_change(before, after)
                ));
            }
        }
        _ => findings.unjudged(format!(
            "the answers are consistent with one effect, but an effect behind a replay or a conflict cannot be seen: {NO_PROBE}"
        )),
    }
    findings.note("the conflicts' codes and Retry-After are judged by the in-progress gate");
    findings.finish(observed)
}
