//! Change notifications: completion, release and abandon publish on the record's
//! channel (`PUBLISH` on a single node, sharded `SPUBLISH` on a cluster, so a
//! message stays on the record's shard). Waiters share one lazily opened RESP3
//! connection that subscribes to a channel while at least one waiter needs it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::{Client, IntoConnectionInfo, ProtocolVersion, PushInfo, PushKind, RedisResult, Value};
use tokio::sync::{Notify, OnceCell};

use crate::RedisConfig;

/// Waiters per channel.
type Channels = Arc<Mutex<HashMap<Vec<u8>, Channel>>>;

struct Channel {
    waiters: usize,
    notify: Arc<Notify>,
}

enum Subscriber {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

pub(crate) struct Notifier {
    config: RedisConfig,
    subscriber: OnceCell<Subscriber>,
    channels: Channels,
    // Serialises SUBSCRIBE/UNSUBSCRIBE so the server sees them in the order the
    // waiter counts changed (a late UNSUBSCRIBE never undoes a newer SUBSCRIBE).
    ops: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Notifier")
            .field("connected", &self.subscriber.initialized())
            .finish_non_exhaustive()
    }
}

fn lock(channels: &Channels) -> MutexGuard<'_, HashMap<Vec<u8>, Channel>> {
    // Every critical section is a single map update; a poisoned lock holds consistent data.
    channels.lock().unwrap_or_else(|e| e.into_inner())
}

/// A registered waiter. Dropping it (also when the waiting future is cancelled)
/// deregisters it, unsubscribing when it was the last on its channel.
pub(crate) struct Registration {
    pub(crate) notify: Arc<Notify>,
    channel: Vec<u8>,
    notifier: Arc<Notifier>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let (notifier, channel) = (self.notifier.clone(), std::mem::take(&mut self.channel));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move { notifier.leave(channel).await });
        }
    }
}

impl Notifier {
    pub(crate) fn new(config: RedisConfig) -> Self {
        Self {
            config,
            subscriber: OnceCell::new(),
            channels: Arc::default(),
            ops: tokio::sync::Mutex::new(()),
        }
    }

    /// The command the scripts publish with.
    pub(crate) fn publish_command(config: &RedisConfig) -> &'static str {
        match (config.notifications, config.cluster) {
            (false, _) => "",
            (true, false) => "PUBLISH",
            (true, true) => "SPUBLISH",
        }
    }

    async fn subscriber(&self) -> RedisResult<&Subscriber> {
        self.subscriber
            .get_or_try_init(|| async {
                let channels = self.channels.clone();
                let on_push = move |info: PushInfo| -> Result<(), std::convert::Infallible> {
                    match info.kind {
                        PushKind::Message | PushKind::SMessage => {
                            if let Some(Value::BulkString(name)) = info.data.first()
                                && let Some(ch) = lock(&channels).get(name)
                            {
                                ch.notify.notify_waiters();
                            }
                        }
                        // Messages may have been missed: wake everyone to re-check.
                        PushKind::Disconnection => {
                            for ch in lock(&channels).values() {
                                ch.notify.notify_waiters();
                            }
                        }
                        _ => {}
                    }
                    Ok(())
                };
                if self.config.cluster {
                    let client = ClusterClientBuilder::new(self.config.urls.clone())
                        .use_protocol(ProtocolVersion::RESP3)
                        .connection_timeout(self.config.connect_timeout)
                        .response_timeout(self.config.operation_timeout)
                        .push_sender(on_push)
                        .build()?;
                    Ok(Subscriber::Cluster(client.get_async_connection().await?))
                } else {
                    let info = self.config.urls[0].as_str().into_connection_info()?;
                    let redis = info.redis_settings().clone().set_protocol(ProtocolVersion::RESP3);
                    let client = Client::open(info.set_redis_settings(redis))?;
                    let manager = ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(self.config.connect_timeout))
                        .set_response_timeout(Some(self.config.operation_timeout))
                        .set_number_of_retries(2)
                        .set_push_sender(on_push)
                        .set_automatic_resubscription();
                    Ok(Subscriber::Single(
                        ConnectionManager::new_with_config(client, manager).await?,
                    ))
                }
            })
            .await
    }

    /// Registers a waiter on `channel`, subscribing when it is the first.
    pub(crate) async fn join(self: &Arc<Self>, channel: &str) -> RedisResult<Registration> {
        let sub = self.subscriber().await?;
        let _ops = self.ops.lock().await;
        let (notify, first) = {
            let mut map = lock(&self.channels);
            let ch = map.entry(channel.as_bytes().to_vec()).or_insert_with(|| Channel {
                waiters: 0,
                notify: Arc::new(Notify::new()),
            });
            ch.waiters += 1;
            (ch.notify.clone(), ch.waiters == 1)
        };
        let reg = Registration {
            notify,
            channel: channel.as_bytes().to_vec(),
            notifier: self.clone(),
        };
        if first {
            match sub {
                Subscriber::Single(c) => c.clone().subscribe(channel).await?,
                Subscriber::Cluster(c) => c.clone().ssubscribe(channel).await?,
            }
        }
        Ok(reg)
    }

    /// Deregisters a waiter, unsubscribing when it was the last.
    async fn leave(&self, channel: Vec<u8>) {
        let _ops = self.ops.lock().await;
        let last = {
            let mut map = lock(&self.channels);
            match map.get_mut(&channel) {
                Some(ch) if ch.waiters <= 1 => {
                    map.remove(&channel);
                    true
                }
                Some(ch) => {
                    ch.waiters -= 1;
                    false
                }
                None => false,
            }
        };
        if last && let Some(sub) = self.subscriber.get() {
            // A failed unsubscribe only leaves a quiet subscription behind.
            let _ = match sub {
                Subscriber::Single(c) => c.clone().unsubscribe(&channel).await,
                Subscriber::Cluster(c) => c.clone().sunsubscribe(&channel).await,
            };
        }
    }
}
