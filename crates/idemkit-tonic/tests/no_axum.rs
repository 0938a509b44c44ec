//! A gRPC-only service builds no HTTP framework beyond tonic's own: this crate
//! depends on the engine crate, not on the axum adapter, and the engine's axum
//! support stays behind its feature.

use std::path::Path;

/// The `[dependencies]` table of a manifest, as lines.
fn dependencies(manifest: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(manifest).unwrap();
    let start = text.find("\n[dependencies]\n").expect("a [dependencies] table");
    let rest = &text[start + "\n[dependencies]\n".len()..];
    let end = rest.find("\n[").unwrap_or(rest.len());
    rest[..end].lines().map(str::to_owned).collect()
}

#[test]
fn the_grpc_adapter_depends_on_no_axum() {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let deps = dependencies(&here.join("Cargo.toml"));
    assert!(deps.iter().any(|l| l.starts_with("idemkit-engine ")), "{deps:?}");
    for banned in ["idemkit-tower ", "axum "] {
        assert!(
            !deps.iter().any(|l| l.starts_with(banned)),
            "idemkit-tonic depends on {banned}"
        );
    }
    for line in deps.iter().filter(|l| l.starts_with("idemkit-engine ")) {
        assert!(
            !line.contains("axum"),
            "idemkit-tonic turns on the engine's axum feature: {line}"
        );
    }
    let engine = dependencies(&here.join("../idemkit-engine/Cargo.toml"));
    let axum = engine
        .iter()
        .find(|l| l.starts_with("axum "))
        .expect("the engine's axum dependency");
    assert!(
        axum.contains("optional = true"),
        "the engine's axum is not optional: {axum}"
    );
}

/// The resolved graph, not only the manifest: nothing this crate builds
/// (normal dependencies, default features) pulls axum in.
#[test]
fn no_dependency_of_the_grpc_adapter_pulls_axum_in() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "idemkit-tonic",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let tree = String::from_utf8(out.stdout).unwrap();
    assert!(tree.lines().any(|l| l.starts_with("idemkit-engine ")), "{tree}");
    let pulled: Vec<&str> = tree
        .lines()
        .filter(|l| l.starts_with("axum ") || l.starts_with("idemkit-tower "))
        .collect();
    assert!(pulled.is_empty(), "idemkit-tonic builds {pulled:?}");
}
