//! Real `redis-server` processes on free loopback ports, for tests.
//!
//! * [`Redis`]: one server (`--save "" --appendonly no`), ready when it
//!   answers `PING`, killed (SIGKILL, by its own PID) on drop;
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
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::ports::free_port;

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
    child: Option<Child>,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl Redis {
    /// Starts a standalone server on a free loopback port and waits for `PING`.
    pub fn start() -> Result<Redis> {
        Self::start_with(&[])
    }

    /// Starts a server with extra `redis-server` arguments (e.g. cluster mode).
    pub fn start_with(extra: &[&str]) -> Result<Redis> {
        let bin = redis_server_bin()?;
        let mut last_err = None;
        for _ in 0..5 {
            let port = free_port()?;
            match Self::spawn(&bin, port, extra) {
                Ok(r) => return Ok(r),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("redis-server did not start")))
    }

    fn spawn(bin: &Path, port: u16, extra: &[&str]) -> Result<Redis> {
        let dir = tempfile::Builder::new()
            .prefix("testkit-redis-")
            .tempdir()?;
        let log = dir.path().join("redis.log");
        let mut cmd = Command::new(bin);
        cmd.arg("--port")
            .arg(port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--dir")
            .arg(dir.path())
            .arg("--logfile")
            .arg(&log)
            .args(["--daemonize", "no"])
            .args(extra.iter().map(|a| a.replace("{port}", &port.to_string())))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut redis = Redis {
            port,
            child: Some(child),
            dir,
            extra: extra.iter().map(|a| a.to_string()).collect(),
        };
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Ok(reply) = raw_command(port, "PING", Duration::from_millis(500)) {
                if reply.starts_with("+PONG") {
                    return Ok(redis);
                }
            }
            if let Some(child) = redis.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    redis.child = None;
                    bail!(
                        "redis-server on port {port} exited with {status}: {}",
                        std::fs::read_to_string(&log).unwrap_or_default()
                    );
                }
            }
            if Instant::now() > deadline {
                bail!("redis-server on port {port} did not answer PING within {READY_TIMEOUT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
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

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => false,
        }
    }

    /// Kills the server now (SIGKILL by its own PID) and waits for it.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same arguments
    /// (killing it first if it still runs) and waits for `PING`. The data
    /// set starts empty: nothing is persisted.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        let bin = redis_server_bin()?;
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        *self = Self::spawn(&bin, self.port, &extra)?;
        Ok(())
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
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

/// Three `redis-server` masters joined into one Redis Cluster; killed on drop.
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
        let mut nodes = Vec::new();
        for _ in 0..3 {
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
        args.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        cli(first, false, &args).context("redis-cli --cluster create")?;
        let cluster = RedisCluster { nodes };
        cluster.wait_ok()?;
        Ok(cluster)
    }

    fn wait_ok(&self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let mut all_ok = true;
            for n in &self.nodes {
                let info = n.cli(&["cluster", "info"]).unwrap_or_default();
                let slots_ok = info.contains("cluster_slots_ok:16384");
                if !info.contains("cluster_state:ok")
                    || !slots_ok
                    || !info.contains("cluster_known_nodes:3")
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
