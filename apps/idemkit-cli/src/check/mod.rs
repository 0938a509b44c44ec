//! `idemkit check`: the black-box conformance gates (the behaviour contract, `docs/spec.md` §9) against any
//! idempotent HTTP endpoint, or (feature `grpc`) a unary gRPC method.
//!
//! The gates themselves live in [`idemkit_check`]; this module turns the
//! command line into a [`CheckConfig`], sends the requests with reqwest, shows
//! progress and prints the report as a table or as JSON.

mod hosts;
mod output;
mod policy;
mod progress;

use std::io::{IsTerminal, Read};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use http::{HeaderMap, HeaderName, HeaderValue, Method};
use idemkit_check::{self as gates, CheckConfig, Gate, KeyPlacement, Template};
use reqwest::Url;

const AFTER_HELP: &str = "\
Gates (run in this order; pick with --gates):
  1 concurrency  N identical requests with one fresh key at once -> one effect; the rest are identical replays or conflicts
  2 replay       a retry replays status, body bytes and allowlisted headers, marked, with no new effect
  3 mismatch     same key, different body -> a 4xx conflict, not a replay, code unlike the in-progress one
  4 in-progress  overlapping duplicates get the in-progress conflict (distinct code, Retry-After) or the identical replay
  5 bad-keys     missing, empty, 256-character, control-character keys -> 4xx, no effect
  6 isolation    the same key from another account -> its own effect, never the first account's response
  7 fresh-key    a fresh key -> a new effect; reordered JSON members under a used key -> replay, not mismatch
  8 claimed-idempotent  the same request twice without a key leaves the state as the first left it
                 (run by default for PUT, PATCH and DELETE, or with --claimed-idempotent)
  9 policy       the endpoint does what its published x-idempotency says (run by default with --policy)

Exit status: 0 every selected gate passed; 1 a gate failed; 2 a gate was inconclusive
(e.g. no probe given, no overlap provoked) and none failed, or the check could not run.

Only loopback hosts (127.0.0.0/8, [::1], localhost) are contacted unless a host is named
with --allow-host. Plain http only.

Example (the quickstart):
  idemkit check --url http://127.0.0.1:3000/orders -H 'Authorization: Bearer checker' \\
    --body '{\"sku\":\"BOOK-1\",\"quantity\":1}' --count-url /orders/count \\
    --other-account-header 'Authorization: Bearer other'

gRPC (instead of --url): --grpc http://HOST:PORT --grpc-method pkg.Service/Method; the body is
the request message's proto3 JSON mapping, the descriptors come from server reflection, the
key travels in the idempotency-key metadata (or, with --grpc-key-field request_id, as a UUID4
in that field). Unary methods only, plaintext HTTP/2 only; the policy gate (9) does not apply.";

/// Arguments of `idemkit check`.
#[derive(Debug, Clone, Args)]
#[command(after_help = AFTER_HELP)]
pub struct CheckArgs {
    /// The endpoint to check, e.g. http://127.0.0.1:3000/orders (or --grpc).
    #[arg(long, value_name = "URL")]
    pub url: Option<String>,

    /// Check a gRPC method instead: the server, e.g. http://127.0.0.1:50051
    /// (plaintext HTTP/2; its reflection service describes the method).
    #[cfg(feature = "grpc")]
    #[arg(long, value_name = "URL", conflicts_with = "url", requires = "grpc_method")]
    pub grpc: Option<String>,

    /// The unary gRPC method to check, `package.Service/Method`.
    #[cfg(feature = "grpc")]
    #[arg(long, value_name = "METHOD", requires = "grpc")]
    pub grpc_method: Option<String>,

    /// The key is this request field (AIP-155, e.g. request_id) instead of the
    /// idempotency-key metadata: every key is then a bare UUID4 written into it.
    #[cfg(feature = "grpc")]
    #[arg(long, value_name = "FIELD", requires = "grpc", conflicts_with_all = ["key_field", "key_header"])]
    pub grpc_key_field: Option<String>,

    /// The request template's HTTP method.
    #[arg(short = 'X', long, default_value = "POST")]
    pub method: String,

    /// The request template's body: inline JSON (or text), @FILE, or @- for stdin.
    /// JSON bodies are sent re-serialised (compact).
    #[arg(short = 'd', long, value_name = "JSON|@FILE")]
    pub body: Option<String>,

    /// A header sent with every request, 'Name: value' (repeatable). JSON bodies get
    /// 'Content-Type: application/json' unless one is given.
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
    pub headers: Vec<String>,

    /// The header the idempotency key travels in [default: Idempotency-Key, or
    /// where --policy puts the key].
    #[arg(long, value_name = "NAME")]
    pub key_header: Option<String>,

    /// Put the key in the JSON body at this JSON pointer instead (e.g. /idempotencyKey).
    #[arg(long, value_name = "POINTER", conflicts_with = "key_header")]
    pub key_field: Option<String>,

    /// A second valid body for the mismatch gate (JSON|@FILE). Default: the template
    /// with its first string or number leaf changed.
    #[arg(long, value_name = "JSON|@FILE")]
    pub alt_body: Option<String>,

    /// The status replays answer when it differs from the original's (e.g. 200 for a
    /// replayed 201) [default: the one --policy publishes].
    #[arg(long, value_name = "STATUS")]
    pub replay_status: Option<u16>,

    /// The header (and value) that marks a replay [default: Idempotent-Replayed:
    /// true, or the one --policy publishes].
    #[arg(long, value_name = "NAME: VALUE")]
    pub replay_marker: Option<String>,

    /// One more response header a replay must repeat exactly (repeatable);
    /// Content-Type and Location always are.
    #[arg(long = "same-header", value_name = "NAME")]
    pub same_headers: Vec<String>,

    /// A second account's credentials for the isolation gate, 'Name: value'; it
    /// replaces the template's header of that name.
    #[arg(long, value_name = "NAME: VALUE")]
    pub other_account_header: Option<String>,

    /// Side-effect probe: a URL (or a path on --url's host) answering the caller's
    /// effect count as {"count": n} or a bare number; fetched with GET and the
    /// template's headers.
    #[arg(long, value_name = "URL")]
    pub count_url: Option<String>,

    /// Where the count probe's JSON holds the count (e.g. /shipments), instead of
    /// {"count": n} or a bare number.
    #[arg(long, value_name = "POINTER", requires = "count_url")]
    pub count_pointer: Option<String>,

    /// State probe of the claimed-idempotency gate: a URL (or a path on --url's host)
    /// whose JSON (GET, the template's headers) must not change when the same
    /// request is repeated without a key.
    #[arg(long, value_name = "URL")]
    pub state_url: Option<String>,

    /// A JSON pointer to a member of the --state-url JSON that changes on its own
    /// (a timestamp), left out of the comparison (repeatable; `*` matches every
    /// element: /items/*/updatedAt).
    #[arg(long = "volatile", value_name = "POINTER", requires = "state_url")]
    pub volatile: Vec<String>,

    /// Run the claimed-idempotency gate (8) on a POST too: the route is said to be
    /// idempotent without a key. It runs by default for PUT, PATCH and DELETE.
    #[arg(long)]
    pub claimed_idempotent: bool,

    /// The endpoint's published policy: an OpenAPI document whose operations carry
    /// x-idempotency, or its JSON policy document (a URL or a path on --url's host).
    /// The key location, replay status and marker default to what it publishes, and
    /// the policy gate (9) compares what the endpoint does with it.
    #[arg(long, value_name = "URL")]
    pub policy: Option<String>,

    /// JSON pointer to the resource id in successful answers (e.g. /id), to tell
    /// effects apart by what the answers show.
    #[arg(long, value_name = "POINTER")]
    pub id_pointer: Option<String>,

    /// The gates to run, by name or number, comma-separated [default: all].
    #[arg(long, value_name = "GATES", value_delimiter = ',', value_parser = parse_gate)]
    pub gates: Vec<Gate>,

    /// How many identical requests the concurrency and in-progress gates start at once
    /// (2 to 1000).
    #[arg(
        short = 'n',
        long,
        value_name = "N",
        default_value_t = gates::DEFAULT_CONCURRENCY,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=1000)
    )]
    pub concurrency: usize,

    /// Per-request timeout, in seconds.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 30,
        value_parser = clap::builder::RangedU64ValueParser::<u64>::new().range(1..=3600)
    )]
    pub timeout: u64,

    /// Allow contacting this non-loopback host (repeatable). Without it, only
    /// 127.0.0.0/8, ::1 and localhost are contacted.
    #[arg(long = "allow-host", value_name = "HOST")]
    pub allow_hosts: Vec<String>,

    /// Print the report as JSON on stdout (and no progress bar).
    #[arg(long)]
    pub json: bool,
}

fn parse_gate(s: &str) -> Result<Gate, String> {
    s.parse().map_err(|e: gates::UnknownGate| e.to_string())
}

/// Runs `idemkit check` and returns its exit code (0 pass, 1 fail, 2 inconclusive).
pub fn run(args: CheckArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let timeout = Duration::from_secs(args.timeout);
    let http = idemkit_check::HttpTransport::new(timeout)?;
    #[cfg(feature = "grpc")]
    let grpc = runtime.block_on(grpc_target(&args))?;
    #[cfg(feature = "grpc")]
    let plan = Plan::from_args(&args, grpc.as_ref())?;
    #[cfg(not(feature = "grpc"))]
    let plan = Plan::from_args(&args, None)?;
    #[cfg(feature = "grpc")]
    let transport: Box<dyn gates::Transport> = match grpc {
        Some(g) => Box::new(g.transport.with_probes(std::sync::Arc::new(http))),
        None => Box::new(http),
    };
    #[cfg(not(feature = "grpc"))]
    let transport: Box<dyn gates::Transport> = Box::new(http);
    let show_progress = !args.json && std::io::stderr().is_terminal();
    let bar = progress::Bar::new(show_progress);
    let report = runtime.block_on(gates::run(&plan.config, transport.as_ref(), &bar));
    bar.finish();
    // The exit code is the verdict's whatever happens to stdout (`| head`).
    let mut out = crate::VerdictOutput::new(std::io::stdout().lock());
    if args.json {
        output::json(&mut out, &plan, &report)?;
    } else {
        output::table(&mut out, &plan, &report)?;
    }
    out.finish();
    Ok(ExitCode::from(report.exit_code()))
}

/// The gRPC method under test: its transport, and what the plan needs of it.
#[cfg_attr(not(feature = "grpc"), allow(dead_code))]
struct GrpcTarget {
    /// `pkg.Service/Method`.
    method: String,
    /// The template URL (`http://host:port/pkg.Service/Method`).
    url: String,
    /// `--grpc-key-field`: the field's name and its JSON pointer.
    key_field: Option<(String, String)>,
    /// Whether a body maps to the request message (`Err`: why not).
    #[allow(clippy::type_complexity)]
    maps: Box<dyn Fn(&[u8]) -> Result<(), String> + Send + Sync>,
    #[cfg(feature = "grpc")]
    transport: idemkit_check::GrpcTransport,
}

/// Connects to `--grpc` and finds `--grpc-method` by reflection (`None`: HTTP).
#[cfg(feature = "grpc")]
async fn grpc_target(args: &CheckArgs) -> anyhow::Result<Option<GrpcTarget>> {
    let Some(endpoint) = &args.grpc else {
        return Ok(None);
    };
    let url = Url::parse(endpoint).with_context(|| format!("--grpc `{endpoint}`"))?;
    hosts::check(&url, &args.allow_hosts).context("--grpc")?;
    if url.path() != "/" || url.query().is_some() {
        bail!("--grpc `{endpoint}`: give the server only (http://host:port), the method with --grpc-method");
    }
    let method = args
        .grpc_method
        .clone()
        .context("--grpc needs --grpc-method pkg.Service/Method")?;
    let transport =
        idemkit_check::GrpcTransport::connect(url.as_str(), &method, Duration::from_secs(args.timeout))
            .await
            .with_context(|| format!("--grpc {endpoint} --grpc-method {method}"))?;
    let key_field = args
        .grpc_key_field
        .as_deref()
        .map(|f| {
            transport
                .key_pointer(f.trim())
                .map(|p| (f.trim().to_owned(), p))
                .context("--grpc-key-field")
        })
        .transpose()?;
    let input = transport.method().input();
    Ok(Some(GrpcTarget {
        method: method.trim().trim_start_matches('/').to_owned(),
        url: transport.url().to_owned(),
        key_field,
        maps: Box::new(move |body| {
            idemkit_check::grpc_request_message(&input, body)
                .map(drop)
                .map_err(|e| e.0)
        }),
        transport,
    }))
}

/// The validated check: its configuration and what to say about it.
struct Plan {
    config: CheckConfig,
    url: Url,
    count_url: Option<Url>,
    key_header: String,
    /// The gRPC method under test, and its key field.
    grpc: Option<(String, Option<String>)>,
}

impl Plan {
    fn from_args(args: &CheckArgs, grpc: Option<&GrpcTarget>) -> anyhow::Result<Self> {
        let url = match (grpc, &args.url) {
            (Some(g), _) => {
                Url::parse(&g.url).with_context(|| format!("the gRPC method's URL `{}`", g.url))?
            }
            (None, Some(u)) => Url::parse(u).with_context(|| format!("--url `{u}`"))?,
            (None, None) => bail!(
                "give the endpoint to check: --url URL (or --grpc URL --grpc-method pkg.Service/Method)"
            ),
        };
        hosts::check(&url, &args.allow_hosts).context(if grpc.is_some() { "--grpc" } else { "--url" })?;
        if grpc.is_some() {
            if !args.method.eq_ignore_ascii_case("POST") {
                bail!(
                    "--method {}: a gRPC call has no HTTP method to choose (leave -X out)",
                    args.method
                );
            }
            if args.policy.is_some() {
                bail!(
                    "--policy: the x-idempotency policy describes HTTP operations; a gRPC method has none (the policy gate does not apply to gRPC)"
                );
            }
        }
        let count_url = args
            .count_url
            .as_deref()
            .map(|c| {
                let u = url.join(c).with_context(|| format!("--count-url `{c}`"))?;
                hosts::check(&u, &args.allow_hosts).context("--count-url")?;
                anyhow::Ok(u)
            })
            .transpose()?;

        let method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
            .with_context(|| format!("--method `{}`", args.method))?;
        let mut headers = HeaderMap::new();
        for h in &args.headers {
            let (name, value) = parse_header(h).context("--header")?;
            headers.append(name, value);
        }
        let published = args
            .policy
            .as_deref()
            .map(|p| {
                let u = url.join(p).with_context(|| format!("--policy `{p}`"))?;
                hosts::check(&u, &args.allow_hosts).context("--policy")?;
                policy::load(&u, &method, &url, Duration::from_secs(args.timeout)).context("--policy")
            })
            .transpose()?;
        let grpc_key = grpc.and_then(|g| g.key_field.as_ref());
        let key = match (&args.key_field, &args.key_header, &published) {
            _ if grpc_key.is_some() => {
                KeyPlacement::Field(grpc_key.map(|(_, p)| p.clone()).unwrap_or_default())
            }
            (Some(pointer), _, _) => KeyPlacement::Field(pointer.clone()),
            (None, Some(header), _) => KeyPlacement::Header(
                HeaderName::from_bytes(header.trim().as_bytes())
                    .with_context(|| format!("--key-header `{header}`"))?,
            ),
            (None, None, Some(p)) => p.key.clone(),
            (None, None, None) => KeyPlacement::Header(HeaderName::from_static("idempotency-key")),
        };
        let key_header = match &key {
            KeyPlacement::Header(h) => args
                .key_header
                .as_deref()
                .map_or_else(|| policy::title(h.as_str()), |h| h.trim().to_owned()),
            KeyPlacement::Field(_) => String::new(),
        };
        let mut template = Template::new(method.clone(), url.as_str()).with_headers(headers);
        let body = match (&args.body, grpc) {
            (Some(body), _) => Some(read_body(body).context("--body")?),
            // A gRPC call always has a message: the empty one by default.
            (None, Some(_)) => Some(b"{}".to_vec()),
            (None, None) => None,
        };
        if let Some(body) = &body {
            template = template.with_body(body)?;
        }
        let alt = args
            .alt_body
            .as_deref()
            .map(|alt| read_body(alt).context("--alt-body"))
            .transpose()?;
        if let Some(alt) = &alt {
            template = template.with_alt_body(alt)?;
        }
        if let Some(g) = grpc {
            for (flag, b) in [("--body", &body), ("--alt-body", &alt)] {
                if let Some(b) = b {
                    (g.maps)(b).map_err(|e| anyhow::anyhow!("{e}")).context(flag)?;
                }
            }
        }
        template = template.with_key(key)?;

        let mut config = CheckConfig::new(template).with_concurrency(args.concurrency);
        if grpc_key.is_some() {
            config = config.with_uuid4_keys();
        }
        if args.gates.is_empty() {
            let mut gates = Gate::KEYED.to_vec();
            if args.claimed_idempotent || [Method::PUT, Method::PATCH, Method::DELETE].contains(&method) {
                gates.push(Gate::ClaimedIdempotent);
            }
            // Over gRPC the policy gate is listed, as not applicable, so the report
            // says what was not checked.
            if published.is_some() || grpc.is_some() {
                gates.push(Gate::Policy);
            }
            config = config.with_gates(gates);
        } else {
            config = config.with_gates(args.gates.iter().copied());
        }
        let replay_status = args
            .replay_status
            .or_else(|| published.as_ref().and_then(|p| p.replay_status));
        if let Some(status) = replay_status {
            if !(100..600).contains(&status) {
                bail!("--replay-status {status} is not an HTTP status");
            }
            config = config.with_replay_status(status);
        }
        match (
            &args.replay_marker,
            published.as_ref().and_then(|p| p.replay_marker.clone()),
        ) {
            (Some(marker), _) => {
                let (name, value) = parse_header(marker).context("--replay-marker")?;
                config = config.with_replay_marker(name, value.to_str().unwrap_or("true").trim());
            }
            (None, Some((name, value))) => config = config.with_replay_marker(name, value),
            (None, None) => {}
        }
        for h in &args.same_headers {
            let name = HeaderName::from_bytes(h.trim().as_bytes())
                .with_context(|| format!("--same-header `{h}`"))?;
            config = config.with_same_header(name);
        }
        if let Some(other) = &args.other_account_header {
            let (name, value) = parse_header(other).context("--other-account-header")?;
            config = config.with_other_account(name, value);
        }
        if let Some(u) = &count_url {
            config = config.with_count_url(u.as_str());
        }
        if let Some(pointer) = &args.count_pointer {
            check_pointer("--count-pointer", pointer)?;
            config = config.with_count_pointer(pointer.clone());
        }
        if let Some(s) = &args.state_url {
            let u = url.join(s).with_context(|| format!("--state-url `{s}`"))?;
            hosts::check(&u, &args.allow_hosts).context("--state-url")?;
            config = config.with_state_url(u.as_str());
        }
        for pointer in &args.volatile {
            check_pointer("--volatile", pointer)?;
            config = config.with_volatile(pointer.clone());
        }
        if let Some(p) = published {
            config = config.with_published(p);
        }
        if let Some(pointer) = &args.id_pointer {
            if !pointer.is_empty() && !pointer.starts_with('/') {
                bail!("--id-pointer `{pointer}` is not a JSON pointer (it starts with `/`)");
            }
            config = config.with_id_pointer(pointer.clone());
        }
        Ok(Self {
            config,
            url,
            count_url,
            key_header,
            grpc: grpc.map(|g| (g.method.clone(), g.key_field.as_ref().map(|(f, _)| f.clone()))),
        })
    }
}

/// A JSON pointer starts with `/` (or is empty: the whole document).
fn check_pointer(flag: &str, pointer: &str) -> anyhow::Result<()> {
    if !pointer.is_empty() && !pointer.starts_with('/') {
        bail!("{flag} `{pointer}` is not a JSON pointer (it starts with `/`)");
    }
    Ok(())
}

/// `Name: value` → a header.
fn parse_header(s: &str) -> anyhow::Result<(HeaderName, HeaderValue)> {
    let Some((name, value)) = s.split_once(':') else {
        bail!("`{s}` is not `Name: value`");
    };
    let name =
        HeaderName::from_bytes(name.trim().as_bytes()).with_context(|| format!("header name in `{s}`"))?;
    let value = HeaderValue::from_str(value.trim()).with_context(|| format!("header value in `{s}`"))?;
    Ok((name, value))
}

/// Inline text, `@FILE`, or `@-` for stdin.
fn read_body(arg: &str) -> anyhow::Result<Vec<u8>> {
    match arg.strip_prefix('@') {
        Some("-") => {
            let mut buf = Vec::new();
            std::io::stdin().read_to_end(&mut buf).context("reading stdin")?;
            Ok(buf)
        }
        Some(path) => std::fs::read(path).with_context(|| format!("reading {path}")),
        None => Ok(arg.as_bytes().to_vec()),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::{Cli, Command};

    fn plan(args: &[&str]) -> anyhow::Result<Plan> {
        let cli = Cli::try_parse_from(["idemkit", "check"].iter().chain(args))?;
        let Command::Check(args) = cli.command else {
            unreachable!("the command line starts with `check`")
        };
        Plan::from_args(&args, None)
    }

    #[test]
    fn relative_count_url_joins_the_endpoint() {
        let p = plan(&[
            "--url",
            "http://127.0.0.1:9/orders",
            "--count-url",
            "/orders/count",
            "-d",
            "{}",
        ])
        .unwrap();
        assert_eq!(p.count_url.unwrap().as_str(), "http://127.0.0.1:9/orders/count");
        assert_eq!(p.config.gates(), Gate::KEYED);
        let p = plan(&["--url", "http://127.0.0.1:9/orders/1", "-X", "put", "-d", "{}"]).unwrap();
        assert_eq!(p.config.gates().last(), Some(&Gate::ClaimedIdempotent));
        let p = plan(&["--url", "http://127.0.0.1:9/o", "--claimed-idempotent"]).unwrap();
        assert_eq!(p.config.gates().len(), 8);
    }

    #[test]
    fn gates_by_name_or_number_in_documented_order() {
        let p = plan(&[
            "--url",
            "http://localhost:9/x",
            "--gates",
            "isolation,1,in-progress",
        ])
        .unwrap();
        assert_eq!(
            p.config.gates(),
            [Gate::Concurrency, Gate::InProgress, Gate::Isolation]
        );
        assert!(plan(&["--url", "http://localhost:9/x", "--gates", "speed"]).is_err());
    }

    #[test]
    fn remote_hosts_need_allow_host() {
        let err = plan(&["--url", "http://api.example.com/orders"]).err().unwrap();
        assert!(
            format!("{err:#}").contains("--allow-host api.example.com"),
            "{err:#}"
        );
        assert!(
            plan(&[
                "--url",
                "http://api.example.com/orders",
                "--allow-host",
                "api.example.com"
            ])
            .is_ok()
        );
        let err = plan(&[
            "--url",
            "http://127.0.0.1:9/orders",
            "--count-url",
            "http://10.0.0.1/count",
        ])
        .err()
        .unwrap();
        assert!(format!("{err:#}").contains("--count-url"), "{err:#}");
    }

    #[test]
    fn bad_headers_and_key_fields_are_refused() {
        assert!(plan(&["--url", "http://[::1]:9/x", "-H", "no colon"]).is_err());
        assert!(plan(&["--url", "http://[::1]:9/x", "-d", "text", "--key-field", "/k"]).is_err());
        assert!(plan(&["--url", "http://[::1]:9/x", "-d", "{}", "--key-field", "/k"]).is_ok());
    }
}
