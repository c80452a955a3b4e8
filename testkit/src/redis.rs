//! Real `redis-server` processes on free loopback ports, for tests.
//!
//! * [`Redis`]: one server (`--save "" --appendonly no`), ready when it
//!   answers `PING`, killed (SIGKILL, by its own PID) on drop, and, like
//!   every child of [`crate::process`], when the thread that started it ends;
//! * [`RedisCluster`]: three masters joined by
//!   `redis-cli --cluster create … --cluster-replicas 0`, ready when every
//!   node reports `cluster_state:ok`.
//!
//! `redis-server` and `redis-cli` come from the Debian package `redis-server`
//! (installed by `make deps`); `$REDIS_SERVER_BIN` / `$REDIS_CLI_BIN`
//! override them.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::ports::free_port;
use crate::process::{read_log, start_retrying, Failed, Process};

/// Overrides the `redis-server` binary.
pub const REDIS_SERVER_ENV: &str = "REDIS_SERVER_BIN";
/// Overrides the `redis-cli` binary.
pub const REDIS_CLI_ENV: &str = "REDIS_CLI_BIN";

const READY_TIMEOUT: Duration = Duration::from_secs(15);

fn binary(env: &str, default: &str) -> Result<PathBuf> {
    let bin = match std::env::var_os(env) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(default),
    };
    match Command::new(&bin)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(s) if s.success() => Ok(bin),
        _ => bail!(
            "{} not found or not working: run `make deps` (it installs the Debian package \
             redis-server, which brings redis-server and redis-cli), or set {env}",
            bin.display()
        ),
    }
}

/// The `redis-server` binary; fails with a message telling to run `make deps`.
pub fn redis_server_bin() -> Result<PathBuf> {
    binary(REDIS_SERVER_ENV, "redis-server")
}

/// The `redis-cli` binary; fails with a message telling to run `make deps`.
pub fn redis_cli_bin() -> Result<PathBuf> {
    binary(REDIS_CLI_ENV, "redis-cli")
}

/// Sends one inline command and returns the raw reply (first read only:
/// enough for `PING` and short replies).
pub fn raw_command(port: u16, command: &str, timeout: Duration) -> Result<String> {
    let mut s = TcpStream::connect_timeout(&(Ipv4Addr::LOCALHOST, port).into(), timeout)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(format!("{command}\r\n").as_bytes())?;
    let mut buf = [0u8; 4096];
    let n = s.read(&mut buf)?;
    Ok(String::from_utf8_lossy(buf.get(..n).unwrap_or_default()).into_owned())
}

/// One `redis-server` process; killed on drop.
#[derive(Debug)]
pub struct Redis {
    port: u16,
    process: Option<Process>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
    /// The content of a config file given before the flags (Sentinels need one).
    conf: Option<String>,
    /// The TLS port, when started with [`Redis::start_tls`].
    tls_port: Option<u16>,
}

impl Redis {
    /// Starts a standalone server on a free loopback port and waits for `PING`.
    pub fn start() -> Result<Redis> {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments (e.g. cluster mode).
    pub fn start_with(extra: &[&str]) -> Result<Redis> {
        let bin = redis_server_bin()?;
        start_retrying("redis-server", true, || {
            Self::spawn(&bin, free_port().map_err(anyhow::Error::from)?, extra, None)
        })
    }

    /// Starts a server that also serves TLS (`--tls-port`) with the given
    /// PEM files; client certificates are checked when sent, not required
    /// (`--tls-auth-clients optional`). The plain port stays open for
    /// readiness and [`Redis::cli`].
    pub fn start_tls(cert: &Path, key: &Path, ca: &Path) -> Result<Redis> {
        let tls_port = free_port()?;
        let (tls, cert, key, ca) = (
            tls_port.to_string(),
            cert.display().to_string(),
            key.display().to_string(),
            ca.display().to_string(),
        );
        let mut redis = Self::start_with(&[
            "--tls-port",
            &tls,
            "--tls-cert-file",
            &cert,
            "--tls-key-file",
            &key,
            "--tls-ca-cert-file",
            &ca,
            "--tls-auth-clients",
            "optional",
        ])?;
        redis.tls_port = Some(tls_port);
        Ok(redis)
    }

    /// Starts a Sentinel (`redis-server <conf> --sentinel`) watching the
    /// master at 127.0.0.1:`master_port` as `name`, quorum 2, with the given
    /// `down-after-milliseconds` and `failover-timeout`.
    pub fn start_sentinel(
        master_port: u16,
        name: &str,
        down_after_ms: u64,
        failover_timeout_ms: u64,
    ) -> Result<Redis> {
        let bin = redis_server_bin()?;
        let conf = format!(
            "sentinel monitor {name} 127.0.0.1 {master_port} 2\n\
             sentinel down-after-milliseconds {name} {down_after_ms}\n\
             sentinel failover-timeout {name} {failover_timeout_ms}\n"
        );
        start_retrying("redis-server --sentinel", true, || {
            let port = free_port().map_err(anyhow::Error::from)?;
            Self::spawn(&bin, port, &["--sentinel"], Some(&conf))
        })
    }

    /// `rediss://127.0.0.1:TLS_PORT`, when started with [`Redis::start_tls`].
    pub fn tls_url(&self) -> Option<String> {
        self.tls_port.map(|p| format!("rediss://127.0.0.1:{p}"))
    }

    /// Starts `redis-server` on `port` and waits for `PING`; its output
    /// (it logs to stdout without `--logfile`) goes to `redis.log` in a fresh
    /// working directory.
    fn spawn(
        bin: &Path,
        port: u16,
        extra: &[&str],
        conf: Option<&str>,
    ) -> std::result::Result<Redis, Failed> {
        let dir = tempfile::Builder::new()
            .prefix("testkit-redis-")
            .tempdir()
            .context("creating a temporary directory")?;
        let mut cmd = Command::new(bin);
        if let Some(conf) = conf {
            // A config file must come first; a Sentinel rewrites it.
            let path = dir.path().join("redis.conf");
            std::fs::write(&path, conf).with_context(|| format!("writing {}", path.display()))?;
            cmd.arg(path);
        }
        cmd.arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .args(["--daemonize", "no"])
            .args(extra.iter().map(|a| a.replace("{port}", &port.to_string())))
            .current_dir(dir.path());
        let name = format!("redis-server on port {port}");
        let mut process = Process::spawn(&name, cmd, &dir.path().join("redis.log"))?;
        let ready = process.wait_ready(READY_TIMEOUT, |_| {
            match raw_command(port, "PING", Duration::from_millis(500)) {
                // -NOAUTH: up, with a password (`--requirepass`).
                Ok(r) if r.starts_with("+PONG") || r.starts_with("-NOAUTH") => Ok(()),
                Ok(r) => Err(format!("PING answered {r:?}")),
                Err(e) => Err(format!("PING: {e}")),
            }
        });
        if let Err(e) = ready {
            return Err(process.failed(e));
        }
        Ok(Redis {
            port,
            process: Some(process),
            dir,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            conf: conf.map(str::to_string),
            tls_port: None,
        })
    }

    /// The port it listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's working directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Runs `redis-cli -p PORT ARGS…` and returns its standard output
    /// (trimmed); fails when it exits non-zero or prints an `(error)`.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        cli(self.port, false, args)
    }

    /// Whole tokens in use in the gateway's token bucket at `key` (a limit of
    /// `requests` per `window_ms`), from its state (`"<TAT ms>:<TAT
    /// remainder in 1/requests ms>"`) at the server's `TIME`; a partly
    /// refilled token counts as used, as the filter counts a share in use.
    /// 0 for a key that does not exist.
    pub fn tokens_in_use(&self, key: &str, requests: u64, window_ms: u64) -> Result<u64> {
        let state = self.cli(&["GET", key])?;
        let Some((tat, rem)) = state.trim().split_once(':') else {
            return Ok(0);
        };
        let (tat, rem): (u64, u64) = (tat.parse()?, rem.parse()?);
        let time = self.cli(&["TIME"])?;
        let mut parts = time.lines().map(|l| l.trim().parse::<u64>());
        let (Some(secs), Some(micros)) = (parts.next(), parts.next()) else {
            bail!("TIME answered {time:?}");
        };
        let now_ms = secs? * 1000 + micros? / 1000;
        let units = u128::from(tat.saturating_sub(now_ms)) * u128::from(requests) + u128::from(rem);
        Ok(u64::try_from(units.div_ceil(u128::from(window_ms.max(1))))?)
    }

    /// Every key with its type, value and absolute expiry (`PEXPIRETIME`,
    /// which unlike `PTTL` does not change while time passes), one line per
    /// key, sorted: two dumps are equal exactly when nothing was written in
    /// between. For "a refused request writes nothing" checks.
    pub fn dump(&self) -> Result<String> {
        let keys = self.cli(&["--raw", "KEYS", "*"])?;
        let mut keys: Vec<&str> = keys.lines().filter(|k| !k.is_empty()).collect();
        keys.sort_unstable();
        let mut out = String::new();
        for key in keys {
            let kind = self.cli(&["TYPE", key])?;
            let value = match kind.as_str() {
                "string" => self.cli(&["--raw", "GET", key])?,
                "hash" => self.cli(&["--raw", "HGETALL", key])?,
                "zset" => self.cli(&["--raw", "ZRANGE", key, "0", "-1", "WITHSCORES"])?,
                "set" => self.cli(&["--raw", "SMEMBERS", key])?,
                "list" => self.cli(&["--raw", "LRANGE", key, "0", "-1"])?,
                other => other.to_string(),
            };
            let expiry = self.cli(&["PEXPIRETIME", key])?;
            out.push_str(&format!("{key} {kind} {value:?} expires {expiry}\n"));
        }
        Ok(out)
    }

    /// [`Redis::dump`] without the gateway's health probe keys and without
    /// expiries (they follow each server's own clock): what the checks wrote.
    pub fn contents(&self) -> Result<String> {
        Ok(self
            .dump()?
            .lines()
            .filter(|l| !l.contains("health:"))
            .map(|l| format!("{}\n", l.split(" expires ").next().unwrap_or(l)))
            .collect())
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Process::is_running)
    }

    /// Kills the server now (SIGKILL by its own PID) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// The server's log (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        read_log(&self.dir.path().join("redis.log"))
    }

    /// Starts the server again on the same port with the same arguments
    /// (killing it first if it still runs) and waits for `PING`. The data
    /// set starts empty: nothing is persisted.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let bin = redis_server_bin()?;
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        let tls_port = self.tls_port;
        let (port, conf) = (self.port, self.conf.clone());
        *self = start_retrying("redis-server", false, || {
            Self::spawn(&bin, port, &extra, conf.as_deref())
        })?;
        self.tls_port = tls_port;
        Ok(())
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(Process::pid)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.kill();
    }
}

fn cli(port: u16, cluster: bool, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(redis_cli_bin()?);
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string()]);
    if cluster {
        cmd.arg("-c");
    }
    let out = cmd
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running redis-cli")?;
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || stdout.starts_with("(error)") || stdout.starts_with("ERR") {
        bail!(
            "redis-cli -p {port} {args:?} failed ({}): {stdout} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

/// A master, one replica and three Sentinels watching them (quorum 2);
/// killed on drop.
#[derive(Debug)]
pub struct RedisSentinels {
    /// The master at start.
    pub master: Redis,
    /// Its replica at start.
    pub replica: Redis,
    /// Three Sentinels.
    pub sentinels: Vec<Redis>,
    name: String,
}

impl RedisSentinels {
    /// Starts the master, its replica (`--replicaof`), waits for the link,
    /// then three Sentinels watching `name`, and waits until every Sentinel
    /// knows the replica and the two other Sentinels (so that a failover
    /// can be voted).
    pub fn start(name: &str, down_after_ms: u64, failover_timeout_ms: u64) -> Result<Self> {
        let master = Redis::start()?;
        let mport = master.port().to_string();
        let replica = Redis::start_with(&["--replicaof", "127.0.0.1", &mport])?;
        wait_until("the replica's link to its master", || {
            Ok(replica
                .cli(&["INFO", "replication"])?
                .contains("master_link_status:up"))
        })?;
        let sentinels = (0..3)
            .map(|_| Redis::start_sentinel(master.port(), name, down_after_ms, failover_timeout_ms))
            .collect::<Result<Vec<_>>>()?;
        let set = RedisSentinels {
            master,
            replica,
            sentinels,
            name: name.to_string(),
        };
        wait_until(
            "every Sentinel knowing the replica and two other Sentinels",
            || {
                for s in &set.sentinels {
                    let fields = s.cli(&["SENTINEL", "master", &set.name])?;
                    let lines: Vec<&str> = fields.lines().collect();
                    let value = |k: &str| {
                        lines
                            .iter()
                            .position(|l| *l == k)
                            .and_then(|i| lines.get(i + 1).copied())
                    };
                    if value("num-slaves") != Some("1") || value("num-other-sentinels") != Some("2")
                    {
                        return Ok(false);
                    }
                }
                Ok(true)
            },
        )?;
        Ok(set)
    }

    /// `127.0.0.1:PORT` of each Sentinel (the gateway's `--redis-sentinel`).
    pub fn addrs(&self) -> Vec<String> {
        self.sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect()
    }

    /// The master's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The master's port as the first Sentinel names it.
    pub fn master_port(&self) -> Result<u16> {
        let s = self.sentinels.first().context("no Sentinel")?;
        let out = s.cli(&["SENTINEL", "get-master-addr-by-name", &self.name])?;
        out.lines()
            .nth(1)
            .and_then(|p| p.trim().parse().ok())
            .with_context(|| format!("SENTINEL get-master-addr-by-name answered {out:?}"))
    }
}

/// Polls `ready` every 50 ms until true, for at most [`READY_TIMEOUT`].
fn wait_until(what: &str, mut ready: impl FnMut() -> Result<bool>) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if ready().unwrap_or(false) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {READY_TIMEOUT:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `redis-server` nodes joined into one Redis Cluster of three masters
/// (and their replicas); killed on drop.
#[derive(Debug)]
pub struct RedisCluster {
    nodes: Vec<Redis>,
}

impl RedisCluster {
    /// Starts three masters (`--cluster-enabled yes`, each with its own
    /// `nodes-PORT.conf` and a free cluster bus port), creates the cluster
    /// with `redis-cli --cluster create … --cluster-replicas 0 --cluster-yes`
    /// and waits until every node says `cluster_state:ok`.
    pub fn start() -> Result<RedisCluster> {
        Self::start_with_replicas(0)
    }

    /// As [`RedisCluster::start`], with `replicas` replicas per master
    /// (`--cluster-replicas`): 3 × (1 + `replicas`) nodes.
    pub fn start_with_replicas(replicas: usize) -> Result<RedisCluster> {
        let mut nodes = Vec::new();
        for _ in 0..3 * (1 + replicas) {
            let bus = free_port()?;
            let bus = bus.to_string();
            nodes.push(Redis::start_with(&[
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes-{port}.conf",
                "--cluster-port",
                &bus,
                "--cluster-node-timeout",
                "5000",
            ])?);
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let first = nodes.first().map(Redis::port).context("no cluster node")?;
        let mut args = vec!["--cluster", "create"];
        args.extend(addrs.iter().map(String::as_str));
        let replicas = replicas.to_string();
        args.extend(["--cluster-replicas", &replicas, "--cluster-yes"]);
        cli(first, false, &args).context("redis-cli --cluster create")?;
        let cluster = RedisCluster { nodes };
        cluster.wait_ok()?;
        Ok(cluster)
    }

    /// Waits until every node says `cluster_state:ok`, knows every node and
    /// has all 16384 slots served.
    pub fn wait_ok(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let known = format!("cluster_known_nodes:{}", self.nodes.len());
        loop {
            let mut all_ok = true;
            for n in &self.nodes {
                let info = n.cli(&["cluster", "info"]).unwrap_or_default();
                let slots_ok = info.contains("cluster_slots_ok:16384");
                // Every node also sees every replica as one (gossip lags
                // `redis-cli --cluster create`).
                let replicas = n
                    .cli(&["cluster", "nodes"])
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.split(' ').nth(2).is_some_and(|f| f.contains("slave")))
                    .count();
                if !info.contains("cluster_state:ok")
                    || !slots_ok
                    || !info.contains(&known)
                    || replicas != self.nodes.len().saturating_sub(3)
                {
                    all_ok = false;
                }
            }
            if all_ok {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the Redis Cluster did not reach cluster_state:ok within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The nodes.
    pub fn nodes(&self) -> &[Redis] {
        &self.nodes
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> Result<&Redis> {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .with_context(|| format!("no cluster node on port {port}"))
    }

    /// `(port, role, master port)` per node, from `CLUSTER NODES` as `asked`
    /// (a node's port) sees it: role `master` or `slave`, master port of a
    /// replica (0 for a master).
    pub fn roles(&self, asked: u16) -> Result<Vec<(u16, String, u16)>> {
        let text = self.node(asked)?.cli(&["CLUSTER", "NODES"])?;
        let port_of = |addr: &str| -> Option<u16> {
            addr.split(['@', ','])
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .ok()
        };
        let lines: Vec<Vec<&str>> = text.lines().map(|l| l.split(' ').collect()).collect();
        let id_port: Vec<(&str, u16)> = lines
            .iter()
            .filter_map(|f| Some((*f.first()?, port_of(f.get(1)?)?)))
            .collect();
        lines
            .iter()
            .map(|f| {
                let port = f
                    .get(1)
                    .and_then(|a| port_of(a))
                    .context("CLUSTER NODES: no address")?;
                let flags = f.get(2).copied().unwrap_or_default();
                let role = if flags.contains("master") {
                    "master"
                } else {
                    "slave"
                };
                let master = f.get(3).copied().unwrap_or("-");
                let master_port = id_port
                    .iter()
                    .find(|(id, _)| *id == master)
                    .map_or(0, |(_, p)| *p);
                Ok((port, role.to_string(), master_port))
            })
            .collect()
    }

    /// The port of the master serving `key` (no spaces): a `GET` to the
    /// first node answers, or redirects with `-MOVED <slot> <ip>:<port>`.
    pub fn master_for_key(&self, key: &str) -> Result<u16> {
        let first = self.nodes.first().context("no cluster node")?;
        let reply = raw_command(first.port(), &format!("GET {key}"), Duration::from_secs(2))?;
        match reply.strip_prefix("-MOVED ") {
            Some(rest) => rest
                .split_whitespace()
                .nth(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("GET {key}: {reply:?}")),
            None => Ok(first.port()),
        }
    }

    /// Seed URLs `redis://127.0.0.1:PORT`, one per node.
    pub fn seeds(&self) -> Vec<String> {
        self.nodes.iter().map(Redis::url).collect()
    }

    /// Runs `redis-cli -c` (following redirections) against the first node.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let port = self
            .nodes
            .first()
            .map(Redis::port)
            .context("no cluster node")?;
        cli(port, true, args)
    }

    /// Runs `redis-cli ARGS…` against every node; the outputs in node order.
    pub fn cli_each(&self, args: &[&str]) -> Result<Vec<String>> {
        self.nodes.iter().map(|n| n.cli(args)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_starts_answers_and_dies_on_drop() {
        let mut r = match Redis::start() {
            Ok(r) => r,
            Err(e) => panic!("{e:#}"),
        };
        assert_eq!(r.cli(&["set", "a", "1"]).unwrap(), "OK");
        assert_eq!(r.cli(&["get", "a"]).unwrap(), "1");
        let port = r.port();
        r.kill();
        assert!(!r.is_running());
        assert!(raw_command(port, "PING", Duration::from_millis(200)).is_err());
    }
}
