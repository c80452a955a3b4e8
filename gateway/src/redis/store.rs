//! The Redis connection, shared by every request: one multiplexed
//! connection (a single server, or the master the Sentinels name) or one
//! cluster connection. Every round trip is bounded by the configured
//! timeout; scripts run by `EVALSHA` and are loaded again on `NOSCRIPT`.
//!
//! The gateway runs one Tokio runtime per worker thread
//! (`--worker-threads`, [`crate::run`]); each has its own connection, its
//! own *lane*, made and driven on that thread, so a request's round trip
//! never wakes another thread and its reply is freed where it was allocated.
//! A request takes the lane of the thread it runs on ([`set_lane`]).
//!
//! A supervisor task per lane makes the connection and makes it again when it stops
//! being the master's: a request that gets `READONLY` (the server became a
//! replica), a dropped or refused connection, or `MOVED`/`ASK`/`CLUSTERDOWN`
//! (cluster) wakes it; with Sentinels it also re-resolves on every
//! `+switch-master` and polls them every [`SENTINEL_POLL`]. Requests never
//! wait for it: during the switch they fail fast (503) on the old connection.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, ServerErrorKind};
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use crate::metrics::Metrics;
use crate::redis::script::LuaScript;
use crate::redis::sentinel::Sentinels;
use crate::redis::url::{self as redis_url, Redacted, RedisOptions};

/// Longest wait between two attempts to connect (or reconnect).
const RECONNECT_MAX_DELAY: Duration = Duration::from_millis(500);
/// Shortest time between two reconnections on request errors, so an error
/// storm makes at most 10 new connections a second.
const RECONNECT_MIN_INTERVAL: Duration = Duration::from_millis(100);
/// How often the Sentinels are asked for the master besides `+switch-master`.
pub const SENTINEL_POLL: Duration = Duration::from_secs(1);
/// Lifetime of the health check's key.
pub const HEALTH_TTL_MS: u64 = 5000;

/// Every command the gateway sends, directly or from its scripts (Redis
/// checks a script's calls against the user's ACL too): what a least-privilege
/// ACL user needs, e.g. `ACL SETUSER ratelimit on >PASSWORD resetkeys ~rl:*
/// resetchannels -@all +evalsha +script|load …` (gateway/README.md,
/// "Operating Redis"). `role` is for Sentinel setups and `cluster|slots`
/// for a Cluster.
pub const ACL_COMMANDS: &[&str] = &[
    "evalsha",
    "script|load",
    "set",
    "ping",
    "role",
    "cluster|slots",
    // Inside the scripts.
    "time",
    "get",
    "del",
    "incrby",
    "decrby",
    "pexpireat",
    // Reservation records (check.lua, settle.lua).
    "hset",
    "hgetall",
    "pexpire",
    // The key budget's ledger (check.lua).
    "zadd",
    "zremrangebyscore",
    "zcard",
    "zrange",
    // Concurrency limits' sets of slots (check.lua, refund.lua, settle.lua).
    "exists",
    "zcount",
    "zscore",
    "zrem",
];

/// Where Redis is. `Debug` and `Display` show the addresses redacted.
#[derive(Clone, PartialEq, Eq)]
pub enum Target {
    /// One server, e.g. `redis://127.0.0.1:6379` or `rediss://user:pw@host:6380`.
    Single(String),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<String>),
    /// The master that these Sentinels (`host:port`) name `master`.
    Sentinel {
        /// Sentinel addresses.
        sentinels: Vec<String>,
        /// The master's name.
        master: String,
    },
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let list = |v: &[String]| {
            v.iter()
                .map(|u| Redacted(u).to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match self {
            Target::Single(u) => write!(f, "{}", Redacted(u)),
            Target::Cluster(seeds) => write!(f, "cluster {}", list(seeds)),
            Target::Sentinel { sentinels, master } => {
                write!(f, "sentinel {} master {master:?}", list(sentinels))
            }
        }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Target({self})")
    }
}

/// Why a Redis round trip failed.
#[derive(Debug, Clone)]
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
            StoreError::Redis(e) if is_oom(e) => "oom",
            StoreError::Redis(e) if e.code() == Some("KEYBUDGET") => "key_budget",
            StoreError::Redis(e) if e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly) => {
                "readonly"
            }
            StoreError::Redis(_) => "redis",
            StoreError::Reply(_) => "reply",
        }
    }
}

impl StoreError {
    /// The error one check of a batch met inside the batch script (Redis's
    /// text: code, then message), read as Redis would have answered it for
    /// that check alone: a `KEYBUDGET` is of kind `key_budget`, an `OOM` of
    /// kind `oom`.
    pub fn of_script(text: &str) -> StoreError {
        let line = text.trim_start_matches('-').replace(['\r', '\n'], " ");
        match redis::parse_redis_value(format!("-{line}\r\n").as_bytes())
            .and_then(redis::Value::extract_error)
        {
            Err(e) => StoreError::Redis(e),
            Ok(_) => StoreError::Reply(line),
        }
    }
}

/// `-OOM command not allowed when used memory > 'maxmemory'` (under
/// `noeviction`), whether from a command or from inside a script.
fn is_oom(e: &RedisError) -> bool {
    e.code() == Some("OOM") || e.to_string().contains("OOM command not allowed")
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
    /// A single server: reconnects by itself after a dropped connection.
    Managed(ConnectionManager),
    /// The master named by the Sentinels: replaced by the supervisor.
    Plain(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, RedisError> {
        match self.clone() {
            Conn::Managed(mut c) => cmd.query_async::<T>(&mut c).await,
            Conn::Plain(mut c) => cmd.query_async::<T>(&mut c).await,
            Conn::Cluster(mut c) => cmd.query_async::<T>(&mut c).await,
        }
    }
}

/// Whether an error says the connection no longer reaches the master. A
/// single server's `ConnectionManager` reconnects by itself after a dropped
/// connection (`io` false): only `READONLY` calls for a new one there (a
/// DNS name such as a managed primary endpoint may now name another server).
fn calls_for_reconnect(e: &RedisError, io: bool) -> bool {
    if !io {
        return e.kind() == ErrorKind::Server(ServerErrorKind::ReadOnly);
    }
    matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ReadOnly
                | ServerErrorKind::Moved
                | ServerErrorKind::Ask
                | ServerErrorKind::ClusterDown
                | ServerErrorKind::MasterDown
        )
    ) || e.is_io_error()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
}

/// What requests and the supervisor share.
struct Shared {
    /// The connection in use and its generation (1, 2, …; 0 = none yet).
    conn: RwLock<Option<(u64, Conn)>>,
    /// The generation a request found broken (see [`calls_for_reconnect`]).
    suspect: AtomicU64,
    /// Wakes the supervisor after `suspect` was set.
    wake: Notify,
    /// Whether connection errors (not only `READONLY`) wake it.
    wake_on_io: bool,
    /// The last failure to connect, redacted (cleared once connected).
    last_error: Mutex<Option<String>>,
}

impl Shared {
    fn current(&self) -> Option<(u64, Conn)> {
        self.conn.read().ok().and_then(|c| c.clone())
    }
}

/// How the supervisor makes a connection.
enum Plan {
    Single(redis::Client, redis::aio::ConnectionManagerConfig),
    Cluster(redis::cluster::ClusterClient),
    Sentinel(Arc<Sentinels>, RedisOptions),
}

thread_local! {
    /// The lane of the worker thread this code runs on ([`set_lane`]).
    static LANE: Cell<usize> = const { Cell::new(0) };
}

/// Makes this thread's requests use lane `lane` (the worker thread's index,
/// the runtime its supervisor was spawned on). Threads that never call it use
/// lane 0.
pub fn set_lane(lane: usize) {
    LANE.with(|l| l.set(lane));
}

/// The Redis connections, one per lane.
pub struct Store {
    /// One per worker runtime, in the order of the handles given to [`Store::new`].
    lanes: Vec<Arc<Shared>>,
    timeout: Duration,
    metrics: Metrics,
    tasks: Vec<JoinHandle<()>>,
    cluster: bool,
    health_key: String,
}

impl Drop for Store {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// How long one attempt to connect may take (the request timeout is often
/// too short for a TCP and TLS handshake plus `CLUSTER SLOTS` to a remote node).
fn connect_timeout(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(2))
}

impl Store {
    /// Validates the target and options (reading the TLS files) and starts
    /// connecting in the background: one lane per runtime of `runtimes`, its
    /// supervisor (and so its connection) spawned there; the Sentinels'
    /// watcher, if any, on the first. Requests fail with
    /// [`StoreError::NotConnected`] until their lane's first connection is
    /// made. Errors name addresses redacted.
    pub fn new(
        target: Target,
        key_prefix: &str,
        opts: &RedisOptions,
        timeout: Duration,
        metrics: Metrics,
        runtimes: &[Handle],
    ) -> Result<Store, String> {
        let Some(first) = runtimes.first() else {
            return Err("no runtime to connect to Redis on".to_string());
        };
        redis_url::install_crypto_provider();
        if opts.tls.insecure {
            tracing::warn!(
                "--redis-tls-insecure: the Redis server's certificate is NOT checked; \
                 anyone on the path can read and change every check (trials only)"
            );
        }
        let cluster = matches!(target, Target::Cluster(_));
        let plan = match &target {
            Target::Single(url) => {
                let client = redis_url::managed_client(url, opts)?;
                // Reconnect attempts back off exponentially; capped so that a
                // connection is never still asleep long after Redis is back,
                // and never given up: after a spent series the manager would
                // wait for a failed check to start the next one.
                let config = redis::aio::ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(connect_timeout(timeout)))
                    .set_response_timeout(Some(timeout))
                    .set_max_delay(RECONNECT_MAX_DELAY)
                    .set_number_of_retries(usize::MAX);
                Plan::Single(client, config)
            }
            Target::Cluster(seeds) => {
                let infos = seeds
                    .iter()
                    .map(|s| {
                        redis_url::client(s, opts, false).map(|c| c.get_connection_info().clone())
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let mut builder = redis::cluster::ClusterClientBuilder::new(infos)
                    .connection_timeout(connect_timeout(timeout))
                    .response_timeout(timeout);
                if let Some(first) = seeds.first() {
                    let c = redis_url::client(first, opts, false)?;
                    let s = c.get_connection_info().redis_settings();
                    if let Some(u) = s.username() {
                        builder = builder.username(u);
                    }
                    if let Some(p) = s.password() {
                        builder = builder.password(p);
                    }
                }
                if let Some(certs) = opts.tls.certificates()? {
                    builder = builder.certs(certs);
                }
                if opts.tls.insecure {
                    builder = builder.tls(redis::TlsMode::Insecure);
                }
                Plan::Cluster(
                    builder
                        .build()
                        .map_err(|e| format!("Redis Cluster {target}: {e}"))?,
                )
            }
            Target::Sentinel { sentinels, master } => Plan::Sentinel(
                Arc::new(Sentinels::new(sentinels, master, opts)?),
                opts.clone(),
            ),
        };
        let plan = Arc::new(plan);
        let lanes: Vec<Arc<Shared>> = runtimes
            .iter()
            .map(|_| {
                Arc::new(Shared {
                    conn: RwLock::new(None),
                    suspect: AtomicU64::new(0),
                    wake: Notify::new(),
                    wake_on_io: !matches!(target, Target::Single(_)),
                    last_error: Mutex::new(None),
                })
            })
            .collect();
        let switched: Vec<Arc<Notify>> = runtimes.iter().map(|_| Arc::new(Notify::new())).collect();
        let mut tasks = Vec::new();
        if let Plan::Sentinel(s, _) = plan.as_ref() {
            tasks
                .push(first.spawn(Arc::clone(s).watch(switched.clone(), connect_timeout(timeout))));
        }
        for ((runtime, shared), switched) in runtimes.iter().zip(&lanes).zip(switched) {
            tasks.push(runtime.spawn(supervise(
                Arc::clone(shared),
                Arc::clone(&plan),
                target.to_string(),
                timeout,
                switched,
            )));
        }
        Ok(Store {
            lanes,
            timeout,
            metrics,
            tasks,
            cluster,
            health_key: format!("{key_prefix}health:{}", instance()),
        })
    }

    /// Whether the target is a Redis Cluster (keys must then be grouped by slot).
    pub fn is_cluster(&self) -> bool {
        self.cluster
    }

    /// This thread's lane ([`set_lane`]).
    /// Never `None`: `new` refuses an empty list of runtimes; a lane past
    /// the end wraps.
    fn lane(&self) -> Option<&Shared> {
        let lane = LANE.with(Cell::get);
        let i = lane.checked_rem(self.lanes.len())?;
        self.lanes.get(i).map(Arc::as_ref)
    }

    /// Waits (up to `limit`) for every lane's first connection; true when connected.
    pub async fn wait_connected(&self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.is_connected() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.is_connected()
    }

    /// Whether every lane has a connection (it may still fail).
    pub fn is_connected(&self) -> bool {
        self.lanes.iter().all(|l| l.current().is_some())
    }

    /// The last failure to connect (redacted) of a lane not connected since.
    pub fn last_error(&self) -> Option<String> {
        self.lanes
            .iter()
            .find_map(|l| l.last_error.lock().ok().and_then(|e| e.clone()))
    }

    /// Runs one command within the timeout, timing it as `op`.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd, op: &str) -> Result<T, StoreError> {
        let Some(shared) = self.lane() else {
            return Err(StoreError::NotConnected);
        };
        let Some((generation, conn)) = shared.current() else {
            return Err(StoreError::NotConnected);
        };
        let started = Instant::now();
        let result = tokio::time::timeout(self.timeout, conn.query::<T>(cmd)).await;
        self.metrics
            .redis_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        match result {
            Err(_) => Err(StoreError::Timeout(self.timeout)),
            Ok(Err(e)) => {
                if calls_for_reconnect(&e, shared.wake_on_io) {
                    shared.suspect.store(generation, Ordering::SeqCst);
                    shared.wake.notify_one();
                }
                Err(StoreError::Redis(e))
            }
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

    /// The health check's key, `<prefix>health:<host>-<pid>`.
    pub fn health_key(&self) -> &str {
        &self.health_key
    }

    /// Proves a write goes through: `SET <prefix>health:<instance> 1 PX 5000`
    /// on the connection the checks use (a replica answers `READONLY`, a
    /// full Redis under `noeviction` answers `OOM`), once every lane has a
    /// connection: a worker still connecting would answer its checks 503.
    pub async fn probe_write(&self) -> Result<(), StoreError> {
        if !self.is_connected() {
            return Err(StoreError::NotConnected);
        }
        let mut cmd = redis::cmd("SET");
        cmd.arg(&self.health_key)
            .arg(1)
            .arg("PX")
            .arg(HEALTH_TTL_MS);
        let ok: String = self.query(&cmd, "health").await?;
        if ok == "OK" {
            Ok(())
        } else {
            Err(StoreError::Reply(ok))
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

impl Plan {
    /// One attempt: the connection and the name of what it reaches (redacted).
    async fn connect(&self, timeout: Duration) -> Result<(Conn, String), String> {
        let limit = connect_timeout(timeout);
        let attempt = async {
            match self {
                Plan::Single(client, config) => {
                    // One plain attempt first, for its error (a refused TLS
                    // certificate, a wrong password): the manager retries
                    // without end and would only time out.
                    let probe = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(limit))
                        .set_response_timeout(Some(timeout));
                    client
                        .get_multiplexed_async_connection_with_config(&probe)
                        .await
                        .map_err(|e| redis_url::explain(&e.to_string()))?;
                    ConnectionManager::new_with_config(client.clone(), config.clone())
                        .await
                        .map(|c| (Conn::Managed(c), String::new()))
                        .map_err(|e| redis_url::explain(&e.to_string()))
                }
                Plan::Cluster(client) => client
                    .get_async_connection()
                    .await
                    .map(|c| (Conn::Cluster(c), String::new()))
                    .map_err(|e| redis_url::explain(&e.to_string())),
                Plan::Sentinel(sentinels, opts) => {
                    let url = sentinels.master_url(limit).await?;
                    let client = redis_url::client(&url, opts, false)?;
                    let config = redis::AsyncConnectionConfig::new()
                        .set_connection_timeout(Some(limit))
                        .set_response_timeout(Some(timeout));
                    let mut c = client
                        .get_multiplexed_async_connection_with_config(&config)
                        .await
                        .map_err(|e| {
                            format!("master {url}: {}", redis_url::explain(&e.to_string()))
                        })?;
                    // Right after a failover a Sentinel may still name the
                    // old master, now a replica: only a master will do.
                    let role: Vec<redis::Value> = redis::cmd("ROLE")
                        .query_async(&mut c)
                        .await
                        .map_err(|e| format!("master {url}: ROLE: {e}"))?;
                    match role.first() {
                        Some(redis::Value::BulkString(r)) if r.as_slice() == b"master" => {
                            Ok((Conn::Plain(c), url))
                        }
                        _ => Err(format!(
                            "{url}, named by the Sentinels, is not a master (yet)"
                        )),
                    }
                }
            }
        };
        match tokio::time::timeout(limit + timeout, attempt).await {
            Ok(r) => r,
            Err(_) => Err(format!("no connection within {:?}", limit + timeout)),
        }
    }
}

/// Connects, then reconnects whenever the connection stops reaching the
/// master: forever (aborted when the [`Store`] is dropped).
async fn supervise(
    shared: Arc<Shared>,
    plan: Arc<Plan>,
    name: String,
    timeout: Duration,
    switched: Arc<Notify>,
) {
    let sentinel = matches!(plan.as_ref(), Plan::Sentinel(..));
    let mut generation = 0u64;
    loop {
        let mut delay = Duration::from_millis(50);
        let mut last_logged = String::new();
        let (conn, reached) = loop {
            tracing::trace!(redis = %name, "connecting to Redis");
            match plan.connect(timeout).await {
                Ok(c) => break c,
                Err(e) => {
                    // Each new reason once at WARN; repeats at DEBUG.
                    if e != last_logged {
                        tracing::warn!(redis = %name, error = %e, "cannot connect to Redis; retrying");
                        last_logged = e.clone();
                    } else {
                        tracing::debug!(redis = %name, error = %e, "cannot connect to Redis; retrying");
                    }
                    if let Ok(mut l) = shared.last_error.lock() {
                        *l = Some(e);
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RECONNECT_MAX_DELAY);
                }
            }
        };
        preload(&conn).await;
        generation += 1;
        if let Ok(mut c) = shared.conn.write() {
            *c = Some((generation, conn));
        }
        if let Ok(mut l) = shared.last_error.lock() {
            *l = None;
        }
        let connected_at = Instant::now();
        if reached.is_empty() {
            tracing::info!(redis = %name, "connected to Redis");
        } else {
            tracing::info!(redis = %name, master = %Redacted(&reached), "connected to Redis");
        }
        // Wait for a reason to connect again.
        loop {
            tokio::select! {
                _ = shared.wake.notified() => {
                    if shared.suspect.load(Ordering::SeqCst) == generation {
                        tracing::info!(redis = %name, "the connection no longer reaches the master; reconnecting");
                        break;
                    }
                }
                _ = switched.notified(), if sentinel => {
                    tracing::info!(redis = %name, "the Sentinels switched the master; reconnecting");
                    break;
                }
                _ = tokio::time::sleep(SENTINEL_POLL), if sentinel => {
                    if let Plan::Sentinel(s, _) = plan.as_ref() {
                        match s.master_url(connect_timeout(timeout)).await {
                            Ok(url) if url != reached => {
                                tracing::info!(redis = %name, master = %Redacted(&url), "the Sentinels name another master; reconnecting");
                                break;
                            }
                            Ok(_) => {}
                            Err(e) => tracing::debug!(redis = %name, error = %e, "cannot ask the Sentinels"),
                        }
                    }
                }
            }
        }
        let since = connected_at.elapsed();
        if since < RECONNECT_MIN_INTERVAL {
            tokio::time::sleep(RECONNECT_MIN_INTERVAL - since).await;
        }
    }
}

/// This process among the gateway's replicas: `<host name>-<pid>` (the
/// pod's name in Kubernetes).
fn instance() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "gateway".to_string());
    format!("{host}-{}", std::process::id())
}

/// Loads every script once on a new connection (on every master, in a
/// cluster). Best effort: `EVALSHA` loads a missing script on `NOSCRIPT`.
async fn preload(conn: &Conn) {
    for script in crate::redis::script::all() {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(script.source);
        match conn.query::<String>(&cmd).await {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `redis.call('X'` of every script is in [`ACL_COMMANDS`], so the
    /// README's ACL user can run them.
    #[test]
    fn the_acl_list_covers_every_script_call() {
        for script in crate::redis::script::all() {
            for call in script.source.split("redis.call(").skip(1) {
                let name: String = call
                    .trim_start_matches(['\'', '"'])
                    .chars()
                    .take_while(|c| c.is_ascii_alphabetic())
                    .collect();
                assert!(
                    ACL_COMMANDS.contains(&name.to_ascii_lowercase().as_str()),
                    "{}: redis.call('{name}') is not in ACL_COMMANDS",
                    script.name
                );
            }
        }
    }

    #[test]
    fn a_batch_check_error_has_the_kind_redis_would_give_it() {
        let kind = |text: &str| StoreError::of_script(text).kind();
        assert_eq!(
            kind("KEYBUDGET ratelimit: 2 live keys of 2, 1 more refused"),
            "key_budget"
        );
        assert_eq!(kind("-KEYBUDGET ratelimit: 2 live keys"), "key_budget");
        assert_eq!(
            kind("OOM command not allowed when used memory > 'maxmemory'."),
            "oom"
        );
        assert_eq!(kind("ERR ratelimit: unknown period x"), "redis");
        assert_eq!(
            kind("user_script:1: attempt to compare nil\r\nwith number"),
            "redis"
        );
    }

    #[test]
    fn targets_show_no_password() {
        let t = Target::Sentinel {
            sentinels: vec!["rediss://:pw@s1:26379".into(), "s2:26379".into()],
            master: "m".into(),
        };
        assert_eq!(
            format!("{t:?}"),
            "Target(sentinel rediss://:***@s1:26379,s2:26379 master \"m\")"
        );
        assert_eq!(
            Target::Single("redis://u:pw@h".into()).to_string(),
            "redis://u:***@h"
        );
    }
}
