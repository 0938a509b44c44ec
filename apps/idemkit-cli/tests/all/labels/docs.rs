//! The `idemkit check` command that `docs/check.md` shows under "Against the
//! reference service" is run as written (ports substituted) against the real
//! labels service, and must pass every gate it runs.

use super::*;

const CHECK_MD: &str = include_str!("../../../../../docs/check.md");

/// The marker comment that names the command CI runs.
const MARKER: &str = "<!-- ci: labels-check -->";

/// The first ```sh block after `marker`.
pub(crate) fn block_after(doc: &str, marker: &str) -> String {
    let at = doc
        .find(marker)
        .unwrap_or_else(|| panic!("no `{marker}` in the document"));
    let rest = &doc[at + marker.len()..];
    let start = rest.find("```sh\n").expect("a ```sh block after the marker") + "```sh\n".len();
    let end = rest[start..].find("\n```").expect("the block ends");
    rest[start..start + end].to_owned()
}

/// A shell command line split into words: backslash-newline continues the line,
/// single quotes keep everything, double quotes keep everything but `\"` and `\\`.
pub(crate) fn words(command: &str) -> Vec<String> {
    let text = command.replace("\\\n", " ");
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                for q in chars.by_ref() {
                    if q == '\'' {
                        break;
                    }
                    w.push(q);
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some(q) = chars.next() {
                    match q {
                        '"' => break,
                        '\\' => {
                            if let Some(e) = chars.next() {
                                w.push(e);
                            }
                        }
                        q => w.push(q),
                    }
                }
            }
            c if c.is_whitespace() => {
                if let Some(w) = word.take() {
                    words.push(w);
                }
            }
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    words
}

#[test]
fn command_lines_split_like_a_shell() {
    assert_eq!(
        words("idemkit check --url x \\\n  -H 'A: b c' --body '{\"k\":1}' \"q\\\"d\""),
        [
            "idemkit",
            "check",
            "--url",
            "x",
            "-H",
            "A: b c",
            "--body",
            "{\"k\":1}",
            "q\"d"
        ]
    );
}

/// Runs the ```sh block after `marker` as written, against a fresh labels
/// service and courier (the documented ports replaced by theirs), with `--json`.
async fn run_documented(marker: &str) -> crate::Run {
    let block = block_after(CHECK_MD, marker);
    assert!(!block.contains("\n\n"), "one command: {block}");
    let mut args = words(&block);
    assert_eq!(args.first().map(String::as_str), Some("idemkit"), "{block}");
    args.remove(0);
    assert_eq!(args.first().map(String::as_str), Some("check"), "{block}");
    let labels = Labels::start();
    let args: Vec<String> = args
        .into_iter()
        .map(|a| {
            a.replace("http://127.0.0.1:8080", &labels.base)
                .replace("http://127.0.0.1:8081", &labels.courier)
        })
        .chain(["--json".to_owned()])
        .collect();
    crate::idemkit(args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_check_passes_against_the_labels_service() {
    let run = run_documented(MARKER).await;
    assert_eq!(run.code, 0, "the documented check does not pass: {run:#?}");
    let verdicts = run.verdicts();
    let names: Vec<&str> = verdicts.iter().map(|(g, _)| g.as_str()).collect();
    assert_eq!(
        names,
        [
            "concurrency",
            "replay",
            "mismatch",
            "in-progress",
            "bad-keys",
            "isolation",
            "fresh-key",
            "policy"
        ],
        "the gates the documentation promises: {run:#?}"
    );
    for (gate, verdict) in &verdicts {
        assert_eq!(verdict, "pass", "gate {gate}: {}", run.evidence(gate));
    }
    assert_eq!(run.report()["verdict"], "pass");
}

/// The gRPC command of `docs/check.md`: gates 1-7 pass, the policy gate does not
/// apply over gRPC.
#[cfg(feature = "grpc")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_grpc_check_passes_against_the_labels_service() {
    let run = run_documented("<!-- ci: labels-grpc-check -->").await;
    assert_eq!(run.code, 0, "the documented gRPC check does not pass: {run:#?}");
    assert_eq!(
        run.verdicts(),
        crate::expect(&[
            ("concurrency", "pass"),
            ("replay", "pass"),
            ("mismatch", "pass"),
            ("in-progress", "pass"),
            ("bad-keys", "pass"),
            ("isolation", "pass"),
            ("fresh-key", "pass"),
            ("policy", "not-applicable"),
        ]),
        "{run:#?}"
    );
    assert_eq!(run.report()["target"]["protocol"], "grpc");
}
