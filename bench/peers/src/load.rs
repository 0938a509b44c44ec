//! The load generator, run as a child process of the harness (`idemkit-bench-peers
//! load …`): it shares the machine with the servers but none of their runtime,
//! and it is as lean as `wrk`: raw keep-alive TCP connections, requests written
//! from one reused buffer, answers parsed with `httparse` (the parser hyper
//! uses), no HTTP client library in between.
//!
//! Each connection sends its share of `--requests` one after another with the keys
//! `{tag}-{connection}-{i}`; the clock starts once every connection is open and
//! stops when the last answer is read. It prints one line:
//! `sent=N seconds=F replayed=R p50_us=P p99_us=Q status=201:N[,CODE:N…]`,
//! every status counted; the percentiles are of each request's time from its
//! first byte written to its answer read whole.

use std::fmt::Write as _;
use std::time::Instant;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What one run of the generator is told (from its command line).
pub(crate) struct LoadArgs {
    pub(crate) addr: String,
    pub(crate) path: String,
    pub(crate) connections: usize,
    pub(crate) requests: usize,
    pub(crate) tag: String,
    pub(crate) marker: Option<String>,
    pub(crate) cookies: Vec<String>,
    pub(crate) body: String,
}

impl LoadArgs {
    /// Parses `--addr A --path P --connections C --requests N --tag T [--marker H]
    /// [--cookie C]… --body B`.
    pub(crate) fn parse(mut args: impl Iterator<Item = String>) -> Self {
        let mut out = Self {
            addr: String::new(),
            path: "/orders".into(),
            connections: 16,
            requests: 0,
            tag: "load".into(),
            marker: None,
            cookies: Vec::new(),
            body: String::new(),
        };
        while let Some(flag) = args.next() {
            let value = args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
            match flag.as_str() {
                "--addr" => out.addr = value,
                "--path" => out.path = value,
                "--connections" => out.connections = value.parse().expect("--connections"),
                "--requests" => out.requests = value.parse().expect("--requests"),
                "--tag" => out.tag = value,
                "--marker" => out.marker = Some(value.to_ascii_lowercase()),
                "--cookie" => out.cookies.push(value),
                "--body" => out.body = value,
                other => panic!("unknown flag {other}"),
            }
        }
        assert!(!out.addr.is_empty(), "--addr is required");
        out
    }
}

/// What a run saw: requests answered, seconds, replay markers, statuses.
#[derive(Default, Debug)]
pub(crate) struct LoadResult {
    pub(crate) sent: usize,
    pub(crate) seconds: f64,
    pub(crate) replayed: usize,
    pub(crate) p50_us: u64,
    pub(crate) p99_us: u64,
    pub(crate) statuses: Vec<(u16, usize)>,
}

impl LoadResult {
    pub(crate) fn line(&self) -> String {
        let statuses: Vec<String> = self.statuses.iter().map(|(s, n)| format!("{s}:{n}")).collect();
        format!(
            "sent={} seconds={:.6} replayed={} p50_us={} p99_us={} status={}",
            self.sent,
            self.seconds,
            self.replayed,
            self.p50_us,
            self.p99_us,
            statuses.join(",")
        )
    }

    pub(crate) fn parse(line: &str) -> Self {
        let mut out = Self::default();
        for field in line.split_whitespace() {
            let (k, v) = field
                .split_once('=')
                .unwrap_or_else(|| panic!("bad field {field}"));
            match k {
                "sent" => out.sent = v.parse().unwrap(),
                "seconds" => out.seconds = v.parse().unwrap(),
                "replayed" => out.replayed = v.parse().unwrap(),
                "p50_us" => out.p50_us = v.parse().unwrap(),
                "p99_us" => out.p99_us = v.parse().unwrap(),
                "status" => {
                    for pair in v.split(',').filter(|p| !p.is_empty()) {
                        let (s, n) = pair.split_once(':').unwrap();
                        out.statuses.push((s.parse().unwrap(), n.parse().unwrap()));
                    }
                }
                _ => panic!("bad field {field}"),
            }
        }
        out
    }

    /// How many answers had `status`.
    pub(crate) fn count(&self, status: u16) -> usize {
        self.statuses
            .iter()
            .find(|(s, _)| *s == status)
            .map_or(0, |(_, n)| *n)
    }
}

#[derive(Default)]
struct Seen {
    replayed: usize,
    statuses: Vec<(u16, usize)>,
    /// Each request's latency, in microseconds.
    latencies: Vec<u32>,
}

impl Seen {
    fn add(&mut self, status: u16, count: usize) {
        match self.statuses.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += count,
            None => self.statuses.push((status, count)),
        }
    }
}

/// Reads one answer from `stream` into `buf` (which may hold bytes of the next
/// one: keep-alive without pipelining never leaves any, but be exact).
async fn read_answer(stream: &mut TcpStream, buf: &mut Vec<u8>, marker: Option<&str>, seen: &mut Seen) {
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut res = httparse::Response::new(&mut headers);
        if let httparse::Status::Complete(head) = res.parse(buf).expect("a valid HTTP answer") {
            let mut length = 0usize;
            let mut replayed = false;
            for h in res.headers.iter() {
                if h.name.eq_ignore_ascii_case("content-length") {
                    length = std::str::from_utf8(h.value).unwrap().trim().parse().unwrap();
                } else if marker.is_some_and(|m| h.name.eq_ignore_ascii_case(m))
                    && h.value.eq_ignore_ascii_case(b"true")
                {
                    replayed = true;
                }
            }
            let status = res.code.expect("a status");
            while buf.len() < head + length {
                read_more(stream, buf).await;
            }
            buf.drain(..head + length);
            seen.add(status, 1);
            seen.replayed += usize::from(replayed);
            return;
        }
        read_more(stream, buf).await;
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) {
    let mut chunk = [0u8; 16 * 1024];
    let n = stream.read(&mut chunk).await.expect("read");
    assert!(n > 0, "the server closed a keep-alive connection");
    buf.extend_from_slice(&chunk[..n]);
}

/// Runs the load and returns what it saw.
pub(crate) async fn run(args: LoadArgs) -> LoadResult {
    let args = std::sync::Arc::new(args);
    let mut streams = Vec::new();
    for _ in 0..args.connections {
        let s = TcpStream::connect(&args.addr).await.expect("connect");
        s.set_nodelay(true).unwrap();
        streams.push(s);
    }
    let started = Instant::now();
    let tasks: Vec<_> = streams
        .into_iter()
        .enumerate()
        .map(|(c, mut stream)| {
            let args = args.clone();
            let share = args.requests / args.connections + usize::from(c < args.requests % args.connections);
            tokio::spawn(async move {
                let mut seen = Seen::default();
                let mut req = String::with_capacity(512);
                let mut buf = Vec::with_capacity(16 * 1024);
                let cookie = (!args.cookies.is_empty()).then(|| &args.cookies[c % args.cookies.len()]);
                for i in 0..share {
                    req.clear();
                    write!(
                        req,
                        "POST {} HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer bench\r\n\
                         content-type: application/json\r\nidempotency-key: {}-{c}-{i}\r\n\
                         content-length: {}\r\n",
                        args.path,
                        args.addr,
                        args.tag,
                        args.body.len()
                    )
                    .unwrap();
                    if let Some(cookie) = cookie {
                        write!(req, "cookie: {cookie}\r\n").unwrap();
                    }
                    req.push_str("\r\n");
                    req.push_str(&args.body);
                    let sent = Instant::now();
                    stream.write_all(req.as_bytes()).await.expect("write");
                    read_answer(&mut stream, &mut buf, args.marker.as_deref(), &mut seen).await;
                    let us = u32::try_from(sent.elapsed().as_micros()).unwrap_or(u32::MAX);
                    seen.latencies.push(us);
                }
                seen
            })
        })
        .collect();
    let mut out = LoadResult::default();
    let mut all = Seen::default();
    for t in tasks {
        let seen = t.await.expect("a connection task");
        all.replayed += seen.replayed;
        all.latencies.extend(seen.latencies);
        for (s, n) in seen.statuses {
            all.add(s, n);
        }
    }
    out.seconds = started.elapsed().as_secs_f64();
    out.sent = args.requests;
    out.replayed = all.replayed;
    all.latencies.sort_unstable();
    let at = |q: f64| {
        let i = ((all.latencies.len() as f64 * q).ceil() as usize).clamp(1, all.latencies.len().max(1)) - 1;
        all.latencies.get(i).copied().map_or(0, u64::from)
    };
    out.p50_us = at(0.50);
    out.p99_us = at(0.99);
    out.statuses = all.statuses;
    out.statuses.sort();
    out
}
