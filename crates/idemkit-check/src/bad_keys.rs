//! Gate 5: missing, empty, oversized and control-character keys are refused with no
//! effect.

use super::{
    Account, Ctx, Findings, Judgement, NO_PROBE, OVERSIZED_KEY_LEN, Unjudged, Variant, count_change,
};

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let mut oversized = format!("idemkit-check-oversized-{unique}-");
    while oversized.len() < OVERSIZED_KEY_LEN {
        oversized.push('k');
    }
    let cases: [(&str, Option<String>); 4] = [
        ("missing", None),
        ("empty", Some(String::new())),
        ("256 characters", Some(oversized)),
        ("control character", Some(ctx.cfg.template.control_key(&unique))),
    ];
    let before = ctx.count(Account::Main).await?;
    let mut findings = Findings::default();
    let mut seen = Vec::new();
    for (name, key) in &cases {
        let answer = ctx
            .send(ctx.request(key.as_deref(), Variant::Template, Account::Main))
            .await?;
        if answer.is_success() {
            findings.fail(format!("the {name} key was accepted: {}", ctx.describe(&answer)));
        } else if !(400..500).contains(&answer.status) {
            findings.fail(format!("the {name} key got {}, not a 4xx", ctx.describe(&answer)));
        }
        seen.push(format!("{name} → {}", ctx.label(&answer)));
    }
    let after = ctx.count(Account::Main).await?;
    match (before, after) {
        (Some(b), Some(a)) if a != b => findings.fail(format!(
            "the refused keys left {} effect(s) ({})",
            a - b,
            count_change(before, after)
        )),
        (Some(_), Some(_)) => {}
        _ => findings.unjudged(format!(
            "the answers are judged, but whether a refused key left an effect is unseen: {NO_PROBE}"
        )),
    }
    findings.finish(format!("{}; {}", seen.join(", "), count_change(before, after)))
}
