//! # idemkit-lint
//!
//! The first step of an idempotency contract, automated: every state-changing
//! operation of an OpenAPI document (OpenAPI 3.0, 3.1 or Swagger 2.0, JSON or YAML)
//! either takes an idempotency key or is documented as not retry-safe. [`lint`] lists
//! them with where their key travels (a header, a body field, or where the
//! `x-idempotency` extension says) and one [`Verdict`] each. The `idemkit
//! lint-openapi` command is a thin wrapper over this crate.
//!
//! ```
//! use idemkit_lint::{Document, LintReport, Options, Verdict};
//!
//! let doc = Document::parse(r#"{
//!   "openapi": "3.1.0",
//!   "info": {"title": "orders", "version": "1"},
//!   "paths": {
//!     "/orders": {"post": {
//!       "parameters": [{"name": "Idempotency-Key", "in": "header", "required": true}],
//!       "responses": {"201": {"description": "created"}}
//!     }},
//!     "/refunds": {"post": {"responses": {"201": {"description": "created"}}}}
//!   }
//! }"#)?;
//! let report = LintReport::new(&doc, &Options::default());
//! assert_eq!(report.operations[0].verdict, Verdict::Keyed);
//! assert_eq!(report.operations[1].verdict, Verdict::Missing);
//! assert_eq!(report.exit_code(), 1); // a key is missing
//! # Ok::<(), idemkit_lint::DocumentError>(())
//! ```
//!
//! The rules and the extension are described in the guide's `x-idempotency` page.

mod document;
mod rules;

use std::collections::BTreeMap;
use std::io::Write;

use serde::Serialize;

pub use document::{Document, DocumentError};
pub use rules::{Key, Operation, Options, Verdict, lint};

/// The lint's result.
#[derive(Debug, Serialize)]
#[non_exhaustive]
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

    /// Writes the report as a table: one group per verdict with its count,
    /// `missing` first, then a summary line. `source` names the document read.
    pub fn write_table(&self, out: &mut impl Write, source: &str, doc: &Document) -> std::io::Result<()> {
        writeln!(
            out,
            "idemkit lint-openapi: {source} ({}, {} state-changing operation(s))",
            doc.kind(),
            self.operations.len()
        )?;
        let path_w = self
            .operations
            .iter()
            .map(|o| o.path.chars().count())
            .max()
            .unwrap_or(4)
            .min(60);
        for verdict in Verdict::ALL {
            let ops: Vec<&Operation> = self.operations.iter().filter(|o| o.verdict == verdict).collect();
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
            .map(|v| format!("{} {}", self.summary[v.as_str()], v.as_str()))
            .collect();
        writeln!(
            out,
            "\n{} operation(s): {} → exit {}",
            self.operations.len(),
            counts.join(", "),
            self.exit_code()
        )?;
        out.flush()
    }
}
