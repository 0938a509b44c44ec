//! The [`KeyStore`] methods: each one script (one round trip), or a bounded
//! series of batch scripts over `SCAN` pages for the reaper, the review list,
//! the completer's work list and operator listings.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use idemkit_core::{
    ClaimOutcome, ClaimRequest, FencingToken, KeyStore, ListFilter, MOVED_TO_REVIEW, Millis, PhaseUpdate,
    ReapReport, Record, RecordState, ReviewEntry, Scope, StoreError, StoreResult, StoredResponse,
};
use redis::Value;

use crate::decode::*;
use crate::error::OperationTimedOut;
use crate::error::{corrupt, map_err};
use crate::keys;
use crate::scripts::SCRIPTS;
use crate::{RedisStore, ms};

#[async_trait]
impl KeyStore for RedisStore {
    async fn claim(&self, req: &ClaimRequest) -> StoreResult<ClaimOutcome> {
        self.claim_as(req, &self.ids.next()).await
    }

    async fn heartbeat(&self, scope: &Scope, token: FencingToken, lease: Duration) -> StoreResult<Millis> {
        // The script sets the expiry by the server's clock; this is the same
        // instant by this instance's clock.
        let expires = self.clock.now().plus(lease);
        let now = self.now_arg();
        self.fenced(&SCRIPTS.heartbeat, scope, token, &|c| {
            c.arg(&now).arg(ms(lease));
        })
        .await?;
        Ok(expires)
    }

    async fn complete(
        &self,
        scope: &Scope,
        token: FencingToken,
        response: &StoredResponse,
    ) -> StoreResult<()> {
        let now = self.now_arg();
        let headers = to_json(&response.headers)?;
        self.fenced(&SCRIPTS.complete, scope, token, &|c| {
            c.arg(&now)
                .arg(response.status)
                .arg(&headers)
                .arg(&response.body)
                .arg(self.publish);
        })
        .await
    }

    async fn release(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.release_with(scope, token, false).await
    }

    async fn release_discarding(&self, scope: &Scope, token: FencingToken) -> StoreResult<()> {
        self.release_with(scope, token, true).await
    }

    async fn abandon(&self, scope: &Scope, token: FencingToken, error: &str) -> StoreResult<()> {
        let now = self.now_arg();
        self.fenced(&SCRIPTS.abandon, scope, token, &|c| {
            c.arg(&now).arg(error).arg(self.publish);
        })
        .await
    }

    async fn get(&self, scope: &Scope) -> StoreResult<Option<Record>> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(self.record_key(scope));
        let budget = self.config.op_budget();
        let reply = tokio::time::timeout(budget, self.conn().query(&cmd))
            .await
            .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
            .map_err(map_err)?;
        let fields: HashMap<String, Vec<u8>> =
            redis::from_redis_value(reply).map_err(|e| corrupt(e.to_string()))?;
        if fields.is_empty() {
            return Ok(None);
        }
        decode_record(scope, fields).map(Some)
    }

    fn now(&self) -> Millis {
        self.clock.now()
    }

    fn notifies_changes(&self) -> bool {
        self.notifier.is_some()
    }

    /// One fenced script (see [`RedisStore::advance_with`]).
    async fn advance(&self, scope: &Scope, token: FencingToken, update: &PhaseUpdate) -> StoreResult<()> {
        self.advance_with(scope, token, update, &[]).await
    }

    async fn park(&self, scope: &Scope, token: FencingToken, reason: &str) -> StoreResult<()> {
        let now = self.now_arg();
        self.fenced(&SCRIPTS.park, scope, token, &|c| {
            c.arg(&now).arg(reason).arg(self.publish);
        })
        .await
    }

    /// Scans the records (`SCAN`, page by page) and filters them on the server.
    async fn abandoned(&self, claimed_before: Millis, limit: usize) -> StoreResult<Vec<Record>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let names = self
            .scan_all(&keys::pattern(&self.config.key_prefix, "k", None))
            .await?;
        let mut found = self.fetch_records(names, "abandoned", "", claimed_before).await?;
        found.sort_by(|a, b| {
            (a.created_at, a.scope.account.as_str(), a.scope.key.as_str()).cmp(&(
                b.created_at,
                b.scope.account.as_str(),
                b.scope.key.as_str(),
            ))
        });
        found.truncate(limit);
        Ok(found)
    }

    /// `SCAN` page by page over every primary; each batch of records (one
    /// account's on a cluster) is one script.
    async fn reap(&self, before: Millis) -> StoreResult<ReapReport> {
        let prefix = &self.config.key_prefix;
        let names: Vec<String> = self
            .scan_all(&keys::pattern(prefix, "k", None))
            .await?
            .into_iter()
            .filter(|n| keys::parse(prefix, "k", n).is_some())
            .collect();
        let now = self.now_arg();
        let mut report = ReapReport::default();
        for batch in self.batches(names) {
            let mut triples = Vec::with_capacity(batch.len() * 3);
            for name in &batch {
                let scope =
                    keys::parse(prefix, "k", name).ok_or_else(|| corrupt(format!("record name {name}")))?;
                triples.push(name.clone());
                triples.push(keys::review_key(prefix, &scope));
                triples.push(keys::token_key(prefix, &scope));
            }
            let refs: Vec<&str> = triples.iter().map(String::as_str).collect();
            let (reply, acks) = self
                .run(
                    &SCRIPTS.reap,
                    &refs,
                    &|c| {
                        c.arg(&now).arg(before.0).arg(MOVED_TO_REVIEW);
                    },
                    self.config.wait_replicas,
                )
                .await?;
            let counts = match &reply {
                Value::Array(items) if items.len() == 2 => (int_of(&items[0]), int_of(&items[1])),
                _ => (None, None),
            };
            let (Some(deleted), Some(moved)) = counts else {
                return Err(corrupt(format!("reap script returned {reply:?}")));
            };
            report.deleted += u64::try_from(deleted).unwrap_or(0);
            report.moved_to_review += u64::try_from(moved).unwrap_or(0);
            self.check_acks(acks)?;
        }
        Ok(report)
    }

    async fn review(&self, limit: usize) -> StoreResult<Vec<ReviewEntry>> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let prefix = &self.config.key_prefix;
        let names: Vec<String> = self
            .scan_all(&keys::pattern(prefix, "r", None))
            .await?
            .into_iter()
            .filter(|n| keys::parse(prefix, "r", n).is_some())
            .collect();
        let mut entries = Vec::new();
        for (name, fields) in self.fetch(names, "all", "", Millis(0)).await? {
            let scope =
                keys::parse(prefix, "r", &name).ok_or_else(|| corrupt(format!("review name {name}")))?;
            for (_, encoded) in fields {
                entries.push(decode_review(&scope, &encoded)?);
            }
        }
        entries.sort_by(|a, b| {
            (
                a.created_at,
                a.reaped_at,
                a.scope.account.as_str(),
                a.scope.key.as_str(),
            )
                .cmp(&(
                    b.created_at,
                    b.reaped_at,
                    b.scope.account.as_str(),
                    b.scope.key.as_str(),
                ))
        });
        entries.truncate(limit);
        Ok(entries)
    }

    /// `SCAN` over the records (of one account when the filter names one),
    /// filtered by state on the server, sorted here.
    async fn list(&self, filter: &ListFilter) -> StoreResult<Vec<Record>> {
        if filter.limit == 0 {
            return Ok(Vec::new());
        }
        let names = self
            .scan_all(&keys::pattern(
                &self.config.key_prefix,
                "k",
                filter.account.as_ref(),
            ))
            .await?;
        let (mode, state) = match filter.state {
            Some(s) => ("state", s.as_str()),
            None => ("all", ""),
        };
        let mut found: Vec<Record> = self
            .fetch_records(names, mode, state, Millis(0))
            .await?
            .into_iter()
            .filter(|r| filter.matches(r))
            .collect();
        found.sort_by(|a, b| {
            (b.created_at, a.scope.account.as_str(), a.scope.key.as_str()).cmp(&(
                a.created_at,
                b.scope.account.as_str(),
                b.scope.key.as_str(),
            ))
        });
        found.truncate(filter.limit);
        Ok(found)
    }

    async fn force_release(&self, scope: &Scope) -> StoreResult<bool> {
        self.operator_release(scope, false).await
    }

    async fn discard_progress(&self, scope: &Scope) -> StoreResult<bool> {
        self.operator_release(scope, true).await
    }

    async fn wait_for_change(&self, scope: &Scope, timeout: Duration) -> StoreResult<()> {
        let Some(notifier) = &self.notifier else {
            return Ok(());
        };
        let channel = keys::channel(&self.config.key_prefix, scope);
        let joined = tokio::time::timeout(self.config.op_budget(), notifier.join(&channel)).await;
        let registration = match joined {
            Ok(Ok(r)) => r,
            failed => {
                // No subscription (e.g. a proxy without RESP3): degrade to a short
                // poll rather than failing requests the store can still serve.
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "timed out".to_owned(),
                };
                tracing::warn!(error = %why, "idemkit-redis: cannot subscribe to changes; polling");
                tokio::time::sleep(timeout.min(Duration::from_millis(50))).await;
                return Ok(());
            }
        };
        let notified = registration.notify.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        // The record may have changed between the caller's claim and the
        // subscription: look once more now that no message can be missed.
        let mut cmd = redis::cmd("HMGET");
        cmd.arg(self.record_key(scope))
            .arg("state")
            .arg("lease_expires_at");
        let budget = self.config.op_budget();
        let reply = tokio::time::timeout(budget, self.conn().query(&cmd))
            .await
            .map_err(|_| StoreError::Unavailable(Box::new(OperationTimedOut(budget))))?
            .map_err(map_err)?;
        let head: (Option<String>, Option<i64>) =
            redis::from_redis_value(reply).map_err(|e| corrupt(e.to_string()))?;
        let now = self.clock.now();
        let lease = match head {
            (Some(state), Some(lease)) if state == RecordState::InFlight.as_str() && lease > now.0 => {
                Millis(lease)
            }
            _ => return Ok(()),
        };
        // A holder that crashes publishes nothing: wake when its lease ends.
        let _ = tokio::time::timeout(timeout.min(now.until(lease)), notified).await;
        Ok(())
    }
}
