//! The `idemkit keys` synopsis of `docs/operations.md` names exactly the flags
//! each subcommand's `--help` lists, so the page cannot drift from the binary.

use std::collections::BTreeSet;
use std::process::Command;

const OPERATIONS_MD: &str = include_str!("../../../../docs/operations.md");

/// Flags every subcommand takes, described once in the page's prose.
const GLOBAL: [&str; 3] = ["--help", "--pg-schema", "--json"];

fn flags(text: &str) -> BTreeSet<String> {
    text.split(|c: char| c.is_whitespace() || "[]|=,".contains(c))
        .filter(|w| w.starts_with("--") && w.len() > 2)
        .map(|w| w.trim_end_matches(['.', ')']).to_owned())
        .filter(|w| !GLOBAL.contains(&w.as_str()))
        .collect()
}

/// The synopsis block: each subcommand's lines (continuations included),
/// without their `#` comments.
fn synopsis(sub: &str) -> String {
    let start = OPERATIONS_MD.find("idemkit keys list").expect("the synopsis");
    let block = &OPERATIONS_MD[start..start + OPERATIONS_MD[start..].find("```").unwrap()];
    let mut out = String::new();
    let mut inside = false;
    for line in block.lines() {
        if let Some(rest) = line.strip_prefix("idemkit keys ") {
            inside = rest.split_whitespace().next() == Some(sub);
        }
        if inside {
            out.push_str(line.split('#').next().unwrap_or_default());
            out.push('\n');
        }
    }
    out
}

#[test]
fn the_keys_synopsis_names_every_flag_of_each_subcommand() {
    let mut wrong = Vec::new();
    for sub in ["list", "show", "release", "complete", "reap", "review"] {
        let help = Command::new(env!("CARGO_BIN_EXE_idemkit"))
            .args(["keys", sub, "--help"])
            .output()
            .unwrap();
        assert!(help.status.success(), "keys {sub} --help");
        let help: BTreeSet<String> = String::from_utf8_lossy(&help.stdout)
            .lines()
            .filter_map(|l| {
                l.trim_start()
                    .trim_start_matches("-h, ")
                    .split_whitespace()
                    .next()
            })
            .filter(|w| w.starts_with("--"))
            .map(str::to_owned)
            .filter(|w| !GLOBAL.contains(&w.as_str()))
            .collect();
        let page = flags(&synopsis(sub));
        if page != help {
            wrong.push(format!(
                "keys {sub}: missing on the page {:?}, not in --help {:?}",
                help.difference(&page).collect::<Vec<_>>(),
                page.difference(&help).collect::<Vec<_>>()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "docs/operations.md's synopsis:\n{}",
        wrong.join("\n")
    );
}
