//! The scheduler: every store interleaving point of every task parks here,
//! and the driver releases exactly one at a time.
//!
//! Everything runs on one tokio current-thread runtime with paused time. A
//! task that reaches a yield point registers itself and waits; the driver lets
//! the runtime settle (every runnable task runs until it parks at a yield point,
//! sleeps on a timer or finishes), then picks one parked task by the strategy
//! and releases it, possibly with a fault. Time moves only when nothing is
//! parked and nothing is inside a store call: the driver then sleeps and tokio's
//! paused clock jumps to the earliest timer (a client's backoff, a heartbeat, a
//! request timeout). Store clocks read that same virtual time
//! ([`VirtualClock`]), so leases and windows age with it.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use idemkit_core::{Clock, Millis};
use tokio::sync::{Notify, oneshot};

/// A small, fast, seedable generator (splitmix64): the same seed gives the
/// same choices on every platform, which is what a replay needs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 <= p && p > 0.0
    }

    /// A duration in `lo..=hi` milliseconds.
    pub fn millis(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next_u64() % (hi - lo + 1))
    }
}

/// How the driver picks the next parked task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Strategy {
    /// Uniformly among the parked tasks.
    Random,
    /// Probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010):
    /// every task gets a random priority when first seen, the highest-priority
    /// parked task runs, and at `depth - 1` random steps the running task's
    /// priority drops below every other. Finds a bug of depth `d` with
    /// probability at least 1/(n·k^(d-1)) per schedule.
    Pct {
        /// The bug depth aimed at (d).
        depth: usize,
    },
    /// Every interleaving, depth first, with at most `preemptions` context
    /// switches away from a task that could have gone on (preemption
    /// bounding, as CHESS does): choice 0 at each step lets the task that ran
    /// last go on, the others preempt it. A run follows the prefix of choices
    /// it is given ([`Sched::follow`]) and takes choice 0 past it; the log of
    /// its choices ([`Sched::choices`]) gives the next prefix
    /// ([`next_prefix`]). For small scenarios on the memory store.
    Exhaustive {
        /// The preemption bound.
        preemptions: usize,
    },
}

/// The prefix of the schedule after the one whose choices were `log`
/// (chosen, options) in depth-first order, or `None` when every schedule
/// within the bound has run.
pub fn next_prefix(log: &[(usize, usize)]) -> Option<Vec<usize>> {
    let last = log.iter().rposition(|&(chosen, options)| chosen + 1 < options)?;
    let mut prefix: Vec<usize> = log[..last].iter().map(|&(c, _)| c).collect();
    prefix.push(log[last].0 + 1);
    Some(prefix)
}

/// Where in a store call a task parked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Before the call reaches the store.
    Before,
    /// After the store answered, before the caller sees the answer.
    After,
    /// Inside a running store call, between two of its statements (where the
    /// store's test hook pauses): only a crash is drawn here.
    Inside,
}

/// What the driver hands a released task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// Go on.
    Go,
    /// (Before the call) the store is unavailable: fail without calling.
    Unavailable,
    /// (After the call) the reply is lost: the write applied, the caller sees
    /// an `Unavailable` error.
    LoseReply,
    /// (Before the call) the instance freezes for this many milliseconds of
    /// virtual time (a paused process): none of its calls is sent meanwhile,
    /// heartbeats included, so its leases may run out, and its calls then
    /// arrive late.
    Stall(u64),
}

impl Permit {
    fn code(self) -> u64 {
        match self {
            Self::Go => 0,
            Self::Unavailable => 1,
            Self::LoseReply => 2,
            Self::Stall(ms) => 3 + ms,
        }
    }
}

/// Which faults a run injects, and how often (per released yield point).
#[derive(Debug, Clone, Copy)]
pub struct Faults {
    /// A store reply lost after the write applied.
    pub lose_reply: f64,
    /// The store unavailable (for this call and, with
    /// [`Faults::outage_len`], the next few calls of that instance).
    pub unavailable: f64,
    /// Calls an outage lasts.
    pub outage_len: u32,
    /// An instance crash: all its parked calls and every later call of it
    /// unwind their tasks (the process is gone).
    pub crash: f64,
    /// A handler panic (drawn by the handler at its own points).
    pub panic: f64,
    /// A downstream that acted but whose answer was lost.
    pub lost_answer: f64,
    /// A downstream call that takes 1 to 15 s of virtual time.
    pub slow: f64,
    /// An instance that freezes for 1 to 15 s of virtual time.
    pub stall: f64,
}

impl Faults {
    /// No faults.
    pub const NONE: Faults = Faults {
        lose_reply: 0.0,
        unavailable: 0.0,
        outage_len: 0,
        crash: 0.0,
        panic: 0.0,
        lost_answer: 0.0,
        slow: 0.0,
        stall: 0.0,
    };

    /// The default mix.
    pub const DEFAULT: Faults = Faults {
        lose_reply: 0.02,
        unavailable: 0.01,
        outage_len: 3,
        crash: 0.004,
        panic: 0.03,
        lost_answer: 0.1,
        slow: 0.1,
        stall: 0.03,
    };
}

struct Parked {
    /// First-seen order of the task that parked (a stable identity).
    owner: usize,
    instance: usize,
    phase: Phase,
    op: &'static str,
    tx: oneshot::Sender<Permit>,
}

struct Inner {
    rng: Rng,
    strategy: Strategy,
    faults: Faults,
    faults_on: bool,
    parked: Vec<Parked>,
    /// Task identities in first-seen order, and their PCT priorities.
    owners: HashMap<tokio::task::Id, usize>,
    priority: Vec<u64>,
    change_points: Vec<u64>,
    /// Store calls running right now.
    in_store: usize,
    running: Vec<&'static str>,
    /// Bumped on every registration, store entry and exit: the settle loop
    /// waits until it stops moving.
    progress: u64,
    steps: u64,
    hash: u64,
    faults_injected: u64,
    dead: Vec<bool>,
    frozen: HashMap<usize, tokio::time::Instant>,
    outage: HashMap<usize, u32>,
    /// Tasks of frozen instances waiting for the freeze to end.
    frozen_sleepers: usize,
    /// Whether store calls do real I/O (not the memory store).
    real_io: bool,
    trace: Vec<String>,
    tracing: bool,
    /// Exhaustive: the choices to follow, then choice 0.
    forced: Vec<usize>,
    /// Exhaustive: every choice made (chosen, options).
    choices: Vec<(usize, usize)>,
    /// Exhaustive: the task released last, and the preemptions so far.
    last_owner: Option<usize>,
    preempted: usize,
}

/// The scheduler shared by every instrumented store handle of one schedule.
pub struct Sched {
    inner: Mutex<Inner>,
    notify: Notify,
}

impl std::fmt::Debug for Sched {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sched").finish_non_exhaustive()
    }
}

/// Figures of one schedule.
#[derive(Debug, Clone, Copy, Default)]
pub struct SchedStats {
    /// Yield points released.
    pub steps: u64,
    /// Hash of the sequence of choices (which task, which point, which fault).
    pub hash: u64,
    /// Faults injected.
    pub faults: u64,
}

impl Sched {
    /// A scheduler for one schedule.
    pub fn new(seed: u64, strategy: Strategy, faults: Faults) -> Arc<Self> {
        let mut rng = Rng::new(seed);
        let change_points = match strategy {
            Strategy::Pct { depth } => (1..depth).map(|_| rng.next_u64() % 400).collect(),
            Strategy::Random | Strategy::Exhaustive { .. } => Vec::new(),
        };
        Arc::new(Self {
            inner: Mutex::new(Inner {
                rng,
                strategy,
                faults,
                faults_on: true,
                parked: Vec::new(),
                owners: HashMap::new(),
                priority: Vec::new(),
                change_points,
                in_store: 0,
                running: Vec::new(),
                progress: 0,
                steps: 0,
                hash: 0xcbf2_9ce4_8422_2325,
                faults_injected: 0,
                dead: Vec::new(),
                frozen: HashMap::new(),
                outage: HashMap::new(),
                frozen_sleepers: 0,
                real_io: true,
                trace: Vec::new(),
                tracing: std::env::var_os("IDEMKIT_SIM_TRACE").is_some(),
                forced: Vec::new(),
                choices: Vec::new(),
                last_owner: None,
                preempted: 0,
            }),
            notify: Notify::new(),
        })
    }

    /// Exhaustive: the choices this run follows before taking choice 0.
    pub fn follow(&self, prefix: Vec<usize>) {
        self.lock().forced = prefix;
    }

    /// Exhaustive: every choice this run made (chosen, options).
    pub fn choices(&self) -> Vec<(usize, usize)> {
        self.lock().choices.clone()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new instance id (a process; a restart gets a new one).
    pub fn new_instance(&self) -> usize {
        let mut g = self.lock();
        g.dead.push(false);
        g.dead.len() - 1
    }

    /// Until when the instance is frozen (a stalled process: none of its
    /// store calls is sent, heartbeats included).
    pub fn frozen_until(&self, instance: usize) -> Option<tokio::time::Instant> {
        let g = self.lock();
        g.frozen
            .get(&instance)
            .copied()
            .filter(|t| *t > tokio::time::Instant::now())
    }

    /// Whether the instance crashed.
    pub fn is_dead(&self, instance: usize) -> bool {
        self.lock().dead.get(instance).copied().unwrap_or(false)
    }

    /// Stops (or restarts) fault injection: the liveness phase runs without.
    pub fn set_faults(&self, on: bool) {
        self.lock().faults_on = on;
    }

    /// A random draw for actors (retry delays, which instance a client calls, …),
    /// from the schedule's generator so a seed replays it.
    pub fn with_rng<T>(&self, f: impl FnOnce(&mut Rng) -> T) -> T {
        f(&mut self.lock().rng)
    }

    /// A fault drawn by an actor (handler panic, lost downstream answer):
    /// `true` with the configured probability while faults are on.
    pub fn fault(&self, pick: impl FnOnce(&Faults) -> f64) -> bool {
        let mut g = self.lock();
        if !g.faults_on {
            return false;
        }
        let p = pick(&g.faults);
        let hit = g.rng.chance(p);
        if hit {
            g.faults_injected += 1;
        }
        hit
    }

    /// The figures so far.
    pub fn stats(&self) -> SchedStats {
        let g = self.lock();
        SchedStats {
            steps: g.steps,
            hash: g.hash,
            faults: g.faults_injected,
        }
    }

    /// The recorded choices (with `IDEMKIT_SIM_TRACE` set).
    pub fn trace(&self) -> Vec<String> {
        self.lock().trace.clone()
    }

    /// Adds a line to the trace (with `IDEMKIT_SIM_TRACE` set).
    pub fn note(&self, line: impl FnOnce() -> String) {
        let mut g = self.lock();
        if g.tracing {
            let l = line();
            g.trace.push(l);
        }
    }

    /// Parks the calling task at a yield point of `instance`'s store handle
    /// until the driver releases it. A crashed instance's calls never return.
    pub async fn point(&self, instance: usize, phase: Phase, op: &'static str) -> Permit {
        let rx = {
            let mut g = self.lock();
            if g.dead.get(instance).copied().unwrap_or(false) {
                None
            } else {
                let owner = match tokio::task::try_id() {
                    Some(id) => {
                        let next = g.owners.len();
                        let owner = *g.owners.entry(id).or_insert(next);
                        if owner == g.priority.len() {
                            let p = g.rng.next_u64() | (1 << 40);
                            g.priority.push(p);
                        }
                        owner
                    }
                    None => usize::MAX,
                };
                let (tx, rx) = oneshot::channel();
                g.parked.push(Parked {
                    owner,
                    instance,
                    phase,
                    op,
                    tx,
                });
                g.progress += 1;
                Some(rx)
            }
        };
        let Some(rx) = rx else { crashed() };
        self.notify.notify_one();
        match rx.await {
            Ok(p) => p,
            // The driver dropped the permit: the instance crashed.
            Err(_) => crashed(),
        }
    }

    /// A yield point inside a running store call of `instance` (the store's
    /// test pause between two statements): while parked the call does not
    /// count as running, so the driver releases another task at once instead
    /// of waiting for it; the driver may also crash the instance here, which
    /// drops the call half-way, as a process that dies between two statements.
    pub async fn inside(self: &Arc<Self>, instance: usize, op: &'static str) {
        struct Back(Option<Arc<Sched>>);
        impl Drop for Back {
            fn drop(&mut self) {
                if let Some(s) = &self.0 {
                    let mut g = s.lock();
                    g.in_store += 1;
                    g.progress += 1;
                }
            }
        }
        let _back = {
            let mut g = self.lock();
            if g.in_store > 0 {
                g.in_store -= 1;
                g.progress += 1;
                Back(Some(self.clone()))
            } else {
                Back(None)
            }
        };
        let _ = self.point(instance, Phase::Inside, op).await;
    }

    /// The yield point before a call of `instance` (a store call or an
    /// actor's own I/O): waits out a freeze of the instance, parks, and
    /// returns the permit (a drawn freeze already waited out).
    pub async fn before_call(&self, instance: usize, op: &'static str) -> Permit {
        if let Some(until) = self.frozen_until(instance) {
            self.sleep_frozen(until).await;
        }
        let permit = self.point(instance, Phase::Before, op).await;
        if let Permit::Stall(_) = permit
            && let Some(until) = self.frozen_until(instance)
        {
            self.sleep_frozen(until).await;
        }
        permit
    }

    /// A task of a frozen instance waits (virtual time) for the freeze to
    /// end; it may hold a lock meanwhile (an open transaction), which is the
    /// one case where a running call may wait on a sleeping task.
    async fn sleep_frozen(&self, until: tokio::time::Instant) {
        struct Sleeper<'a>(&'a Sched);
        impl Drop for Sleeper<'_> {
            fn drop(&mut self) {
                self.0.lock().frozen_sleepers -= 1;
            }
        }
        self.lock().frozen_sleepers += 1;
        let _sleeper = Sleeper(self);
        tokio::time::sleep_until(until).await;
    }

    /// How long (real time) the driver lets a running call go on, with
    /// nothing else to release, before it lets virtual time move: briefly when
    /// a task of a frozen instance sleeps (the call may wait on a lock it
    /// holds, as it would on a paused process), otherwise long (the call is
    /// plain slow I/O, and moving time under it would fire timers no real
    /// process would see fire: a client's timeout during a 2 ms write).
    pub fn io_patience(&self) -> Duration {
        let g = self.lock();
        if !g.real_io {
            // A memory store call that does not return waits on a timer.
            Duration::ZERO
        } else if g.frozen_sleepers > 0 {
            SLEEPING_LOCK_WAIT
        } else {
            SLOW_IO_LIMIT
        }
    }

    /// Runs an actor's own network I/O (a single-step handler's business
    /// write in the store's database) as a scheduled call of `instance`: a
    /// yield point before it and after it, and counted as running I/O in
    /// between, so the driver waits for its answer (real time) instead of
    /// letting virtual time jump past timers while it is on the wire. Faults:
    /// the database unavailable before the call, the reply lost after it
    /// (both `Err(IoFault)`; the statement ran in the handler's transaction,
    /// which the engine rolls back), a crash or a freeze of the instance.
    pub async fn io<T>(
        self: &Arc<Self>,
        instance: usize,
        op: &'static str,
        fut: impl Future<Output = T>,
    ) -> Result<T, IoFault> {
        if self.before_call(instance, op).await == Permit::Unavailable {
            return Err(IoFault);
        }
        let out = {
            let _guard = self.enter_store(op);
            fut.await
        };
        match self.point(instance, Phase::After, op).await {
            Permit::LoseReply => Err(IoFault),
            _ => Ok(out),
        }
    }

    /// Tells the scheduler whether store calls do real I/O: on the memory
    /// store they never do, so a call that does not return waits on a timer
    /// and the driver need not wait real time for it.
    pub fn set_real_io(&self, real: bool) {
        self.lock().real_io = real;
    }

    /// Marks a store call as running (until the guard drops).
    pub fn enter_store(self: &Arc<Self>, op: &'static str) -> StoreGuard {
        let mut g = self.lock();
        g.running.push(op);
        g.in_store += 1;
        g.progress += 1;
        StoreGuard(self.clone())
    }

    /// Runs the runtime until nothing moves: every task parked, asleep or
    /// finished, and no store call running (or, for a store call blocked on a
    /// lock a parked task holds, nothing moved for a few milliseconds of real
    /// time; see the crate documentation on determinism).
    pub async fn settle(&self) {
        let mut last = u64::MAX;
        let mut still = 0;
        let mut since = std::time::Instant::now();
        loop {
            tokio::task::yield_now().await;
            let (progress, in_store) = {
                let g = self.lock();
                (g.progress, if g.real_io { g.in_store } else { 0 })
            };
            if progress != last {
                last = progress;
                still = 0;
                since = std::time::Instant::now();
                continue;
            }
            still += 1;
            if in_store > 0 {
                if since.elapsed() < LOCK_WAIT {
                    std::thread::yield_now();
                    continue;
                }
                if std::env::var_os("IDEMKIT_SIM_DEBUG").is_some() {
                    let g = self.lock();
                    eprintln!(
                        "lock wait: {:?} in store, parked: {:?}",
                        g.running,
                        g.parked.iter().map(|p| (p.owner, p.op)).collect::<Vec<_>>()
                    );
                }
                return;
            }
            if still >= 24 {
                return;
            }
        }
    }

    /// Releases one parked task, chosen by the strategy, with a fault drawn
    /// for it. Returns `false` when nothing is parked.
    pub fn step(&self) -> bool {
        let mut g = self.lock();
        g.parked.retain(|p| !p.tx.is_closed());
        if g.parked.is_empty() {
            return false;
        }
        // A stable order, independent of wake-up order.
        g.parked.sort_by_key(|p| (p.owner, p.instance));
        let idx = match g.strategy {
            Strategy::Random => {
                let n = g.parked.len();
                g.rng.below(n)
            }
            Strategy::Pct { .. } => {
                let step = g.steps;
                let pri = |g: &Inner, i: usize| {
                    let o = g.parked[i].owner;
                    g.priority.get(o).copied().unwrap_or(0)
                };
                let mut idx = 0;
                for i in 0..g.parked.len() {
                    if pri(&g, i) > pri(&g, idx) {
                        idx = i;
                    }
                }
                if g.change_points.contains(&step) {
                    let o = g.parked[idx].owner;
                    if let Some(p) = g.priority.get_mut(o) {
                        *p = step;
                    }
                }
                idx
            }
            Strategy::Exhaustive { preemptions } => {
                // Choice 0 is the task that ran last, when it is parked again.
                let current = g
                    .last_owner
                    .and_then(|o| g.parked.iter().position(|p| p.owner == o));
                let mut options: Vec<usize> = current.into_iter().collect();
                if current.is_none() || g.preempted < preemptions {
                    options.extend((0..g.parked.len()).filter(|i| Some(*i) != current));
                }
                let at = g.choices.len();
                let chosen = g.forced.get(at).copied().unwrap_or(0).min(options.len() - 1);
                g.choices.push((chosen, options.len()));
                let idx = options[chosen];
                if current.is_some_and(|c| c != idx) {
                    g.preempted += 1;
                }
                g.last_owner = Some(g.parked[idx].owner);
                idx
            }
        };
        g.steps += 1;
        let parked = g.parked.swap_remove(idx);
        let permit = self.draw_fault(&mut g, &parked);
        let h = &mut g.hash;
        for part in [
            parked.owner as u64,
            parked.phase as u64,
            parked.op.len() as u64,
            permit.map_or(9, Permit::code),
        ] {
            *h ^= part;
            *h = h.wrapping_mul(0x0100_0000_01b3);
        }
        if g.tracing {
            let line = format!(
                "step {} owner {} instance {} {:?} {} -> {:?}",
                g.steps, parked.owner, parked.instance, parked.phase, parked.op, permit
            );
            g.trace.push(line);
        }
        match permit {
            Some(p) => {
                let _ = parked.tx.send(p);
            }
            None => {
                // A crash: this call and every parked call of the instance
                // are dropped; their tasks never run again.
                let inst = parked.instance;
                if let Some(d) = g.dead.get_mut(inst) {
                    *d = true;
                }
                g.parked.retain(|p| p.instance != inst);
            }
        }
        true
    }

    fn draw_fault(&self, g: &mut Inner, p: &Parked) -> Option<Permit> {
        if !g.faults_on {
            return Some(Permit::Go);
        }
        let f = g.faults;
        let alive = g.dead.iter().filter(|d| !**d).count();
        if alive > 1 && g.rng.chance(f.crash) {
            g.faults_injected += 1;
            return None;
        }
        match p.phase {
            Phase::Before => {
                if let Some(left) = g.outage.get_mut(&p.instance) {
                    *left -= 1;
                    if *left == 0 {
                        g.outage.remove(&p.instance);
                    }
                    return Some(Permit::Unavailable);
                }
                // Not inside an open transaction: a process frozen while it
                // holds SQLite's write lock stalls every writer for real
                // milliseconds per step, and the freeze is as likely between
                // transactions.
                let in_tx = matches!(
                    p.op,
                    "advance_in_tx" | "commit" | "complete_in_tx" | "rollback_tx" | "business_write"
                );
                if !in_tx && g.rng.chance(f.stall) {
                    g.faults_injected += 1;
                    let ms = 1000 + g.rng.next_u64() % 14_000;
                    let until = tokio::time::Instant::now() + Duration::from_millis(ms);
                    g.frozen.insert(p.instance, until);
                    return Some(Permit::Stall(ms));
                }
                if g.rng.chance(f.unavailable) {
                    g.faults_injected += 1;
                    if f.outage_len > 1 {
                        g.outage.insert(p.instance, f.outage_len - 1);
                    }
                    return Some(Permit::Unavailable);
                }
                Some(Permit::Go)
            }
            Phase::Inside => Some(Permit::Go),
            Phase::After => {
                if g.rng.chance(f.lose_reply) {
                    g.faults_injected += 1;
                    return Some(Permit::LoseReply);
                }
                Some(Permit::Go)
            }
        }
    }

    /// Waits for time to move: sleeps (paused time jumps to the earliest
    /// timer) until something parks or `max` passes.
    pub async fn idle(&self, max: Duration) {
        tokio::select! {
            _ = self.notify.notified() => {}
            _ = tokio::time::sleep(max) => {}
        }
    }

    /// The calls running right now (for debugging output).
    pub fn running(&self) -> Vec<&'static str> {
        self.lock().running.clone()
    }

    /// Whether a store call is running.
    pub fn in_store(&self) -> bool {
        self.lock().in_store > 0
    }
}

/// An actor's I/O failed by an injected fault (see [`Sched::io`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoFault;

impl std::fmt::Display for IoFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("simulated: the database was unavailable or its reply was lost")
    }
}

/// How long (real time) a running store call may take before the scheduler
/// takes it to be blocked on a lock a parked task holds, and releases another.
pub const LOCK_WAIT: Duration = Duration::from_millis(40);

/// How long (real time) a running store call may take, with nothing else
/// to release, before the scheduler lets virtual time move (the call waits on
/// a lock held by a sleeping task).
pub const SLEEPING_LOCK_WAIT: Duration = Duration::from_millis(250);

/// How long (real time) a running call may take, with nothing else to
/// release and no frozen task that could hold the lock it waits on, before
/// the driver lets virtual time move anyway (a safety valve: the call may be
/// waiting on something the scheduler does not see).
pub const SLOW_IO_LIMIT: Duration = Duration::from_secs(5);

/// The panic message of a crashed instance's calls.
pub const CRASHED: &str = "simulated crash: this instance's process is gone";

/// Unwinds the calling task: a crashed process's futures are dropped at
/// their next store call, releasing what they hold (an open SQLite
/// transaction, the writer lock) as the database does when a process dies.
/// Clients see the unwinding as a reset connection.
fn crashed() -> ! {
    std::panic::panic_any(CRASHED)
}

/// Marks the end of a store call when dropped.
pub struct StoreGuard(Arc<Sched>);

impl std::fmt::Debug for StoreGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StoreGuard")
    }
}

impl Drop for StoreGuard {
    fn drop(&mut self) {
        let mut g = self.0.lock();
        g.running.pop();
        g.in_store -= 1;
        g.progress += 1;
    }
}

/// A store clock on tokio's (paused) virtual time, with a fixed skew: the
/// stores' leases and windows age exactly as the simulation's timers do.
#[derive(Debug, Clone)]
pub struct VirtualClock {
    base: Millis,
    start: tokio::time::Instant,
    skew_ms: i64,
}

impl VirtualClock {
    /// A clock reading `base` now, `skew_ms` ahead (negative: behind).
    pub fn new(base: Millis, skew_ms: i64) -> Self {
        Self {
            base,
            start: tokio::time::Instant::now(),
            skew_ms,
        }
    }

    /// The same virtual time with another skew.
    pub fn skewed(&self, skew_ms: i64) -> Self {
        Self {
            skew_ms,
            ..self.clone()
        }
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Millis {
        let elapsed = i64::try_from(self.start.elapsed().as_millis()).unwrap_or(i64::MAX);
        Millis(self.base.0 + elapsed + self.skew_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::next_prefix;

    #[test]
    fn the_next_prefix_advances_the_deepest_choice_with_options_left() {
        assert_eq!(next_prefix(&[(0, 2), (0, 1), (0, 3)]), Some(vec![0, 0, 1]));
        assert_eq!(next_prefix(&[(0, 2), (2, 3), (0, 1)]), Some(vec![1]));
        assert_eq!(next_prefix(&[(1, 2), (2, 3), (0, 1)]), None);
        assert_eq!(next_prefix(&[]), None);
    }
}
