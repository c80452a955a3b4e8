//! A real `ratelimit-gateway` process (the binary `cargo build -p
//! ratelimit-gateway` builds) in front of a Redis, on a loopback port.
//!
//! It can be killed (SIGKILL, as a crash) and started again on the same port,
//! which is what an Envoy rendered with that gateway port keeps calling.
//! Dropping a [`Gateway`] stops it by its own PID.
//!
//! Like every child of [`crate::process`], the gateway gets SIGTERM when the
//! *thread* that started it ends, so that a test or demo that dies never
//! leaves it behind: start it from the thread that keeps the [`Gateway`]
//! value.

use crate::envoy::WorkDir;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::http::{Client, ConnectionMode};
use crate::paths::gateway_bin;
use crate::ports::free_port;
use crate::process::{read_log, start_retrying, tail, Failed, Process};

/// How to start a [`Gateway`].
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// `--redis`, e.g. `redis://127.0.0.1:6379`; or, starting with
    /// [`CLUSTER`], the seeds of `--redis-cluster` ([`GatewayOptions::cluster`]).
    pub redis: String,
    /// Fixed listen port on 127.0.0.1; `None` picks a free one (and retries
    /// with another if it cannot bind).
    pub port: Option<u16>,
    /// More flags, e.g. `["--redis-timeout-ms", "50"]`. Without
    /// `--auth-tokens` among them, `--insecure-no-auth` is added.
    pub extra_args: Vec<String>,
    /// `--redis-timeout-ms` unless `extra_args` give it; default
    /// [`TEST_REDIS_TIMEOUT_MS`]. `None` leaves the gateway's own default
    /// ([`GatewayOptions::shipped_redis_timeout`]).
    pub redis_timeout_ms: Option<u64>,
    /// How long to wait for `GET /healthz` to answer 200 (Redis reachable).
    pub ready_timeout: Duration,
    /// Directory for the log; default a fresh temporary directory.
    pub work_dir: Option<PathBuf>,
    /// The policy: plugin configurations (JSON), written to the work
    /// directory as `policy-<i>.json` and given as `--policy`. The gateway
    /// refuses to start without one unless `extra_args` give `--rls-config`
    /// (with `--grpc-listen`).
    pub policies: Vec<String>,
}

/// The [`GatewayOptions::redis`] prefix of a Redis Cluster's seeds.
pub const CLUSTER: &str = "cluster:";

/// The Redis round-trip timeout a test's gateway gets: the shipped 20 ms is
/// a production bound, and a test sharing 2 cores with the rest of the suite
/// can stall past it (`redis: timed out`, 503) with nothing wrong. Tests of
/// the bound itself give `--redis-timeout-ms` in their flags.
pub const TEST_REDIS_TIMEOUT_MS: u64 = 1000;

impl GatewayOptions {
    /// Defaults for a gateway in front of the Redis Cluster `seeds`
    /// (`--redis-cluster`).
    pub fn cluster(seeds: &[String]) -> Self {
        Self::new(format!("{CLUSTER}{}", seeds.join(",")))
    }

    /// Defaults for a gateway in front of the Redis at `redis_url`.
    pub fn new(redis_url: impl Into<String>) -> Self {
        GatewayOptions {
            redis: redis_url.into(),
            port: None,
            extra_args: Vec::new(),
            redis_timeout_ms: Some(TEST_REDIS_TIMEOUT_MS),
            ready_timeout: Duration::from_secs(15),
            work_dir: None,
            policies: Vec::new(),
        }
    }

    /// Adds a plugin configuration to the policy: pass the JSON the Envoys
    /// get, so that the gateway enforces the same limits.
    pub fn policy(mut self, plugin_config_json: impl Into<String>) -> Self {
        self.policies.push(plugin_config_json.into());
        self
    }

    /// Listens on 127.0.0.1:`port`.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Runs with the gateway's own `--redis-timeout-ms` default, as shipped
    /// (the bench and the demo), instead of [`TEST_REDIS_TIMEOUT_MS`].
    pub fn shipped_redis_timeout(mut self) -> Self {
        self.redis_timeout_ms = None;
        self
    }

    /// Adds command-line flags.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.extra_args.extend(args.iter().map(|a| a.to_string()));
        self
    }

    /// Writes the log `gateway.log` into `dir` (created if needed).
    pub fn work_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.work_dir = Some(dir.into());
        self
    }
}

/// A running `ratelimit-gateway`; stopped (SIGTERM, then SIGKILL) when dropped.
#[derive(Debug)]
pub struct Gateway {
    opts: GatewayOptions,
    bin: PathBuf,
    port: u16,
    process: Option<Process>,
    log_path: PathBuf,
    // Dropped last: removes the temporary directory.
    dir: Option<WorkDir>,
}

impl Gateway {
    /// Starts the gateway and waits until `/healthz` answers 200; on a
    /// picked port that another process took, again on a new one
    /// ([`crate::process::start_retrying`]).
    pub fn start(opts: GatewayOptions) -> Result<Gateway> {
        let bin = gateway_bin()?;
        let dir = WorkDir::new(opts.work_dir.as_deref(), "ratelimit-gateway-")?;
        let log_path = dir.path().join("gateway.log");
        File::create(&log_path).with_context(|| format!("creating {}", log_path.display()))?;
        for (i, json) in opts.policies.iter().enumerate() {
            let path = dir.path().join(format!("policy-{i}.json"));
            std::fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
        }
        let mut gateway = Gateway {
            port: 0,
            opts,
            bin,
            process: None,
            log_path,
            dir: Some(dir),
        };
        let auto_port = gateway.opts.port.is_none();
        start_retrying("ratelimit-gateway", auto_port, || {
            gateway.port = match gateway.opts.port {
                Some(p) => p,
                None => free_port().context("picking a free port")?,
            };
            // The log is appended to across attempts: only this attempt's
            // part tells whether its port was taken.
            let before = gateway.log().len();
            gateway.spawn_and_wait().map_err(|error| {
                gateway.kill();
                Failed {
                    error,
                    log: gateway.log().get(before..).unwrap_or_default().to_string(),
                }
            })
        })?;
        Ok(gateway)
    }

    fn spawn_and_wait(&mut self) -> Result<()> {
        let mut cmd = Command::new(&self.bin);
        for i in 0..self.opts.policies.len() {
            cmd.arg("--policy").arg(self.policy_path(i));
        }
        // Without tokens asked for, the gateway must be told it serves anyone.
        if !self.opts.extra_args.iter().any(|a| a == "--auth-tokens") {
            cmd.arg("--insecure-no-auth");
        }
        let backend = match self.opts.redis.strip_prefix(CLUSTER) {
            Some(seeds) => ["--redis-cluster", seeds],
            None => ["--redis", self.opts.redis.as_str()],
        };
        let timeout_given = self
            .opts
            .extra_args
            .iter()
            .any(|a| a == "--redis-timeout-ms");
        if let (Some(ms), false) = (self.opts.redis_timeout_ms, timeout_given) {
            cmd.arg("--redis-timeout-ms").arg(ms.to_string());
        }
        cmd.arg("--listen")
            .arg(format!("127.0.0.1:{}", self.port))
            .args(backend)
            .args(&self.opts.extra_args)
            // A plain log file, without colour codes.
            .env("NO_COLOR", "1");
        self.process = Some(Process::spawn("ratelimit-gateway", cmd, &self.log_path)?);
        self.wait_healthy(self.opts.ready_timeout)
    }

    /// Polls `GET /healthz` until it answers 200 (the gateway listens and
    /// reaches Redis). Fails early if the process exits, and after `timeout`;
    /// both errors include the tail of the log.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<()> {
        let port = self.port;
        let client = Client::with_timeout(
            self.url(""),
            ConnectionMode::NewPerRequest,
            Duration::from_secs(1),
        );
        // Over TLS (`--tls-cert`), this plain client cannot ask /healthz:
        // the port accepting connections and the start logged must do.
        let tls = self.opts.extra_args.iter().any(|a| a == "--tls-cert");
        let process = self
            .process
            .as_mut()
            .context("ratelimit-gateway is not running")?;
        process
            .wait_ready(timeout, |p| {
                if tls
                    && p.log().contains("ratelimit-gateway listening")
                    && std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
                {
                    return Ok(());
                }
                match client.get("/healthz", &[]) {
                    Ok(r) if r.status == 200 => Ok(()),
                    Ok(r) => Err(format!(
                        "/healthz answered {} {:?}",
                        r.status,
                        r.body.trim()
                    )),
                    Err(e) => Err(format!("/healthz: {e:#}")),
                }
            })
            .with_context(|| format!("ratelimit-gateway on port {port}"))
    }

    /// The exit status if the process has exited (or was killed), without blocking.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.process.as_mut() {
            Some(p) => p.try_wait(),
            None => Ok(None),
        }
    }

    /// Whether the process runs.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Process::is_running)
    }

    /// Kills the gateway now (SIGKILL by its own PID, as a crash) and waits
    /// for it. Its port is free again when this returns.
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Stops the gateway: SIGTERM (it finishes the requests in flight), then
    /// SIGKILL after 5 s. `None` when it was not running.
    pub fn stop(&mut self) -> Result<Option<ExitStatus>> {
        match self.process.take() {
            Some(mut p) => p.stop(Duration::from_secs(5)),
            None => Ok(None),
        }
    }

    /// Starts the gateway again on the same port with the same flags
    /// (killing it first if it still runs) and waits for `/healthz`.
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        // The old listening socket is closed once the process is reaped, but
        // be patient with a port that is briefly still held.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match self.spawn_and_wait() {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.kill();
                    if Instant::now() >= deadline {
                        return Err(e);
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }

    /// The listen port (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(Process::pid)
    }

    /// The file of policy `i` ([`GatewayOptions::policy`]): rewrite it to
    /// reload the gateway's policy (it polls every second; SIGHUP forces).
    pub fn policy_path(&self, i: usize) -> PathBuf {
        self.dir
            .as_ref()
            .map(|d| d.path().join(format!("policy-{i}.json")))
            .unwrap_or_default()
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// The file receiving the gateway's output (appended to across restarts).
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The whole log so far (lossy UTF-8; empty if unreadable).
    pub fn log(&self) -> String {
        read_log(&self.log_path)
    }

    /// The last `lines` lines of the log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail(&self.log(), lines)
    }

    /// The `GET /metrics` page (Prometheus text).
    pub fn metrics(&self) -> Result<String> {
        let client = Client::new(self.url(""), ConnectionMode::NewPerRequest);
        let r = client.get("/metrics", &[])?;
        if r.status != 200 {
            bail!("/metrics answered {}: {}", r.status, r.body);
        }
        Ok(r.body)
    }

    /// The value of one sample of `/metrics`, written exactly as the gateway
    /// prints it, labels included (e.g. `ratelimit_gateway_checks_total{result="allowed"}`);
    /// `None` when there is no such sample.
    pub fn metric(&self, sample: &str) -> Result<Option<f64>> {
        let page = self.metrics()?;
        Ok(page.lines().find_map(|l| {
            l.strip_prefix(sample)?
                .strip_prefix(' ')?
                .trim()
                .parse()
                .ok()
        }))
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.stop();
        if std::thread::panicking() {
            eprintln!(
                "--- ratelimit-gateway (port {}) log tail ---\n{}\n--- end of gateway log ---",
                self.port,
                self.log_tail(30)
            );
            if let Some(WorkDir::Temp(t)) = self.dir.take() {
                eprintln!("kept the gateway's log in {}", t.keep().display());
            }
        }
    }
}
