//! Gate 4: duplicates that overlap a running request get the in-progress conflict
//! or wait for the identical replay.
//!
//! Overlap is provoked by starting the request and its duplicates together, and is
//! proven two ways:
//!
//! - a duplicate refused with a conflict was, by the server's own word, in flight
//!   with the original;
//! - a duplicate answered with the replay although it was sent at least
//!   [`WAIT_PROOF`] before the original's answer arrived was held until the original
//!   finished: it waited (far more than loopback or scheduling delays explain).
//!
//! A replay sent closer to the original's answer either waited or arrived after the
//! original finished, and a black box cannot tell which. Rounds made only of such
//! replays prove nothing: after [`ROUNDS`] of them the gate is inconclusive, never a
//! pass.

use std::time::Duration;

use super::{Account, Ctx, Findings, Judgement, Signal, Timed, Unjudged, Variant, is_conflict};

/// How many bursts the gate tries before calling overlap unprovoked.
const ROUNDS: usize = 5;

/// How long before the original's answer a duplicate must have been sent for its
/// replay to count as a wait.
const WAIT_PROOF: Duration = Duration::from_millis(100);

pub(super) async fn run(ctx: &Ctx<'_>) -> Result<Judgement, Unjudged> {
    let n = ctx.cfg.concurrency;
    let mut findings = Findings::default();
    let mut mismatch = ctx.mismatch_signal();
    // Whether a different body under a used key was tried and not refused with a 4xx:
    // then no mismatch conflict exists to be confused with (the mismatch gate judges that).
    let mut mismatch_absent = None;
    let mut rounds = Vec::new();
    for round in 1..=ROUNDS {
        let key = ctx.fresh_key("in-progress");
        let request = ctx.request(Some(&key), Variant::Template, Account::Main);
        let answers = ctx.timed_burst(&request, n).await?;
        let Some(original) = pick_original(ctx, &answers) else {
            return Err(Unjudged(format!(
                "no request of the burst succeeded ({}): check the request template",
                ctx.histogram(answers.iter().map(|t| &t.answer))
            )));
        };
        if mismatch.is_none() && ctx.cfg.template.has_alt() {
            // Learn the mismatch conflict on this very key, to compare codes.
            let other = ctx
                .send(ctx.request(Some(&key), Variant::Alt, Account::Main))
                .await?;
            if (400..500).contains(&other.status) {
                mismatch = Some(Signal::of(&other));
            } else {
                mismatch_absent = Some(other.status);
            }
        }

        let mut replays = 0;
        let mut waited = 0;
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for t in answers.iter().filter(|t| !std::ptr::eq(*t, original)) {
            let a = &t.answer;
            if ctx.same_as(a, &original.answer) {
                replays += 1;
                if original.received.saturating_duration_since(t.sent) >= WAIT_PROOF {
                    waited += 1;
                }
            } else if is_conflict(a) {
                let signal = Signal::of(a);
                let mut wrong = Vec::new();
                if a.header("retry-after").is_none_or(|v| v.trim().is_empty()) {
                    wrong.push("no Retry-After".to_owned());
                }
                if let Some(m) = &mismatch
                    && !signal.distinct_from(m)
                {
                    wrong.push(format!("the same status and code as the mismatch conflict ({m})"));
                }
                if wrong.is_empty() {
                    good.push(a);
                } else {
                    bad.push((a, wrong.join(" and ")));
                }
            } else if a.is_success() {
                bad.push((
                    a,
                    "a different successful answer: it ran as a new request".to_owned(),
                ));
            } else {
                bad.push((a, "neither the in-progress conflict nor the replay".to_owned()));
            }
        }
        let took = original.received.saturating_duration_since(original.sent);
        rounds.push(format!(
            "round {round}: the original ({} ms) and {} duplicates at once → {replays} identical replay(s){}, {}, {} wrong",
            took.as_millis(),
            answers.len() - 1,
            if waited > 0 {
                format!(" ({waited} sent ≥ {} ms before the original's answer: they waited)", WAIT_PROOF.as_millis())
            } else {
                String::new()
            },
            if good.is_empty() {
                "no in-progress conflict".to_owned()
            } else {
                ctx.histogram(good.iter().copied())
            },
            bad.len()
        ));
        if !bad.is_empty() {
            let mut reasons: Vec<String> = Vec::new();
            for (a, why) in &bad {
                let line = format!("{} — {why}", ctx.label(a));
                if !reasons.contains(&line) {
                    reasons.push(line);
                }
            }
            findings.fail(format!(
                "{} of {} overlapping duplicates got a wrong answer: {}",
                bad.len(),
                answers.len() - 1,
                reasons.join("; ")
            ));
            findings.note(format!("original: {}", ctx.describe(&original.answer)));
            findings.note(format!("first wrong answer: {}", ctx.describe(bad[0].0)));
            if bad.iter().any(|(a, _)| is_conflict(a)) && mismatch.is_none() {
                findings.note("the mismatch conflict was not observed, so codes were not compared");
            }
            break;
        }
        if !good.is_empty() || waited > 0 {
            for a in &good {
                ctx.record_in_progress(Signal::of(a));
            }
            if !good.is_empty() {
                match (&mismatch, mismatch_absent) {
                    (Some(_), _) => {}
                    (None, Some(status)) => findings.note(format!(
                        "a different body under the used key got {status}, no conflict, so there is no mismatch code to \
                         confuse the in-progress one with (the mismatch gate judges that answer)"
                    )),
                    (None, None) => findings.unjudged(
                        "no second body to provoke the mismatch conflict, so the in-progress code could not be shown to \
                         differ from it: pass --alt-body",
                    ),
                }
            }
            break;
        }
        if round == ROUNDS {
            findings.unjudged(format!(
                "no overlap provoked in {ROUNDS} rounds: every duplicate got the identical replay, and none was sent \
                 {} ms or more before the original's answer, so each may have waited or arrived after the original \
                 finished (a black box cannot tell); the in-flight state is unjudged",
                WAIT_PROOF.as_millis()
            ));
        }
    }
    if let Some(m) = &mismatch {
        rounds.push(format!("mismatch conflict for comparison: {m}"));
    }
    findings.finish(rounds.join("; "))
}

/// The answer that looks original: the first answered success without the replay
/// marker, else the first answered success.
fn pick_original<'a>(ctx: &Ctx<'_>, answers: &'a [Timed]) -> Option<&'a Timed> {
    let first = |unmarked: bool| {
        answers
            .iter()
            .filter(|t| t.answer.is_success() && (!unmarked || !ctx.marked(&t.answer)))
            .min_by_key(|t| t.received)
    };
    first(true).or_else(|| first(false))
}
