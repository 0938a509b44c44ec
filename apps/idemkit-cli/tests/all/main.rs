//! Black-box tests of `idemkit check`: the real binary against the quickstart (a real
//! process with its own SQLite file) and against in-process fixtures implementing a
//! correct design and the classic broken ones.

use std::process::Command;

use serde_json::Value;

mod broken;
mod claims;
mod cli;
mod cluster;
mod courier;
mod fixtures;
mod grpc;
#[cfg(feature = "grpc")]
mod grpc_check;
mod keys;
mod labels;
mod lint_openapi;
mod metrics;
mod operations_doc;
mod policy;
mod proxy;
mod proxy_docs;
mod quickstart;
mod readme;
mod repeatable;
mod soak;

/// The Redis Cluster harness of idemkit-redis's tests (std only).
#[path = "../../../../crates/idemkit-redis/tests/all/harness.rs"]
mod redis_harness;

/// What one `idemkit` run left behind.
#[derive(Debug)]
pub(crate) struct Run {
    pub(crate) code: i32,
    pub(crate) stdout: String,
    pub(crate) stderr: String,
}

impl Run {
    /// The `--json` report.
    pub(crate) fn report(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:#?}"))
    }

    /// `gate → verdict` for every gate in the `--json` report, in run order.
    pub(crate) fn verdicts(&self) -> Vec<(String, String)> {
        self.report()["gates"]
            .as_array()
            .expect("gates")
            .iter()
            .map(|g| {
                (
                    g["gate"].as_str().unwrap().to_owned(),
                    g["verdict"].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    /// The evidence of one gate in the `--json` report.
    pub(crate) fn evidence(&self, gate: &str) -> String {
        let report = self.report();
        let g = report["gates"]
            .as_array()
            .unwrap()
            .iter()
            .find(|g| g["gate"] == gate)
            .unwrap_or_else(|| panic!("no gate {gate}: {self:#?}"));
        g["evidence"].as_str().unwrap().to_owned()
    }
}

/// Runs the real `idemkit` binary with `args` (off the async runtime's threads, so
/// in-process fixtures keep serving).
pub(crate) async fn idemkit(args: Vec<String>) -> Run {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(env!("CARGO_BIN_EXE_idemkit"))
            .args(&args)
            .env_remove("RUST_LOG")
            .output()
            .expect("run idemkit");
        Run {
            code: out.status.code().expect("exit code"),
            stdout: String::from_utf8(out.stdout).unwrap(),
            stderr: String::from_utf8(out.stderr).unwrap(),
        }
    })
    .await
    .unwrap()
}

/// `idemkit check` arguments for an orders endpoint at `base`: bearer `checker`,
/// JSON order body, count probe, second account `other`, plus `extra`.
pub(crate) fn check_args(base: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "check",
        "--url",
        &format!("{base}/orders"),
        "--header",
        "Authorization: Bearer checker",
        "--body",
        r#"{"sku":"BOOK-1","quantity":1}"#,
        "--count-url",
        "/orders/count",
        "--other-account-header",
        "Authorization: Bearer other",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `[(gate, verdict)]` in gate order, from short names.
pub(crate) fn expect(verdicts: &[(&str, &str)]) -> Vec<(String, String)> {
    verdicts
        .iter()
        .map(|(g, v)| (g.to_string(), v.to_string()))
        .collect()
}
