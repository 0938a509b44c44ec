//! Gates, verdicts and the report a check produces.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// One black-box gate (the contract's measurements and the key, fingerprint and scope rules they rest on).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Gate {
    /// N identical requests with one fresh key at once → one effect; every other
    /// answer is an identical replay or a conflict.
    Concurrency,
    /// A retry after completion replays status (or the declared replay status), body
    /// bytes and allowlisted headers, with the replay marker, and runs nothing again.
    Replay,
    /// The same key with a different body → a 4xx conflict, no effect, not a replay,
    /// and a code that differs from the in-progress one.
    Mismatch,
    /// Duplicates overlapping a running request get the in-progress conflict (distinct
    /// code, `Retry-After`) or wait for the identical replay.
    InProgress,
    /// Missing, empty, oversized (256) and control-character keys → 4xx, no effect.
    BadKeys,
    /// The same key from another account → a separate effect, never the first
    /// account's stored response.
    Isolation,
    /// A fresh key → a new effect; the same JSON with members reordered under a used
    /// key → a replay, not a mismatch.
    FreshKey,
    /// The same request twice without a key leaves the state as the first left it: a
    /// PUT, PATCH or DELETE (or any route said to be idempotent) is verified, not
    /// trusted.
    ClaimedIdempotent,
    /// The endpoint does what its published `x-idempotency` policy says (key location,
    /// replay status and marker, conflict statuses and codes).
    Policy,
}

impl Gate {
    /// Every gate, in the order a check runs them.
    pub const ALL: [Gate; 9] = [
        Gate::Concurrency,
        Gate::Replay,
        Gate::Mismatch,
        Gate::InProgress,
        Gate::BadKeys,
        Gate::Isolation,
        Gate::FreshKey,
        Gate::ClaimedIdempotent,
        Gate::Policy,
    ];

    /// The gates every keyed endpoint is checked with (1–7); gate 8 is added for
    /// methods that claim idempotency, gate 9 when a published policy is given.
    pub const KEYED: [Gate; 7] = [
        Gate::Concurrency,
        Gate::Replay,
        Gate::Mismatch,
        Gate::InProgress,
        Gate::BadKeys,
        Gate::Isolation,
        Gate::FreshKey,
    ];

    /// The gate's number (1–9), as in the documentation.
    pub const fn number(self) -> u8 {
        match self {
            Gate::Concurrency => 1,
            Gate::Replay => 2,
            Gate::Mismatch => 3,
            Gate::InProgress => 4,
            Gate::BadKeys => 5,
            Gate::Isolation => 6,
            Gate::FreshKey => 7,
            Gate::ClaimedIdempotent => 8,
            Gate::Policy => 9,
        }
    }

    /// The gate's name, as accepted by `--gates` and printed in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Gate::Concurrency => "concurrency",
            Gate::Replay => "replay",
            Gate::Mismatch => "mismatch",
            Gate::InProgress => "in-progress",
            Gate::BadKeys => "bad-keys",
            Gate::Isolation => "isolation",
            Gate::FreshKey => "fresh-key",
            Gate::ClaimedIdempotent => "claimed-idempotent",
            Gate::Policy => "policy",
        }
    }

    /// One line: what passing the gate shows.
    pub const fn asserts(self) -> &'static str {
        match self {
            Gate::Concurrency => {
                "N identical requests with one fresh key at once make one effect; every other answer is an identical replay or a conflict"
            }
            Gate::Replay => {
                "a retry replays status, body bytes and allowlisted headers with the replay marker, and runs nothing again"
            }
            Gate::Mismatch => {
                "the same key with a different body is a 4xx conflict, not a replay, no effect, with a code unlike the in-progress one"
            }
            Gate::InProgress => {
                "duplicates overlapping a running request get the in-progress conflict (distinct code, Retry-After) or the identical replay"
            }
            Gate::BadKeys => {
                "missing, empty, 256-character and control-character keys are refused (4xx) with no effect"
            }
            Gate::Isolation => {
                "the same key from another account is a separate effect, never the first account's stored response"
            }
            Gate::FreshKey => {
                "a fresh key makes a new effect; reordered JSON members under a used key replay, not mismatch"
            }
            Gate::ClaimedIdempotent => {
                "the same request twice without a key leaves the state as the first one left it (the method is not trusted)"
            }
            Gate::Policy => {
                "the endpoint does what its published x-idempotency policy says: key location, replay status and marker, conflict statuses and codes"
            }
        }
    }
}

impl fmt::Display for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A `--gates` entry that names no gate.
#[derive(Debug, Clone, thiserror::Error)]
#[error(
    "unknown gate `{0}`: use a number 1-9 or one of concurrency, replay, mismatch, in-progress, bad-keys, isolation, fresh-key, claimed-idempotent, policy"
)]
pub struct UnknownGate(pub String);

impl FromStr for Gate {
    type Err = UnknownGate;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let wanted = s.trim().to_ascii_lowercase().replace('_', "-");
        Gate::ALL
            .into_iter()
            .find(|g| g.name() == wanted || g.number().to_string() == wanted)
            .ok_or_else(|| UnknownGate(s.to_owned()))
    }
}

/// What a gate concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    /// Everything the gate asserts was observed.
    Pass,
    /// The API broke what the gate asserts; the evidence says how.
    Fail,
    /// The gate could not judge (no probe, no overlap provoked, template refused, no
    /// answer, …). Never counted as a pass.
    Inconclusive,
    /// The gate cannot apply to this kind of API (the `x-idempotency` policy gate
    /// over gRPC): nothing was sent, nothing judged. Never counted as a pass; the
    /// overall verdict is that of the gates that applied.
    NotApplicable,
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Inconclusive => "inconclusive",
            Verdict::NotApplicable => "not-applicable",
        })
    }
}

/// One gate's verdict and the evidence behind it.
#[derive(Debug, Clone, Serialize)]
pub struct GateReport {
    /// The gate.
    pub gate: Gate,
    /// Its number (1–9).
    pub number: u8,
    /// The verdict.
    pub verdict: Verdict,
    /// One paragraph a person can act on: what was sent, what came back.
    pub evidence: String,
    /// Further observations (notes, samples of odd answers).
    pub details: Vec<String>,
    /// How many requests the gate sent (probe reads included).
    pub requests: usize,
}

/// The outcome of a check: one report per selected gate, in run order.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// The reports, in the order the gates ran.
    pub gates: Vec<GateReport>,
}

impl Report {
    /// The overall verdict: `Fail` if any gate failed, else `Inconclusive` if any
    /// gate could not judge (or none that applies ran), else `Pass`. Gates that do
    /// not apply ([`Verdict::NotApplicable`]) count for nothing either way.
    pub fn verdict(&self) -> Verdict {
        let applied = self.gates.iter().filter(|g| g.verdict != Verdict::NotApplicable);
        if self.gates.iter().any(|g| g.verdict == Verdict::Fail) {
            Verdict::Fail
        } else if applied.clone().next().is_none()
            || self.gates.iter().any(|g| g.verdict == Verdict::Inconclusive)
        {
            Verdict::Inconclusive
        } else {
            Verdict::Pass
        }
    }

    /// The process exit code for the overall verdict: 0 pass, 1 fail, 2 inconclusive.
    pub fn exit_code(&self) -> u8 {
        match self.verdict() {
            Verdict::Pass => 0,
            Verdict::Fail => 1,
            // `verdict()` is never `NotApplicable`; nothing judged is not a pass.
            Verdict::Inconclusive | Verdict::NotApplicable => 2,
        }
    }

    /// The report for `gate`, if it ran.
    pub fn gate(&self, gate: Gate) -> Option<&GateReport> {
        self.gates.iter().find(|g| g.gate == gate)
    }

    /// How many gates got `verdict`.
    pub fn count(&self, verdict: Verdict) -> usize {
        self.gates.iter().filter(|g| g.verdict == verdict).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(verdicts: &[(Gate, Verdict)]) -> Report {
        Report {
            gates: verdicts
                .iter()
                .map(|&(gate, verdict)| GateReport {
                    gate,
                    number: gate.number(),
                    verdict,
                    evidence: String::new(),
                    details: Vec::new(),
                    requests: 0,
                })
                .collect(),
        }
    }

    #[test]
    fn not_applicable_gates_neither_pass_nor_fail() {
        let na = (Gate::Policy, Verdict::NotApplicable);
        let r = report(&[(Gate::Concurrency, Verdict::Pass), na]);
        assert_eq!((r.verdict(), r.exit_code()), (Verdict::Pass, 0));
        assert_eq!(r.count(Verdict::NotApplicable), 1);
        let r = report(&[(Gate::Concurrency, Verdict::Fail), na]);
        assert_eq!(r.exit_code(), 1);
        let r = report(&[(Gate::Concurrency, Verdict::Inconclusive), na]);
        assert_eq!(r.exit_code(), 2);
        // Nothing that applied ran: nothing was judged, never a pass.
        let r = report(&[na]);
        assert_eq!((r.verdict(), r.exit_code()), (Verdict::Inconclusive, 2));
        assert_eq!(Verdict::NotApplicable.to_string(), "not-applicable");
        assert_eq!(
            serde_json::to_value(Verdict::NotApplicable).unwrap(),
            "not-applicable"
        );
    }
}
