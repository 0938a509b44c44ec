//! The repository's own docs against the code and against themselves: the
//! statuses that free a key are the engine's, and no doc cites something the
//! repository does not contain (a specification section by a number of a file
//! that is not here, an issue of a tracker).

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `README.md` and every page of `docs/`, but `docs/decisions.md`: an
/// append-only log whose older entries are never rewritten (its last entry
/// says how to read their citations).
fn pages() -> Vec<(String, String)> {
    let mut out = vec![("README.md".to_owned(), read(&root().join("README.md")))];
    let mut dirs = vec![root().join("docs")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "md") && !path.ends_with("decisions.md") {
                out.push((rel(&path), read(&path)));
            }
        }
    }
    out
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn rel(path: &Path) -> String {
    path.strip_prefix(root()).unwrap_or(path).display().to_string()
}

/// Runs of three or more `4xx` statuses written as a list (`400, 401 and
/// 403`, `` `400`/`422` ``), in a paragraph that speaks of freeing a key.
fn released_lists(text: &str) -> Vec<Vec<u16>> {
    let mut lists = Vec::new();
    for paragraph in text.split("\n\n") {
        let lower = paragraph.to_lowercase();
        if !(lower.contains("free") || lower.contains("releas") || lower.contains("not stored")) {
            continue;
        }
        // A parenthesis ends a list, as does any other word.
        let spaced = paragraph.replace(['(', ')'], " | ");
        let words = spaced
            .split(|c: char| c.is_whitespace() || ",`/".contains(c))
            .map(|w| w.trim_end_matches([':', '.', ';']))
            .filter(|w| !w.is_empty());
        let mut run: Vec<u16> = Vec::new();
        for word in words {
            match word.parse::<u16>() {
                Ok(n) if (400..500).contains(&n) && word.len() == 3 => run.push(n),
                _ if word == "and" || word == "or" => {}
                _ => {
                    if run.len() >= 3 {
                        lists.push(std::mem::take(&mut run));
                    }
                    run.clear();
                }
            }
        }
        if run.len() >= 3 {
            lists.push(run);
        }
    }
    lists
}

#[test]
fn the_statuses_that_free_a_key_are_the_engines() {
    let engine = idemkit_contract::released_statuses();
    assert_eq!(engine, [400, 401, 403, 408, 413, 415, 422, 425, 429]);
    let mut found = 0;
    let mut wrong = Vec::new();
    for (page, text) in pages() {
        for list in released_lists(&text) {
            found += 1;
            if list != engine {
                wrong.push(format!("{page}: {list:?}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "pages naming other statuses that free a key than the engine's {engine:?}:\n{}",
        wrong.join("\n")
    );
    // The spec, the proxy page (twice) and the generated contract state the list.
    assert!(found >= 4, "only {found} lists found: the scan is blind");
}

/// What a citation of something the repository does not contain looks like,
/// found in `line`.
fn foreign_citations(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    if line.contains("SPEC §") {
        found.push("SPEC §".to_owned());
    }
    let lower = line.to_lowercase();
    for word in ["issue ", "issues ", "issue #"] {
        let mut rest = lower.as_str();
        while let Some(at) = rest.find(word) {
            let after = &rest[at + word.len()..];
            if after.starts_with(|c: char| c.is_ascii_digit()) {
                found.push(format!(
                    "{word}{}",
                    after.split(|c: char| !c.is_ascii_digit()).next().unwrap_or("")
                ));
            }
            rest = after;
        }
    }
    let bytes = line.as_bytes();
    for (i, b) in bytes.iter().enumerate() {
        if *b != b'#' {
            continue;
        }
        let before = i.checked_sub(1).map(|j| bytes[j]);
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == b'&' || c == b'(' || c == b'/') {
            continue;
        }
        let digits = bytes[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
        let next = bytes.get(i + 1 + digits);
        if digits > 0 && !next.is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_') {
            found.push(String::from_utf8_lossy(&bytes[i..=i + digits]).into_owned());
        }
    }
    found
}

/// Doc comments (`///`, `//!`) of every crate's and app's sources, and the
/// `description` of every manifest.
fn rustdoc_and_manifests() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for top in ["crates", "apps"] {
        for krate in std::fs::read_dir(root().join(top)).unwrap() {
            let krate = krate.unwrap().path();
            let manifest = krate.join("Cargo.toml");
            if manifest.exists() {
                let text = read(&manifest);
                let description = text
                    .lines()
                    .filter(|l| l.starts_with("description"))
                    .collect::<Vec<_>>()
                    .join("\n");
                out.push((rel(&manifest), description));
            }
            let mut dirs = vec![krate.join("src")];
            while let Some(dir) = dirs.pop() {
                let Ok(entries) = std::fs::read_dir(&dir) else {
                    continue;
                };
                for entry in entries {
                    let path = entry.unwrap().path();
                    if path.is_dir() {
                        dirs.push(path);
                    } else if path.extension().is_some_and(|e| e == "rs") {
                        let docs = read(&path)
                            .lines()
                            .filter(|l| {
                                let t = l.trim_start();
                                t.starts_with("///") || t.starts_with("//!")
                            })
                            .collect::<Vec<_>>()
                            .join("\n");
                        out.push((rel(&path), docs));
                    }
                }
            }
        }
    }
    out
}

#[test]
fn no_doc_cites_what_the_repository_does_not_contain() {
    let mut found = Vec::new();
    for (file, text) in pages().into_iter().chain(rustdoc_and_manifests()) {
        for line in text.lines() {
            for citation in foreign_citations(line) {
                found.push(format!("{file}: `{citation}` in: {}", line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "docs citing a specification section or an issue a reader of the repository cannot see \
         (link to the guide's own page instead, e.g. docs/spec.md#3-record-states):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_citation_scan_sees_each_form() {
    for (line, expected) in [
        ("as SPEC §3 says", "SPEC §"),
        ("(issue 15)", "issue 15"),
        ("see #31.", "#31"),
        ("Issue 34 made it", "issue 34"),
    ] {
        assert!(
            foreign_citations(line).iter().any(|c| c == expected),
            "{line}: {:?}",
            foreign_citations(line)
        );
    }
    for clean in [
        "[section 3](#3-record-states)",
        "&#123;",
        "#[derive(Debug)]",
        "[§3](spec.md#3-record-states)",
        "the issuer 3",
    ] {
        assert!(
            foreign_citations(clean).is_empty(),
            "{clean}: {:?}",
            foreign_citations(clean)
        );
    }
}

/// The metrics page's table rows (`| `name` | kind | labels | … |`), by name.
fn metric_rows(page: &str) -> Vec<(String, String)> {
    page.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("| `")?;
            let name = &rest[..rest.find('`')?];
            Some((name.to_owned(), l.to_owned()))
        })
        .collect()
}

#[test]
fn the_metrics_page_names_every_metric_label_and_reason() {
    use idemkit_client::{FatalReason, Stop};
    use idemkit_tower::metrics as m;
    let page = read(&root().join("docs/metrics.md"));
    let rows = metric_rows(&page);
    let row = |name: &str| {
        rows.iter()
            .find(|(n, _)| n == name)
            .map(|(_, l)| l.clone())
            .unwrap_or_else(|| panic!("docs/metrics.md has no row for `{name}`"))
    };
    let mut missing = Vec::new();
    for (name, kind, label) in [
        (m::REQUESTS, "counter", Some("outcome")),
        (m::IN_FLIGHT, "gauge", None),
        (m::FENCED_WRITES, "counter", Some("op")),
        (m::COMPLETER_RESUMES, "counter", Some("result")),
        (m::ORPHANED_KEYS, "gauge", None),
        (m::REAPER_DELETED, "counter", None),
        (m::REAPER_REVIEW, "counter", None),
        (m::STORE_SECONDS, "histogram", Some("op")),
        ("idemkit_client_attempts_total", "counter", Some("outcome")),
        ("idemkit_client_retries_total", "counter", Some("reason")),
        ("idemkit_client_gave_up_total", "counter", Some("reason")),
        ("idemkit_client_budget_tokens", "gauge", Some("client")),
    ] {
        let line = row(name);
        if !line.contains(&format!("| {kind} |")) || label.is_some_and(|l| !line.contains(&format!("`{l}`")))
        {
            missing.push(format!("{name}: kind {kind}, label {label:?} in {line}"));
        }
    }
    for outcome in m::outcome::ALL {
        if !page.contains(&format!("| `{outcome}` |")) {
            missing.push(format!("outcome `{outcome}`"));
        }
    }
    let resumes = row(m::COMPLETER_RESUMES);
    for result in m::completer_result::ALL {
        if !resumes.contains(&format!("`{result}`")) {
            missing.push(format!("result `{result}`"));
        }
    }
    let ops = &page[page.find("### `op` of").expect("the op section")..];
    let ops = &ops[..ops.find("\n## ").unwrap_or(ops.len())];
    for op in [
        m::op::CLAIM,
        m::op::COMPLETE,
        m::op::RELEASE,
        m::op::ABANDON,
        m::op::HEARTBEAT,
        m::op::GET,
        m::op::BEGIN_FENCED,
        m::op::ADVANCE,
        m::op::COMMIT,
        m::op::PARK,
        m::op::ABANDONED,
        m::op::REAP,
    ] {
        if !ops.contains(&format!("`{op}`")) {
            missing.push(format!("op `{op}`"));
        }
    }
    let gave_up = row("idemkit_client_gave_up_total");
    let client = read(&root().join("docs/client.md"));
    let d = std::time::Duration::from_secs(1);
    for stop in [
        Stop::AttemptsExhausted,
        Stop::BudgetExhausted,
        Stop::DeadlineExceeded,
        Stop::RetryAfterPastDeadline { retry_after: d },
        Stop::RetryAfterAboveCap { retry_after: d },
        Stop::NotReplayable,
        Stop::RetryRefused,
        Stop::NotRetryable(FatalReason::NotAllowlisted),
    ] {
        let reason = format!("`{}`", stop.label());
        if !gave_up.contains(&reason) {
            missing.push(format!("metrics.md: gave-up reason {reason}"));
        }
        if !client.contains(&reason) {
            missing.push(format!("client.md: gave-up reason {reason}"));
        }
    }
    assert!(
        missing.is_empty(),
        "the metrics docs lack:\n{}",
        missing.join("\n")
    );
}
