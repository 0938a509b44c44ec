//! `idemkit lint-openapi`: the contract's first step, automated. Every
//! state-changing operation of an OpenAPI document either takes an idempotency key
//! or is documented as not retry-safe; this lists them with where their key travels
//! and one verdict each (`docs/x-idempotency.md` has the rules and the extension it
//! reads).

use std::io::Write;
use std::process::ExitCode;

use anyhow::{Context, bail};
use clap::Args;
use idemkit_lint::{Document, LintReport, Options};

const AFTER_HELP: &str = "\
Verdicts: keyed (the key travels in a header, a body field, or where x-idempotency says),
retry_unsafe (x-idempotency: {\"retrySafe\": false}), claimed_idempotent (a PUT or DELETE
without a key: verify it with `idemkit check --gates claimed-idempotent`), safe
(x-idempotency: {\"safe\": true}, a read that uses a write method), missing (a POST or
PATCH without a key).

Exit status: 0 nothing is missing; 1 an operation is missing a key; 2 the document
cannot be read.

Reads OpenAPI 3.0 and 3.1 and Swagger 2.0, JSON or YAML; local $refs are followed,
references to other files or URLs are not (each is noted).";

/// Arguments of `idemkit lint-openapi`.
#[derive(Debug, Clone, Args)]
#[command(after_help = AFTER_HELP)]
pub struct LintArgs {
    /// The document: a file, `-` for standard input, or an http:// URL.
    #[arg(value_name = "FILE|URL")]
    pub source: String,

    /// A header that carries the key (repeatable; case-insensitive). Replaces the
    /// default, Idempotency-Key.
    #[arg(long = "key-header", value_name = "NAME")]
    pub key_headers: Vec<String>,

    /// A request-body property that carries the key (repeatable). Replaces the
    /// defaults, idempotency_key and idempotencyKey.
    #[arg(long = "key-field", value_name = "NAME")]
    pub key_fields: Vec<String>,

    /// Print the result as JSON: {"operations": [...], "summary": {...}}.
    #[arg(long)]
    pub json: bool,
}

/// Runs `idemkit lint-openapi`: exit 0 nothing missing, 1 something missing; a
/// document that cannot be read is an error (exit 2).
pub fn run(args: LintArgs) -> anyhow::Result<ExitCode> {
    let doc = load(&args.source)?;
    let mut options = Options::default();
    if !args.key_headers.is_empty() {
        options.key_headers = args.key_headers.iter().map(|h| h.trim().to_owned()).collect();
    }
    if !args.key_fields.is_empty() {
        options.key_fields = args
            .key_fields
            .iter()
            .map(|f| f.trim().trim_start_matches('/').to_owned())
            .collect();
    }
    let report = LintReport::new(&doc, &options);
    let mut out = crate::VerdictOutput::new(std::io::stdout().lock());
    if args.json {
        serde_json::to_writer_pretty(&mut out, &report)?;
        writeln!(out)?;
    } else {
        report.write_table(&mut out, &args.source, &doc)?;
    }
    out.finish();
    Ok(ExitCode::from(report.exit_code()))
}

/// Reads `source`: `-` for standard input, an `http://` URL, or a file path.
fn load(source: &str) -> anyhow::Result<Document> {
    let text = if source == "-" {
        std::io::read_to_string(std::io::stdin()).context("reading standard input")?
    } else if source.starts_with("http://") || source.starts_with("https://") {
        fetch(source)?
    } else {
        std::fs::read_to_string(source).with_context(|| format!("reading {source}"))?
    };
    Document::parse(&text).with_context(|| format!("reading {source}"))
}

/// `GET url` (plain http: the binary carries no TLS stack).
fn fetch(url: &str) -> anyhow::Result<String> {
    if url.starts_with("https://") {
        bail!(
            "{url}: https is not supported (the binary carries no TLS stack); download the document and pass the file"
        );
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async {
        let client = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .no_proxy()
            .build()?;
        let res = client
            .get(url)
            .header("accept", "application/json, application/yaml;q=0.9, */*;q=0.1")
            .send()
            .await
            .with_context(|| format!("fetching {url}"))?;
        let status = res.status();
        if !status.is_success() {
            bail!("fetching {url}: the server answered {status}");
        }
        res.text().await.with_context(|| format!("reading {url}"))
    })
}
