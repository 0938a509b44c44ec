//! The memory row: peak RSS of a real `idemkit proxy` process under many
//! concurrent large keyed requests, against its cap.

use super::{listening_on, tempdir};

/// Peak memory of a real `idemkit proxy` process under `concurrent` keyed
/// requests of `size` bytes each, all at once: its `VmHWM` before and after.
pub(crate) async fn peak_memory(upstream: &str, concurrent: usize, size: usize) {
    let dir = tempdir("memory");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idemkit"))
        .args(["proxy", "--listen", "127.0.0.1:0", "--upstream", upstream])
        .arg("--database-url")
        .arg(format!("sqlite://{}", dir.join("keys.db").display()))
        .args(["--max-request-body", &(size + 1024).to_string()])
        .env("IDEMKIT_PROXY_SECRET", "bench")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let base = listening_on(&mut child, "idemkit proxy listening on ");
    let hwm = |pid: u32| -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    };
    let before = hwm(child.id());
    let body = axum::body::Bytes::from(vec![b'x'; size]);
    let http = reqwest::Client::new();
    let answers = futures::future::join_all((0..concurrent).map(|i| {
        let (http, url, body) = (http.clone(), format!("{base}/sink"), body.clone());
        async move {
            http.post(url)
                .header("authorization", "Bearer bench")
                .header("idempotency-key", format!("mem-{i}"))
                .body(body)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    }))
    .await;
    let after = hwm(child.id());
    let _ = child.kill();
    let _ = child.wait();
    // The cap: the idle process plus about twice the in-flight body budget
    // (a body is held once while forwarded, twice at most while its claim is
    // written), plus a margin for the connections' own buffers.
    let cap = before + 2 * (idemkit_proxy::DEFAULT_MAX_INFLIGHT_BODY_BYTES as u64 >> 10) + 32 * 1024;
    let ok = answers.iter().filter(|s| **s == 201).count();
    let refused = answers.iter().filter(|s| **s == 503).count();
    let other = answers.len() - ok - refused;
    println!(
        "memory: {concurrent} concurrent {} KiB keyed requests: peak RSS {} MB (idle {} MB), cap {} MB (idle + 2 × the \
         64 MiB default --max-inflight-body-bytes + 32 MB) {}; {ok} stored, {refused} answered 503 by the budget, {other} \
         cut off while still sending",
        size >> 10,
        after >> 10,
        before >> 10,
        cap >> 10,
        if after <= cap { "met" } else { "EXCEEDED" },
    );
}
