//! Gate 6: the same key from another account is a separate effect, never the first
//! account's stored response.

use super::{Account, Ctx, Findings, Judgement, NO_PROBE, Unjudged, Variant, count_change, header_title};

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let Some((header, _)) = &ctx.cfg.other_account else {
        return Err(Unjudged(
            "no second account: pass --other-account-header 'Authorization: Bearer <other account>'".into(),
        ));
    };
    let header = header_title(header);
    let key = ctx.fresh_key("isolation");
    let mine_before = ctx.count(Account::Main).await?;
    let other_before = ctx.count(Account::Other).await?;
    let mine = ctx
        .send(ctx.request(Some(&key), Variant::Template, Account::Main))
        .await?;
    if !mine.is_success() {
        return Err(Unjudged(format!(
            "the template request with a fresh key was answered {}: the gate needs it to succeed",
            ctx.describe(&mine)
        )));
    }
    let mine_between = ctx.count(Account::Main).await?;
    let other_between = ctx.count(Account::Other).await?;
    let theirs = ctx
        .send(ctx.request(Some(&key), Variant::Template, Account::Other))
        .await?;
    let mine_after = ctx.count(Account::Main).await?;
    let other_after = ctx.count(Account::Other).await?;

    let mut findings = Findings::default();
    let marker = ctx.marker();
    if matches!(theirs.status, 401 | 403) {
        return Err(Unjudged(format!(
            "the other account's credentials ({header}) were refused: {}",
            ctx.describe(&theirs)
        )));
    }
    let mut other_final = other_after;
    if !theirs.is_success() {
        findings.fail(format!(
            "the same key from another account was refused ({}): the key is not scoped by account",
            ctx.describe(&theirs)
        ));
    } else {
        if ctx.marked(&theirs) {
            findings.fail(format!(
                "the other account got a replay (`{marker}`): it was served the first account's stored response"
            ));
        }
        let same_body = theirs.body == mine.body;
        if let (Some(a), Some(b)) = (ctx.id_of(&mine), ctx.id_of(&theirs))
            && a == b
        {
            findings.fail(format!(
                "both accounts' answers show resource id {a}: one effect shared across accounts"
            ));
        } else if same_body && !ctx.has_count() && !ctx.has_ids() {
            findings.fail(
                "the other account got a byte-identical answer: the first account's stored response (or an answer \
                 that names nothing; pass --count-url to tell)",
            );
        }
        // Its own retry must replay its own answer, not the first account's.
        let again = ctx
            .send(ctx.request(Some(&key), Variant::Template, Account::Other))
            .await?;
        other_final = ctx.count(Account::Other).await?;
        if !ctx.same_as(&again, &theirs) {
            findings.fail(format!(
                "the other account's retry did not replay its own answer: got {}",
                ctx.describe(&again)
            ));
        } else if !same_body && again.body == mine.body {
            findings.fail("the other account's retry replayed the first account's answer");
        }
    }
    let counts = (
        mine_before,
        mine_between,
        mine_after,
        other_before,
        other_between,
        other_after,
        other_final,
    );
    let mut shared = false;
    if let (Some(mb), Some(mm), Some(ma), Some(ob), Some(om), Some(oa), Some(of)) = counts {
        // A probe that counts for everyone (the courier's shipments) answers both
        // accounts alike: this account's one effect moves "the other account's"
        // count too. Judged by the total then: each request one effect, the retry none.
        shared = mm - mb == 1 && om - ob == 1 && mb == ob && mm == om;
        if shared {
            findings.note(
                "the count probe answers the same count for both accounts (this account's request moved both): \
                 judged by the total, one effect per account's request; which account an effect was booked to is \
                 not seen",
            );
            if ma - mm != 1 {
                findings.fail(format!(
                    "the other account's request made {} effect(s) (the shared {})",
                    ma - mm,
                    count_change(mine_between, mine_after)
                ));
            }
        } else {
            if mm - mb != 1 {
                findings.fail(format!(
                    "this account's request made {} effect(s) ({})",
                    mm - mb,
                    count_change(mine_before, mine_between)
                ));
            }
            if om != ob {
                findings.fail(format!(
                    "this account's request changed the other account's count ({})",
                    count_change(other_before, other_between)
                ));
            }
            if oa - om != 1 {
                findings.fail(format!(
                    "the other account's request made {} effect(s) for it ({})",
                    oa - om,
                    count_change(other_between, other_after)
                ));
            }
            if ma != mm {
                findings.fail(format!(
                    "the other account's request changed this account's count ({})",
                    count_change(mine_between, mine_after)
                ));
            }
        }
        if of != oa {
            findings.fail(format!(
                "the other account's retry made {} effect(s) ({})",
                of - oa,
                count_change(other_after, other_final)
            ));
        }
    } else {
        findings.unjudged(format!(
            "the answers differ, but whether the other account got its own effect is unseen: {NO_PROBE}"
        ));
    }

    let counted = if shared {
        format!("shared {}", count_change(mine_before, other_final))
    } else {
        format!(
            "this account {}, other account {}",
            count_change(mine_before, mine_after),
            count_change(other_before, other_final)
        )
    };
    findings.finish(format!(
        "this account → {}; the other account ({header} replaced), same key → {}; {counted}",
        ctx.label(&mine),
        ctx.describe(&theirs),
    ))
}
