//! # idemkit-cli
//!
//! The `idemkit` command:
//!
//! - `idemkit demo` — the main job: starts the courier simulator and the label
//!   service as real processes and plays the failures a client meets (lost
//!   responses, duplicate storms, payload mismatch, validation, courier outage, a
//!   server killed mid-request, a courier that drops its answer);
//! - `idemkit serve` — the shipping-label reference service;
//! - `idemkit courier` — the courier simulator, idempotent itself, with faults;
//! - `idemkit check` — black-box conformance gates for any idempotent HTTP API
//!   (see `docs/check.md`): point it at your own endpoint to learn whether retried
//!   writes are really effectively once within the key scope and replay window.
//!
//! The binary is a thin `main` over [`main`]; each subcommand is a module with an
//! `Args` struct and a `run` function, and [`Command`] lists them, so later
//! subcommands (`demo`, `serve`, `courier`, `docs`, `keys`) slot in beside `check`.
//!
//! Exit codes: a subcommand decides its own (for `check`: 0 every selected gate
//! passed, 1 one failed, 2 one was inconclusive and none failed). Errors that stop a
//! command from running at all (bad arguments, a refused host) exit 2 with a message
//! on stderr; a closed stdout (`idemkit check … | head`) exits 0.

use std::io::Write;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod check;
pub mod courier;
pub mod demo;
pub mod docs;
pub mod keys;
pub mod serve;

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "idemkit",
    version,
    about = "idemkit: make retried writes safe — tools for idempotent HTTP APIs",
    propagate_version = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once per process")]
pub enum Command {
    /// Run the black-box conformance gates against an idempotent HTTP endpoint.
    Check(check::CheckArgs),
    /// Run the courier simulator: an idempotent shipments API with fault injection.
    Courier(courier::CourierArgs),
    /// Run the shipping-label reference service.
    Serve(serve::ServeArgs),
    /// Start the courier and the label service and play the failure scenarios a
    /// client meets (the main job).
    Demo(demo::DemoArgs),
    /// Print the integrator contract generated from an idempotency configuration.
    Docs(docs::DocsArgs),
    /// Inspect and repair idempotency records: list, show, release, and run the
    /// completer or the reaper once.
    Keys(keys::KeysArgs),
}

/// Runs a parsed command line and returns the exit code it chose.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Check(args) => check::run(args),
        Command::Courier(args) => courier::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Docs(args) => docs::run(args),
        Command::Keys(args) => keys::run(args),
    }
}

/// Parses the process's arguments, runs them, and maps errors to exit codes: a
/// broken pipe on stdout exits 0, any other error prints `error: …` and exits 2.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(code) => code,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
