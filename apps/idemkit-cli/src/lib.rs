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
//!   writes are really effectively once within the key scope and replay window;
//! - `idemkit lint-openapi` — every state-changing operation of an OpenAPI document
//!   with where its idempotency key travels, one verdict each (see
//!   `docs/x-idempotency.md`).
//!
//! The binary is a thin `main` over [`main`]; each subcommand is a module with an
//! `Args` struct and a `run` function, and [`Command`] lists them, so later
//! subcommands (`demo`, `serve`, `courier`, `docs`, `keys`) slot in beside `check`.
//!
//! Exit codes: a subcommand decides its own (for `check`: 0 every selected gate
//! passed, 1 one failed, 2 one was inconclusive and none failed). Errors that stop a
//! command from running at all (bad arguments, a refused host) exit 2 with a message
//! on stderr. A closed stdout never changes a verdict: `idemkit check … | head` and
//! `idemkit keys … | head` exit with the code the command decided, whatever
//! happened to their output; the other commands exit 0 when their reader goes away.

use std::io::Write;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

pub mod check;
pub mod courier;
pub mod demo;
pub mod docs;
pub mod keys;
pub mod lint_openapi;
pub mod proxy;
pub mod serve;

/// Installs the process's Prometheus recorder (once per process) and runs its
/// upkeep every 5 s on the current runtime (`idemkit serve`, `idemkit proxy`).
pub(crate) fn install_metrics() -> anyhow::Result<()> {
    let metrics = idemkit_labels::service::install_metrics()?;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tick.tick().await;
            metrics.run_upkeep();
        }
    });
    Ok(())
}

/// With the `failpoints` feature, `IDEMKIT_CRASH_AT=<failpoint>` makes the
/// process (`idemkit serve` or `idemkit proxy`) print `CRASHPOINT <name>` there
/// and stop until killed (crash tests).
pub(crate) fn install_crash_point() {
    #[cfg(feature = "failpoints")]
    if let Ok(name) = std::env::var("IDEMKIT_CRASH_AT") {
        let announced = name.clone();
        let installed = fail::cfg_callback(name, move || {
            use std::io::Write;
            println!("CRASHPOINT {announced}");
            let _ = std::io::stdout().flush();
            loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            }
        });
        if let Err(e) = installed {
            eprintln!("IDEMKIT_CRASH_AT: {e}");
        }
    }
}

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
    /// Run the black-box conformance gates against an idempotent HTTP endpoint (or a unary gRPC method).
    Check(check::CheckArgs),
    /// Run the courier simulator: an idempotent shipments API with fault injection.
    Courier(courier::CourierArgs),
    /// Run the shipping-label reference service.
    Serve(serve::ServeArgs),
    /// Start the courier and the label service and play the failure scenarios a
    /// client meets (the main job).
    Demo(demo::DemoArgs),
    /// Print the integrator contract generated from an idempotency configuration
    /// (with `--proxy`: that of an API served through `idemkit proxy`).
    Docs(DocsCommand),
    /// Inspect and repair idempotency records (SQLite, PostgreSQL or Redis): list,
    /// show, release, review, and run the completer or the reaper once.
    Keys(keys::KeysArgs),
    /// List every state-changing operation of an OpenAPI document with where its
    /// idempotency key travels, one verdict each (exit 1 when a key is missing).
    LintOpenapi(lint_openapi::LintArgs),
    /// Put the idempotency-key contract in front of an existing HTTP API (see `docs/proxy.md`).
    Proxy(proxy::ProxyArgs),
}

/// Arguments of `idemkit docs`: the labels service's contract, or with `--proxy`
/// the contract of an API served through `idemkit proxy`.
#[derive(Debug, clap::Args)]
pub struct DocsCommand {
    /// `--config` and `--format`.
    #[command(flatten)]
    pub docs: docs::DocsArgs,
    /// Print the contract of an API served through `idemkit proxy` instead of the
    /// labels service's: `--config` is then the proxy's (without it, the proxy's
    /// default: every POST, PUT, PATCH and DELETE keyed by the `Idempotency-Key`
    /// header with the default policy).
    #[arg(long)]
    pub proxy: bool,
    /// As the proxy's flag: the upstream de-duplicates by `Idempotency-Key`
    /// itself, so a request whose outcome is unknown is re-sent with the same key
    /// instead of being parked.
    #[arg(long, requires = "proxy")]
    pub upstream_honours_keys: bool,
    /// As the proxy's flag: the header carrying the caller's credential
    /// (default: the proxy's).
    #[arg(long, requires = "proxy")]
    pub account_header: Option<String>,
    /// As the proxy's flag: the largest keyed request body accepted, in bytes
    /// (default: the proxy's).
    #[arg(long, requires = "proxy")]
    pub max_request_body: Option<usize>,
    /// As the proxy's flag: every keyed route's lease, in milliseconds
    /// (default: the configuration's).
    #[arg(long, requires = "proxy")]
    pub lease_ms: Option<u64>,
}

/// `idemkit docs`: the labels service's contract, or the proxy's with `--proxy`.
fn run_docs(args: DocsCommand) -> anyhow::Result<ExitCode> {
    use idemkit_contract::{Format, ProxyContract, render_proxy};

    if !args.proxy {
        return docs::run(args.docs);
    }
    let lease = args.lease_ms.map(std::time::Duration::from_millis);
    let config = match &args.docs.config {
        Some(path) => {
            let mut config = idemkit_proxy::ProxyConfig::from_toml(
                &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
            )?;
            // As the proxy applies `--lease-ms`.
            if let Some(lease) = lease {
                config.idemkit = config.idemkit.with_lease(lease)?;
            }
            Some(config)
        }
        None => None,
    };
    let not_executed = config
        .as_ref()
        .map(|c| c.not_executed.clone())
        .unwrap_or_default();
    let replayed_headers = config
        .as_ref()
        .map(|c| c.replayed_headers.clone())
        .unwrap_or_default();
    let config = config.map(|c| c.idemkit);
    let contract = ProxyContract {
        config,
        upstream_honours_keys: args.upstream_honours_keys,
        account_header: match args.account_header {
            Some(header) => header,
            None => proxy_default("account_header")?,
        },
        max_request_body: match args.max_request_body {
            Some(n) => n,
            None => proxy_default("max_request_body")?
                .parse()
                .context("the default of --max-request-body")?,
        },
        default_lease: lease,
        not_executed,
        replayed_headers,
    };
    let format = match args.docs.format {
        docs::DocsFormat::Markdown => Format::Markdown,
        docs::DocsFormat::Html => Format::Html,
    };
    std::io::stdout()
        .lock()
        .write_all(render_proxy(&contract, &idemkit_client::RetryConfig::new(), format).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

/// The default value of an `idemkit proxy` argument, read from its definition
/// ([`proxy::ProxyArgs`]), so the proxy's contract publishes what the proxy runs
/// with unless told otherwise.
fn proxy_default(id: &str) -> anyhow::Result<String> {
    use clap::CommandFactory;
    let cli = Cli::command();
    let value = cli
        .find_subcommand("proxy")
        .and_then(|proxy| proxy.get_arguments().find(|a| a.get_id() == id))
        .and_then(|arg| arg.get_default_values().first())
        .and_then(|v| v.to_str())
        .with_context(|| format!("`idemkit proxy` has no default for {id}"))?;
    Ok(value.to_owned())
}

/// Runs a parsed command line and returns the exit code it chose.
pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Check(args) => check::run(args),
        Command::Courier(args) => courier::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Docs(args) => run_docs(args),
        Command::Keys(args) => keys::run(args),
        Command::LintOpenapi(args) => lint_openapi::run(args),
        Command::Proxy(args) => proxy::run(args),
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
            // serde_json's error hides the `io::Error` from `source()`.
            || cause
                .downcast_ref::<serde_json::Error>()
                .is_some_and(|json| json.io_error_kind() == Some(std::io::ErrorKind::BrokenPipe))
    })
}

/// Standard output for a command whose exit code is a verdict (`check`, `keys`).
///
/// The first failed write (a reader that went away: `idemkit check --json | head`)
/// is remembered and that write and every later one are discarded as if written,
/// so the command runs to its end and exits with the code it decided: a closed
/// pipe can neither turn a failing verdict into 0 nor a pass into 2.
/// [`VerdictOutput::finish`] reports a failure other than a broken pipe on stderr.
#[derive(Debug)]
pub(crate) struct VerdictOutput<W: Write> {
    inner: W,
    failed: Option<std::io::Error>,
}

impl<W: Write> VerdictOutput<W> {
    pub(crate) fn new(inner: W) -> Self {
        Self { inner, failed: None }
    }

    /// Flushes, and says on stderr if the output was cut short by anything but a
    /// closed pipe (a full disk, a closed descriptor). The exit code is the caller's.
    pub(crate) fn finish(mut self) {
        let _ = self.flush();
        if let Some(e) = self.failed
            && e.kind() != std::io::ErrorKind::BrokenPipe
        {
            let _ = writeln!(std::io::stderr(), "warning: writing to stdout failed: {e}");
        }
    }

    fn record(&mut self, e: std::io::Error) {
        if self.failed.is_none() {
            self.failed = Some(e);
        }
    }
}

impl<W: Write> Write for VerdictOutput<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.failed.is_some() {
            return Ok(buf.len());
        }
        loop {
            match self.inner.write(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    self.record(e);
                    return Ok(buf.len());
                }
                ok => return ok,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if self.failed.is_none()
            && let Err(e) = self.inner.flush()
        {
            self.record(e);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer that takes `room` bytes, then fails like a closed pipe.
    struct Closing {
        room: usize,
        taken: Vec<u8>,
    }

    impl Write for Closing {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.room == 0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            let n = buf.len().min(self.room);
            self.room -= n;
            self.taken.extend_from_slice(&buf[..n]);
            Ok(n)
        }

        fn flush(&mut self) -> std::io::Result<()> {
            if self.room == 0 {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
            Ok(())
        }
    }

    #[test]
    fn a_closed_pipe_swallows_the_rest_without_an_error() {
        let mut out = VerdictOutput::new(Closing {
            room: 5,
            taken: Vec::new(),
        });
        writeln!(out, "hello world").unwrap();
        serde_json::to_writer_pretty(&mut out, &serde_json::json!({"verdict": "fail"})).unwrap();
        out.flush().unwrap();
        assert_eq!(out.inner.taken, b"hello");
        assert!(
            out.failed
                .as_ref()
                .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
        );
        out.finish();
    }
}
