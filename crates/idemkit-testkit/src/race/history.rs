//! The history checker run after each schedule: what the actors saw against
//! what the store holds.

use super::*;

pub(super) async fn check_history(
    h: &History,
    target: &RaceTarget,
    s: &Scope,
    clock: &Arc<ManualClock>,
) -> Result<(), String> {
    // The first request lasts until its first completion plus the window; an
    // attempt claimed after that is a new request under a reused key.
    let first_done = h.completions.first().map(|(t, _)| *t);
    let new_request_from = first_done.map(|t| t.plus(WINDOW));
    let is_first = |claimed: Millis| new_request_from.is_none_or(|from| claimed < from);
    let first_calls = h.calls.iter().filter(|c| is_first(**c)).count();
    let later_calls = h.calls.len() - first_calls;
    if first_calls > 1 || later_calls > 1 {
        return Err(format!(
            "{} external calls for one request (downstream ignores keys): {:?} (first completed at {first_done:?})",
            first_calls.max(later_calls),
            h.calls
        ));
    }
    if let Some((_, first)) = h.completions.first() {
        let first_request: Vec<_> = h
            .completions
            .iter()
            .filter(|(t, r)| is_first(*t) && r != first)
            .collect();
        if !first_request.is_empty() {
            return Err(format!(
                "two completed responses for one request: {first:?} then {first_request:?}"
            ));
        }
        for (at, replayed) in &h.replays {
            if is_first(*at) && replayed != first {
                return Err(format!("replayed {replayed:?}, not the completed {first:?}"));
            }
        }
    }
    let now = clock.now();
    let rec = target.store.get(s).await.map_err(|e| e.to_string())?;
    if let Some(r) = &rec
        && r.state == RecordState::InFlight
        && r.lease_expires_at > now
    {
        return Err(format!("every actor is done, yet the record is held: {r:?}"));
    }
    let unfinished = !h.calls.is_empty() && h.completions.is_empty();
    if unfinished {
        let ok = match &rec {
            Some(r) => matches!(r.state, RecordState::InFlight | RecordState::Parked),
            None => match target.store.review(1000).await {
                Ok(list) => list.iter().any(|e| e.scope == *s),
                Err(StoreError::Unsupported(_)) => false,
                Err(e) => return Err(e.to_string()),
            },
        };
        if !ok {
            return Err(format!(
                "a request that called out never completed and is neither resumable, parked nor listed for review: {rec:?}"
            ));
        }
    }
    Ok(())
}
