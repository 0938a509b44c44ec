//! Gate 7: a fresh key is a new effect; the same JSON with members reordered under a
//! used key is a replay, not a mismatch.

use super::{Account, Ctx, Findings, Judgement, NO_PROBE, Unjudged, Variant, count_change};

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let mut findings = Findings::default();
    let c0 = ctx.count(Account::Main).await?;
    let first = ctx
        .send(ctx.request(Some(&ctx.fresh_key("fresh-1")), Variant::Template, Account::Main))
        .await?;
    if !first.is_success() {
        return Err(Unjudged(format!(
            "the template request with a fresh key was answered {}: the gate needs it to succeed",
            ctx.describe(&first)
        )));
    }
    let c1 = ctx.count(Account::Main).await?;
    let key = ctx.fresh_key("fresh-2");
    let second = ctx
        .send(ctx.request(Some(&key), Variant::Template, Account::Main))
        .await?;
    let c2 = ctx.count(Account::Main).await?;

    for (name, answer, before, after) in [("first", &first, c0, c1), ("second", &second, c1, c2)] {
        if !answer.is_success() {
            findings.fail(format!(
                "the {name} fresh key was answered {}",
                ctx.describe(answer)
            ));
        } else if ctx.marked(answer) {
            findings.fail(format!(
                "the {name} fresh key got a replay: the server matched it to an earlier request (a key derived from the payload?)"
            ));
        }
        if let (Some(b), Some(a)) = (before, after)
            && a - b != 1
        {
            findings.fail(if a == b && answer.is_success() {
                format!(
                    "the {name} fresh key was answered {} but made no effect ({}): acknowledged and never applied, worse than no key support",
                    answer.status,
                    count_change(before, after)
                )
            } else {
                format!("the {name} fresh key made {} effects ({})", a - b, count_change(before, after))
            });
        }
    }
    if let (Some(a), Some(b)) = (ctx.id_of(&first), ctx.id_of(&second))
        && a == b
    {
        findings.fail(format!("two fresh keys produced the same resource id {a}"));
    }
    if second.is_success() && second.body == first.body && !ctx.has_count() && !ctx.has_ids() {
        findings.unjudged(format!("two fresh keys got byte-identical answers: {NO_PROBE}"));
    } else if !ctx.has_count() {
        findings.unjudged(format!(
            "whether each fresh key made an effect is unseen: {NO_PROBE}"
        ));
    }

    let reorder = if ctx.cfg.template.reorderable() {
        let reordered = ctx
            .send(ctx.request(Some(&key), Variant::Reordered, Account::Main))
            .await?;
        let c3 = ctx.count(Account::Main).await?;
        if second.is_success() {
            if reordered.is_success() && ctx.same_as(&reordered, &second) {
                if !ctx.marked(&reordered) {
                    findings.fail(format!(
                        "the reordered body got the same answer without the replay marker `{}`",
                        ctx.marker()
                    ));
                }
            } else if (400..500).contains(&reordered.status) {
                findings.fail(format!(
                    "the same JSON with members reordered was refused ({}): the fingerprint covers raw bytes, not canonical JSON",
                    ctx.describe(&reordered)
                ));
            } else {
                findings.fail(format!(
                    "the same JSON with members reordered did not replay the answer: {}",
                    ctx.describe(&reordered)
                ));
            }
        }
        if let (Some(b), Some(a)) = (c2, c3)
            && a != b
        {
            findings.fail(format!(
                "the reordered body made {} new effect(s) ({})",
                a - b,
                count_change(c2, c3)
            ));
        }
        format!("same key, members reordered → {}", ctx.label(&reordered))
    } else {
        findings.unjudged(
            "the key-order half needs a JSON body with an object of two members or more; this template has none",
        );
        "key order not tested".to_owned()
    };
    findings.finish(format!(
        "fresh key → {}, another fresh key → {} ({}); {reorder}",
        ctx.label(&first),
        ctx.label(&second),
        count_change(c0, c2)
    ))
}
