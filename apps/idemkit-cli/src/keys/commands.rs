//! The subcommands over an opened store: list, show, release, complete, reap,
//! review.

use super::render::*;
use super::*;

pub(super) async fn list(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    l: &ListArgs,
) -> anyhow::Result<ExitCode> {
    let filter = ListFilter {
        state: l.state.map(RecordState::from),
        account: l.account.as_deref().map(account_arg),
        limit: l.limit,
    };
    let records = store.list(&filter).await.context("listing records")?;
    let now = store.now();
    if args.json {
        json_out(
            out,
            &json!({"records": records.iter().map(|r| record_json(r, now, false)).collect::<Vec<_>>()}),
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = records
        .iter()
        .map(|r| {
            vec![
                account_text(&r.scope.account),
                r.scope.key.as_str().to_owned(),
                state_text(r.state).to_owned(),
                time_s(r.created_at),
                lease_text(r, now),
                r.fencing_token.0.to_string(),
                or_dash(r.recovery_point.as_deref()),
                cut(&or_dash(r.last_error.as_deref()), 60),
            ]
        })
        .collect();
    table(
        out,
        &[
            "account",
            "key",
            "state",
            "created",
            "lease/completed",
            "token",
            "recovery point",
            "last error",
        ],
        &rows,
    )?;
    let what = l.state.map_or("", |s| RecordState::from(s).as_str());
    writeln!(
        out,
        "\n{} {}record(s){}",
        records.len(),
        if what.is_empty() {
            String::new()
        } else {
            format!("{what} ")
        },
        if records.len() == l.limit {
            format!(" (limit {}; raise --limit for more)", l.limit)
        } else {
            String::new()
        }
    )?;
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn show(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    s: &ScopeArgs,
) -> anyhow::Result<ExitCode> {
    let scope = scope_arg(s)?;
    let Some(r) = store.get(&scope).await.context("reading the record")? else {
        if args.json {
            json_out(out, &json!({"record": null}))?;
        } else {
            writeln!(out, "no record for account {} key {}", s.account, s.key)?;
        }
        return Ok(ExitCode::from(1));
    };
    let now = store.now();
    if args.json {
        json_out(out, &json!({"record": record_json(&r, now, true)}))?;
        return Ok(ExitCode::SUCCESS);
    }
    let field = |out: &mut dyn Write, name: &str, value: String| writeln!(out, "{name:<16}{value}");
    field(out, "account", account_text(&r.scope.account))?;
    field(out, "key", r.scope.key.as_str().to_owned())?;
    field(out, "state", state_text(r.state).to_owned())?;
    field(out, "created", time(r.created_at))?;
    match r.state {
        RecordState::InFlight if r.lease_expires_at > now => {
            field(out, "lease", format!("held until {}", time(r.lease_expires_at)))?
        }
        RecordState::InFlight => field(
            out,
            "lease",
            format!(
                "expired {} (abandoned: the completer or a retry resumes it)",
                time(r.lease_expires_at)
            ),
        )?,
        RecordState::Parked => field(out, "parked", time(r.lease_expires_at))?,
        _ => {}
    }
    if let Some(done) = r.completed_at {
        field(out, "completed", time(done))?;
    }
    field(out, "fencing token", r.fencing_token.0.to_string())?;
    field(out, "fingerprint", r.fingerprint.to_hex())?;
    field(out, "recovery point", or_dash(r.recovery_point.as_deref()))?;
    field(out, "last error", or_dash(r.last_error.as_deref()))?;
    if r.step_outputs.is_empty() {
        field(out, "step outputs", "-".to_owned())?;
    } else {
        writeln!(out, "step outputs")?;
        for (name, value) in &r.step_outputs {
            writeln!(out, "  {}: {}", one_line(name), cut(&value.to_string(), 200))?;
        }
    }
    writeln!(out, "request         {} {}", r.request.method, r.request.path)?;
    for h in &r.request.headers {
        writeln!(
            out,
            "  {}: {}",
            h.name,
            one_line(&String::from_utf8_lossy(&h.value))
        )?;
    }
    writeln!(
        out,
        "  body ({} bytes): {}",
        r.request.body.len(),
        body_text(&r.request.body, Some(BODY_PREVIEW))
    )?;
    match &r.response {
        Some(resp) => {
            writeln!(out, "response        {}", resp.status)?;
            for h in &resp.headers {
                writeln!(
                    out,
                    "  {}: {}",
                    h.name,
                    one_line(&String::from_utf8_lossy(&h.value))
                )?;
            }
            writeln!(
                out,
                "  body ({} bytes): {}",
                resp.body.len(),
                body_text(&resp.body, Some(BODY_PREVIEW))
            )?;
        }
        None => field(out, "response", "-".to_owned())?,
    }
    Ok(ExitCode::SUCCESS)
}

/// The external calls an earlier attempt may have made: step outputs that
/// record an intent and no result, and an `idemkit proxy` record's forward
/// (its recovery point is the intent).
pub(super) fn pending_intents(r: &Record) -> Vec<String> {
    let forwarded = (r.recovery_point.as_deref() == Some(idemkit_proxy::FORWARDED))
        .then(|| "the upstream (forwarded by idemkit proxy)".to_owned());
    r.step_outputs
        .iter()
        .filter(|(_, v)| v.get("intent").is_some() && v.get("done").is_none())
        .map(|(name, _)| name.clone())
        .chain(forwarded)
        .collect()
}

pub(super) async fn release(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    a: &ReleaseArgs,
) -> anyhow::Result<ExitCode> {
    let scope = scope_arg(&a.scope)?;
    let released = idemkit_tower::release_key(store, &scope, a.downstream_did_nothing)
        .await
        .context("releasing the record")?
        .is_ok();
    let after = store.get(&scope).await.context("reading the record")?;
    let now = store.now();
    let (state, reason) = match (released, &after) {
        (true, Some(r)) if r.state == RecordState::Released => (
            Some(r.state),
            "released: the next request with this key runs as a first attempt".to_owned(),
        ),
        (true, Some(r)) => {
            let intents = pending_intents(r);
            let point = r.recovery_point.as_deref().unwrap_or_default();
            let mut reason = format!(
                "released to resume: its recorded progress is kept (recovery point `{point}`), so the next \
                 request with this key resumes from it and skips committed phases"
            );
            if !intents.is_empty() {
                reason.push_str(&format!(
                    "; the call of {} has an intent and no result, so a downstream that ignores keys parks \
                     it again instead of being called twice (if the downstream did nothing, release with \
                     --downstream-did-nothing)",
                    intents.join(", ")
                ));
            }
            (Some(r.state), reason)
        }
        (true, None) => (None, "released".to_owned()),
        (false, _) => {
            let reason = match &after {
                None => "no record with this account and key".to_owned(),
                Some(r) => match r.state {
                    RecordState::Completed => {
                        "completed: its response is replayed until the replay window ends; not released"
                            .to_owned()
                    }
                    RecordState::Released => "already released".to_owned(),
                    RecordState::InFlight if r.lease_expires_at > now => format!(
                        "held by a live lease until {}; not released (try again once it has expired)",
                        time(r.lease_expires_at)
                    ),
                    other => format!("{}: not released", other.as_str()),
                },
            };
            (after.as_ref().map(|r| r.state), reason)
        }
    };
    if args.json {
        let kept = released && state == Some(RecordState::InFlight);
        json_out(
            out,
            &json!({
                "account": scope.account.as_str(),
                "key": scope.key.as_str(),
                "released": released,
                "state": state.map(state_text),
                "kept_progress": kept,
                "recovery_point": after.as_ref().filter(|_| kept).and_then(|r| r.recovery_point.clone()),
                "pending_intents": after.as_ref().filter(|_| kept).map(pending_intents).unwrap_or_default(),
                "fencing_token": after.as_ref().map(|r| r.fencing_token.0),
                "reason": reason,
            }),
        )?;
    } else {
        writeln!(
            out,
            "{} {}: {reason}",
            account_text(&scope.account),
            scope.key.as_str()
        )?;
    }
    Ok(if released {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub(super) async fn complete(
    out: &mut impl Write,
    args: &KeysArgs,
    url: &str,
    c: &CompleteArgs,
) -> anyhow::Result<ExitCode> {
    // Keys on Redis: the labels rows live in their own SQL database.
    let (rows, keys) = if StoreKind::of(url) == StoreKind::Redis {
        let rows = c.labels_database_url.clone().context(
            "with a Redis key store, pass --labels-database-url: the labels rows' database \
             (the service's --database-url)",
        )?;
        anyhow::ensure!(
            StoreKind::of(&rows) != StoreKind::Redis,
            "--labels-database-url names the labels rows' SQL database, not Redis"
        );
        (rows, Some(url.to_owned()))
    } else {
        anyhow::ensure!(
            c.labels_database_url.is_none(),
            "--labels-database-url is for a Redis key store; with a SQL key store the labels rows \
             live in --database-url"
        );
        (url.to_owned(), None)
    };
    if is_postgres(&rows) {
        // The pass builds the labels service on the store named by --pg-schema;
        // like every `keys` command it never creates one.
        drop(open_pg(&rows, &args.pg_schema, Access::Write).await?);
    } else if !rows.starts_with("sqlite:") && !std::path::Path::new(&rows).exists() {
        return Err(OpenError::NoSqliteFile(rows).into());
    }
    let idempotency = match &c.config {
        Some(path) => idemkit_tower::config::IdemkitConfig::from_toml(
            &std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?,
        )?,
        None => idemkit_labels::contract::default_config(),
    };
    let config = LabelsConfig {
        database: rows,
        keys,
        courier_url: c.courier_url.trim_end_matches('/').to_owned(),
        lease: Duration::from_millis(c.lease_ms),
        // The completer replays with the record's own account; no caller signs in.
        tokens: Default::default(),
        courier_deadline: Duration::from_millis(c.courier_deadline_ms),
        idempotency,
        pg_schema: Some(args.pg_schema.clone()),
    };
    let service = build(config).await.context("building the labels service")?;
    let report = Completer::new(service.keys.clone(), service.router.clone())
        .min_age(Duration::from_millis(c.min_age_ms))
        .batch(c.limit)
        .run_once()
        .await
        .context("running the completer")?;
    if args.json {
        json_out(
            out,
            &json!({
                "found": report.found,
                "completed": report.completed,
                "parked": report.parked,
                "unfinished": report.unfinished.iter().map(|(s, answer)| json!({
                    "account": s.account.as_str(), "key": s.key.as_str(), "answer": answer,
                })).collect::<Vec<_>>(),
            }),
        )?;
    } else {
        writeln!(
            out,
            "completer pass: found {}, completed {}, parked {}, unfinished {}",
            report.found,
            report.completed,
            report.parked,
            report.unfinished.len()
        )?;
        if !report.unfinished.is_empty() {
            let rows: Vec<Vec<String>> = report
                .unfinished
                .iter()
                .map(|(s, answer)| {
                    vec![
                        account_text(&s.account),
                        s.key.as_str().to_owned(),
                        one_line(answer),
                    ]
                })
                .collect();
            writeln!(out)?;
            table(out, &["account", "key", "answer"], &rows)?;
        }
    }
    Ok(if report.unfinished.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

pub(super) async fn reap(
    out: &mut impl Write,
    args: &KeysArgs,
    store: Arc<dyn KeyStore>,
    r: &ReapArgs,
) -> anyhow::Result<ExitCode> {
    let threshold = r.older_than_hours.map_or(Policy::new().reap_threshold, |h| {
        Duration::from_secs(h.saturating_mul(3600))
    });
    let replay_window = r.replay_window_hours.map_or(Policy::new().replay_window, |h| {
        Duration::from_secs(h.saturating_mul(3600))
    });
    let before = store.now().minus(threshold);
    let report = Reaper::with_threshold(store, threshold, replay_window)?
        .run_once()
        .await
        .context("running the reaper")?;
    if args.json {
        json_out(
            out,
            &json!({
                "before": time(before),
                "deleted": report.deleted,
                "moved_to_review": report.moved_to_review,
            }),
        )?;
    } else {
        writeln!(
            out,
            "reaper pass (records older than {}): deleted {} completed or released, moved {} unfinished to the review list",
            time(before),
            report.deleted,
            report.moved_to_review
        )?;
    }
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn review(
    out: &mut impl Write,
    args: &KeysArgs,
    store: &dyn KeyStore,
    r: &ReviewArgs,
) -> anyhow::Result<ExitCode> {
    let entries = store.review(r.limit).await.context("reading the review list")?;
    if args.json {
        json_out(
            out,
            &json!({"entries": entries.iter().map(review_json).collect::<Vec<_>>()}),
        )?;
        return Ok(ExitCode::SUCCESS);
    }
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|e| {
            vec![
                account_text(&e.scope.account),
                e.scope.key.as_str().to_owned(),
                state_text(e.state).to_owned(),
                time_s(e.created_at),
                time_s(e.reaped_at),
                or_dash(e.recovery_point.as_deref()),
                format!("{} {}", e.request.method, e.request.path),
                cut(&or_dash(e.last_error.as_deref()), 60),
            ]
        })
        .collect();
    table(
        out,
        &[
            "account",
            "key",
            "state",
            "created",
            "reaped",
            "recovery point",
            "request",
            "last error",
        ],
        &rows,
    )?;
    writeln!(
        out,
        "\n{} entr{} awaiting review",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" }
    )?;
    Ok(ExitCode::SUCCESS)
}
