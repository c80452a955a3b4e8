//! Redis Sentinel: which server is the master now. A small resolver
//! (`SENTINEL get-master-addr-by-name`, each Sentinel in turn, each bounded
//! by a timeout) rather than the `redis` crate's `sentinel` feature, whose
//! clients have no connect or response timeout; and a watcher subscribed to
//! `+switch-master`, so a failover is noticed the moment the Sentinels
//! announce it.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::Notify;

use crate::redis::url::{self as redis_url, Redacted, RedisOptions};

/// The Sentinels of one master.
pub struct Sentinels {
    /// (address as given, client) per Sentinel.
    nodes: Vec<(String, redis::Client)>,
    /// The master's name (`sentinel monitor <name> …`).
    master: String,
    /// Whether the master is reached over TLS (the Sentinels are).
    tls: bool,
}

impl Sentinels {
    /// Clients for `addrs` (`host:port`, `redis://…` or `rediss://…`).
    pub fn new(addrs: &[String], master: &str, opts: &RedisOptions) -> Result<Sentinels, String> {
        if addrs.is_empty() || master.is_empty() {
            return Err(
                "--redis-sentinel needs at least one host:port and --redis-master a name".into(),
            );
        }
        let nodes = addrs
            .iter()
            .map(|a| Ok((a.clone(), redis_url::client(a, opts, true)?)))
            .collect::<Result<Vec<_>, String>>()?;
        let tls = nodes.iter().any(|(_, c)| {
            matches!(
                c.get_connection_info().addr(),
                redis::ConnectionAddr::TcpTls { .. }
            )
        });
        Ok(Sentinels {
            nodes,
            master: master.to_string(),
            tls,
        })
    }

    /// The master's URL (`redis[s]://host:port`, no credentials: those come
    /// from the options) as the first Sentinel that answers names it.
    pub async fn master_url(&self, timeout: Duration) -> Result<String, String> {
        let mut errors = Vec::new();
        for (addr, client) in &self.nodes {
            let ask = async {
                let mut c = client.get_multiplexed_async_connection().await?;
                redis::cmd("SENTINEL")
                    .arg("get-master-addr-by-name")
                    .arg(&self.master)
                    .query_async::<Option<(String, u16)>>(&mut c)
                    .await
            };
            match tokio::time::timeout(timeout, ask).await {
                Ok(Ok(Some((host, port)))) => {
                    let scheme = if self.tls { "rediss" } else { "redis" };
                    return Ok(format!("{scheme}://{host}:{port}"));
                }
                Ok(Ok(None)) => errors.push(format!(
                    "{}: no master named {:?}",
                    Redacted(addr),
                    self.master
                )),
                Ok(Err(e)) => errors.push(format!("{}: {e}", Redacted(addr))),
                Err(_) => errors.push(format!("{}: no answer within {timeout:?}", Redacted(addr))),
            }
        }
        Err(format!(
            "no Sentinel named the master: {}",
            errors.join("; ")
        ))
    }

    /// Runs until dropped/aborted: subscribed to `+switch-master` on one
    /// Sentinel at a time (the next one when its connection ends), notifying
    /// each of `changed` (one per connection lane) on every switch of this master.
    pub async fn watch(self: Arc<Self>, changed: Vec<Arc<Notify>>, timeout: Duration) {
        let mut i = 0usize;
        loop {
            let Some((addr, client)) = self.nodes.get(i % self.nodes.len().max(1)) else {
                return;
            };
            i = i.wrapping_add(1);
            let subscribe = async {
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe("+switch-master").await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            match tokio::time::timeout(timeout, subscribe).await {
                Ok(Ok(pubsub)) => {
                    tracing::debug!(sentinel = %Redacted(addr), "watching +switch-master");
                    let mut messages = pubsub.into_on_message();
                    while let Some(msg) = messages.next().await {
                        // "<master name> <old ip> <old port> <new ip> <new port>"
                        let payload: String = msg.get_payload().unwrap_or_default();
                        if payload.split(' ').next() == Some(self.master.as_str()) {
                            tracing::info!(sentinel = %Redacted(addr), switch = %payload, "+switch-master");
                            for c in &changed {
                                c.notify_one();
                            }
                        }
                    }
                }
                Ok(Err(e)) => {
                    tracing::debug!(sentinel = %Redacted(addr), error = %e, "cannot subscribe to +switch-master")
                }
                Err(_) => {
                    tracing::debug!(sentinel = %Redacted(addr), "cannot subscribe to +switch-master: timeout")
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
