//! `idemkit docs`: the integrator contract, generated from a configuration.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use idemkit_client::RetryConfig;
use idemkit_labels::docs::{Format, default_config, render};
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
    /// The idempotency configuration (TOML); default: the labels service's.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = DocsFormat::Markdown)]
    pub format: DocsFormat,
}

/// Prints the contract to stdout.
pub fn run(args: DocsArgs) -> anyhow::Result<ExitCode> {
    let config = match &args.config {
        Some(path) => IdemkitConfig::from_toml(
            &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        )?,
        None => default_config(),
    };
    let format = match args.format {
        DocsFormat::Markdown => Format::Markdown,
        DocsFormat::Html => Format::Html,
    };
    std::io::stdout()
        .lock()
        .write_all(render(&config, &RetryConfig::new(), format).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
