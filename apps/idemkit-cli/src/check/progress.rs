//! The progress bar: one bar per gate, counting its requests, on stderr. Hidden
//! when stderr is not a terminal and with `--json`.

use idemkit_check::{Gate, GateReport, Progress};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub(super) struct Bar {
    bar: ProgressBar,
}

impl Bar {
    pub(super) fn new(visible: bool) -> Self {
        let target = if visible {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let bar = ProgressBar::with_draw_target(Some(0), target);
        bar.set_style(
            ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} requests {elapsed}")
                .expect("a valid progress template")
                .progress_chars("=> "),
        );
        Self { bar }
    }

    pub(super) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Progress for Bar {
    fn gate_started(&self, gate: Gate) {
        self.bar.reset();
        self.bar.set_length(0);
        self.bar.set_prefix(format!("{} {}", gate.number(), gate.name()));
    }

    fn planned(&self, n: usize) {
        self.bar.inc_length(n as u64);
    }

    fn request_done(&self) {
        self.bar.inc(1);
    }

    fn gate_finished(&self, report: &GateReport) {
        // A no-op on a hidden bar.
        self.bar.println(format!(
            "{:>16}  {}",
            format!("{} {}", report.number, report.gate),
            report.verdict
        ));
    }
}
