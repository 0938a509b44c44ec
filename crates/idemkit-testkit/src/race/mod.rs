//! The race suite (the behaviour contract, `docs/spec.md` §9, race gate): the store operations of two to four
//! actors on one key, interleaved at every operation boundary, deterministically,
//! with a history checker run after each schedule.
//!
//! The actors, each a small program over [`KeyStore`] operations:
//!
//! - **holder**: claim → record the intent of an external call → call → record
//!   its result → complete. The downstream ignores idempotency keys, so an intent
//!   without a result found on resume parks the request instead of calling again.
//! - **retrier**: the same program on a second store handle (another instance;
//!   on PostgreSQL and Redis its application clock runs [`SKEW`] ahead).
//! - **completer**: lists abandoned records, then resumes ours with the token it
//!   saw ([`ClaimRequest::resume`]) and runs the same program.
//! - **reaper**: one reaper pass at the default threshold ([`REAP`]).
//! - **operator**: `idemkit keys release` (a force release).
//! - **clock**: moves time past the lease, then past the replay window and the
//!   reap threshold; every other actor may be paused across either move.
//!
//! A *schedule* is the order in which actors take their next step. Stores whose
//! operations take several round trips name *yield points* (failpoints of the
//! `fail` crate between a read and its write); a step that reaches one pauses
//! there and the other actors may run before it resumes, so a
//! read-decide-write operation is interleaved inside too.
//!
//! After every step the checker reads the record; after every schedule it checks
//! the history (the behaviour contract, `docs/spec.md` §9):
//!
//! - at most one completed response per request, and it never changes while
//!   the replay window lasts (no record goes back from completed);
//! - at most one external call per request (the downstream ignores keys), where
//!   a new request under the key starts only after a completion and its window;
//! - nothing stays in flight with a live lease once every actor is done;
//! - a request that called out and never completed is resumable (in flight,
//!   lease expired), parked, or listed for review.
//!
//! [`explore`] runs every schedule of a scenario in depth-first order (up to a
//! limit) or a seeded random sample; each schedule gets a fresh clock, a target
//! from the factory reading time from it, and a key of its own, so schedules
//! never see each other's records even when targets share one database.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use idemkit_core::{
    ClaimOutcome, ClaimRequest, Clock, FencingToken, KeyStore, Millis, PhaseUpdate, RecordState, Scope,
    StoreError, StoredResponse,
};
use serde_json::json;

use crate::ManualClock;
use crate::lifecycle::REAP;
use crate::suite::{LEASE, WINDOW, claim_req, response, scope};

mod history;
mod pause;

use history::check_history;
use pause::{Stepped, install_yield_points, resume_paused, start_step};

/// A clock running a fixed time ahead of another: the application clock of an
/// instance whose clock is skewed.
#[derive(Debug)]
pub struct SkewedClock {
    /// The true time.
    pub base: Arc<dyn Clock>,
    /// How far ahead this clock runs.
    pub ahead: Duration,
}

impl Clock for SkewedClock {
    fn now(&self) -> Millis {
        self.base.now().plus(self.ahead)
    }
}

/// How far ahead of the store's clock the retrier's application clock runs on
/// stores that offer a second, skewed handle: more than a lease, so a store that
/// judged leases by the application's clock would take over live leases at once.
pub const SKEW: Duration = Duration::from_secs(LEASE.as_secs() + 5);

/// One store under test, fresh for one schedule.
pub struct RaceTarget {
    /// The handle of the holder, the completer, the reaper and the operator.
    pub store: Arc<dyn KeyStore>,
    /// The retrier's handle: another instance on the same store (its
    /// application clock may be skewed by [`SKEW`]); the same handle where a
    /// store has one clock (memory, SQLite).
    pub second: Arc<dyn KeyStore>,
    /// The failpoints inside this store's multi-round-trip operations at which
    /// a step may pause (see the module docs).
    pub yield_points: &'static [&'static str],
}

/// Makes a fresh target whose store reads time from the given clock.
pub type TargetFactory =
    Arc<dyn Fn(Arc<ManualClock>) -> Pin<Box<dyn Future<Output = RaceTarget> + Send>> + Send + Sync>;

/// The actors of a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Claims first and runs the request.
    Holder,
    /// A client retry through another instance.
    Retrier,
    /// The completer's pass.
    Completer,
    /// The reaper's pass.
    Reaper,
    /// An operator's force release.
    Operator,
    /// Moves time: past the lease, then past the window and reap threshold.
    Clock,
}

/// The scenarios every store runs: each pairs the holder with the actors that
/// can break it.
pub const SCENARIOS: &[(&str, &[Role])] = &[
    ("holder-retrier", &[Role::Holder, Role::Retrier, Role::Clock]),
    ("holder-completer", &[Role::Holder, Role::Completer, Role::Clock]),
    (
        "holder-reaper-retrier",
        &[Role::Holder, Role::Reaper, Role::Retrier, Role::Clock],
    ),
    (
        "holder-completer-operator",
        &[Role::Holder, Role::Completer, Role::Operator, Role::Clock],
    ),
];

/// How schedules are chosen.
#[derive(Debug, Clone, Copy)]
pub enum Explore {
    /// Every schedule, depth first, stopping after `limit`.
    All {
        /// The most schedules to run.
        limit: usize,
    },
    /// `runs` schedules with choices drawn from a generator seeded with `seed`.
    Sample {
        /// Schedules to run.
        runs: usize,
        /// The seed (the same seed gives the same schedules).
        seed: u64,
    },
}

impl Explore {
    /// Reads `IDEMKIT_RACE` (`all`, `all:N` or `sample:N`; default `sample:N`
    /// with the given default), so CI runs a bounded sample and one command
    /// runs the whole space.
    pub fn from_env(default_runs: usize) -> Self {
        let seed = std::env::var("IDEMKIT_RACE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x01de_3c17);
        match std::env::var("IDEMKIT_RACE").as_deref() {
            Ok("all") => Self::All { limit: usize::MAX },
            Ok(s) if s.starts_with("all:") => Self::All {
                limit: s[4..].parse().unwrap_or(usize::MAX),
            },
            Ok(s) if s.starts_with("sample:") => Self::Sample {
                runs: s[7..].parse().unwrap_or(default_runs),
                seed,
            },
            _ => Self::Sample {
                runs: default_runs,
                seed,
            },
        }
    }
}

/// What [`explore`] did for one scenario.
#[derive(Debug, Clone)]
pub struct RaceReport {
    /// The scenario.
    pub scenario: &'static str,
    /// Schedules run.
    pub schedules: usize,
    /// Whether every schedule of the scenario was run (depth first, no limit hit).
    pub complete: bool,
    /// How long it took.
    pub elapsed: Duration,
}

/// A schedule after which the history checker found a broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The scenario.
    pub scenario: &'static str,
    /// The schedule: which actor took each step.
    pub schedule: Vec<String>,
    /// What broke.
    pub what: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "race `{}` broke a promise: {}\n  schedule: {}",
            self.scenario,
            self.what,
            self.schedule.join(" → ")
        )
    }
}

/// Runs every scenario of [`SCENARIOS`] on the target and panics with the first
/// violation; prints one line per scenario with its schedule count and time.
pub async fn run_all(factory: TargetFactory, explore_with: Explore) -> Vec<RaceReport> {
    let mut reports = Vec::new();
    for (name, roles) in SCENARIOS {
        match explore(factory.clone(), name, roles, explore_with).await {
            Ok(report) => {
                eprintln!(
                    "race {name}: {} schedules{} in {:?}",
                    report.schedules,
                    if report.complete { " (all)" } else { "" },
                    report.elapsed
                );
                reports.push(report);
            }
            Err(v) => panic!("{v}"),
        }
    }
    reports
}

/// Runs the schedules of one scenario; the first violation ends it.
pub async fn explore(
    factory: TargetFactory,
    scenario: &'static str,
    roles: &[Role],
    how: Explore,
) -> Result<RaceReport, Violation> {
    let started = Instant::now();
    let mut schedules = 0;
    let mut complete = false;
    match how {
        Explore::All { limit } => {
            let mut prefix: Vec<usize> = Vec::new();
            loop {
                let clock = Arc::new(ManualClock::new());
                let target = factory(clock.clone()).await;
                let mut chooser = Chooser::Prefix(prefix.clone());
                let trace = run_schedule(scenario, roles, &target, &clock, &mut chooser).await?;
                schedules += 1;
                // The next schedule in depth-first order: the last choice point
                // with an untried alternative.
                let next = trace.iter().rposition(|&(chosen, options)| chosen + 1 < options);
                match next {
                    Some(i) => {
                        prefix = trace[..i].iter().map(|&(c, _)| c).collect();
                        prefix.push(trace[i].0 + 1);
                    }
                    None => {
                        complete = true;
                        break;
                    }
                }
                if schedules >= limit {
                    break;
                }
            }
        }
        Explore::Sample { runs, seed } => {
            for run in 0..runs {
                let clock = Arc::new(ManualClock::new());
                let target = factory(clock.clone()).await;
                let mut chooser = Chooser::Random(seed ^ (run as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
                run_schedule(scenario, roles, &target, &clock, &mut chooser).await?;
                schedules += 1;
            }
        }
    }
    Ok(RaceReport {
        scenario,
        schedules,
        complete,
        elapsed: started.elapsed(),
    })
}

/// Picks the next actor at each choice point.
enum Chooser {
    /// Follow these choices, then always the first option.
    Prefix(Vec<usize>),
    /// A splitmix64 state: choices drawn uniformly.
    Random(u64),
}

impl Chooser {
    fn choose(&mut self, at: usize, options: usize) -> usize {
        match self {
            Self::Prefix(p) => p.get(at).copied().unwrap_or(0).min(options - 1),
            Self::Random(state) => {
                *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
                let mut z = *state;
                z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
                z ^= z >> 31;
                (z % options as u64) as usize
            }
        }
    }
}

/// Where an actor's program is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pc {
    /// The completer lists abandoned records; the clock moves time.
    Start,
    Claim,
    Load,
    Intent,
    Call,
    Result,
    Complete,
    Park,
    Reap,
    Release,
    Done,
}

struct Actor {
    role: Role,
    pc: Pc,
    /// The token this actor holds.
    token: Option<FencingToken>,
    /// When its claim succeeded (by the test clock).
    claimed_at: Option<Millis>,
    /// The completer's resume token, and the generation (first claim) of the
    /// record it listed.
    resume: Option<(FencingToken, Millis)>,
    /// Clock moves made.
    moves: u8,
    /// A step paused at a yield point.
    paused: Option<Paused>,
}

impl Actor {
    fn new(role: Role) -> Self {
        Self {
            role,
            pc: match role {
                Role::Holder | Role::Retrier => Pc::Claim,
                Role::Completer | Role::Clock => Pc::Start,
                Role::Reaper => Pc::Reap,
                Role::Operator => Pc::Release,
            },
            token: None,
            claimed_at: None,
            resume: None,
            moves: 0,
            paused: None,
        }
    }
}

/// What the schedule did, for the checker.
#[derive(Default)]
struct History {
    /// External calls: the claim time of the attempt that made each.
    calls: Vec<Millis>,
    /// Successful completions: (time, response).
    completions: Vec<(Millis, StoredResponse)>,
    /// Replays answered to a claim: (claim time, response).
    replays: Vec<(Millis, StoredResponse)>,
}

/// The effect of one step, applied by the scheduler.
enum Effect {
    Next(Pc),
    Claimed {
        token: FencingToken,
        at: Millis,
        resumed: bool,
        generation: Option<Millis>,
    },
    Replayed(StoredResponse),
    Resume(FencingToken, Millis),
    Called,
    Completed(StoredResponse),
    Done,
}

type StepResult = Result<Effect, String>;

struct Paused {
    handle: tokio::task::JoinHandle<StepResult>,
    id: tokio::task::Id,
}

const STEP: &str = "courier";

async fn run_schedule(
    scenario: &'static str,
    roles: &[Role],
    target: &RaceTarget,
    clock: &Arc<ManualClock>,
    chooser: &mut Chooser,
) -> Result<Vec<(usize, usize)>, Violation> {
    install_yield_points(target.yield_points);
    // A key of its own, so targets may share one database across schedules.
    static SCHEDULES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SCHEDULES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let s = scope("race", &format!("k-{}-{n}", std::process::id()));
    let body = r#"{"sku":"race"}"#;
    let mut actors: Vec<Actor> = roles.iter().map(|r| Actor::new(*r)).collect();
    let mut history = History::default();
    let mut trace = Vec::new();
    let mut steps: Vec<String> = Vec::new();
    let violation = |steps: &[String], what: String| Violation {
        scenario,
        schedule: steps.to_vec(),
        what,
    };
    // The completed response the record must keep answering, and until when.
    let mut kept: Option<(StoredResponse, Millis)> = None;
    loop {
        let enabled: Vec<usize> = (0..actors.len()).filter(|&i| actors[i].pc != Pc::Done).collect();
        if enabled.is_empty() {
            break;
        }
        let pick = chooser.choose(trace.len(), enabled.len());
        trace.push((pick, enabled.len()));
        let i = enabled[pick];
        steps.push(format!("{:?}:{:?}", actors[i].role, actors[i].pc).to_lowercase());
        if steps.len() > 200 {
            return Err(violation(
                &steps,
                "a schedule did not end within 200 steps".into(),
            ));
        }
        let outcome = match actors[i].paused.take() {
            Some(paused) => resume_paused(paused).await,
            None => {
                let fut = step(&actors[i], target, clock.clone(), s.clone(), body);
                start_step(fut).await
            }
        };
        let effect = match outcome {
            Stepped::Paused(p) => {
                actors[i].paused = Some(p);
                continue;
            }
            Stepped::Done(Ok(effect)) => effect,
            Stepped::Done(Err(e)) => return Err(violation(&steps, e)),
        };
        if matches!(effect, Effect::Claimed { .. }) {
            // Never a second runner while a lease is alive (the behaviour contract, `docs/spec.md` §3): every other
            // actor that holds a claim and is still working must have had its
            // lease expire by now.
            let now = clock.now();
            let live = actors.iter().enumerate().find(|(j, a)| {
                *j != i && a.pc != Pc::Done && a.claimed_at.is_some_and(|c| c.plus(LEASE) > now)
            });
            if let Some((_, a)) = live {
                return Err(violation(
                    &steps,
                    format!("a claim succeeded while {:?} held a live lease", a.role),
                ));
            }
        }
        let actor = &mut actors[i];
        match effect {
            Effect::Next(pc) => {
                if actor.role == Role::Clock {
                    actor.moves += 1;
                }
                actor.pc = pc;
            }
            Effect::Claimed {
                token,
                at,
                resumed,
                generation,
            } => {
                if let Some((_, listed)) = actor.resume
                    && generation != Some(listed)
                {
                    return Err(violation(
                        &steps,
                        format!(
                            "the completer's resume started a new request (generation {generation:?}, listed {listed:?}) \
                             instead of taking over the abandoned one"
                        ),
                    ));
                }
                let _ = resumed;
                actor.token = Some(token);
                actor.claimed_at = Some(at);
                // As `Phases::begin` does: read what earlier attempts recorded,
                // whatever the claim said (a takeover's view may be older than
                // the record by the time it lands).
                actor.pc = Pc::Load;
            }
            Effect::Replayed(r) => {
                history.replays.push((clock.now(), r));
                actor.pc = Pc::Done;
            }
            Effect::Resume(token, generation) => {
                actor.resume = Some((token, generation));
                actor.pc = Pc::Claim;
            }
            Effect::Called => {
                history.calls.push(actor.claimed_at.unwrap_or(Millis(0)));
                actor.pc = Pc::Result;
            }
            Effect::Completed(r) => {
                history.completions.push((clock.now(), r));
                actor.pc = Pc::Done;
            }
            Effect::Done => actor.pc = Pc::Done,
        }
        // No record goes back from completed while its window lasts.
        let now = clock.now();
        let rec = target
            .store
            .get(&s)
            .await
            .map_err(|e| violation(&steps, format!("get failed: {e}")))?;
        if let Some((resp, until)) = &kept
            && now < *until
        {
            let same = rec
                .as_ref()
                .is_some_and(|r| r.state == RecordState::Completed && r.response.as_ref() == Some(resp));
            if !same {
                return Err(violation(
                    &steps,
                    format!("a completed record changed inside its replay window: now {rec:?}"),
                ));
            }
        }
        if let Some(r) = &rec
            && r.state == RecordState::Completed
            && kept
                .as_ref()
                .is_none_or(|(resp, _)| r.response.as_ref() != Some(resp))
        {
            let done = r.completed_at.unwrap_or(r.created_at);
            kept = r.response.clone().map(|resp| (resp, done.plus(WINDOW)));
        }
    }
    check_history(&history, target, &s, clock)
        .await
        .map_err(|what| violation(&steps, what))?;
    Ok(trace)
}

/// One step of `actor`'s program, as a future that owns what it needs.
fn step(
    actor: &Actor,
    target: &RaceTarget,
    clock: Arc<ManualClock>,
    s: Scope,
    body: &'static str,
) -> Pin<Box<dyn Future<Output = StepResult> + Send>> {
    let store = if actor.role == Role::Retrier {
        target.second.clone()
    } else {
        target.store.clone()
    };
    let (role, pc, token, resume, moves) = (actor.role, actor.pc, actor.token, actor.resume, actor.moves);
    Box::pin(async move {
        let held = || token.ok_or_else(|| format!("{role:?} at {pc:?} holds no token"));
        let fenced = |r: Result<(), StoreError>, next: Pc| -> StepResult {
            match r {
                Ok(()) => Ok(Effect::Next(next)),
                // The lease was lost: this attempt stops, as a real one would.
                Err(StoreError::Fenced) => Ok(Effect::Done),
                Err(e) => Err(format!("{role:?} at {pc:?}: {e}")),
            }
        };
        match (role, pc) {
            (Role::Clock, Pc::Start) => {
                if moves == 0 {
                    clock.advance(LEASE * 2);
                    Ok(Effect::Next(Pc::Start))
                } else {
                    clock.advance(WINDOW + REAP + LEASE);
                    Ok(Effect::Next(Pc::Done))
                }
            }
            (Role::Completer, Pc::Start) => {
                let list = match store.abandoned(store.now(), 10_000).await {
                    Ok(list) => list,
                    // A store without a completer's work list (Redis today).
                    Err(StoreError::Unsupported(_)) => Vec::new(),
                    Err(e) => return Err(format!("abandoned: {e}")),
                };
                Ok(match list.iter().find(|r| r.scope == s) {
                    Some(r) => Effect::Resume(r.fencing_token, r.created_at),
                    None => Effect::Done,
                })
            }
            (Role::Reaper, Pc::Reap) => match store.reap(store.now().minus(REAP)).await {
                Ok(_) | Err(StoreError::Unsupported(_)) => Ok(Effect::Done),
                Err(e) => Err(format!("reap: {e}")),
            },
            (Role::Operator, Pc::Release) => match store.force_release(&s).await {
                Ok(_) | Err(StoreError::Unsupported(_)) => Ok(Effect::Done),
                Err(e) => Err(format!("force release: {e}")),
            },
            (_, Pc::Claim) => {
                let req = ClaimRequest {
                    resume: resume.map(|(token, _)| token),
                    ..claim_req(&s, body)
                };
                match store.claim(&req).await {
                    Ok(ClaimOutcome::Claimed(lease)) => {
                        let rec = store.get(&s).await.map_err(|e| format!("get: {e}"))?;
                        Ok(Effect::Claimed {
                            token: lease.token,
                            at: clock.now(),
                            resumed: lease.resumed_from.is_some(),
                            generation: rec.map(|r| r.created_at),
                        })
                    }
                    Ok(ClaimOutcome::Replay(r)) => Ok(Effect::Replayed(r)),
                    Ok(_) => Ok(Effect::Done),
                    Err(e) => Err(format!("{role:?} claim: {e}")),
                }
            }
            (_, Pc::Load) => {
                let token = held()?;
                let rec = store.get(&s).await.map_err(|e| format!("get: {e}"))?;
                let Some(rec) = rec.filter(|r| r.fencing_token == token) else {
                    return Ok(Effect::Done);
                };
                let state = rec.step_outputs.get(STEP);
                Ok(Effect::Next(if state.and_then(|v| v.get("done")).is_some() {
                    Pc::Complete
                } else if state.and_then(|v| v.get("intent")).is_some() {
                    // The downstream ignores keys: never call it twice.
                    Pc::Park
                } else {
                    Pc::Intent
                }))
            }
            (_, Pc::Intent) => {
                let update = PhaseUpdate {
                    recovery_point: String::new(),
                    step: Some((STEP.into(), json!({ "intent": "dk" }))),
                };
                fenced(store.advance(&s, held()?, &update).await, Pc::Call)
            }
            (_, Pc::Call) => Ok(Effect::Called),
            (_, Pc::Result) => {
                let update = PhaseUpdate {
                    recovery_point: STEP.into(),
                    step: Some((STEP.into(), json!({ "done": "TRK-1" }))),
                };
                fenced(store.advance(&s, held()?, &update).await, Pc::Complete)
            }
            (_, Pc::Complete) => {
                let token = held()?;
                let resp = response(201, &format!("{role:?} {}", token.0));
                match store.complete(&s, token, &resp).await {
                    Ok(()) => Ok(Effect::Completed(resp)),
                    Err(StoreError::Fenced) => Ok(Effect::Done),
                    Err(e) => Err(format!("{role:?} complete: {e}")),
                }
            }
            (_, Pc::Park) => {
                let token = held()?;
                match store.park(&s, token, "outcome unknown").await {
                    Err(StoreError::Unsupported(_)) => {
                        // A store without parking ends the lease instead.
                        fenced(store.abandon(&s, token, "outcome unknown").await, Pc::Done)
                    }
                    other => fenced(other, Pc::Done),
                }
            }
            (role, pc) => Err(format!("{role:?} has no step at {pc:?}")),
        }
    })
}
