//! The command's surface: table output, exit codes, inconclusive verdicts, refused
//! hosts, broken pipes.

use std::process::{Command, Stdio};

use crate::fixtures::{Design, Fixture};
use crate::{check_args, expect, idemkit};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_shows_gate_verdict_evidence_and_details() {
    let fixture = Fixture::start(Design::Unscoped).await;
    let run = idemkit(check_args(&fixture.base, &["--gates", "replay,isolation"])).await;
    assert_eq!(run.code, 1, "{run:#?}");
    let out = &run.stdout;
    assert!(out.contains("gate"), "{out}");
    assert!(out.contains("verdict"), "{out}");
    assert!(out.contains("evidence"), "{out}");
    let row = |gate: &str| {
        out.lines()
            .find(|l| l.starts_with(gate))
            .unwrap_or_else(|| panic!("no row for {gate}: {out}"))
            .to_owned()
    };
    assert!(row("2 replay").contains(" pass "), "{out}");
    let isolation = row("6 isolation");
    assert!(isolation.contains(" fail "), "{out}");
    assert!(isolation.contains("the first account's stored response"), "{out}");
    assert!(
        out.contains("6 isolation (fail): the same key from another account"),
        "{out}"
    );
    assert!(
        out.contains("2 gate(s): 1 pass, 1 fail, 0 inconclusive → exit 1"),
        "{out}"
    );
    assert!(
        run.stderr.is_empty(),
        "no progress bar off a terminal: {}",
        run.stderr
    );
}

/// Without a probe, the gates that need to count effects cannot pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_probe_is_inconclusive() {
    let fixture = Fixture::start(Design::Correct).await;
    let run = idemkit(vec![
        "check".into(),
        "--url".into(),
        format!("{}/orders", fixture.base),
        "-H".into(),
        "Authorization: Bearer noprobe".into(),
        "-d".into(),
        r#"{"sku":"A","quantity":1}"#.into(),
        "--json".into(),
    ])
    .await;
    assert_eq!(
        run.verdicts(),
        expect(&[
            ("concurrency", "inconclusive"),
            ("replay", "inconclusive"),
            ("mismatch", "inconclusive"),
            ("in-progress", "pass"),
            ("bad-keys", "inconclusive"),
            ("isolation", "inconclusive"),
            ("fresh-key", "inconclusive"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.code, 2);
    assert!(run.evidence("concurrency").contains("no count probe"), "{run:#?}");
    assert!(
        run.evidence("replay")
            .contains("whether one of them ran again is unseen"),
        "{run:#?}"
    );
    assert!(
        run.evidence("isolation").contains("no second account"),
        "{run:#?}"
    );
}

/// Nothing listening: every gate is inconclusive (exit 2), none passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_inconclusive() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let run = idemkit(check_args(
        &format!("http://127.0.0.1:{port}"),
        &["--json", "--timeout", "5"],
    ))
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(
        run.verdicts().iter().all(|(_, v)| v == "inconclusive"),
        "{run:#?}"
    );
    assert!(run.evidence("replay").contains("no answer"), "{run:#?}");
}

/// Check traffic goes to loopback unless a host is named with --allow-host.
#[tokio::test]
async fn other_hosts_are_refused_unless_named() {
    let run = idemkit(check_args("http://192.0.2.1:80", &[])).await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stdout.is_empty());
    assert!(
        run.stderr.contains(
            "refusing to send check traffic to `192.0.2.1`: only loopback hosts are checked unless named with --allow-host 192.0.2.1"
        ),
        "{run:#?}"
    );
}

#[tokio::test]
async fn usage_errors_and_help() {
    let run = idemkit(vec![
        "check".into(),
        "--url".into(),
        "http://127.0.0.1:1/x".into(),
        "--gates".into(),
        "speed".into(),
    ])
    .await;
    assert_eq!(run.code, 2, "{run:#?}");
    assert!(run.stderr.contains("unknown gate `speed`"), "{run:#?}");

    let run = idemkit(vec!["check".into(), "--help".into()]).await;
    assert_eq!(run.code, 0);
    for gate in [
        "concurrency",
        "replay",
        "mismatch",
        "in-progress",
        "bad-keys",
        "isolation",
        "fresh-key",
    ] {
        assert!(run.stdout.contains(gate), "{gate}: {}", run.stdout);
    }
    assert!(run.stdout.contains("--allow-host"));
}

/// Runs the real binary with its stdout on a real pipe whose read end is closed
/// before the command writes anything (`idemkit … | head -0`), and returns the
/// exit code and stderr.
pub(crate) async fn with_closed_stdout(
    args: Vec<String>,
    env: Vec<(String, String)>,
) -> (Option<i32>, String) {
    tokio::task::spawn_blocking(move || {
        let mut child = Command::new(env!("CARGO_BIN_EXE_idemkit"))
            .args(&args)
            .envs(env)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The only read end: from here every write to stdout is EPIPE.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

/// A closed stdout (`idemkit check … | head`) never changes the exit code: it is
/// the verdict's, in table and JSON output alike (a failing check must not pass
/// as 0, a passing one must not fail as 2), and stderr does not complain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_keeps_the_verdicts_exit_code() {
    for (design, verdict) in [(Design::Unscoped, 1), (Design::Correct, 0)] {
        let fixture = Fixture::start(design).await;
        for json in [false, true] {
            let mut extra = vec!["--gates", "isolation"];
            if json {
                extra.push("--json");
            }
            let (code, stderr) = with_closed_stdout(check_args(&fixture.base, &extra), vec![]).await;
            assert_eq!(
                code,
                Some(verdict),
                "{design:?}, json {json}: the exit code is the verdict's; stderr: {stderr}"
            );
            assert!(
                !stderr.contains("Broken pipe"),
                "{design:?}, json {json}: {stderr}"
            );
        }
    }
}
