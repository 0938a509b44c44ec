//! Phases and business data in Redis: a phase's recovery point, its step
//! output and the application's own writes, applied by one fenced script.

use idemkit_core::{FencingToken, PhaseUpdate, Scope, StoreError, StoreResult};
use redis::Value;

use crate::decode::bytes_of;
use crate::error::{WriteRefused, corrupt};
use crate::scripts::SCRIPTS;
use crate::{RedisStore, RedisWrite, keys};

impl RedisStore {
    /// Advances a phase of a multi-step request: records `recovery_point` and,
    /// when given, one step's saved output, in one fenced script. Refused with
    /// [`StoreError::Fenced`] when `token` is no longer the record's.
    pub async fn record_phase(
        &self,
        scope: &Scope,
        token: FencingToken,
        recovery_point: &str,
        step: Option<(&str, &serde_json::Value)>,
    ) -> StoreResult<()> {
        let update = PhaseUpdate {
            recovery_point: recovery_point.to_owned(),
            step: step.map(|(name, value)| (name.to_owned(), value.clone())),
        };
        self.advance_with(scope, token, &update, &[]).await
    }

    /// The name of a business key of `account`'s, in the account's cluster slot
    /// (`<prefix>:{<account>}:b:<name>`): the only keys
    /// [`RedisStore::advance_with`] writes, so that on Redis Cluster they live
    /// on the same primary as the account's records and one script can write
    /// them with the recovery point.
    pub fn business_key(&self, account: &idemkit_core::Account, name: &str) -> String {
        keys::business_key(&self.config.key_prefix, account, name)
    }

    /// [`KeyStore::advance`](idemkit_core::KeyStore::advance) and the application's own writes to Redis in one
    /// fenced script: the recovery point (and step output) of `update` and
    /// every write of `writes` are applied together, or, when `token` is no
    /// longer the record's ([`StoreError::Fenced`]) or Redis would refuse a
    /// write ([`StoreError::Backend`] with a [`WriteRefused`]
    /// naming it: a key of another type as the batch's own earlier writes leave
    /// it, an `INCRBY` that is not a 64-bit integer by Redis's rules or would
    /// overflow), none of them is: the whole batch is checked before the first
    /// write, so the script cannot fail half-way. This is what a
    /// relational store's phase transaction gives a handler whose business data
    /// lives in SQL: a phase's effects and its recovery point commit as one, so
    /// a takeover never repeats or loses a phase. The same call delivered
    /// again after a lost reply (a client library's resend) is recognised by
    /// its write id, whatever ran in between (a heartbeat, a later phase), and
    /// answered as applied without being applied twice. A new call is a new
    /// write: a handler that calls this again after an error must first read
    /// the record (`step_outputs`, `recovery_point`) to see whether it landed.
    ///
    /// Every key must be a [`RedisStore::business_key`] of the scope's account.
    ///
    /// ```no_run
    /// # async fn run(store: idemkit_redis::RedisStore, scope: idemkit_core::Scope,
    /// #              token: idemkit_core::FencingToken) -> idemkit_core::StoreResult<()> {
    /// use idemkit_core::PhaseUpdate;
    /// use idemkit_redis::RedisWrite;
    ///
    /// let order = store.business_key(&scope.account, "order:4711");
    /// let stock = store.business_key(&scope.account, "stock:BOOK-1");
    /// store
    ///     .advance_with(
    ///         &scope,
    ///         token,
    ///         &PhaseUpdate { recovery_point: "reserved".into(), step: None },
    ///         &[
    ///             RedisWrite::hset(order, "status", "reserved"),
    ///             RedisWrite::incr_by(stock, -1),
    ///         ],
    ///     )
    ///     .await
    /// # }
    /// ```
    pub async fn advance_with(
        &self,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
        writes: &[RedisWrite],
    ) -> StoreResult<()> {
        self.advance_as(scope, token, update, writes, &self.ids.next())
            .await
    }

    /// [`RedisStore::advance_with`] under a given write id (tests deliver the
    /// same call twice with it, as a client that lost the reply does).
    pub(crate) async fn advance_as(
        &self,
        scope: &Scope,
        token: FencingToken,
        update: &PhaseUpdate,
        writes: &[RedisWrite],
        write_id: &str,
    ) -> StoreResult<()> {
        let own = self.business_key(&scope.account, "");
        if let Some(w) = writes.iter().find(|w| !w.key.starts_with(&own)) {
            return Err(StoreError::Backend(
                format!(
                    "`{}` is not a business key of this account (use RedisStore::business_key): \
                     one script can only write keys in the account's cluster slot",
                    w.key
                )
                .into(),
            ));
        }
        let (name, output) = match &update.step {
            Some((name, _)) if name.is_empty() => {
                return Err(StoreError::Backend("a step needs a name".into()));
            }
            Some((name, value)) => (
                name.as_str(),
                serde_json::to_vec(value).map_err(|e| corrupt(e.to_string()))?,
            ),
            None => ("", Vec::new()),
        };
        let key = self.record_key(scope);
        let channel = keys::channel(&self.config.key_prefix, scope);
        let tokens = keys::token_key(&self.config.key_prefix, scope);
        let mut all_keys = vec![key.as_str(), channel.as_str(), tokens.as_str()];
        all_keys.extend(writes.iter().map(|w| w.key.as_str()));
        let fill = |c: &mut redis::Cmd| {
            c.arg(token.0)
                .arg(&update.recovery_point)
                .arg(name)
                .arg(&output)
                .arg(writes.len());
            for w in writes {
                c.arg(w.op.as_str()).arg(&w.field).arg(&w.value);
            }
            c.arg(write_id);
        };
        let (reply, acks) = self
            .run_redelivered(&SCRIPTS.phase, &all_keys, &fill, self.config.wait_replicas)
            .await?;
        match reply {
            Value::Int(1) => self.check_acks(acks),
            Value::Int(0) => Err(StoreError::Fenced),
            Value::Array(refusal) => {
                let (index, reason) = match refusal.as_slice() {
                    [Value::Int(i), reason] => (
                        usize::try_from(*i - 1).ok().filter(|i| *i < writes.len()),
                        bytes_of(reason.clone()).map(|b| String::from_utf8_lossy(&b).into_owned()),
                    ),
                    _ => (None, None),
                };
                let (Some(index), Some(reason)) = (index, reason) else {
                    return Err(corrupt(format!("phase script returned {refusal:?}")));
                };
                let w = &writes[index];
                Err(StoreError::Backend(Box::new(WriteRefused {
                    index,
                    op: w.op,
                    key: w.key.clone(),
                    reason,
                })))
            }
            other => Err(corrupt(format!("phase script returned {other:?}"))),
        }
    }
}
