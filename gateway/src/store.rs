//! The Redis connection: one multiplexed connection (single server, through a
//! `ConnectionManager` that reconnects by itself) or one cluster connection,
//! shared by every request. Every round trip is bounded by the configured
//! timeout; scripts run by `EVALSHA` and are loaded again on `NOSCRIPT`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::script::LuaScript;

/// Longest wait between two reconnect attempts to a single Redis.
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(500);

/// Where Redis is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server, e.g. `redis://127.0.0.1:6379`.
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
}

/// Why a Redis round trip failed.
#[derive(Debug)]
pub enum StoreError {
    /// No connection yet (the first connection is still being made).
    NotConnected,
    /// No answer within the timeout.
    Timeout(Duration),
    /// Redis or the connection failed.
    Redis(RedisError),
    /// Redis answered something the gateway does not understand.
    Reply(String),
}

impl StoreError {
    /// The `kind` label of the errors metric.
    pub fn kind(&self) -> &'static str {
        match self {
            StoreError::NotConnected => "not_connected",
            StoreError::Timeout(_) => "timeout",
            StoreError::Redis(e) if e.is_timeout() => "timeout",
            StoreError::Redis(_) => "redis",
            StoreError::Reply(_) => "reply",
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::NotConnected => write!(f, "redis: not connected yet"),
            StoreError::Timeout(d) => write!(f, "redis: no answer within {} ms", d.as_millis()),
            StoreError::Redis(e) => write!(f, "redis: {e}"),
            StoreError::Reply(e) => write!(f, "redis: unexpected reply: {e}"),
        }
    }
}

impl std::error::Error for StoreError {}

#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// The shared Redis connection.
pub struct Store {
    conn: Arc<OnceCell<Conn>>,
    timeout: Duration,
    metrics: Metrics,
    connector: JoinHandle<()>,
    cluster: bool,
}

impl Drop for Store {
    fn drop(&mut self) {
        self.connector.abort();
    }
}

/// How long one attempt to connect may take (the request timeout is often
/// too short for a TCP handshake plus `CLUSTER SLOTS` to a remote node).
fn connect_timeout(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(2))
}

impl Store {
    /// Validates the target and starts connecting in the background; must be
    /// called inside a Tokio runtime. Requests fail with
    /// [`StoreError::NotConnected`] until the first connection is made; after
    /// that the connection reconnects by itself.
    pub fn new(target: Target, timeout: Duration, metrics: Metrics) -> Result<Store, RedisError> {
        let conn: Arc<OnceCell<Conn>> = Arc::new(OnceCell::new());
        let cell = Arc::clone(&conn);
        let cluster = matches!(target, Target::Cluster(_));
        let connector = match target {
            Target::Single(url) => {
                let client = redis::Client::open(url.as_str())?;
                // Reconnect attempts back off exponentially; capped so that a
                // connection is never still asleep long after Redis is back.
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout(timeout)))
                    .set_response_timeout(Some(timeout))
                    .set_max_delay(RECONNECT_MAX_DELAY);
                tokio::spawn(async move {
                    connect_loop(cell, &url, || async {
                        ConnectionManager::new_with_config(client.clone(), config.clone())
                            .await
                            .map(Conn::Single)
                    })
                    .await;
                })
            }
            Target::Cluster(seeds) => {
                let client = redis::cluster::ClusterClientBuilder::new(seeds.clone())
                    .connection_timeout(connect_timeout(timeout))
                    .response_timeout(timeout)
                    .build()?;
                let name = seeds.join(",");
                tokio::spawn(async move {
                    connect_loop(cell, &name, || async {
                        client.get_async_connection().await.map(Conn::Cluster)
                    })
                    .await;
                })
            }
        };
        Ok(Store {
            conn,
            timeout,
            metrics,
            connector,
            cluster,
        })
    }

    /// Whether the target is a Redis Cluster (keys must then be grouped by slot).
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// Waits (up to `limit`) for the first connection; true when connected.
    pub async fn wait_connected(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.conn.initialized() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.conn.initialized()
    }

    /// Runs one command within the timeout, timing it as `op`.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd, op: &str) -> Result<T, StoreError> {
        let Some(conn) = self.conn.get() else {
            return Err(StoreError::NotConnected);
        };
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, async {
            match conn.clone() {
                Conn::Single(mut c) => cmd.query_async::<T>(&mut c).await,
                Conn::Cluster(mut c) => cmd.query_async::<T>(&mut c).await,
            }
        })
        .await;
        self.metrics
            .redis_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Err(e)) => Err(StoreError::Redis(e)),
            Ok(Ok(v)) => Ok(v),
        }
    }

    /// `PING`.
    pub async fn ping(&self) -> Result<(), StoreError> {
        let pong: String = self.query(&redis::cmd("PING"), "ping").await?;
        if pong == "PONG" {
            Ok(())
        } else {
            Err(StoreError::Reply(pong))
        }
    }

    /// `SCRIPT LOAD` (on every master, in a cluster).
    pub async fn load(&self, script: &LuaScript) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(script.source);
        let sha: String = self.query(&cmd, "load").await?;
        if sha != script.sha {
            return Err(StoreError::Reply(format!(
                "SCRIPT LOAD of {} gave {sha}, expected {}",
                script.name, script.sha
            )));
        }
        Ok(())
    }

    /// `EVALSHA`; on `NOSCRIPT` loads the script, counts the reload and tries once more.
    pub async fn eval<T: FromRedisValue>(
        &self,
        script: &LuaScript,
        keys: &[String],
        args: &[String],
        op: &str,
    ) -> Result<T, StoreError> {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&script.sha).arg(keys.len()).arg(keys).arg(args);
        match self.query(&cmd, op).await {
            Err(StoreError::Redis(e))
                if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
            {
                self.metrics.script_reloads.inc();
                tracing::info!(script = script.name, "NOSCRIPT: loading the script again");
                self.load(script).await?;
                self.query(&cmd, op).await
            }
            other => other,
        }
    }
}

async fn connect_loop<F, Fut>(cell: Arc<OnceCell<Conn>>, name: &str, connect: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<Conn, RedisError>>,
{
    let mut delay = Duration::from_millis(50);
    loop {
        match connect().await {
            Ok(conn) => {
                tracing::info!(redis = name, "connected to Redis");
                preload(&conn).await;
                // Only this task sets the cell.
                let _ = cell.set(conn);
                return;
            }
            Err(e) => {
                tracing::warn!(redis = name, error = %e, "cannot connect to Redis; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// Loads every script once on a new connection (on every master, in a
/// cluster). Best effort: `EVALSHA` loads a missing script on `NOSCRIPT`.
async fn preload(conn: &Conn) {
    for script in [
        crate::script::check(),
        crate::script::refund(),
        crate::script::lease(),
    ] {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(script.source);
        let result: Result<String, RedisError> = match conn.clone() {
            Conn::Single(mut c) => cmd.query_async(&mut c).await,
            Conn::Cluster(mut c) => cmd.query_async(&mut c).await,
        };
        match result {
            Ok(sha) if sha == script.sha => {}
            Ok(sha) => {
                tracing::warn!(script = script.name, %sha, "SCRIPT LOAD gave an unexpected SHA1")
            }
            Err(e) => {
                tracing::warn!(script = script.name, error = %e, "SCRIPT LOAD failed; will load on NOSCRIPT")
            }
        }
    }
}
