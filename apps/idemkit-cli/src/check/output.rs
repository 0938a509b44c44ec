//! The report as a table for people or as JSON for machines.

use std::io::Write;

use idemkit_check::{KeyPlacement, Report, Verdict};
use serde::Serialize;

use super::Plan;

fn key_text(plan: &Plan) -> String {
    match (plan.config.template().key(), &plan.grpc) {
        (KeyPlacement::Header(h), Some(_)) => format!("key in metadata {h}"),
        (KeyPlacement::Field(_), Some((_, Some(field)))) => format!("key in field {field} (a UUID4)"),
        (KeyPlacement::Field(pointer), Some(_)) => format!("key in the message at {pointer}"),
        (KeyPlacement::Header(_), None) => format!("key in header {}", plan.key_header),
        (KeyPlacement::Field(pointer), None) => format!("key in body at {pointer}"),
    }
}

/// `POST http://…/orders`, or `gRPC pkg.Service/Method at http://host:port`.
fn target_text(plan: &Plan) -> String {
    match &plan.grpc {
        Some((method, _)) => format!(
            "gRPC {method} at {}",
            plan.url
                .as_str()
                .trim_end_matches(method.as_str())
                .trim_end_matches('/')
        ),
        None => format!("{} {}", plan.config.template().method(), plan.url),
    }
}

fn probe_text(plan: &Plan) -> String {
    match &plan.count_url {
        Some(u) => format!("count probe {u}"),
        None => "no count probe".to_owned(),
    }
}

/// The table: one row per gate (gate, verdict, evidence), then for every gate that
/// did not pass what it asserts and its details, then the totals.
pub(super) fn table(out: &mut impl Write, plan: &Plan, report: &Report) -> anyhow::Result<()> {
    writeln!(
        out,
        "idemkit check: {} ({}; {}; {} at once)\n",
        target_text(plan),
        key_text(plan),
        probe_text(plan),
        plan.config.concurrency()
    )?;
    let gate_w = report
        .gates
        .iter()
        .map(|g| g.gate.name().len() + 3)
        .chain([4])
        .max()
        .unwrap_or(4);
    let verdict_w = report
        .gates
        .iter()
        .map(|g| g.verdict.to_string().len())
        .chain(["inconclusive".len()])
        .max()
        .unwrap_or(12);
    writeln!(out, "{:<gate_w$}  {:<verdict_w$}  evidence", "gate", "verdict")?;
    writeln!(out, "{:-<gate_w$}  {:-<verdict_w$}  {:-<8}", "", "", "")?;
    for g in &report.gates {
        let name = format!("{} {}", g.number, g.gate.name());
        writeln!(
            out,
            "{name:<gate_w$}  {:<verdict_w$}  {}",
            g.verdict.to_string(),
            g.evidence
        )?;
    }
    let unhappy: Vec<_> = report
        .gates
        .iter()
        .filter(|g| g.verdict != Verdict::Pass)
        .collect();
    if !unhappy.is_empty() {
        writeln!(out)?;
        for g in unhappy {
            writeln!(
                out,
                "{} {} ({}): {}",
                g.number,
                g.gate.name(),
                g.verdict,
                g.gate.asserts()
            )?;
            for d in &g.details {
                writeln!(out, "  - {d}")?;
            }
        }
    }
    let not_applicable = match report.count(Verdict::NotApplicable) {
        0 => String::new(),
        n => format!(", {n} not applicable"),
    };
    writeln!(
        out,
        "\n{} gate(s): {} pass, {} fail, {} inconclusive{not_applicable} → exit {}",
        report.gates.len(),
        report.count(Verdict::Pass),
        report.count(Verdict::Fail),
        report.count(Verdict::Inconclusive),
        report.exit_code()
    )?;
    out.flush()?;
    Ok(())
}

#[derive(Serialize)]
struct JsonReport<'a> {
    target: Target<'a>,
    verdict: Verdict,
    exit_code: u8,
    gates: &'a [idemkit_check::GateReport],
}

#[derive(Serialize)]
struct Target<'a> {
    /// `http` or `grpc`.
    protocol: &'static str,
    /// The gRPC method (`pkg.Service/Method`), over gRPC.
    #[serde(skip_serializing_if = "Option::is_none")]
    grpc_method: Option<&'a str>,
    method: &'a str,
    url: &'a str,
    key: String,
    count_url: Option<&'a str>,
    concurrency: usize,
}

/// The report as one JSON document (`verdict`, `exit_code`, `gates[]` with `gate`,
/// `number`, `verdict`, `evidence`, `details`, `requests`).
pub(super) fn json(out: &mut impl Write, plan: &Plan, report: &Report) -> anyhow::Result<()> {
    let doc = JsonReport {
        target: Target {
            protocol: if plan.grpc.is_some() { "grpc" } else { "http" },
            grpc_method: plan.grpc.as_ref().map(|(m, _)| m.as_str()),
            method: plan.config.template().method().as_str(),
            url: plan.url.as_str(),
            key: key_text(plan),
            count_url: plan.count_url.as_ref().map(|u| u.as_str()),
            concurrency: plan.config.concurrency(),
        },
        verdict: report.verdict(),
        exit_code: report.exit_code(),
        gates: &report.gates,
    };
    serde_json::to_writer_pretty(&mut *out, &doc)?;
    writeln!(out)?;
    out.flush()?;
    Ok(())
}
