//! Finding the binaries black-box tests start as real processes.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The path of `package`'s example `example`, built for the profile the calling
/// test was built with. It is (re)built once per test process with `cargo build`,
/// so a test in another package never runs a stale binary.
pub fn example_bin(package: &str, example: &str) -> PathBuf {
    example_bin_with(package, example, &[])
}

/// [`example_bin`] for an example that needs cargo features of its package.
pub fn example_bin_with(package: &str, example: &str, features: &[&str]) -> PathBuf {
    static BUILT: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> → target/<profile>
    let profile_dir = exe
        .parent()
        .and_then(|p| p.parent())
        .expect("target profile directory");
    let bin = profile_dir.join("examples").join(example);
    let id = format!("{package}/{example}/{}", features.join(","));
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if !built.contains(&id) {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args(["build", "--quiet", "-p", package, "--example", example]);
        if !features.is_empty() {
            cmd.arg("--features").arg(features.join(","));
        }
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(
            status.success(),
            "cargo build -p {package} --example {example} failed"
        );
        built.push(id);
    }
    bin
}
