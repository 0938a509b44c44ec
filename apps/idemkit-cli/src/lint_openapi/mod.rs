//! `idemkit lint-openapi`: the contract's first step, automated. Every
//! state-changing operation of an OpenAPI document either takes an idempotency key
//! or is documented as not retry-safe; this lists them with where their key travels
//! and one verdict each (`docs/x-idempotency.md` has the rules and the extension it
//! reads).

mod document;
mod rules;

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use clap::Args;
use serde::Serialize;

pub use document::Document;
pub use rules::{Key, Operation, Options, Verdict, lint};

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

/// The lint's result.
#[derive(Debug, Serialize)]
pub struct LintReport {
    /// Every state-changing operation, by path then method.
    pub operations: Vec<Operation>,
    /// How many operations got each verdict (every verdict, zeros included).
    pub summary: BTreeMap<&'static str, usize>,
}

impl LintReport {
    /// Lints `doc`.
    pub fn new(doc: &Document, options: &Options) -> Self {
        let operations = lint(doc, options);
        let summary = Verdict::ALL
            .iter()
            .map(|v| (v.as_str(), operations.iter().filter(|o| o.verdict == *v).count()))
            .collect();
        Self { operations, summary }
    }

    /// 0 nothing is missing, 1 something is.
    pub fn exit_code(&self) -> u8 {
        u8::from(self.operations.iter().any(|o| o.verdict == Verdict::Missing))
    }
}

/// Runs `idemkit lint-openapi`: exit 0 nothing missing, 1 something missing; a
/// document that cannot be read is an error (exit 2).
pub fn run(args: LintArgs) -> anyhow::Result<ExitCode> {
    let doc = Document::load(&args.source)?;
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
        table(&mut out, &args.source, &doc, &report)?;
    }
    out.finish();
    Ok(ExitCode::from(report.exit_code()))
}

/// The table: one group per verdict with its count, `missing` first.
fn table(out: &mut impl Write, source: &str, doc: &Document, report: &LintReport) -> std::io::Result<()> {
    writeln!(
        out,
        "idemkit lint-openapi: {source} ({}, {} state-changing operation(s))",
        doc.kind(),
        report.operations.len()
    )?;
    let path_w = report
        .operations
        .iter()
        .map(|o| o.path.chars().count())
        .max()
        .unwrap_or(4)
        .min(60);
    for verdict in Verdict::ALL {
        let ops: Vec<&Operation> = report
            .operations
            .iter()
            .filter(|o| o.verdict == verdict)
            .collect();
        if ops.is_empty() {
            continue;
        }
        writeln!(out, "\n{} ({})", verdict.as_str(), ops.len())?;
        for o in ops {
            let key = match &o.key {
                Some(k) => format!("key in {} {}", k.location, k.name),
                None => "no key".to_owned(),
            };
            let id = o
                .operation_id
                .as_deref()
                .map_or_else(String::new, |id| format!("  ({id})"));
            writeln!(out, "  {:<6} {:<path_w$}  {key}{id}", o.method, o.path)?;
            for n in &o.notes {
                writeln!(out, "         - {n}")?;
            }
        }
    }
    let counts: Vec<String> = Verdict::ALL
        .iter()
        .map(|v| format!("{} {}", report.summary[v.as_str()], v.as_str()))
        .collect();
    writeln!(
        out,
        "\n{} operation(s): {} → exit {}",
        report.operations.len(),
        counts.join(", "),
        report.exit_code()
    )?;
    out.flush()
}
