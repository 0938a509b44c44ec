//! `idemkit-sim`: runs schedules for a time budget per store; prints the
//! figures, each violation with its seed and replay command, and a last line
//! `sim: <schedules> schedules, <faults> faults, <violations> violations`.

use std::collections::HashSet;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use idemkit_sim::{Mutation, StoreKind, config_for, exhaustive_config, run, sched::next_prefix};

struct Args {
    stores: Vec<StoreKind>,
    seconds: f64,
    seed: Option<u64>,
    schedule: Option<u64>,
    mutation: Option<Mutation>,
    always_panic: bool,
    /// `--exhaustive`: the preemption bound of a depth-first run.
    exhaustive: Option<usize>,
    /// `--prefix`: the one exhaustive schedule to replay.
    prefix: Option<Vec<usize>>,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        stores: Vec::new(),
        seconds: 20.0,
        seed: None,
        schedule: None,
        mutation: None,
        always_panic: false,
        exhaustive: None,
        prefix: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = || it.next().ok_or(format!("{a} needs a value"));
        match a.as_str() {
            "--store" => {
                args.stores = match value()?.as_str() {
                    "memory" => vec![StoreKind::Memory],
                    "sqlite" => vec![StoreKind::Sqlite],
                    "postgres" => vec![StoreKind::Postgres],
                    "all" => every_store()?,
                    "redis" => vec![StoreKind::Redis],
                    s => return Err(format!("unknown store {s}")),
                }
            }
            "--seconds" => args.seconds = value()?.parse().map_err(|e| format!("--seconds: {e}"))?,
            "--seed" => args.seed = Some(value()?.parse().map_err(|e| format!("--seed: {e}"))?),
            "--schedule" => args.schedule = Some(value()?.parse().map_err(|e| format!("--schedule: {e}"))?),
            "--mutant" => {
                let v = value()?;
                args.mutation = Some(Mutation::parse(&v).ok_or(format!("unknown mutant {v}"))?);
            }
            "--always-panic" => args.always_panic = true,
            "--exhaustive" => args.exhaustive = Some(args.exhaustive.unwrap_or(2)),
            "--prefix" => {
                let v = value()?;
                let choices = v
                    .split(',')
                    .filter(|c| !c.is_empty())
                    .map(|c| c.parse::<usize>().map_err(|e| format!("--prefix: {e}")))
                    .collect::<Result<Vec<_>, _>>()?;
                args.prefix = Some(choices);
                args.exhaustive = Some(args.exhaustive.unwrap_or(2));
            }
            "--preemptions" => {
                args.exhaustive = Some(value()?.parse().map_err(|e| format!("--preemptions: {e}"))?);
            }
            "--help" | "-h" => {
                println!(
                    "usage: idemkit-sim [--store memory|sqlite|postgres|redis|all] [--seconds N] [--seed S] [--schedule N] [--mutant NAME] [--always-panic] [--exhaustive [--preemptions K] [--prefix C,C,..]]"
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.stores.is_empty() {
        args.stores = every_store()?;
    }
    Ok(args)
}

/// Every store (the default, and `--store all`): memory and SQLite, then
/// PostgreSQL and Redis where their URLs are set. Under `CI=true` a missing
/// URL is an error, never a silent skip.
fn every_store() -> Result<Vec<StoreKind>, String> {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true");
    let mut all = vec![StoreKind::Memory, StoreKind::Sqlite];
    for (var, kind) in [
        ("IDEMKIT_TEST_POSTGRES_URL", StoreKind::Postgres),
        ("IDEMKIT_TEST_REDIS_URL", StoreKind::Redis),
    ] {
        if std::env::var_os(var).is_some() {
            all.push(kind);
        } else if ci {
            return Err(format!(
                "{var} is not set (CI=true: a missing store is a failure)"
            ));
        } else {
            eprintln!("sim: {var} is not set; {} skipped", kind.name());
        }
    }
    Ok(all)
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("idemkit-sim: {e}");
            return ExitCode::from(2);
        }
    };
    // Injected handler panics are expected; keep other panics loud.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|s| s.starts_with("simulated"))
            || info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|s| s.starts_with("simulated"));
        if !injected {
            default_hook(info);
        }
    }));
    if let Some(bound) = args.exhaustive {
        return exhaustive(bound, args.seconds, args.mutation, args.prefix);
    }
    let run_seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    println!("sim: run seed {run_seed}");
    let (mut schedules, mut faults, mut violations) = (0u64, 0u64, 0u64);
    for store in &args.stores {
        let started = Instant::now();
        let mut hashes = HashSet::new();
        let (mut n, mut store_faults, mut steps) = (0u64, 0u64, 0u64);
        let mut first_violation: Option<(u64, f64)> = None;
        let budget = Duration::from_secs_f64(args.seconds);
        loop {
            let index = args.schedule.unwrap_or(n);
            let mut config = config_for(*store, run_seed, index, args.mutation);
            config.always_panic = args.always_panic;
            let outcome = run(&config);
            n += 1;
            hashes.insert(outcome.stats.hash);
            store_faults += outcome.stats.faults;
            steps += outcome.stats.steps;
            for line in &outcome.trace {
                println!("  {line}");
            }
            if !outcome.violations.is_empty() {
                violations += outcome.violations.len() as u64;
                first_violation.get_or_insert((n, started.elapsed().as_secs_f64()));
                println!(
                    "sim: VIOLATION on {} (schedule {index}, seed {run_seed}, strategy {:?}):",
                    store.name(),
                    config.strategy
                );
                for v in &outcome.violations {
                    println!("  {v}");
                }
                let mut extra = args
                    .mutation
                    .map(|m| format!(" --mutant {}", m.name()))
                    .unwrap_or_default();
                if args.always_panic {
                    extra.push_str(" --always-panic");
                }
                println!(
                    "sim: replay with: bash .ci/sim --store {} --seed {run_seed} --schedule {index}{extra}",
                    store.name()
                );
            }
            if args.schedule.is_some() || started.elapsed() >= budget {
                break;
            }
        }
        let secs = started.elapsed().as_secs_f64();
        if let Some((k, at)) = first_violation {
            println!(
                "sim: {}: first violation in schedule {} of the run, after {at:.1}s",
                store.name(),
                k.saturating_sub(1)
            );
        }
        println!(
            "sim: {}: {n} schedules in {secs:.1}s ({:.1}/s), {} distinct interleavings, {steps} yield points released, {store_faults} faults",
            store.name(),
            n as f64 / secs.max(1e-9),
            hashes.len()
        );
        schedules += n;
        faults += store_faults;
    }
    println!("sim: {schedules} schedules, {faults} faults, {violations} violations");
    if violations > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// `--exhaustive`: every schedule of the small scenario on the memory store
/// within the preemption bound, depth first, until done or out of time.
/// With `only`, runs that one schedule (a replay).
fn exhaustive(bound: usize, seconds: f64, mutation: Option<Mutation>, only: Option<Vec<usize>>) -> ExitCode {
    let started = Instant::now();
    let budget = Duration::from_secs_f64(seconds);
    let (mut n, mut violations) = (0u64, 0u64);
    let mut hashes = HashSet::new();
    let replay = only.is_some();
    let mut prefix = Some(only.unwrap_or_default());
    while let Some(p) = prefix.take() {
        if started.elapsed() >= budget {
            prefix = Some(p);
            break;
        }
        let outcome = run(&exhaustive_config(bound, p.clone(), mutation));
        n += 1;
        hashes.insert(outcome.stats.hash);
        if !outcome.violations.is_empty() {
            violations += outcome.violations.len() as u64;
            // The path taken, up to its last choice other than the default 0.
            let mut taken: Vec<String> = outcome.choices.iter().map(|(c, _)| c.to_string()).collect();
            while taken.len() > 1 && taken.last().is_some_and(|c| c == "0") {
                taken.pop();
            }
            println!("sim: VIOLATION on memory (exhaustive, preemption bound {bound}):");
            for v in &outcome.violations {
                println!("  {v}");
            }
            let extra = mutation
                .map(|m| format!(" --mutant {}", m.name()))
                .unwrap_or_default();
            println!(
                "sim: replay with: bash .ci/sim --exhaustive --preemptions {bound} --prefix {}{extra}",
                taken.join(",")
            );
        }
        for line in &outcome.trace {
            println!("  {line}");
        }
        if replay {
            break;
        }
        prefix = next_prefix(&outcome.choices);
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "sim: memory (exhaustive, preemption bound {bound}): {n} schedules in {secs:.1}s, {} distinct interleavings, {}",
        hashes.len(),
        match (replay, prefix.is_none()) {
            (true, _) => "one schedule replayed",
            (false, true) => "every schedule within the bound explored",
            (false, false) => "stopped by the time budget",
        }
    );
    println!("sim: {n} schedules, 0 faults, {violations} violations");
    if violations > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
