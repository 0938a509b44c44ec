//! One connection type over a single node (the connection manager, which
//! reconnects by itself) and a cluster (the cluster client, which follows slots).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Client, Cmd, ErrorKind, RedisResult, ServerErrorKind, Value};

use crate::RedisConfig;
use crate::scripts::Lua;

#[derive(Clone)]
pub(crate) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Single(_) => "Single",
            Self::Cluster(_) => "Cluster",
        })
    }
}

/// Per-attempt response timeout: the operation budget bounds the whole call.
fn response_timeout(config: &RedisConfig) -> Duration {
    config.op_budget()
}

impl Conn {
    pub(crate) async fn connect(config: &RedisConfig) -> RedisResult<Self> {
        if config.cluster {
            let client = ClusterClientBuilder::new(config.urls.clone())
                .connection_timeout(config.connect_timeout)
                .response_timeout(response_timeout(config))
                .retries(3)
                .build()?;
            Ok(Self::Cluster(client.get_async_connection().await?))
        } else {
            let client = Client::open(config.urls[0].as_str())?;
            let manager = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.connect_timeout))
                .set_response_timeout(Some(response_timeout(config)))
                // Few, quick reconnect attempts: a lost server must become a 503
                // within the operation budget, not a long stall.
                .set_number_of_retries(2)
                .set_min_delay(Duration::from_millis(50))
                .set_max_delay(Duration::from_millis(500));
            Ok(Self::Single(
                ConnectionManager::new_with_config(client, manager).await?,
            ))
        }
    }

    /// Sends one command.
    pub(crate) async fn query(&self, cmd: &Cmd) -> RedisResult<Value> {
        match self {
            Self::Single(c) => cmd.query_async(&mut c.clone()).await,
            Self::Cluster(c) => cmd.query_async(&mut c.clone()).await,
        }
    }

    /// Sends `cmd` (which touches `key`) and `WAIT replicas timeout` in one
    /// pipeline, to the primary that owns `key`. Returns the command's reply and
    /// the number of replicas that acknowledged.
    async fn query_and_wait(
        &self,
        cmd: &Cmd,
        key: &str,
        replicas: u32,
        timeout: Duration,
    ) -> RedisResult<(Value, i64)> {
        let mut pipe = redis::pipe();
        pipe.add_command(cmd.clone())
            .cmd("WAIT")
            .arg(replicas)
            .arg(u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX));
        let values: Vec<Value> = match self {
            Self::Single(c) => pipe.query_async(&mut c.clone()).await?,
            Self::Cluster(c) => {
                // `WAIT` names no key: route the pipeline by the record's slot, so
                // it runs on the connection that carried the write.
                let route = SingleNodeRoutingInfo::SpecificNode(Route::with_key(key, SlotAddr::Master));
                c.clone().route_pipeline(pipe, 0, 2, route).await?
            }
        };
        let mut values = values.into_iter();
        let (Some(reply), Some(acks)) = (values.next(), values.next()) else {
            return Err((ErrorKind::Parse, "pipeline returned fewer than two replies").into());
        };
        let reply = reply.extract_error()?;
        let acks = match acks.extract_error()? {
            Value::Int(n) => n,
            _ => return Err((ErrorKind::Parse, "WAIT did not return an integer").into()),
        };
        Ok((reply, acks))
    }

    /// Runs a script by hash, falling back to `EVAL` (which also caches it) when
    /// the server does not know it (a restart, a failover, a new node).
    /// `fill` appends the keys and arguments; `keys[0]` routes the call.
    pub(crate) async fn eval(
        &self,
        lua: &Lua,
        keys: &[&str],
        fill: &(dyn Fn(&mut Cmd) + Send + Sync),
        wait: Option<(u32, Duration)>,
    ) -> RedisResult<(Value, Option<i64>)> {
        let mut by_source = false;
        loop {
            let mut cmd = if by_source {
                let mut c = redis::cmd("EVAL");
                c.arg(lua.source);
                c
            } else {
                let mut c = redis::cmd("EVALSHA");
                c.arg(lua.hash());
                c
            };
            cmd.arg(keys.len()).arg(keys);
            fill(&mut cmd);
            let result = match wait {
                None => self.query(&cmd).await.map(|v| (v, None)),
                Some((n, t)) => self
                    .query_and_wait(&cmd, keys[0], n, t)
                    .await
                    .map(|(v, a)| (v, Some(a))),
            };
            match result {
                Err(e) if !by_source && e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    tracing::debug!(
                        script = lua.name,
                        "idemkit-redis: script not cached, sending source"
                    );
                    by_source = true;
                }
                other => return other,
            }
        }
    }

    /// Where a keyspace scan goes: the node (single), or one slot of each
    /// primary (cluster; `CLUSTER SLOTS`), so every key is visited on the
    /// primary that owns it.
    pub(crate) async fn scan_targets(&self) -> RedisResult<Vec<Option<u16>>> {
        let Self::Cluster(c) = self else {
            return Ok(vec![None]);
        };
        let reply = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c.clone())
            .await?;
        let Value::Array(ranges) = reply else {
            return Err((ErrorKind::Parse, "CLUSTER SLOTS did not return an array").into());
        };
        let mut by_primary: std::collections::BTreeMap<String, u16> = std::collections::BTreeMap::new();
        for range in ranges {
            let Value::Array(fields) = range else { continue };
            let (Some(Value::Int(start)), Some(Value::Array(primary))) = (fields.first(), fields.get(2))
            else {
                continue;
            };
            let addr = primary
                .iter()
                .take(2)
                .map(|v| match v {
                    Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
                    Value::Int(n) => n.to_string(),
                    other => format!("{other:?}"),
                })
                .collect::<Vec<_>>()
                .join(":");
            let slot = u16::try_from(*start).unwrap_or(0);
            by_primary.entry(addr).or_insert(slot);
        }
        Ok(by_primary.into_values().map(Some).collect())
    }

    /// One `SCAN cursor MATCH pattern COUNT count` on `target` (see
    /// [`Conn::scan_targets`]): the next cursor and the names it returned.
    pub(crate) async fn scan_page(
        &self,
        target: Option<u16>,
        cursor: u64,
        pattern: &str,
        count: usize,
    ) -> RedisResult<(u64, Vec<String>)> {
        let mut cmd = redis::cmd("SCAN");
        cmd.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(count);
        let reply = match (self, target) {
            (Self::Cluster(c), Some(slot)) => {
                let route = redis::cluster_routing::RoutingInfo::SingleNode(
                    SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)),
                );
                c.clone().route_command(cmd, route).await?
            }
            _ => self.query(&cmd).await?,
        };
        let (next, names): (String, Vec<Vec<u8>>) = redis::from_redis_value(reply)
            .map_err(|e| redis::RedisError::from((ErrorKind::Parse, "SCAN reply", e.to_string())))?;
        let next = next
            .parse()
            .map_err(|_| redis::RedisError::from((ErrorKind::Parse, "SCAN cursor")))?;
        Ok((
            next,
            names
                .into_iter()
                .filter_map(|n| String::from_utf8(n).ok())
                .collect(),
        ))
    }

    /// Whether this is a cluster connection (scripts must then touch one slot).
    pub(crate) fn is_cluster(&self) -> bool {
        matches!(self, Self::Cluster(_))
    }

    /// Loads every script on the node (single node) or on every primary (cluster),
    /// so the first requests do not pay the `NOSCRIPT` fallback.
    pub(crate) async fn preload(&self, scripts: &[&Lua]) -> RedisResult<()> {
        for lua in scripts {
            let mut cmd = redis::cmd("SCRIPT");
            cmd.arg("LOAD").arg(lua.source);
            match self {
                Self::Single(c) => {
                    let _: Value = cmd.query_async(&mut c.clone()).await?;
                }
                Self::Cluster(c) => {
                    let route = redis::cluster_routing::RoutingInfo::MultiNode((
                        redis::cluster_routing::MultipleNodeRoutingInfo::AllMasters,
                        Some(redis::cluster_routing::ResponsePolicy::AllSucceeded),
                    ));
                    let _ = c.clone().route_command(cmd, route).await?;
                }
            }
        }
        Ok(())
    }
}
