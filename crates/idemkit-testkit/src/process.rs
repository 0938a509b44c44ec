//! Finding the binaries black-box tests start as real processes.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The path of the workspace example `example`, built for the profile the calling
/// test was built with. It is (re)built once per test process with
/// `cargo build --workspace --all-features`, the feature set CI's test run
/// builds with, so the call is a no-op there, and a test in another package
/// never runs a stale binary.
pub fn example_bin(example: &str) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>
    let profile_dir = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("target profile directory");
    let bin = profile_dir.join("examples").join(example);
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.iter().any(|b| b == example) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "--quiet",
            "--workspace",
            "--all-features",
            "--example",
            example,
        ]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build --example {example} failed");
        built.push(example.to_owned());
    }
    bin
}
