//! `idemkit docs`: the integrator contract, generated from a configuration.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use idemkit_contract::{Contract, Format};
use idemkit_tower::config::IdemkitConfig;

/// Output formats.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum DocsFormat {
    /// Markdown.
    Markdown,
    /// A standalone HTML page.
    Html,
}

/// Arguments of `idemkit docs`.
#[derive(Debug, clap::Args)]
pub struct DocsArgs {
    /// The idempotency configuration (TOML): the contract of any service that runs
    /// with it. Default: the labels service's own, with its examples and gRPC
    /// section.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = DocsFormat::Markdown)]
    pub format: DocsFormat,
}

/// Prints the contract to stdout.
pub fn run(args: DocsArgs) -> anyhow::Result<ExitCode> {
    let contract = match &args.config {
        Some(path) => Contract::new(IdemkitConfig::from_toml(
            &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        )?),
        None => idemkit_labels::contract::contract(&idemkit_labels::contract::default_config()),
    };
    let format = match args.format {
        DocsFormat::Markdown => Format::Markdown,
        DocsFormat::Html => Format::Html,
    };
    std::io::stdout()
        .lock()
        .write_all(contract.render(format).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
