//! `idemkit demo`: the main job. Starts the courier simulator and the label
//! service as real processes on a temporary SQLite, then plays the failure
//! scenarios a client meets and prints what it saw, how many labels exist and how
//! many shipments the courier made.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use idemkit_client::{IdempotencyKey, RetryConfig, RetryMiddleware};
use idemkit_labels::proto::{self, labels_client::LabelsClient};
use serde_json::{Value, json};

/// Arguments of `idemkit demo`.
#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// Print the table as JSON.
    #[arg(long)]
    pub json: bool,
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Starts `idemkit <args>` and waits for its "listening on" line.
fn spawn(args: &[&str]) -> anyhow::Result<Proc> {
    let exe = std::env::current_exe()?;
    let mut child = Command::new(exe)
        .args(args)
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting idemkit {}", args.join(" ")))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    if !line.contains("listening on") {
        bail!("idemkit {} did not start: {line}", args[0]);
    }
    Ok(Proc(child))
}

struct World {
    dir: PathBuf,
    courier: String,
    courier_proc: Proc,
    service_port: u16,
    service: Option<Proc>,
}

impl World {
    fn start() -> anyhow::Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_nanos();
        let dir = std::env::temp_dir().join(format!("idemkit-demo-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let courier_port = free_port()?;
        let courier_db = dir.join("courier.db");
        let courier_proc = spawn(&[
            "courier",
            "--listen",
            &format!("127.0.0.1:{courier_port}"),
            "--database-url",
            courier_db.to_str().context("path")?,
        ])?;
        let mut world = Self {
            dir,
            courier: format!("http://127.0.0.1:{courier_port}"),
            courier_proc,
            service_port: free_port()?,
            service: None,
        };
        world.start_service()?;
        Ok(world)
    }

    fn start_service(&mut self) -> anyhow::Result<()> {
        let db = self.dir.join("labels.db");
        self.service = Some(spawn(&[
            "serve",
            "--demo-tokens",
            "--listen",
            &format!("127.0.0.1:{}", self.service_port),
            "--database-url",
            db.to_str().context("path")?,
            "--courier-url",
            &self.courier,
            "--lease-ms",
            "500",
            "--courier-deadline-ms",
            "1500",
        ])?);
        Ok(())
    }

    fn kill_service(&mut self) {
        if let Some(mut p) = self.service.take() {
            // SIGKILL: no cleanup, no graceful shutdown.
            let _ = p.0.kill();
            let _ = p.0.wait();
        }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.service_port)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        self.kill_service();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = &self.courier_proc;
    }
}

fn label_body(key: &str, country: &str) -> Value {
    json!({
        "idempotencyKey": key,
        "courier": "dhl",
        "shipFrom": {"name": "Warehouse", "line1": "1-2-3 Minato", "city": "Tokyo", "postalCode": "105-0001", "country": "JP"},
        "shipTo": {"name": "Ada", "line1": "10 Downing St", "city": "London", "postalCode": "SW1A 2AA", "country": country},
        "parcel": {"weightGrams": 1200, "lengthCm": 30, "widthCm": 20, "heightCm": 10}
    })
}

struct Saw {
    status: u16,
    replayed: bool,
    body: Value,
}

impl Saw {
    fn describe(&self) -> String {
        let what = self.body["status"]
            .as_str()
            .or(self.body["code"].as_str())
            .unwrap_or("");
        format!(
            "{}{} {what}",
            self.status,
            if self.replayed { " (replay)" } else { "" }
        )
    }
}

struct Client {
    raw: reqwest::Client,
    /// idemkit's client: retries allowlisted failures (409 in progress, 502, 503,
    /// connection loss) with full jitter; the key in the body makes that safe.
    retrying: reqwest_middleware::ClientWithMiddleware,
}

impl Client {
    async fn post(&self, base: &str, body: &Value) -> anyhow::Result<Saw> {
        let res = self
            .raw
            .post(format!("{base}/labels"))
            .bearer_auth("demo-token-acme")
            .json(body)
            .timeout(Duration::from_secs(10))
            .send()
            .await?;
        let status = res.status().as_u16();
        let replayed = res.headers().get("idempotent-replayed").is_some();
        let body = res.json().await.unwrap_or(Value::Null);
        Ok(Saw {
            status,
            replayed,
            body,
        })
    }

    /// Retries a label request with the same key and body until it is answered
    /// for good, with idemkit's client.
    async fn post_until_final(&self, base: &str, body: &Value) -> anyhow::Result<Saw> {
        let sent = self
            .retrying
            .post(format!("{base}/labels"))
            .bearer_auth("demo-token-acme")
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await;
        let res = match sent {
            Ok(res) => res,
            Err(reqwest_middleware::Error::Middleware(e)) => {
                match e.downcast::<idemkit_client::ReqwestRetryError>() {
                    Ok(retry) => retry.into_response().context("gave up without an answer")?,
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e.into()),
        };
        let status = res.status().as_u16();
        let replayed = res.headers().get("idempotent-replayed").is_some();
        Ok(Saw {
            status,
            replayed,
            body: res.json().await.unwrap_or(Value::Null),
        })
    }
}

async fn courier_json(
    http: &reqwest::Client,
    courier: &str,
    path: &str,
    body: Option<Value>,
) -> anyhow::Result<Value> {
    let req = match body {
        Some(b) => http.post(format!("{courier}{path}")).json(&b),
        None => http.get(format!("{courier}{path}")),
    };
    Ok(req
        .send()
        .await?
        .error_for_status()?
        .json()
        .await
        .unwrap_or(Value::Null))
}

async fn count_labels(db: &Path) -> anyhow::Result<i64> {
    let url = format!("sqlite://{}?mode=ro", db.display());
    let pool = sqlx::SqlitePool::connect(&url).await?;
    let n = sqlx::query_scalar("SELECT COUNT(*) FROM labels")
        .fetch_one(&pool)
        .await?;
    pool.close().await;
    Ok(n)
}

/// One row of the demo's table.
#[derive(serde::Serialize)]
struct Row {
    scenario: &'static str,
    client_saw: String,
    labels_created: i64,
    courier_shipments: i64,
    pass: bool,
}

/// Courier shipments so far.
async fn shipments(http: &reqwest::Client, courier: &str) -> anyhow::Result<i64> {
    Ok(courier_json(http, courier, "/_stats", None).await?["shipments"]
        .as_i64()
        .unwrap_or(-1))
}

/// Plays one scenario and records it with the labels and courier shipments it
/// made (counted before and after).
macro_rules! scenario {
    ($rows:expr, $db:expr, $http:expr, $world:expr, $name:literal, $body:block) => {{
        let labels_before = count_labels($db).await.unwrap_or(0);
        let ships_before = shipments($http, &$world.courier).await?;
        let (saw, ok): (String, bool) = $body;
        $rows.push(Row {
            scenario: $name,
            client_saw: saw,
            labels_created: count_labels($db).await? - labels_before,
            courier_shipments: shipments($http, &$world.courier).await? - ships_before,
            pass: ok,
        });
    }};
}

async fn play(world: &mut World) -> anyhow::Result<Vec<Row>> {
    let http = reqwest::Client::new();
    let retrying = reqwest_middleware::ClientBuilder::new(http.clone())
        .with(RetryMiddleware::new(
            RetryConfig::new()
                .with_max_attempts(12)
                .with_deadline(Duration::from_secs(20)),
        ))
        .build();
    let client = Client {
        raw: http.clone(),
        retrying: retrying.clone(),
    };
    let db = world.dir.join("labels.db");
    let mut rows = Vec::new();
    let key = |name: &str| {
        IdempotencyKey::derived("demo", format!("{name}-{}", std::process::id()))
            .as_str()
            .to_owned()
    };

    scenario!(rows, &db, &http, world, "lost response", {
        let body = label_body(&key("lost"), "GB");
        let first = client.post(&world.base(), &body).await?; // the client "loses" this answer
        let retry = client.post(&world.base(), &body).await?;
        let ok = first.status == 201 && retry.status == 200 && retry.replayed && retry.body == first.body;
        (format!("{} then {}", first.describe(), retry.describe()), ok)
    });

    scenario!(rows, &db, &http, world, "50 concurrent duplicates", {
        let body = Arc::new(label_body(&key("storm"), "GB"));
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (client, base, body) = (
                    Client {
                        raw: http.clone(),
                        retrying: retrying.clone(),
                    },
                    world.base(),
                    body.clone(),
                );
                tokio::spawn(async move { client.post(&base, &body).await })
            })
            .collect();
        let mut created = 0;
        let mut replays = 0;
        let mut in_progress = 0;
        for t in tasks {
            match t.await?? {
                s if s.status == 201 => created += 1,
                s if s.status == 200 && s.replayed => replays += 1,
                s if s.status == 409 && s.body["code"] == "idempotency_request_in_progress" => {
                    in_progress += 1
                }
                s => bail!("unexpected answer {}", s.describe()),
            }
        }
        (
            format!("{created}×201, {replays}×200 replay, {in_progress}×409 in progress"),
            created == 1,
        )
    });

    scenario!(rows, &db, &http, world, "payload mismatch", {
        let k = key("mismatch");
        let first = client.post(&world.base(), &label_body(&k, "GB")).await?;
        let other = client.post(&world.base(), &label_body(&k, "FR")).await?;
        let ok = first.status == 201 && other.status == 409 && other.body["code"] == "idempotency_key_reused";
        (format!("{} then {}", first.describe(), other.describe()), ok)
    });

    scenario!(rows, &db, &http, world, "validation then fix", {
        let k = key("fix");
        let bad = client.post(&world.base(), &label_body(&k, "XX")).await?;
        let good = client.post(&world.base(), &label_body(&k, "GB")).await?;
        let ok = bad.status == 400 && good.status == 201;
        (format!("{} then {}", bad.describe(), good.describe()), ok)
    });

    scenario!(rows, &db, &http, world, "courier 503 then retry", {
        let body = label_body(&key("outage"), "GB");
        courier_json(
            &http,
            &world.courier,
            "/_faults",
            Some(json!({"failNext": 100, "status": 503})),
        )
        .await?;
        let failed = client.post(&world.base(), &body).await?;
        courier_json(&http, &world.courier, "/_faults", Some(json!({"reset": true}))).await?;
        let retry = client.post_until_final(&world.base(), &body).await?;
        let ok = failed.status == 502
            && failed.body["error"]["retryable"] == true
            && retry.status == 201
            && retry.body["id"] == failed.body["id"];
        (
            format!("{} then {} (same label id)", failed.describe(), retry.describe()),
            ok,
        )
    });

    scenario!(rows, &db, &http, world, "server killed mid-request", {
        let body = label_body(&key("killed"), "GB");
        courier_json(
            &http,
            &world.courier,
            "/_faults",
            Some(json!({"latencyMs": 1500})),
        )
        .await?;
        let base = world.base();
        let in_flight = tokio::spawn({
            let (client, body) = (
                Client {
                    raw: http.clone(),
                    retrying: retrying.clone(),
                },
                body.clone(),
            );
            async move { client.post(&base, &body).await }
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        world.kill_service();
        let lost = in_flight.await?.is_err();
        courier_json(&http, &world.courier, "/_faults", Some(json!({"reset": true}))).await?;
        world.start_service()?;
        let retry = client.post_until_final(&world.base(), &body).await?;
        let again = client.post(&world.base(), &body).await?;
        let ok = lost
            && (retry.status == 201 || retry.status == 200)
            && again.replayed
            && again.body["id"] == retry.body["id"];
        (format!("connection lost, then {}", retry.describe()), ok)
    });

    scenario!(
        rows,
        &db,
        &http,
        world,
        "courier drops the response after commit",
        {
            let body = label_body(&key("dropped"), "GB");
            courier_json(
                &http,
                &world.courier,
                "/_faults",
                Some(json!({"dropResponseAfterCommit": 1})),
            )
            .await?;
            let saw = client.post_until_final(&world.base(), &body).await?;
            courier_json(&http, &world.courier, "/_faults", Some(json!({"reset": true}))).await?;
            (saw.describe(), saw.status == 201)
        }
    );

    play_grpc(world, &mut rows, &db).await?;

    for r in &mut rows {
        // Every scenario must end with exactly one label and one shipment, except the
        // mismatch (one request executed) and the validation error (nothing for it).
        r.pass &= r.labels_created == 1 && r.courier_shipments == 1;
    }
    Ok(rows)
}

/// A gRPC client of the labels service: raw (one call) and retrying
/// (idemkit's [`GrpcRetryService`](idemkit_client::GrpcRetryService), which
/// retries `UNAVAILABLE`, `ABORTED` in progress and lost calls with the same key).
struct GrpcClient {
    raw: LabelsClient<tonic::transport::Channel>,
    retrying: LabelsClient<idemkit_client::GrpcRetryService<tonic::transport::Channel>>,
}

/// What a gRPC call came back with, for the table.
struct GrpcSaw {
    label: Option<proto::Label>,
    code: tonic::Code,
    reason: String,
    replayed: bool,
}

impl GrpcSaw {
    fn describe(&self) -> String {
        match &self.label {
            Some(l) => format!("OK{} {}", if self.replayed { " (replay)" } else { "" }, l.status),
            None => format!("{:?} {}", self.code, self.reason),
        }
    }
}

fn grpc_request(key: &str, country: &str) -> anyhow::Result<proto::CreateLabelRequest> {
    // The REST body is the request's proto3 JSON mapping.
    Ok(proto::from_json(&label_body(key, country).to_string())?)
}

/// The call: the bearer token, and the key also as metadata so the retrying
/// client knows the call is protected by one.
fn grpc_call(
    message: &proto::CreateLabelRequest,
) -> anyhow::Result<tonic::Request<proto::CreateLabelRequest>> {
    let mut req = tonic::Request::new(message.clone());
    req.metadata_mut()
        .insert("authorization", "Bearer demo-token-acme".parse()?);
    req.metadata_mut()
        .insert("idempotency-key", message.idempotency_key.parse()?);
    req.set_timeout(Duration::from_secs(10));
    Ok(req)
}

fn grpc_saw(result: Result<tonic::Response<proto::Label>, tonic::Status>) -> GrpcSaw {
    use tonic_types::StatusExt;
    match result {
        Ok(res) => GrpcSaw {
            replayed: res.metadata().get("idempotent-replayed").is_some(),
            label: Some(res.into_inner()),
            code: tonic::Code::Ok,
            reason: String::new(),
        },
        Err(s) => GrpcSaw {
            label: None,
            code: s.code(),
            reason: s
                .get_error_details()
                .error_info()
                .map(|i| i.reason.clone())
                .unwrap_or_default(),
            replayed: false,
        },
    }
}

impl GrpcClient {
    async fn connect(base: &str) -> anyhow::Result<Self> {
        let channel = tonic::transport::Channel::from_shared(base.to_owned())?
            .connect()
            .await?;
        let policy = RetryConfig::new()
            .with_max_attempts(12)
            .with_deadline(Duration::from_secs(20));
        Ok(Self {
            raw: LabelsClient::new(channel.clone()),
            retrying: LabelsClient::new(idemkit_client::GrpcRetryService::new(channel, policy)),
        })
    }

    async fn create(&self, message: &proto::CreateLabelRequest) -> anyhow::Result<GrpcSaw> {
        Ok(grpc_saw(self.raw.clone().create_label(grpc_call(message)?).await))
    }

    async fn create_until_final(&self, message: &proto::CreateLabelRequest) -> anyhow::Result<GrpcSaw> {
        Ok(grpc_saw(
            self.retrying.clone().create_label(grpc_call(message)?).await,
        ))
    }
}

/// The same failures over gRPC (`labels.v1.Labels/CreateLabel`, served on the
/// same port), with the same store, courier and counts.
async fn play_grpc(world: &mut World, rows: &mut Vec<Row>, db: &Path) -> anyhow::Result<()> {
    let http = reqwest::Client::new();
    let key = |name: &str| {
        IdempotencyKey::derived("demo-grpc", format!("{name}-{}", std::process::id()))
            .as_str()
            .to_owned()
    };
    let mut client = GrpcClient::connect(&world.base()).await?;

    scenario!(rows, db, &http, world, "gRPC: lost response", {
        let m = grpc_request(&key("lost"), "GB")?;
        let first = client.create(&m).await?;
        let retry = client.create(&m).await?;
        let ok = first.label.is_some() && retry.replayed && retry.label == first.label;
        (format!("{} then {}", first.describe(), retry.describe()), ok)
    });

    scenario!(rows, db, &http, world, "gRPC: 50 concurrent duplicates", {
        let m = Arc::new(grpc_request(&key("storm"), "GB")?);
        let tasks: Vec<_> = (0..50)
            .map(|_| {
                let (c, m) = (client.raw.clone(), m.clone());
                tokio::spawn(
                    async move { anyhow::Ok(grpc_saw(c.clone().create_label(grpc_call(&m)?).await)) },
                )
            })
            .collect();
        let (mut ok, mut aborted, mut ids) = (0, 0, std::collections::BTreeSet::new());
        for t in tasks {
            let s = t.await??;
            match (&s.label, s.code) {
                (Some(l), _) => {
                    ok += 1;
                    ids.insert(l.id.clone());
                }
                (None, tonic::Code::Aborted) => aborted += 1,
                _ => bail!("unexpected answer {}", s.describe()),
            }
        }
        (
            format!("{ok}×OK (one label id), {aborted}×ABORTED in progress"),
            ids.len() == 1,
        )
    });

    scenario!(rows, db, &http, world, "gRPC: payload mismatch", {
        let k = key("mismatch");
        let first = client.create(&grpc_request(&k, "GB")?).await?;
        let other = client.create(&grpc_request(&k, "FR")?).await?;
        let ok = first.label.is_some()
            && other.code == tonic::Code::FailedPrecondition
            && other.reason == "idempotency_key_reused";
        (format!("{} then {}", first.describe(), other.describe()), ok)
    });

    scenario!(rows, db, &http, world, "gRPC: courier UNAVAILABLE then retry", {
        let m = grpc_request(&key("outage"), "GB")?;
        courier_json(
            &http,
            &world.courier,
            "/_faults",
            Some(json!({"failNext": 100, "status": 503})),
        )
        .await?;
        let failed = client.create(&m).await?;
        courier_json(&http, &world.courier, "/_faults", Some(json!({"reset": true}))).await?;
        let retry = client.create_until_final(&m).await?;
        let ok = failed.code == tonic::Code::Unavailable
            && failed.reason == "courier_unavailable"
            && retry.label.is_some();
        (format!("{} then {}", failed.describe(), retry.describe()), ok)
    });

    scenario!(rows, db, &http, world, "gRPC: server killed mid-call", {
        let m = grpc_request(&key("killed"), "GB")?;
        courier_json(
            &http,
            &world.courier,
            "/_faults",
            Some(json!({"latencyMs": 1500})),
        )
        .await?;
        let in_flight = tokio::spawn({
            let (c, m) = (client.raw.clone(), m.clone());
            async move { anyhow::Ok(grpc_saw(c.clone().create_label(grpc_call(&m)?).await)) }
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        world.kill_service();
        let lost = in_flight.await??.label.is_none();
        courier_json(&http, &world.courier, "/_faults", Some(json!({"reset": true}))).await?;
        world.start_service()?;
        client = GrpcClient::connect(&world.base()).await?;
        let retry = client.create_until_final(&m).await?;
        let again = client.create(&m).await?;
        let ok = lost && retry.label.is_some() && again.replayed && again.label == retry.label;
        (format!("call lost, then {}", retry.describe()), ok)
    });
    Ok(())
}

/// Runs the demo.
pub fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let started = Instant::now();
    let rows = runtime.block_on(async {
        let mut world = World::start()?;
        play(&mut world).await
    })?;
    let all = rows.iter().all(|r| r.pass);
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&rows)?)?;
    } else {
        writeln!(
            out,
            "{:<42} {:<58} {:>7} {:>9}  result",
            "scenario", "what the client saw", "labels", "shipments"
        )?;
        for r in &rows {
            let verdict = if r.pass { "pass" } else { "FAIL" };
            writeln!(
                out,
                "{:<42} {:<58} {:>7} {:>9}  {verdict}",
                r.scenario, r.client_saw, r.labels_created, r.courier_shipments
            )?;
        }
        writeln!(
            out,
            "\n{} of {} scenarios passed in {:.1} s: every label was created once, with one courier shipment, however the client retried.",
            rows.iter().filter(|r| r.pass).count(),
            rows.len(),
            started.elapsed().as_secs_f64()
        )?;
    }
    Ok(if all { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
